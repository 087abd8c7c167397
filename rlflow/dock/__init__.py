"""The transfer dock: the distributed sample flow of an RL iteration (MindSpeed RL, arXiv 2507.19017).

S warehouses hold the rows' tensors; one controller per consumer stage holds scalar metadata only.
A get asks the consumer's controller for ready, unconsumed rows, then reads them straight from the
warehouses. See docs/dock.md.

    schema.py       Column, Schema, GRPO_COLUMNS, GRPO_CONSUMERS, the wire format
    warehouse.py    Warehouse (rows, unpadded), Meter / payload_bytes (bytes through a process)
    controller.py   Controller (readiness, consumed bits, warehouse ids, lengths)
    samplers.py     row / whole-group selection, DP length balancing
    client.py       Dock (put / take / read / get / get_dp / clear), DockBatch, Ticket
    centralized.py  CentralizedBuffer: one store through which every byte passes (the ablation)
    ray_backend.py  ray_dock, ray_centralized (actors); imported on demand, Ray is optional
    cost.py         communication-volume model (the paper's Eqs. (1), (2), (4))
"""

from rlflow.dock.centralized import CentralizedBuffer, CentralStore
from rlflow.dock.client import Dock, DockBatch, LocalTransport, Ticket
from rlflow.dock.controller import Controller
from rlflow.dock.schema import GRPO_COLUMNS, GRPO_CONSUMERS, Column, Schema
from rlflow.dock.warehouse import Meter, Warehouse, payload_bytes

__all__ = ["CentralizedBuffer", "CentralStore", "Column", "Controller", "Dock", "DockBatch", "GRPO_COLUMNS",
           "GRPO_CONSUMERS", "LocalTransport", "Meter", "Schema", "Ticket", "Warehouse", "payload_bytes"]
