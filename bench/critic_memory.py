"""What PPO's critic costs in the memory ledger: its train state per rank beside the policy's.

Definition: train state = weights in bf16 (2 bytes per element) + fp32 gradient (4) + AdamW's fp32 master
and two moments (12), as ``rlflow.sharding.memory.StateBytes`` counts them, for the busiest rank of the
train layout. The critic is the policy's decoder with a [1, D] value head in place of the LM head
(``rlflow.algos.critic``), laid out like the policy (``models.sharding.layout(..., head="value")``).

    python bench/critic_memory.py [--case MODEL:SPEC:WORLD ...]
"""

from __future__ import annotations

import argparse

import torch

from rlflow.models.sharding import layout
from rlflow.sharding.memory import StateBytes, elements_per_rank
from rlflow.sharding.mesh import Mesh

CASES = ("qwen3-moe-30b-a3b:ep=8,tp=4:32", "qwen2.5-7b:tp=4:8", "qwen2.5-32b:tp=8:16")


def busiest(model: str, mesh: Mesh, head: str) -> int:
    return int(elements_per_rank(layout(model, mesh, dtype=torch.bfloat16, head=head)).max())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", help="MODEL:SPEC:WORLD (default: %s)" % ", ".join(CASES))
    args = ap.parse_args(argv)
    per_el = 2 + StateBytes().grad_bytes + StateBytes().optim_bytes
    print(f"train state per element: {per_el} bytes (bf16 weight, fp32 grad, fp32 master + 2 moments); busiest rank")
    print("| model | train layout | policy, GiB/rank | critic, GiB/rank | critic / policy |")
    print("| --- | --- | --- | --- | --- |")
    for case in args.case or CASES:
        model, spec, world = case.split(":")
        mesh = Mesh.parse(spec, int(world))
        a, c = (busiest(model, mesh, h) * per_el / 2**30 for h in ("lm", "value"))
        print(f"| {model} | {mesh} on {world} ranks | {a:.2f} | {c:.2f} | {c / a:.3f} |")


if __name__ == "__main__":
    main()
