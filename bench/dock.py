"""Transfer dock vs centralized replay buffer: one GRPO-shaped iteration on Ray, in the same run.

    .venv/bin/python bench/dock.py                       # 256 prompts x 8, 1k prompt / 2k response tokens
    .venv/bin/python bench/dock.py --prompts 32 --iters 1  # quick

The driver puts the prompts; W worker actors (default 4) run every stage of GRPO.flow (rlflow/runtime/graph.py) in turn
(rollout, score, ref_logprob, old_logprob, advantage, update), each taking whole groups in
micro-batches from the dock as soon as they are ready and putting the stage's outputs back. Stage
compute is trivial (random tokens and log-probs, real group-normalized advantages), so the figures
are those of the sample flow itself. The same workers and code run against the centralized buffer
and against the dock with S = 1, 2, 4 warehouses (one node: all warehouses share this machine).

Figures (definitions are printed with them):
  busiest_bytes  max over the dock's own processes (warehouses and controllers, or the centralized
                 store) of bytes received + bytes sent in one iteration, measured at each process as
                 the serialized size (pickle-5 header + buffers) of every call's arguments and result.
  wall_s         wall time of one iteration: from launching the workers to the last get, i.e. all puts
                 and gets with trivial stage compute (best of --iters).
  model          rlflow.dock.cost prediction of busiest_bytes (Eq. (2) centralized, Eq. (4) dock).
  model_error    max over configurations of |busiest_bytes - model| / model.
Last line: one JSON object with busiest_bytes_ratio and wall_ratio (centralized / dock at the largest
S) and model_error.
"""

from __future__ import annotations

import argparse
import json
import time

import ray
import torch

from rlflow.dock.cost import Shape, centralized_bytes, dock_bytes, project
from rlflow.dock.ray_backend import ray_centralized, ray_dock
from rlflow.runtime.graph import GRPO

EPS = 1e-6


@ray.remote(num_cpus=0)
class StageWorker:
    """One of W workers; runs its share of every stage against whatever client it is handed."""

    def __init__(self, rank: int, seed: int):
        self.rank, self.seed = rank, seed
        torch.set_num_threads(1)

    def ping(self) -> int:
        return self.rank

    def run(self, dock, response_len: int, micro_batch: int, gets_per_stage: int, it: int) -> float:
        g = torch.Generator().manual_seed(self.seed * 1000 + it * 10 + self.rank)
        busy = 0.0
        for stage in GRPO.flow[1:]:
            for _ in range(gets_per_stage):
                t = time.perf_counter()
                b = dock.get(stage.name, list(stage.reads), micro_batch, groups=True, timeout=600)
                out = self.compute(stage.name, b, response_len, g)
                if out:
                    dock.put(b.index_B, out)
                busy += time.perf_counter() - t
        return busy

    @staticmethod
    def compute(stage: str, b, SL: int, g: torch.Generator) -> dict:
        k = b.size
        if stage == "rollout":
            lens = torch.randint(SL // 2, SL + SL // 2 + 1, (k,), generator=g).tolist()
            resp = [torch.randint(0, 150_000, (n,), generator=g) for n in lens]
            return {"response_ids": resp, "sample_logprobs": [-torch.rand(n, generator=g) for n in lens]}
        if stage == "score":
            return {"rewards": torch.randint(0, 2, (k,), generator=g).float()}
        if stage in ("ref_logprob", "old_logprob"):
            lens = b.lengths("response_ids").tolist()
            return {f"{stage.split('_')[0]}_logprobs": [-torch.rand(n, generator=g) for n in lens]}
        if stage == "advantage":  # GRPO: (r - mean over the group) / (std over the group + eps)
            r = b["rewards"].reshape(-1, b.size // len(set(b["group"].tolist())))
            return {"advantages": ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + EPS)).reshape(-1)}
        return {}  # update: consumes everything, writes nothing


