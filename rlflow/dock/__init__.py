"""The transfer dock: the distributed sample flow of an RL iteration (MindSpeed RL, arXiv 2507.19017).

S warehouses hold the rows' tensors; one controller per consumer stage holds scalar metadata only.
A get asks the consumer's controller for ready, unconsumed rows, then reads them straight from the
warehouses. See docs/dock.md.

    schema.py       Column, Schema, the wire format (the GRPO columns: rlflow.runtime.graph)
    warehouse.py    Warehouse (rows, unpadded), Meter / payload_bytes (bytes through a process)
    controller.py   Controller (readiness, consumed bits, warehouse ids, lengths)
    samplers.py     row / whole-group selection, DP length balancing
    client.py       Dock (put / take / read / get / get_dp / clear), DockBatch, Ticket
    centralized.py  CentralizedBuffer: one store through which every byte passes (the ablation)
    ray_backend.py  ray_dock, ray_centralized (actors); imported on demand, Ray is optional
    cost.py         communication-volume model (the paper's Eqs. (1), (2), (4))
"""

import importlib

# Lazy exports (PEP 562): a Ray actor process that hosts a warehouse or a controller imports only
# numpy-only modules, not torch.
_EXPORTS = {
    "CentralizedBuffer": "centralized", "CentralStore": "centralized", "Dock": "client", "DockBatch": "client",
    "LocalTransport": "client", "Ticket": "client", "Controller": "controller", "Column": "schema", "Schema": "schema", "Meter": "warehouse",
    "Warehouse": "warehouse", "payload_bytes": "warehouse",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rlflow.dock' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlflow.dock.{_EXPORTS[name]}"), name)
