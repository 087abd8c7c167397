"""The dock's client API: ``put`` rows, ``get`` typed batches, ``clear`` between iterations.

    dock = Dock.local(GRPO.schema, GRPO.flow_consumers, capacity=2048, warehouses=4, group_size=8)  # runtime/graph.py
    dock.put(idx, {"prompt_ids": prompts, "group": group})          # rows go to warehouses
    b = dock.get("rollout", ["prompt_ids"], 64, groups=True)         # DockBatch, padded
    dock.put(b.index_B, {"response_ids": resp, "sample_logprobs": lp})
    parts = dock.get_dp("update", cols, 256, dp_size=4)              # balanced by sequence length

put: validate everything against the schema; ask the lead controller where each row lives (its
warehouse, chosen on the row's first put: a warehouse on the producer's node if there is one, else
round-robin over groups); write each warehouse's rows (all or nothing: a failure deletes what the
other warehouses took); then flip readiness in every controller.
get = ``take`` (the consumer's controller marks n ready rows consumed and returns their indices and
warehouses: scalars) + ``read`` (fetch each row straight from its warehouse). ``take`` and ``read``
are public so DP ranks can each read their own share of one balanced take.

The same code runs in-process (``LocalTransport``: direct calls, thread-safe) and on Ray
(``rlflow.dock.ray_backend``: warehouses and controllers are actors).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from rlflow.dock.controller import Controller
from rlflow.dock.routing import route
from rlflow.dock.schema import Schema, Wire, concat_cells, take_rows
from rlflow.dock.warehouse import Warehouse
from rlflow.sharding.mesh import Mesh


@dataclass(frozen=True, kw_only=True, slots=True)
class DockBatch:
    """Rows returned by a get. Padded: var columns ``[B, T]`` + ``mask[name]`` ``[B, T]`` bool (left-padded
    where the column says so), scalar ``[B]``, fixed ``[B, L]``. Packed: var columns flat ``[N]`` +
    ``cu_seqlens[name]`` int32 ``[B+1]``."""

    index_B: Tensor  # int64, global row index
    data: Mapping[str, Tensor]
    mask: Mapping[str, Tensor] = field(default_factory=dict)  # padded var columns only
    cu_seqlens: Mapping[str, Tensor] = field(default_factory=dict)  # packed var columns only
    packed: bool = False

    def __post_init__(self):
        for f in ("data", "mask", "cu_seqlens"):
            object.__setattr__(self, f, types.MappingProxyType(dict(getattr(self, f))))
        if self.index_B.dtype != torch.int64 or self.index_B.dim() != 1:
            raise ValueError(f"DockBatch.index_B: expected int64 [B], got {self.index_B.dtype} "
                             f"{tuple(self.index_B.shape)}")
        B = self.index_B.shape[0]
        for name, t in self.data.items():
            if name in self.cu_seqlens:
                cu = self.cu_seqlens[name]
                if cu.shape != (B + 1,) or int(cu[-1]) != t.shape[0]:
                    raise ValueError(f"DockBatch.cu_seqlens[{name!r}]: expected [{B + 1}] ending at {t.shape[0]}, "
                                     f"got {tuple(cu.shape)}")
            elif t.shape[:1] != (B,):
                raise ValueError(f"DockBatch.data[{name!r}]: expected {B} rows, got shape {tuple(t.shape)}")
            if name in self.mask and self.mask[name].shape != t.shape:
                raise ValueError(f"DockBatch.mask[{name!r}]: shape {tuple(self.mask[name].shape)} != {tuple(t.shape)}")

    @property
    def size(self) -> int:
        return self.index_B.shape[0]

    def __getitem__(self, name: str) -> Tensor:
        return self.data[name]

    def lengths(self, name: str) -> Tensor:
        """Per-row length of a var column, int64 [B]."""
        if name in self.cu_seqlens:
            return self.cu_seqlens[name].diff().long()
        return self.mask[name].sum(dim=1)

    def rows(self, name: str) -> list[Tensor]:
        """The rows of a column without padding."""
        if name in self.cu_seqlens:
            cu = self.cu_seqlens[name].tolist()
            return [self.data[name][a:b] for a, b in zip(cu[:-1], cu[1:])]
        if name in self.mask:
            return [r[m] for r, m in zip(self.data[name], self.mask[name])]
        return list(self.data[name])


@dataclass(frozen=True, slots=True, eq=False)
class Ticket:
    """What a take hands out: the rows (ascending), their warehouses and lengths. Scalars only."""

    consumer: str
    columns: tuple[str, ...]
    index: np.ndarray  # int64 [k]
    warehouse: np.ndarray  # int32 [k]
    lengths: dict[str, np.ndarray] = field(default_factory=dict)  # var column -> int64 [k]

    def __len__(self) -> int:
        return len(self.index)


class LocalTransport:
    """Direct method calls on in-process objects (which lock internally)."""

    nodes: tuple = ()

    def call(self, target, method: str, *args):
        return getattr(target, method)(*args)

    def call_many(self, calls) -> list:
        """Run every call; a failed one yields its exception instead of a result."""
        out = []
        for target, method, args in calls:
            try:
                out.append(getattr(target, method)(*args))
            except Exception as e:  # noqa: BLE001 - returned to the caller, who re-raises
                out.append(e)
        return out

    def here(self):
        return None

    def close(self, targets) -> None:
        pass


def _raise_first(results: list) -> list:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class _Client:
    """Validation, encoding and batch assembly shared by the dock and the centralized buffer."""

    def __init__(self, schema: Schema, consumers: Sequence[str], capacity: int, group_size: int):
        consumers = tuple(consumers)
        if not consumers or len(set(consumers)) != len(consumers):
            raise ValueError(f"dock: consumers must be non-empty and distinct, got {consumers}")
        if group_size < 1 or capacity < 1 or capacity % group_size:
            raise ValueError(f"dock: capacity={capacity} must be a positive multiple of group_size={group_size}")
        self.schema, self.consumers, self.capacity, self.group_size = schema, consumers, capacity, group_size

    def _indices(self, where: str, indices) -> np.ndarray:
        arr = indices.detach().cpu().numpy() if isinstance(indices, Tensor) else np.asarray(indices)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"dock.{where}: indices must be a 1-D integer sequence, got {arr.dtype} {arr.shape}")
        idx = arr.astype(np.int64)
        bad = idx[(idx < 0) | (idx >= self.capacity)]
        if bad.size:
            raise ValueError(f"dock.{where}: index {int(bad[0])} out of range [0, {self.capacity})")
        uniq, counts = np.unique(idx, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"dock.{where}: index {int(uniq[counts > 1][0])} appears more than once")
        return idx

    def _encode(self, indices, columns: Mapping[str, object]) -> tuple[np.ndarray, Wire]:
        idx = self._indices("put", indices)
        if not isinstance(columns, Mapping):
            raise ValueError(f"dock.put: columns must be a mapping name -> values, got {type(columns).__name__}")
        return idx, self.schema.encode("dock.put", len(idx), columns)

    def _lengths(self, wire: Wire) -> dict[str, np.ndarray]:
        return {c: cell[1] for c, cell in wire.items() if cell[1] is not None}

    def _check_get(self, consumer: str, columns, n: int, groups: bool, dp_size: int) -> tuple[str, ...]:
        if consumer not in self.consumers:
            raise ValueError(f"dock.get: unknown consumer {consumer!r} (known: {', '.join(self.consumers)})")
        if isinstance(columns, str):
            columns = (columns,)
        columns = self.schema.check_names("dock.get", columns)
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"dock.get: n must be a positive integer, got {n!r}")
        if n > self.capacity:
            raise ValueError(f"dock.get: n={n} exceeds the dock's capacity {self.capacity}")
        if groups and n % self.group_size:
            raise ValueError(f"dock.get: n={n} is not a multiple of group_size={self.group_size} (groups=True)")
        if not isinstance(dp_size, (int, np.integer)) or dp_size < 1:
            raise ValueError(f"dock.get: dp_size must be a positive integer, got {dp_size!r}")
        return columns

    def _cost(self, columns, lengths: dict[str, np.ndarray], k: int) -> np.ndarray:
        """Each row's sequence length over the length groups of ``columns`` (1 each when none is var)."""
        seen, cost = set(), np.zeros(k)
        for c in columns:
            g = self.schema[c].length_group or c
            if c in lengths and g not in seen:
                seen.add(g)
                cost += lengths[c]
        return cost if seen else cost + 1

    def _split(self, columns, lengths: dict[str, np.ndarray], k: int, groups: bool, dp_size: int) -> list[np.ndarray]:
        """Positions of each DP rank: equal counts, total sequence length balanced (groups kept whole)."""
        if dp_size == 1:
            return [np.arange(k)]
        plan = route(np.arange(k), np.zeros(k), self._cost(columns, lengths, k), np.zeros(k), Mesh(dp=dp_size),
                     group_size=self.group_size if groups else 1)
        return [plan.positions(p) for p in range(dp_size)]

    def _assemble(self, columns, index: np.ndarray, chunks: list[tuple[np.ndarray, Wire]], packed: bool) -> DockBatch:
        """Build a DockBatch of rows ``index`` from wire chunks, each (positions in the batch, wire)."""
        B = len(index)
        chunks = [c for c in chunks if len(c[0])]
        order = np.concatenate([p for p, _ in chunks]) if chunks else np.zeros(0, dtype=np.int64)
        inv = np.empty(B, dtype=np.int64)
        inv[order] = np.arange(B)
        data, mask, cu = {}, {}, {}
        for name in columns:
            col = self.schema[name]
            if chunks:
                values, lens = take_rows(concat_cells([w[name] for _, w in chunks]), inv)
            else:
                values, lens = np.zeros((0, col.length) if col.kind == "fixed" else 0), (np.zeros(0, np.int64)
                                                                                        if col.kind == "var" else None)
            flat = torch.from_numpy(np.ascontiguousarray(values)).to(col.wire_dtype).view(col.dtype)
            if lens is None:
                data[name] = flat
            elif packed:
                data[name] = flat
                cu[name] = torch.zeros(B + 1, dtype=torch.int32)
                cu[name][1:] = torch.from_numpy(np.cumsum(lens)).to(torch.int32)
            else:
                L = torch.from_numpy(lens)
                T = int(L.max()) if B else 0
                ar = torch.arange(T)
                m = ar[None, :] >= (T - L)[:, None] if col.pad_left else ar[None, :] < L[:, None]
                out = torch.full((B, T), col.pad_value, dtype=col.dtype)
                out[m] = flat
                data[name], mask[name] = out, m
        return DockBatch(index_B=torch.from_numpy(np.asarray(index, dtype=np.int64).copy()), data=data, mask=mask,
                         cu_seqlens=cu, packed=packed)

    def get(self, consumer: str, columns, n: int, *, groups: bool = False, timeout: float | None = None,
            partial: bool = False, packed: bool = False) -> DockBatch:
        """``n`` rows ready in all ``columns`` and not yet consumed by ``consumer``, marked consumed.

        ``groups``: whole GRPO groups only. ``timeout``: seconds to wait for ``n`` ready rows (``None``
        waits without limit, ``0`` not at all); then ``TimeoutError``, or with ``partial`` the rows
        that are ready. ``packed``: var columns flat with cu_seqlens instead of padded.
        """
        return self.get_dp(consumer, columns, n, 1, groups=groups, timeout=timeout, partial=partial,
                           packed=packed)[0]


