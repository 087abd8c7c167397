"""``python bench/transition_timing.py``: run an allgather-swap transition (and its way back) of a named
model on local processes with real collectives, and time it.

Every rank builds its train shards (random bf16), then runs the plan ``--repeat`` times after one
warm-up (which also creates the process groups). Printed per transition: wall time (max over ranks,
median over repeats), bytes received by the busiest rank, and the achieved rate = those bytes / time.
Beside it, the link's reference: one raw ``all_gather_into_tensor`` over the world in which every rank
receives the bytes the plan's busiest rank receives; efficiency = raw time / transition time. The last
line is one JSON object. On one CPU machine with gloo this measures the executor's packing
and the loopback transport, not a network.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rlflow.runtime.launch import spawn


def _worker(rank: int, world: int, model: str, src: str, dst: str, repeat: int, bucket: int) -> dict:
    import torch.distributed as dist

    from rlflow.models.sharding import layout
    from rlflow.sharding.dist import execute
    from rlflow.sharding.execute import TrainState
    from rlflow.sharding.mesh import Mesh
    from rlflow.sharding.plan import allgather_swap, swap_back

    train = layout(model, Mesh.parse(src, world))
    rollout = layout(model, Mesh.parse(dst, world))
    fwd = allgather_swap(train, rollout, bucket_bytes=bucket)
    back = swap_back(fwd)
    pp = train.mesh.coords(rank)["pp"]
    g = torch.Generator().manual_seed(rank)
    weights = {p.name: torch.randn(p.local_shape(train.mesh), generator=g).to(p.dtype)
               for p in train.params if p.stage == pp}
    times = {"forward": [], "back": []}
    for i in range(repeat + 1):
        dist.barrier()
        t = time.perf_counter()
        state = TrainState()
        out = execute(fwd, dict(weights), state)
        times["forward"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        execute(back, out, state)
        times["back"].append(time.perf_counter() - t)
    # the link's reference: one all-gather over the world in which every rank receives what the busiest rank
    # of the plan receives (the same bytes in one collective, no packing)
    recv = int(fwd.bytes_received().max())
    chunk = -(-recv // max(world - 1, 1))
    dev = next(iter(weights.values())).device
    inp, out_buf = torch.empty(chunk, dtype=torch.uint8, device=dev), torch.empty(chunk * world, dtype=torch.uint8, device=dev)
    times["raw"] = []
    for i in range(repeat + 1):
        dist.barrier()
        t = time.perf_counter()
        dist.all_gather_into_tensor(out_buf, inp)
        times["raw"].append(time.perf_counter() - t)
    return {k: v[1:] for k, v in times.items()} | {"recv": fwd.bytes_received().tolist()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/transition_timing.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-moe-0.5b")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--src", default="pp=2,tp=2")
    ap.add_argument("--dst", default="tp=2")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--backend", default=None, help="gloo / nccl / hccl (default: rlflow.device's)")
    a = ap.parse_args(argv)
    res = spawn(_worker, a.world, a.model, a.src, a.dst, a.repeat, int(a.bucket_mb * (1 << 20)),
                backend=a.backend)
    recv = max(res[0]["recv"])
    out = {"model": a.model, "world": a.world, "src": a.src, "dst": a.dst, "busiest_recv_bytes": recv}
    for k in ("forward", "back", "raw"):
        per_repeat = [max(r[k][i] for r in res) for i in range(a.repeat)]
        out[f"{k}_seconds"] = round(statistics.median(per_repeat), 4)
    out["recv_GBps"] = round(recv / out["forward_seconds"] / 1e9, 3)
    out["efficiency"] = round(out["raw_seconds"] / out["forward_seconds"], 3)
    print(f"{a.model} on {a.world} ranks, {a.src} -> {a.dst}: allgather-swap {out['forward_seconds']:.3f} s "
          f"(busiest rank receives {recv / 2**20:.1f} MiB: {out['recv_GBps']:.2f} GB/s), way back "
          f"{out['back_seconds']:.3f} s; one raw all-gather of the same bytes {out['raw_seconds']:.3f} s: "
          f"efficiency (raw / transition) {out['efficiency']:.2f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
