"""``python -m rlflow.sharding.cli``: plan a train -> rollout transition of a named model from mesh
specs alone, and print the steps, the bytes each rank moves and the peak memory per rank with
allgather-swap and with the naive transition. The last line is one JSON object."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from rlflow.sharding.layout import fmt_bytes
from rlflow.sharding.memory import CATEGORIES, StateBytes, ledger
from rlflow.sharding.mesh import Mesh
from rlflow.sharding.plan import allgather_swap
from rlflow.sharding.spec import DTYPES_BY_NAME


def parse_rules(text: str) -> dict:
    """``experts=ep+tp,expert_mlp=none`` -> {"experts": ("ep", "tp"), "expert_mlp": None}."""
    out: dict = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        if "=" not in part:
            raise ValueError(f"rule {part!r} is not name=axis")
        k, v = (s.strip() for s in part.split("=", 1))
        out[k] = None if v.lower() in ("none", "-", "") else tuple(v.split("+")) if "+" in v else v
    return out


def _stats(a: np.ndarray) -> str:
    return f"min {fmt_bytes(a.min())}, mean {fmt_bytes(a.mean())}, max {fmt_bytes(a.max())}"


def main(argv: list[str] | None = None) -> int:
    from rlflow.models.sharding import layout, model_shapes
    ap = argparse.ArgumentParser(prog="python -m rlflow.sharding.cli", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="qwen2.5-7b, qwen2.5-32b, qwen3-moe-30b-a3b, "
                    "deepseek-r1-671b, qwen3-moe-tiny, deepseek-tiny ...")
    ap.add_argument("--world", type=int, required=True, help="number of ranks")
    ap.add_argument("--src", required=True, help="train mesh, e.g. pp=6,ep=16,tp=4 (dp fills the world)")
    ap.add_argument("--dst", required=True, help="rollout mesh, e.g. tp=2,ep=64")
    ap.add_argument("--src-rules", default="", help="override logical-dim rules, e.g. expert_mlp=none")
    ap.add_argument("--dst-rules", default="", help="same, for the rollout layout")
    ap.add_argument("--dtype", default="bf16", help="weight dtype (bf16, f16, f32)")
    ap.add_argument("--bucket-mb", type=float, default=512, help="max temporary buffer per bucket per rank")
    ap.add_argument("--grad-bytes", type=int, default=4, help="gradient bytes per weight (fp32: 4)")
    ap.add_argument("--optim-bytes", type=int, default=12, help="optimizer bytes per weight (Adam fp32 "
                    "master + 2 moments: 12)")
    ap.add_argument("--steps", type=int, default=12, help="how many steps to list (all: -1)")
    ap.add_argument("--layouts", action="store_true", help="print both layouts, layers folded")
    ap.add_argument("--ledger-rank", type=int, default=None, help="print this rank's ledger, step by step")
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    if a.dtype not in DTYPES_BY_NAME:
        ap.error(f"--dtype {a.dtype!r}: expected one of {sorted(DTYPES_BY_NAME)}")
    dtype = DTYPES_BY_NAME[a.dtype]
    for flag, v, ok, want in (("--world", a.world, a.world >= 1, ">= 1"), ("--bucket-mb", a.bucket_mb, a.bucket_mb > 0, "> 0"),
                              ("--grad-bytes", a.grad_bytes, a.grad_bytes >= 0, ">= 0"),
                              ("--optim-bytes", a.optim_bytes, a.optim_bytes >= 0, ">= 0")):
        if not ok:
            ap.error(f"{flag} {v}: must be {want}")
    meshes = {}
    for flag, text, rules, name in (("--src", a.src, a.src_rules, "train"), ("--dst", a.dst, a.dst_rules, "rollout")):
        if not text.strip():
            ap.error(f"{flag} is empty: give the mesh, e.g. {flag} tp=2 (dp fills the world)")
        try:
            meshes[name] = layout(a.model, Mesh.parse(text, a.world), parse_rules(rules), dtype=dtype, name=name)
        except (ValueError, KeyError) as e:
            ap.error(f"{flag} {text!r} / {flag}-rules {rules!r}: {e}")
    src, dst = meshes["train"], meshes["rollout"]
    if a.ledger_rank is not None and not 0 <= a.ledger_rank < a.world:
        ap.error(f"--ledger-rank {a.ledger_rank}: must be a rank in [0, {a.world})")
    p = allgather_swap(src, dst, bucket_bytes=int(a.bucket_mb * (1 << 20)))
    state = StateBytes(grad_bytes=a.grad_bytes, optim_bytes=a.optim_bytes)
    swap, naive = ledger(p, state), ledger(p, state, naive=True)
    secs = time.perf_counter() - t0

    n = sum(int(np.prod(s, dtype=np.int64)) for s in model_shapes(a.model).values())
    print(f"model {a.model}: {n / 1e9:.2f}B params, {a.dtype}; {a.world} ranks; train {src.mesh}, "
          f"rollout {dst.mesh}")
    if a.layouts:
        print(src.summary())
        print(dst.summary())
    print(p.summary())
    k = len(p.steps) if a.steps < 0 else min(a.steps, len(p.steps))
    print(f"first {k} of {len(p.steps)} steps:")
    for i in range(k):
        print("  " + p.format_step(i))
    recv, sent = p.bytes_received(), p.bytes_sent()
    print(f"bytes moved per rank (received): {_stats(recv)}")
    print(f"bytes sent per rank:             {_stats(sent)}")
    start = swap.bytes[0]
    print(f"train state per rank: weights {_stats(start[0])}; grads+optim {_stats(start[1] + start[2])}")
    print(f"rollout weights per rank: {_stats(dst.bytes_per_rank())}")
    print(f"peak per rank, allgather-swap: {_stats(swap.peak)}")
    print(f"peak per rank, naive:          {_stats(naive.peak)}")
    after = swap.total[3:].max(axis=0) if len(swap.labels) > 3 else swap.total[-1]
    print(f"peak once grads and optimizer state are out, allgather-swap: {_stats(after)}")
    print(f"left on the device for rollout, allgather-swap: {_stats(swap.total[-1])}; naive: "
          f"{_stats(naive.total[-1])}")
    w = int(swap.peak.argmax())
    parts = ", ".join(f"{c} {fmt_bytes(v)}" for c, v in swap.at_peak(w).items())
    nparts = ", ".join(f"{c} {fmt_bytes(v)}" for c, v in naive.at_peak(w).items())
    print(f"rank {w} at its allgather-swap peak ({swap.labels[swap.peak_step[w]]}): {parts}")
    print(f"rank {w} at its naive peak ({naive.labels[naive.peak_step[w]]}): {nparts}")
    if a.ledger_rank is not None:
        print(f"ledger of rank {a.ledger_rank} (allgather-swap):")
        print(swap.table(a.ledger_rank))
    print(f"planned in {secs:.2f} s")
    out = {"model": a.model, "world": a.world, "src": str(src.mesh), "dst": str(dst.mesh),
           "buckets": len(p.buckets), "steps": len(p.steps), "plan_seconds": round(secs, 3),
           "peak_bytes_max": int(swap.peak.max()), "naive_peak_bytes_max": int(naive.peak.max()),
           "bytes_moved_max": int(recv.max()), "end_bytes_max": int(swap.total[-1].max()),
           "naive_end_bytes_max": int(naive.total[-1].max()), "categories": list(CATEGORIES),
           "peak_bytes_per_rank": swap.peak.tolist(), "naive_peak_bytes_per_rank": naive.peak.tolist(),
           "bytes_moved_per_rank": recv.tolist(), "bytes_sent_per_rank": sent.tolist()}
    print(json.dumps(out, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
