"""Controller: one per consumer stage; scalar metadata only, never a row's data.

Per row (``capacity`` rows, global index ``0..capacity-1``) a controller holds:

- the warehouse id of the row (``-1`` until the row is first put),
- a readiness bit per column (the cell has been written),
- a consumed bit (this consumer has taken the row),
- the length of each variable-length column (scalars too; they let a get balance sequence length
  across DP ranks without touching the data).

``take`` picks rows ready in all requested columns and not yet consumed, marks them consumed and
returns their indices, warehouse ids and lengths, all under one lock, so two callers never receive
the same row. It can block (a condition variable is notified by every ``mark_ready``), with a
timeout. One controller, the *lead*, also assigns a row's warehouse on its first put (``place``).

Numpy only; thread-safe (in-process threads, or a threaded Ray actor).
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np

from rlflow.dock.samplers import pick_groups, pick_rows, whole_groups
from rlflow.dock.warehouse import Meter


class DockTimeout(TimeoutError):
    """A dock get waited its ``timeout`` for rows that did not come (their producer is late, hung or lost)."""


class Controller:
    def __init__(self, consumer: str, capacity: int, columns: Sequence[str], var_columns: Sequence[str],
                 group_size: int = 1):
        if capacity <= 0 or capacity % group_size:
            raise ValueError(f"Controller: capacity={capacity} must be a positive multiple of group_size={group_size}")
        self.consumer = consumer
        self.capacity = capacity
        self.group_size = group_size
        self._col = {c: i for i, c in enumerate(columns)}
        self._var = tuple(var_columns)
        self._ready = np.zeros((capacity, len(self._col)), dtype=bool)
        self._consumed = np.zeros(capacity, dtype=bool)
        self._wh = np.full(capacity, -1, dtype=np.int32)
        self._len = {c: np.zeros(capacity, dtype=np.int64) for c in self._var}
        self._cond = threading.Condition()
        self.meter = Meter()

    def _ids(self, columns: Sequence[str]) -> list[int]:
        return [self._col[c] for c in columns]

    # ---- placement (lead controller only) ----
    def place(self, indices: np.ndarray, columns: Sequence[str], preferred: np.ndarray):
        """Warehouse of each row: its existing one, else ``preferred``. Rejects cells already written.

        Returns ``(warehouse ids int32[k], newly placed bool[k])``.
        """
        self.meter.recv(indices, columns, preferred)
        ids = self._ids(columns)
        with self._cond:
            written = self._ready[np.ix_(indices, ids)]
            if written.any():
                r, c = np.argwhere(written)[0]
                raise ValueError(f"dock.put: cell (row {int(indices[r])}, column {columns[c]!r}) already written")
            wh = self._wh[indices].copy()
            new = wh < 0
            wh[new] = preferred[new]
            self._wh[indices[new]] = wh[new]
        return self.meter.send((wh, new))

    def unplace(self, indices: np.ndarray) -> None:
        """Forget the placement of rows that still have no cell (roll back a failed first put)."""
        self.meter.recv(indices)
        with self._cond:
            rows = indices[~self._ready[indices].any(axis=1)]
            self._wh[rows] = -1
        self.meter.send(None)

    # ---- readiness ----
    def mark_ready(self, indices: np.ndarray, wh: np.ndarray, columns: Sequence[str],
                   lengths: dict[str, np.ndarray]) -> None:
        """Cells ``indices`` x ``columns`` are written, in warehouses ``wh``; wake blocked takes."""
        self.meter.recv(indices, wh, columns, lengths)
        with self._cond:
            self._wh[indices] = wh
            self._ready[np.ix_(indices, self._ids(columns))] = True
            for c, n in lengths.items():
                self._len[c][indices] = n
            self._cond.notify_all()
        self.meter.send(None)

    # ---- taking rows ----
    def take(self, columns: Sequence[str], n: int, groups: bool = False, partial: bool = False,
             timeout: float | None = None):
        """Take ``n`` rows ready in all ``columns`` and not yet consumed; mark them consumed.

        ``groups``: whole groups only. ``timeout``: seconds to wait (``None``: no limit, ``0``: no wait).
        ``partial``: on timeout return the rows that are ready (possibly none) instead of raising
        ``TimeoutError``. Fails without changing anything. Returns
        ``(indices int64[k] ascending, warehouse ids int32[k], {var column in columns: lengths int64[k]})``.
        """
        self.meter.recv(columns, n, groups, partial, timeout)
        ids = self._ids(columns)
        G = self.group_size if groups else 1
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                eligible = self._ready[:, ids].all(axis=1) & ~self._consumed
                sel = pick_groups(eligible, G, n) if groups else pick_rows(eligible, n)
                left = len(whole_groups(~self._consumed, G)) * G
                if left < n and not partial:
                    raise ValueError(f"dock.get: consumer {self.consumer!r} asks for {n} rows"
                                     f"{' in whole groups' if groups else ''} but only {left} remain unconsumed "
                                     f"until clear()")
                if len(sel) >= min(n, left):
                    break
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    if partial:
                        break
                    raise DockTimeout(f"dock.get: consumer {self.consumer!r} waited {timeout} s for {n} rows ready "
                                       f"in {list(columns)} and not yet consumed; {len(sel)} are ready "
                                       f"(partial=True takes them)")
                self._cond.wait(wait)
            self._consumed[sel] = True
            out = (sel, self._wh[sel].copy(), {c: self._len[c][sel].copy() for c in columns if c in self._len})
        return self.meter.send(out)

    # ---- iteration boundary and inspection ----
    def clear(self) -> None:
        self.meter.recv()
        with self._cond:
            self._ready[:] = False
            self._consumed[:] = False
            self._wh[:] = -1
            for a in self._len.values():
                a[:] = 0
            self._cond.notify_all()
        self.meter.send(None)

    def pending(self, columns: Sequence[str] | None = None) -> tuple[int, int]:
        """(rows not yet consumed, of those the ones ready in ``columns``)."""
        with self._cond:
            left = ~self._consumed
            ready = self._ready[:, self._ids(columns)].all(axis=1) if columns else np.ones_like(left)
            return int(left.sum()), int((left & ready).sum())

    def state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of (ready [capacity, columns], consumed [capacity], warehouse [capacity])."""
        with self._cond:
            return self._ready.copy(), self._consumed.copy(), self._wh.copy()

    def traffic(self) -> dict[str, int]:
        return self.meter.read()

    def reset_traffic(self) -> None:
        self.meter.reset()
