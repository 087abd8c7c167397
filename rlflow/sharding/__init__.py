"""Explicit sharding: meshes, specs, layouts and transition plans as data (see docs/sharding.md).

    mesh.py       Mesh (pp, dp, ep, tp; Megatron rank order), rank <-> coords, groups per axis
    spec.py       P (JAX PartitionSpec notation), validation, ``f32[T@dp, D@tp]`` printing
    layout.py     Layout = mesh + spec per param + pp stage; Layout.build from logical-dim rules
    geometry.py   shard boxes and exact point-to-point pieces, from shapes alone
    strategy.py   per-parameter choice: slice / all_gather / broadcast / p2p, with the cost model
    plan.py       plan(src, dst), allgather_swap, swap_back
    memory.py     per-rank ledger: train weights, grads, optimizer state, rollout weights, buffers
    execute.py    simulated executor (the reference), per-rank packing, TrainState, HostArena
    reference.py  reference slicing: shard, full_from_shards, reshard from another layout
    push.py       the weight push between separate pools (PushPlan's pieces and slots)
    dist.py       torch.distributed executor, process groups
    cli.py        ``python -m rlflow.sharding.cli``: plan a named model's transition from mesh specs, print it
"""

import importlib

# Lazy exports (PEP 562), so importing one module of the package imports no other (a mesh stays pure
# data, tests/test_layering.py). The function ``plan`` is not exported here: ``rlflow.sharding.plan`` is
# its module; import it from there.
_EXPORTS = {
    "Mesh": "mesh", "AXES": "mesh", "P": "spec", "Layout": "layout", "ParamLayout": "layout",
    "Logical": "layout", "Plan": "plan", "Bucket": "plan", "Step": "plan",
    "allgather_swap": "plan", "swap_back": "plan", "ledger": "memory", "Ledger": "memory",
    "StateBytes": "memory", "report": "memory", "simulate": "execute", "shard": "reference",
    "TrainState": "execute",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rlflow.sharding' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlflow.sharding.{_EXPORTS[name]}"), name)
