"""The full-size step without the hardware (issue 44): rlflow's code executed for every rank class of a full-size
world on meta tensors in torch's fake world (``rlflow/dryrun.py``). Built so far: the transition into the
rollout layout (the allgather-swap, the train state swapped out); the engine's prefill and decode, the swap
back and the update are not yet (docs/dryrun.md).

Per case: each rank class (ranks alike in every coordinate but dp, one run each; all ranks where the world
check needs them) executed alone; its live device bytes after every plan step against the plan's ledger; every
group's members' collectives compared (``dryrun.mismatched``); the largest rank's peak against an H200 (141 GB)
and an Ascend 910B (64 GB). Last line: one JSON object with ``cases``.

    python bench/dryrun.py                       # Qwen3-30B-A3B and Qwen2.5-32B on 16 devices
    python bench/dryrun.py --cases v3            # DeepSeek-V3-671B on 384 (rank classes only)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

H200, ASCEND_910B = 141e9, 64e9
# (model, world, train layout, rollout layout): bench/pools_projection.py's colocated layouts, and a dense one
CASES = {"qwen3-30b": ("qwen3-moe-30b-a3b", 16, "ep=8,dp=2", "tp=4,dp=4"),
         "qwen2.5-32b": ("qwen2.5-32b", 16, "pp=2,tp=8", "tp=4,dp=4"),
         "v3": ("deepseek-r1-671b", 384, "pp=8,ep=16,dp=3", "ep=32,tp=2,dp=6")}


def rank_classes(train, rollout) -> list[int]:
    """One rank per distinct (train coordinates but dp, rollout coordinates but dp)."""
    seen, out = set(), []
    for r in range(train.mesh.size):
        key = tuple((k, v) for m in (train.mesh, rollout.mesh) for k, v in m.coords(r).items() if k != "dp")
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def run_case(name: str, every_rank: bool) -> dict:
    from rlflow import dryrun
    from rlflow.models.sharding import layout
    from rlflow.sharding.mesh import Mesh

    model, world, train_spec, rollout_spec = CASES[name]
    t0 = time.perf_counter()
    train = layout(model, Mesh.parse(train_spec, world), dtype=torch.bfloat16)
    rollout = layout(model, Mesh.parse(rollout_spec, world), dtype=torch.bfloat16)
    classes = rank_classes(train, rollout)
    ranks = range(world) if every_rank or len(classes) == world else classes
    traces = [dryrun.transition(train, rollout, r) for r in ranks]
    bad = dryrun.mismatched(traces) if len(traces) == world else None
    peak = max(t.peak_bytes for t in traces)
    gap = max(t.ledger_gap() for t in traces)
    secs = time.perf_counter() - t0
    print(f"{model} on {world}: train {train.mesh} -> rollout {rollout.mesh}, the transition: {len(traces)} ranks "
          f"executed ({len(classes)} classes), {sum(len(t.collectives) for t in traces)} collectives; largest peak "
          f"{peak / 1e9:.2f} GB (ledger {max(t.ledger_peak_bytes for t in traces) / 1e9:.2f} GB, live bytes within "
          f"{gap:.1%} of it at every step); collectives "
          f"{'not checked (rank classes only)' if bad is None else 'matched' if not bad else bad[:3]}; "
          f"fits H200 {peak <= H200}, 910B {peak <= ASCEND_910B}; {secs:.1f} s", flush=True)
    return {"model": model, "world": world, "train": str(train.mesh), "rollout": str(rollout.mesh),
            "stages": ["transition"], "rank_classes": len(classes), "ranks_executed": len(traces),
            "peak_bytes_max": peak, "ledger_bytes_max": max(t.ledger_peak_bytes for t in traces),
            "ledger_gap_max": gap, "fits_h200": peak <= H200, "fits_910b": peak <= ASCEND_910B,
            "collectives_matched": None if bad is None else not bad, "seconds": round(secs, 1)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["qwen3-30b", "qwen2.5-32b"], choices=sorted(CASES))
    a = ap.parse_args(argv)
    out = {"cases": [run_case(c, every_rank=CASES[c][1] <= 64) for c in a.cases]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
