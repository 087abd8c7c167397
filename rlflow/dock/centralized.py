"""The centralized replay buffer: the conventional design the transfer dock replaces (the ablation).

One store process holds the rows *and* every consumer's metadata. A put sends all its bytes to the
store; a get asks the store, which selects the rows and sends all their bytes back. Every byte of the
sample flow passes through that one process, whatever the number of workers: that process is the
bottleneck the paper measures (MSRLB in its ablation).

Same API as ``rlflow.dock.client.Dock`` (put / get / get_dp / clear / traffic), same selection rules
(it reuses ``Controller`` and ``Warehouse`` inside the one process), so a stage's code runs unchanged
against either and a benchmark compares like with like.
"""

from __future__ import annotations

import threading
from typing import Mapping, Sequence

import numpy as np

from rlflow.dock.client import DockBatch, LocalTransport, _Client
from rlflow.dock.controller import Controller
from rlflow.dock.schema import Schema, Wire, take_rows
from rlflow.dock.warehouse import Meter, Warehouse


class CentralStore:
    """The single store process: data (one warehouse) plus every consumer's controller."""

    def __init__(self, spec: dict, capacity: int, consumers: Sequence[str], var_columns: Sequence[str],
                 group_size: int = 1):
        self._wh = Warehouse("central", spec)
        self._ctrl = {c: Controller(c, capacity, list(spec), var_columns, group_size) for c in consumers}
        self._lead = self._ctrl[consumers[0]]
        self._put_lock = threading.Lock()
        self.meter = Meter()

    def put(self, indices: np.ndarray, wire: Wire, lengths: dict[str, np.ndarray]) -> int:
        self.meter.recv(indices, wire, lengths)
        cols = list(wire)
        zero = np.zeros(len(indices), dtype=np.int32)
        with self._put_lock:  # reject written cells, then store; nothing changes on failure
            _, new = self._lead.place(indices, cols, zero)
            try:
                self._wh.put(indices, wire)
            except Exception:
                self._lead.unplace(indices[new])
                raise
        for c in self._ctrl.values():
            c.mark_ready(indices, zero, cols, lengths)
        return self.meter.send(len(indices))

    def get(self, consumer: str, columns: list[str], n: int, groups: bool, partial: bool, timeout: float | None):
        """Take rows for ``consumer`` and return them with their data: (indices, lengths, wire)."""
        self.meter.recv(consumer, columns, n, groups, partial, timeout)
        idx, _, lens = self._ctrl[consumer].take(columns, n, groups, partial, timeout)
        wire = self._wh.get(idx, columns) if len(idx) else {}
        return self.meter.send((idx, lens, wire))

    def clear(self) -> None:
        self.meter.recv()
        self._wh.clear()
        for c in self._ctrl.values():
            c.clear()
        self.meter.send(None)

    def pending(self, consumer: str, columns=None) -> tuple[int, int]:
        return self._ctrl[consumer].pending(columns)

    def state(self) -> dict:
        return {"controllers": {c: tuple(a.tolist() for a in ctl.state()) for c, ctl in self._ctrl.items()},
                "warehouses": [self._wh.contents()]}

    def traffic(self) -> dict[str, int]:
        return self.meter.read()

    def reset_traffic(self) -> None:
        self.meter.reset()


class CentralizedBuffer(_Client):
    """Client of a ``CentralStore`` with the dock's API."""

    def __init__(self, schema: Schema, consumers: Sequence[str], capacity: int, group_size: int, transport, store):
        super().__init__(schema, consumers, capacity, group_size)
        self.transport, self.store = transport, store

    @staticmethod
    def make_store(schema: Schema, consumers: Sequence[str], capacity: int, group_size: int) -> tuple:
        """Constructor arguments of the store (shared by the in-process and Ray backends)."""
        return (schema.wire_spec(), capacity, tuple(consumers), [c.name for c in schema if c.kind == "var"],
                group_size)

    @classmethod
    def local(cls, schema: Schema, consumers: Sequence[str], *, capacity: int,
              group_size: int = 1) -> "CentralizedBuffer":
        _Client(schema, consumers, capacity, group_size)  # validate before building the store
        store = CentralStore(*cls.make_store(schema, consumers, capacity, group_size))
        return cls(schema, consumers, capacity, group_size, LocalTransport(), store)

    def put(self, indices, columns: Mapping[str, object], *, warehouse: int | None = None) -> None:
        """Write rows to the store (``warehouse`` is accepted for API parity and must be None or 0)."""
        idx, wire = self._encode(indices, columns)
        if warehouse not in (None, 0):
            raise ValueError(f"dock.put: warehouse={warehouse} out of range [0, 1) (centralized buffer)")
        if len(idx):
            self.transport.call(self.store, "put", idx, wire, self._lengths(wire))

    def get_dp(self, consumer: str, columns, n: int, dp_size: int, *, groups: bool = False,
               timeout: float | None = None, partial: bool = False, packed: bool = False) -> tuple[DockBatch, ...]:
        columns = self._check_get(consumer, columns, n, groups, dp_size)
        idx, lens, wire = self.transport.call(self.store, "get", consumer, list(columns), int(n), groups, partial,
                                              timeout)
        out = []
        for p in self._split(columns, lens, len(idx), groups, dp_size):
            sub = {c: take_rows(cell, p) for c, cell in wire.items()}
            out.append(self._assemble(columns, idx[p], [(np.arange(len(p)), sub)] if len(p) else [], packed))
        return tuple(out)

    def clear(self) -> None:
        self.transport.call(self.store, "clear")

    def pending(self, consumer: str, columns=None) -> tuple[int, int]:
        self._check_get(consumer, columns or self.schema.names[:1], 1, False, 1)
        return self.transport.call(self.store, "pending", consumer, columns)

    def traffic(self) -> dict[str, dict[str, int]]:
        return {"central": self.transport.call(self.store, "traffic")}

    def reset_traffic(self) -> None:
        self.transport.call(self.store, "reset_traffic")

    def snapshot(self) -> dict:
        return self.transport.call(self.store, "state")

    def close(self) -> None:
        self.transport.close([self.store])