class Dock(_Client):
    """The transfer dock: S warehouses + one controller per consumer, behind put / get / clear."""

    def __init__(self, schema: Schema, consumers: Sequence[str], capacity: int, group_size: int, transport,
                 warehouses: list, controllers: dict):
        super().__init__(schema, consumers, capacity, group_size)
        self.transport, self.warehouses, self.controllers = transport, list(warehouses), dict(controllers)
        self.lead = self.controllers[self.consumers[0]]

    @classmethod
    def local(cls, schema: Schema, consumers: Sequence[str], *, capacity: int,
              warehouses: int = 1, group_size: int = 1) -> "Dock":
        """In-process dock (threads): warehouses and controllers are plain objects in this process."""
        if warehouses < 1:
            raise ValueError(f"Dock.local: warehouses must be >= 1, got {warehouses}")
        var = [c.name for c in schema if c.kind == "var"]
        whs = [Warehouse(f"w{i}", schema.wire_spec()) for i in range(warehouses)]
        ctrls = {c: Controller(c, capacity, schema.names, var, group_size) for c in consumers}
        return cls(schema, consumers, capacity, group_size, LocalTransport(), whs, ctrls)

    def _preferred(self, idx: np.ndarray, warehouse: int | None) -> np.ndarray:
        S = len(self.warehouses)
        if warehouse is not None:
            if not 0 <= warehouse < S:
                raise ValueError(f"dock.put: warehouse={warehouse} out of range [0, {S})")
            return np.full(len(idx), warehouse, dtype=np.int32)
        here, nodes = self.transport.here(), self.transport.nodes
        local = [w for w in range(S) if nodes and nodes[w] == here] or list(range(S))
        return np.asarray(local, dtype=np.int32)[(idx // self.group_size) % len(local)]

    def put(self, indices, columns: Mapping[str, object], *, warehouse: int | None = None) -> None:
        """Write ``columns`` (name -> values, one per index) for rows ``indices``; each cell once.

        Values: a sequence of 1-D tensors for a var column, ``[k]`` for a scalar, ``[k, L]`` for a fixed
        column. ``warehouse``: where rows put for the first time go (default: the producer's node,
        round-robin over groups); a row already placed stays where it is.
        """
        idx, wire = self._encode(indices, columns)
        pref = self._preferred(idx, warehouse)
        if len(idx) == 0:
            return
        cols = list(wire)
        t = self.transport
        wh, new = t.call(self.lead, "place", idx, cols, pref)
        targets = np.unique(wh).tolist()
        parts = {w: np.flatnonzero(wh == w) for w in targets}
        results = t.call_many([(self.warehouses[w], "put", (idx[p], {c: take_rows(wire[c], p) for c in cols}))
                               for w, p in parts.items()])
        if any(isinstance(r, BaseException) for r in results):
            done = [w for w, r in zip(targets, results) if not isinstance(r, BaseException)]
            t.call_many([(self.warehouses[w], "delete", (idx[parts[w]], cols)) for w in done])
            t.call(self.lead, "unplace", idx[new])
            _raise_first(results)
        lens = self._lengths(wire)
        _raise_first(t.call_many([(c, "mark_ready", (idx, wh, cols, lens)) for c in self.controllers.values()]))

    def take(self, consumer: str, columns, n: int, *, groups: bool = False, dp_size: int = 1,
             timeout: float | None = None, partial: bool = False) -> tuple[Ticket, ...]:
        """Mark ``n`` rows consumed for ``consumer``; one ticket per DP rank (balanced by length)."""
        columns = self._check_get(consumer, columns, n, groups, dp_size)
        idx, wh, lens = self.transport.call(self.controllers[consumer], "take", list(columns), int(n), groups,
                                            partial, timeout)
        parts = self._split(columns, lens, len(idx), groups, dp_size)
        return tuple(Ticket(consumer, columns, idx[p], wh[p], {c: v[p] for c, v in lens.items()}) for p in parts)

    def take_share(self, consumer: str, columns, n: int, *, key, parts: int, part: int, cost=(),
                   groups: bool = False, timeout: float | None = None,
                   within: tuple[int, int] | None = None) -> Ticket:
        """Part ``part`` of ``parts`` of the take ``key`` (``Controller.take_share``): the first rank of a
        data-parallel group to ask takes ``n`` rows for all (of the rows ``within`` = (first, end) when given)
        and the controller routes them onto the parts, balanced by the lengths of the ``cost`` columns; each
        rank reads its part with ``read``."""
        columns = self._check_get(consumer, columns, n, groups, parts)
        if not isinstance(part, (int, np.integer)) or not 0 <= part < parts:
            raise ValueError(f"dock.take_share: part must be in [0, {parts}), got {part!r}")
        cost = self.schema.check_names("dock.take_share", cost) if cost else ()
        if set(cost) - set(columns):
            raise ValueError(f"dock.take_share: cost columns {sorted(set(cost) - set(columns))} are not among the "
                             f"columns taken {list(columns)}")
        idx, wh, lens = self.transport.call(self.controllers[consumer], "take_share", key, list(columns), int(n),
                                            int(parts), int(part), list(cost), groups, timeout, within)
        return Ticket(consumer, columns, idx, wh, lens)

    def read(self, ticket: Ticket, *, packed: bool = False) -> DockBatch:
        """Fetch a ticket's rows straight from their warehouses."""
        targets = np.unique(ticket.warehouse).tolist()
        parts = [np.flatnonzero(ticket.warehouse == w) for w in targets]
        wires = _raise_first(self.transport.call_many(
            [(self.warehouses[w], "get", (ticket.index[p], list(ticket.columns))) for w, p in zip(targets, parts)]))
        return self._assemble(ticket.columns, ticket.index, list(zip(parts, wires)), packed)

    def get_dp(self, consumer: str, columns, n: int, dp_size: int, *, groups: bool = False,
               timeout: float | None = None, partial: bool = False, packed: bool = False) -> tuple[DockBatch, ...]:
        """Like ``get``, split into ``dp_size`` batches of equal row count and balanced total length."""
        tickets = self.take(consumer, columns, n, groups=groups, dp_size=dp_size, timeout=timeout, partial=partial)
        return tuple(self.read(tk, packed=packed) for tk in tickets)

    def clear(self) -> None:
        """Drop every row and reset every controller (between iterations)."""
        _raise_first(self.transport.call_many([(x, "clear", ()) for x in [*self.warehouses,
                                                                           *self.controllers.values()]]))

    def release(self, first: int, end: int) -> None:
        """Free rows ``first..end-1`` for new puts (a streaming run's trained rows): every warehouse drops their
        cells, then every controller forgets them. Rows being read must not be released."""
        idx = np.arange(first, end, dtype=np.int64)
        _raise_first(self.transport.call_many([(w, "delete", (idx, list(self.schema.names))) for w in self.warehouses]))
        _raise_first(self.transport.call_many([(c, "release", (first, end)) for c in self.controllers.values()]))

    def pending(self, consumer: str, columns=None) -> tuple[int, int]:
        """(rows ``consumer`` has not consumed, of those the ones ready in ``columns``)."""
        self._check_get(consumer, columns or self.schema.names[:1], 1, False, 1)
        return self.transport.call(self.controllers[consumer], "pending", columns)

    def traffic(self) -> dict[str, dict[str, int]]:
        """Bytes in / out and calls of every dock process since the last reset."""
        names = [f"warehouse/{i}" for i in range(len(self.warehouses))] + [f"controller/{c}" for c in self.controllers]
        procs = [*self.warehouses, *self.controllers.values()]
        return dict(zip(names, _raise_first(self.transport.call_many([(p, "traffic", ()) for p in procs]))))

    def reset_traffic(self) -> None:
        procs = [*self.warehouses, *self.controllers.values()]
        _raise_first(self.transport.call_many([(p, "reset_traffic", ()) for p in procs]))

    def snapshot(self) -> dict:
        """Every controller's bits and every warehouse's cells, as plain lists (to compare states)."""
        calls = [(c, "state", ()) for c in self.controllers.values()] + [(w, "contents", ()) for w in self.warehouses]
        res = _raise_first(self.transport.call_many(calls))
        k = len(self.controllers)
        return {"controllers": {c: tuple(a.tolist() for a in s) for c, s in zip(self.controllers, res[:k])},
                "warehouses": res[k:]}

    def close(self) -> None:
        self.transport.close([*self.warehouses, *self.controllers.values()])