def put_prompts(dock, shape: Shape, chunk: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    PL, n = int(shape.prompt_len), shape.group_size
    for start in range(0, shape.rows, chunk):
        rows = list(range(start, min(start + chunk, shape.rows)))
        lens = {p: int(torch.randint(PL // 2, PL + PL // 2 + 1, (1,), generator=g)) for p in {r // n for r in rows}}
        ids = {p: torch.randint(0, 150_000, (lens[p],), generator=g) for p in lens}
        dock.put(rows, {"prompt_ids": [ids[r // n] for r in rows], "group": torch.tensor(rows) // n,
                        "answer": [torch.zeros(8, dtype=torch.uint8) for _ in rows]})


def run_config(name: str, dock, workers, shape: Shape, args) -> dict:
    gets = shape.rows // (args.micro_batch * len(workers))
    best = None
    for it in range(args.iters):
        dock.clear()
        dock.reset_traffic()
        t0 = time.perf_counter()
        refs = [w.run.remote(dock, int(shape.response_len), args.micro_batch, gets, it) for w in workers]
        put_prompts(dock, shape, chunk=args.micro_batch * len(workers), seed=args.seed + it)
        busy = ray.get(refs)
        wall = time.perf_counter() - t0
        traffic = dock.traffic()
        per = {p: v["bytes_in"] + v["bytes_out"] for p, v in traffic.items()}
        res = {"name": name, "wall_s": wall, "worker_busy_s": max(busy), "per_process": per,
               "busiest": max(per, key=per.get), "busiest_bytes": max(per.values()), "total_bytes": sum(per.values()),
               "controller_bytes": max([v for p, v in per.items() if p.startswith("controller")], default=0)}
        if best is None or wall < best["wall_s"]:
            best = res
    dock.clear()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024, help="mean prompt tokens (uniform in [L/2, 3L/2])")
    ap.add_argument("--response-len", type=int, default=2048, help="mean response tokens (uniform in [L/2, 3L/2])")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=64, help="rows per get (whole groups)")
    ap.add_argument("--warehouses", default="1,2,4")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--link-GBps", type=float, default=25.0, help="per-process bandwidth for the projection")
    args = ap.parse_args()
    shape = Shape(args.prompts, args.group_size, args.prompt_len, args.response_len)
    if shape.rows % (args.micro_batch * args.workers) or args.micro_batch % args.group_size:
        raise SystemExit(f"rows={shape.rows} must be a multiple of micro_batch x workers = "
                         f"{args.micro_batch * args.workers}, and micro_batch a multiple of group_size")
    S_list = [int(s) for s in args.warehouses.split(",")]

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    workers = [StageWorker.remote(r, args.seed) for r in range(args.workers)]
    ray.get([w.ping.remote() for w in workers])
    kw = dict(schema=GRPO.schema, consumers=GRPO.flow_consumers, capacity=shape.rows, group_size=shape.group_size)
    results = []
    c = ray_centralized(**kw)
    results.append(run_config("centralized", c, workers, shape, args) | {"model": centralized_bytes(shape, GRPO.flow, GRPO.schema)})
    c.close()
    for S in S_list:
        d = ray_dock(**kw, warehouses=S)
        results.append(run_config(f"dock S={S}", d, workers, shape, args) | {"model": dock_bytes(shape, S, GRPO.flow, GRPO.schema)["busiest"]})
        d.close()
    ray.shutdown()

    print(f"shape: {args.prompts} prompts x {args.group_size} samples = {shape.rows} rows, prompt ~{args.prompt_len} "
          f"tokens, response ~{args.response_len} tokens (uniform in [L/2, 3L/2]), columns {list(GRPO.schema.names)}, "
          f"{args.workers} worker actors, micro-batch {args.micro_batch}, Ray on {args.num_cpus} CPUs, one node")
    print("busiest_bytes = max over dock processes (warehouses + controllers, or the centralized store) of bytes in + "
          "out per iteration, measured as serialized payload sizes; total = all dock processes; ctrl = busiest "
          "controller; wall_s = one iteration, all puts and gets (best of --iters); model = rlflow.dock.cost; "
          "error = |measured - model| / model\n")
    print(f"{'config':<13}{'busiest MB':>11}{'model MB':>10}{'error':>8}{'total MB':>10}{'ctrl MB':>9}{'wall s':>8}"
          "  busiest process")
    for r in results:
        r["error"] = abs(r["busiest_bytes"] - r["model"]) / r["model"]
        print(f"{r['name']:<13}{r['busiest_bytes'] / 2**20:>11.1f}{r['model'] / 2**20:>10.1f}{r['error']:>8.2%}"
              f"{r['total_bytes'] / 2**20:>10.1f}{r['controller_bytes'] / 2**20:>9.2f}{r['wall_s']:>8.2f}"
              f"  {r['busiest']}")
    central, top = results[0], results[-1]
    ratio = central["busiest_bytes"] / top["busiest_bytes"]
    wall_ratio = central["wall_s"] / top["wall_s"]
    print(f"\nbusiest-process bytes, centralized / {top['name']}: {ratio:.2f}x   wall, centralized / {top['name']}: "
          f"{wall_ratio:.2f}x")
    print(f"\nmodel projection (this shape, one warehouse per 8-device node, C = {len(GRPO.flow_consumers)} controllers; "
          f"time = busiest bytes / {args.link_GBps:g} GB/s):")
    print(f"{'devices':>8}{'S':>5}{'central GB':>12}{'dock GB':>10}{'ratio':>8}{'central s':>11}{'dock s':>9}")
    proj = []
    for D in (16, 64, 192, 384):
        p = project(shape, D, GRPO.flow, GRPO.schema)
        proj.append(p)
        print(f"{D:>8}{p['S']:>5}{p['central_busiest'] / 1e9:>12.3f}{p['dock_busiest'] / 1e9:>10.3f}{p['ratio']:>8.1f}"
              f"{p['central_busiest'] / 1e9 / args.link_GBps:>11.4f}{p['dock_busiest'] / 1e9 / args.link_GBps:>9.4f}")
    print(json.dumps({
        "busiest_bytes_ratio": round(ratio, 3), "wall_ratio": round(wall_ratio, 3),
        "model_error": round(max(r["error"] for r in results), 4),
        "shape": {"prompts": args.prompts, "group_size": args.group_size, "prompt_len": args.prompt_len,
                  "response_len": args.response_len, "workers": args.workers, "micro_batch": args.micro_batch},
        "configs": {r["name"]: {"busiest_bytes": r["busiest_bytes"], "model": r["model"],
                                "wall_s": round(r["wall_s"], 3), "total_bytes": r["total_bytes"],
                                "controller_bytes": r["controller_bytes"]} for r in results},
        "projection": {p["devices"]: round(p["ratio"], 2) for p in proj}}))


if __name__ == "__main__":
    main()
