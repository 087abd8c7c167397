"""Warehouse: holds the real rows of the dock, unpadded, one cell per (row, column).

A dock has S warehouses (one or more per node). A row lives in exactly one warehouse, chosen when
the row is first put; every later column of that row goes to the same warehouse. Readers fetch rows
straight from the warehouses that hold them, so the bytes of a step are spread over S processes
instead of passing through one.

Numpy only (no torch), so the process that hosts a warehouse needs nothing else. Thread-safe: the
in-process backend calls it from many threads, the Ray backend from a threaded actor.

Traffic: every public method records the serialized size of what it receives and what it returns
(``payload_bytes``: pickle protocol 5 header plus out-of-band buffers, which is what Ray ships), so
benchmarks count bytes that really crossed the process boundary.
"""

from __future__ import annotations

import pickle
import threading

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # schema.py imports torch; a warehouse process needs only numpy
    from rlflow.dock.schema import Cell, Wire


def payload_bytes(obj: object) -> int:
    """Serialized size of ``obj``: pickle-5 header + out-of-band buffers (numpy data is not copied)."""
    bufs: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    return len(head) + sum(b.raw().nbytes for b in bufs)


class Meter:
    """Bytes received and sent by one dock process, and the number of calls."""

    __slots__ = ("bytes_in", "bytes_out", "calls", "_lock")

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.bytes_in = self.bytes_out = self.calls = 0

    def recv(self, *args: object) -> None:
        n = payload_bytes(args)
        with self._lock:
            self.bytes_in += n
            self.calls += 1

    def send(self, result):
        n = payload_bytes(result)
        with self._lock:
            self.bytes_out += n
        return result

    def read(self) -> dict[str, int]:
        return {"bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "calls": self.calls}


class Warehouse:
    """Cells of the rows placed here. ``spec``: column name -> (kind, length_group)."""

    def __init__(self, name: str, spec: dict[str, tuple[str, str | None]]):
        self.name = name
        self._spec = dict(spec)
        self._cells: dict[str, dict[int, np.ndarray]] = {c: {} for c in spec}
        self._lock = threading.Lock()
        self.meter = Meter()

    # ---- writes ----
    def put(self, indices: np.ndarray, wire: Wire) -> int:
        """Store ``wire``'s rows at ``indices``; all or nothing. Returns the number of rows stored."""
        self.meter.recv(indices, wire)
        indices = np.asarray(indices, dtype=np.int64)
        with self._lock:
            self._check_put(indices, wire)
            for name, (values, lengths) in wire.items():
                store = self._cells[name]
                if lengths is None:
                    for i, r in enumerate(indices.tolist()):
                        store[r] = values[i]
                else:
                    parts = np.split(values, np.cumsum(lengths)[:-1]) if len(lengths) else []
                    for r, part in zip(indices.tolist(), parts):
                        store[r] = part
        return self.meter.send(len(indices))

    def _check_put(self, indices: np.ndarray, wire: Wire) -> None:
        for name, (values, lengths) in wire.items():
            if name not in self._spec:
                raise ValueError(f"dock.put: warehouse {self.name} has no column {name!r}")
            store = self._cells[name]
            for r in indices.tolist():
                if r in store:
                    raise ValueError(f"dock.put: cell (row {r}, column {name!r}) already written")
            group = self._spec[name][1]
            if group is None:
                continue
            for other, (kind, g) in self._spec.items():  # lengths must agree with stored cells of the group
                if g != group or other in wire:
                    continue
                ostore = self._cells[other]
                for r, n in zip(indices.tolist(), lengths.tolist()):
                    if r in ostore and len(ostore[r]) != n:
                        raise ValueError(f"dock.put: column {name!r} row {r} has length {n} but stored "
                                         f"{other!r} has {len(ostore[r])} (length group {group!r})")

    def delete(self, indices: np.ndarray, columns: list[str]) -> int:
        """Remove cells (used to roll back a put that failed on another warehouse)."""
        self.meter.recv(indices, columns)
        with self._lock:
            n = 0
            for name in columns:
                store = self._cells[name]
                for r in np.asarray(indices).tolist():
                    n += store.pop(r, None) is not None
        return self.meter.send(n)

    def clear(self) -> None:
        self.meter.recv()
        with self._lock:
            for store in self._cells.values():
                store.clear()
        self.meter.send(None)

    # ---- reads ----
    def get(self, indices: np.ndarray, columns: list[str]) -> Wire:
        """The cells of ``indices`` x ``columns``, rows in the order given."""
        self.meter.recv(indices, columns)
        rows = np.asarray(indices, dtype=np.int64).tolist()
        out: Wire = {}
        with self._lock:
            for name in columns:
                store = self._cells[name]
                missing = [r for r in rows if r not in store]
                if missing:
                    raise KeyError(f"dock.get: warehouse {self.name} has no cell (row {missing[0]}, column {name!r})")
                cells = [store[r] for r in rows]
                out[name] = self._gather(name, cells)
        return self.meter.send(out)

    def _gather(self, name: str, cells: list[np.ndarray]) -> Cell:
        kind = self._spec[name][0]
        if kind == "var":
            lengths = np.fromiter((len(c) for c in cells), dtype=np.int64, count=len(cells))
            return (np.concatenate(cells) if cells else np.empty(0)), lengths
        return (np.stack(cells) if cells else np.empty(0)), None

    # ---- inspection ----
    def contents(self) -> dict[str, list[int]]:
        """Column -> sorted rows held (for tests and debugging; no bytes counted)."""
        with self._lock:
            return {c: sorted(s) for c, s in self._cells.items()}

    def held_bytes(self) -> int:
        """Bytes of the cells held (for tests and the cost model's check; no bytes counted)."""
        with self._lock:
            return sum(a.nbytes for s in self._cells.values() for a in s.values())

    def traffic(self) -> dict[str, int]:
        return self.meter.read()

    def reset_traffic(self) -> None:
        self.meter.reset()
