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

``release`` frees rows for new puts (the streaming case: rows of several steps share the dock, each step's
rows a range of it, freed once trained on; ``clear`` frees them all). A take may be limited to a range of
rows (``within``): a step takes its own rows.

``take_share`` is the take of a data-parallel worker group: the first of its ranks to ask takes the
rows for all of them and routes them onto the group's parts (``dock.routing``: balanced by sequence
length, groups whole); every rank (its tp and pp peers too) gets its part of that one take. The
routing is computed where the metadata is, so no rank waits for another's plan and none broadcasts one.

Numpy only; thread-safe (in-process threads, or a threaded Ray actor).
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np

from rlflow.dock.routing import route
from rlflow.dock.samplers import pick_groups, pick_rows, whole_groups
from rlflow.dock.warehouse import Meter
from rlflow.sharding.mesh import Mesh


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
        self._cond = threading.Condition(threading.RLock())
        self._shares: dict = {}  # take_share key -> (its request, rows, warehouses, lengths, each row's part)
        self._sharing: set = set()  # keys whose take is under way
        self._epoch = 0  # clear() counts up: a take_share waiting across a clear fails
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
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            out = self._take(columns, n, groups, partial, timeout, deadline)
        return self.meter.send(out)

    def _in(self, within) -> np.ndarray:
        """The rows a take may pick: all, or those of ``within`` = (first, end)."""
        if within is None:
            return np.ones(self.capacity, dtype=bool)
        lo, hi = within
        if not 0 <= lo < hi <= self.capacity or lo % self.group_size or hi % self.group_size:
            raise ValueError(f"dock.take: within={within} must be a range of whole groups in [0, {self.capacity})")
        out = np.zeros(self.capacity, dtype=bool)
        out[lo:hi] = True
        return out

    def _take(self, columns, n, groups, partial, timeout, deadline, epoch=None, key=None, within=None):
        ids = self._ids(columns)
        G = self.group_size if groups else 1
        inside = self._in(within)
        while True:
            eligible = self._ready[:, ids].all(axis=1) & ~self._consumed & inside
            sel = pick_groups(eligible, G, n) if groups else pick_rows(eligible, n)
            left = len(whole_groups(~self._consumed & inside, G)) * G
            if left < n and not partial:
                raise ValueError(f"dock.get: consumer {self.consumer!r} asks for {n} rows"
                                 f"{' in whole groups' if groups else ''} but only {left} remain unconsumed "
                                 f"{'' if within is None else f'in rows {within} '}until clear() or release()")
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
            if epoch is not None:  # a take_share's: a clear while it waited fails it
                self._check_epoch(epoch, key)
        self._consumed[sel] = True
        return sel, self._wh[sel].copy(), {c: self._len[c][sel].copy() for c in columns if c in self._len}

    def take_share(self, key, columns: Sequence[str], n: int, parts: int, part: int, cost: Sequence[str] = (),
                   groups: bool = False, timeout: float | None = None, within: tuple[int, int] | None = None):
        """Part ``part`` of ``parts`` of the one take ``key`` names: the first call with a new ``key`` takes
        ``n`` rows as ``take`` does (it may wait, up to ``timeout``) and routes them onto ``parts``
        data-parallel parts, balanced by the summed lengths of the ``cost`` columns (1 per row without),
        whole groups when ``groups``; every call with that key (from any rank, the same part as often as
        asked) returns its part, ``take``'s triple for those rows. A call with the key of another request
        (columns, n, parts, cost, groups) is refused; ``clear`` forgets the keys and fails the calls still
        waiting. ``within``: only rows of that range (first, end) are taken."""
        self.meter.recv(key, columns, n, parts, part, cost, groups, timeout, within)
        if not 0 <= part < parts:
            raise ValueError(f"dock.take_share: part {part} out of range [0, {parts})")
        within = None if within is None else (int(within[0]), int(within[1]))
        request = (tuple(columns), int(n), int(parts), tuple(cost), bool(groups), within)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            epoch = self._epoch
            while key not in self._shares:
                if key in self._sharing:  # another rank's call is taking: wait for its routing
                    wait = None if deadline is None else deadline - time.monotonic()
                    if wait is not None and wait <= 0:
                        raise DockTimeout(f"dock.get: consumer {self.consumer!r} waited {timeout} s for the "
                                          f"rows of take {key!r}")
                    self._cond.wait(wait)
                    self._check_epoch(epoch, key)
                    continue
                self._sharing.add(key)
                try:
                    sel, wh, lens = self._take(columns, n, groups, False, timeout, deadline, epoch, key, within)
                finally:
                    self._sharing.discard(key)
                    self._cond.notify_all()
                k = len(sel)
                weight = sum((lens[c] for c in cost if c in lens), np.zeros(k)) if any(c in lens for c in cost) \
                    else np.ones(k)
                plan = route(sel, wh, weight, np.zeros(k), Mesh(dp=parts), group_size=self.group_size if groups else 1)
                self._shares[key] = (request, sel, wh, lens, plan.part)
            asked, sel, wh, lens, where = self._shares[key]
            if asked != request:
                raise ValueError(f"dock.take_share: take {key!r} was made for (columns, n, parts, cost, groups, "
                                 f"within) = {asked}, not {request}")
            pos = np.flatnonzero(where == part)
            out = (sel[pos], wh[pos], {c: v[pos] for c, v in lens.items()})
        return self.meter.send(out)

    def _check_epoch(self, epoch: int, key) -> None:
        if self._epoch != epoch:
            raise ValueError(f"dock.get: consumer {self.consumer!r}: the dock was cleared while take {key!r} waited "
                             "for its rows")

    # ---- iteration boundary and inspection ----
    def clear(self) -> None:
        self.meter.recv()
        with self._cond:
            self._free(0, self.capacity)
            self._shares.clear()
            self._sharing.clear()
            self._epoch += 1
            self._cond.notify_all()
        self.meter.send(None)

    def release(self, first: int, end: int) -> None:
        """Rows ``first..end-1`` free for new puts: not ready, not consumed, not placed (their warehouses drop
        the cells, ``Dock.release``). A take waiting on them keeps waiting for new puts."""
        self.meter.recv(first, end)
        if not 0 <= first <= end <= self.capacity:
            raise ValueError(f"dock.release: rows [{first}, {end}) outside [0, {self.capacity})")
        with self._cond:
            self._free(first, end)
            self._cond.notify_all()
        self.meter.send(None)

    def _free(self, first: int, end: int) -> None:
        """Rows ``first..end-1`` not ready, not consumed, not placed (the caller holds the lock)."""
        self._ready[first:end] = False
        self._consumed[first:end] = False
        self._wh[first:end] = -1
        for a in self._len.values():
            a[first:end] = 0

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
