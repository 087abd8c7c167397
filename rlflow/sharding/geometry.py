"""Shard geometry from shapes alone: which box of a parameter's view each rank holds, and the exact
pieces a destination rank needs from which source rank.

A *placement* is ``(mesh, spec, stage, view)``; everything here is cached per placement pair, so the
61 layers of a model (which differ only by name, and by stage in pp layouts) cost one computation per
distinct (placement, placement) pair. Boxes are tuples of ``(lo, hi)`` per view dim.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from rlflow.sharding.mesh import Mesh
from rlflow.sharding.spec import P

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, eq=False)
class Blocks:
    """The holders of one placement and their chunk indices."""

    ranks: np.ndarray  # [n] holder ranks, ascending
    idx: np.ndarray  # [n, ndim] chunk index per view dim
    grid: tuple[int, ...]  # chunks per view dim
    chunk: tuple[int, ...]  # chunk length per view dim
    row_of: np.ndarray  # [world] row in ranks/idx, -1 where the rank does not hold

    def box(self, row: int) -> Box:
        return tuple((int(i) * c, (int(i) + 1) * c) for i, c in zip(self.idx[row], self.chunk))

    def box_of(self, rank: int) -> Box | None:
        row = self.row_of[rank]
        return None if row < 0 else self.box(int(row))

    @property
    def lo(self) -> np.ndarray:
        return self.idx * np.asarray(self.chunk, dtype=np.int64)


@functools.lru_cache(maxsize=8192)
def blocks(mesh: Mesh, spec: P, stage: int, view: tuple[int, ...]) -> Blocks:
    ranks = np.flatnonzero(mesh.coord_array[:, 0] == stage)
    idx = np.stack([mesh.index(P.dim_axes(e))[ranks] for e in spec], axis=1) if len(spec) else \
        np.zeros((len(ranks), 0), dtype=np.int64)
    grid = spec.divisors(mesh)
    row_of = np.full(mesh.size, -1, dtype=np.int64)
    row_of[ranks] = np.arange(len(ranks))
    return Blocks(ranks=ranks, idx=idx.astype(np.int64), grid=grid,
                  chunk=tuple(n // g for n, g in zip(view, grid)), row_of=row_of)


def placement(layout, name: str):
    p = layout[name]
    return (layout.mesh, p.spec, p.stage, p.view)


def _overlaps(n: int, ns: int, nt: int) -> list[list[tuple[int, int, int]]]:
    """For each of ``nt`` destination chunks of ``[0, n)``: the ``ns``-source chunks it overlaps, as
    ``(source chunk, lo, hi)``."""
    cs, ct = n // ns, n // nt
    out = []
    for j in range(nt):
        lo, hi = j * ct, (j + 1) * ct
        out.append([(i, max(lo, i * cs), min(hi, (i + 1) * cs)) for i in range(lo // cs, (hi - 1) // cs + 1)])
    return out


@dataclass(frozen=True, eq=False)
class Transfers:
    """Exact pieces for one placement pair: piece ``k`` goes from ``send[k]`` to ``recv[k]`` (the same
    rank: a local copy) and covers ``boxes[k]`` of the view; ``numel[k]`` elements."""

    recv: np.ndarray
    send: np.ndarray
    boxes: tuple[Box, ...]
    numel: np.ndarray
    world: int
    apart: bool = False  # ``send`` and ``recv`` number the ranks of two disjoint meshes: every piece is remote

    @functools.cached_property
    def remote(self) -> np.ndarray:
        return np.ones(len(self.recv), dtype=bool) if self.apart else self.recv != self.send

    def recv_numel(self) -> np.ndarray:
        r = self.remote
        return np.bincount(self.recv[r], weights=self.numel[r], minlength=self.world).astype(np.int64)

    def send_numel(self) -> np.ndarray:
        r = self.remote
        return np.bincount(self.send[r], weights=self.numel[r], minlength=self.world).astype(np.int64)

    @functools.cached_property
    def by_recv(self) -> dict[int, list[int]]:
        return _positions_by_value(self.recv)

    @functools.cached_property
    def by_send(self) -> dict[int, list[int]]:
        return _positions_by_value(self.send)


def _positions_by_value(ranks: np.ndarray) -> dict[int, list[int]]:
    """rank -> the positions (transfer indices) where it appears, in order."""
    out: dict[int, list[int]] = {}
    for k, r in enumerate(ranks.tolist()):
        out.setdefault(r, []).append(k)
    return out


@functools.lru_cache(maxsize=8192)
def transfers(src: tuple, dst: tuple, apart: bool = False) -> Transfers:
    """Minimal point-to-point pieces from placement ``src`` to placement ``dst`` (same view shape).

    A piece a receiver already holds is copied locally; otherwise it comes from the least-loaded
    replica holding it (ties to the lowest rank), so replicated sources share the sending. ``apart``: the
    two meshes are disjoint rank sets (separate device pools, any sizes), each numbered from 0: no piece is
    local, ``send`` holds source-mesh ranks and ``recv`` destination-mesh ranks."""
    smesh, sspec, sstage, view = src
    dmesh, dspec, dstage, dview = dst
    assert view == dview and (apart or smesh.size == dmesh.size)
    sb, db = blocks(*src), blocks(*dst)
    replicas: dict[tuple, list] = {}
    for r, i in zip(sb.ranks.tolist(), map(tuple, sb.idx.tolist())):
        replicas.setdefault(i, []).append([0, r])
    ov = [_overlaps(n, a, b) for n, a, b in zip(view, sb.grid, db.grid)]
    combos: dict[tuple, list] = {}
    recv, send, boxes, numel = [], [], [], []
    for r, j in zip(db.ranks.tolist(), map(tuple, db.idx.tolist())):
        pieces = combos.get(j)
        if pieces is None:
            pieces = []
            for c in itertools.product(*(ov[d][jd] for d, jd in enumerate(j))):
                box = tuple((lo, hi) for _, lo, hi in c)
                pieces.append((tuple(x[0] for x in c), box, int(np.prod([hi - lo for lo, hi in box]))))
            combos[j] = pieces
        srow = -1 if apart else sb.row_of[r]
        mine = tuple(sb.idx[srow].tolist()) if srow >= 0 else None
        for i, box, n in pieces:
            if i == mine:
                s = r
            else:
                heap = replicas[i]
                s = heap[0][1]
                heapq.heapreplace(heap, [heap[0][0] + n, s])
            recv.append(r), send.append(s), boxes.append(box), numel.append(n)
    return Transfers(recv=np.asarray(recv, dtype=np.int64), send=np.asarray(send, dtype=np.int64),
                     boxes=tuple(boxes), numel=np.asarray(numel, dtype=np.int64), world=smesh.size, apart=apart)


def gather_axes_candidates(mesh: Mesh, spec: P) -> list[tuple[str, ...]]:
    """Nonempty sets of the spec's axes (size > 1) whose all-gather leaves every rank a box: on each
    dim, the gathered axes must be the minor end of that dim's axes."""
    dims = [tuple(a for a in P.dim_axes(e) if getattr(mesh, a) > 1) for e in spec]
    axes = [a for d in dims for a in d]
    out = []
    for k in range(1, len(axes) + 1):
        for sub in itertools.combinations(axes, k):
            s = set(sub)
            if all(tuple(a for a in d if a in s) == d[len(d) - len(s & set(d)):] for d in dims):
                out.append(tuple(sub))
    return out


@functools.lru_cache(maxsize=8192)
def gathered(src: tuple, axes: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """After an all-gather over ``axes``, the box each holder of ``src`` has: ``(lo, hi)`` arrays
    ``[n_holders, ndim]`` (rows as in ``blocks(*src)``)."""
    mesh, spec, _, view = src
    b = blocks(*src)
    lo, hi = np.empty_like(b.idx), np.empty_like(b.idx)
    for d, e in enumerate(spec):
        m = mesh.axis_size(tuple(a for a in P.dim_axes(e) if a in axes))
        g = b.grid[d] // m
        c = view[d] // g
        lo[:, d] = (b.idx[:, d] // m) * c
        hi[:, d] = lo[:, d] + c
    return lo, hi


def group_of(mesh: Mesh, axes: tuple[str, ...], rank: int) -> tuple[int, ...]:
    return mesh.group_ranks(axes, rank) if axes else (rank,)


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def rel(box: Box, origin: Box) -> tuple[slice, ...]:
    """Index of ``box`` inside a tensor that holds the box ``origin``."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def box_numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n
