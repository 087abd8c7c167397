"""How one parameter moves from a source placement to a destination placement.

Candidates, each exact:

- ``slice``: every destination shard already lies inside the rank's own source shard.
- ``all_gather(A)``: all-gather over source axes ``A`` into a temporary buffer, then slice (the
  paper's allgather-swap step). Valid when every destination rank is a source holder whose gathered
  box covers its destination shard.
- ``broadcast(A)``: for a pp source layout: all-gather over ``A`` inside the stage, then broadcast the
  stage's buffer along ``pp`` to the other stages, then slice (pp -> no pp).
- ``p2p``: the minimal pieces (``geometry.transfers``), each sent once by one holder; executed as an
  ``all_to_all`` (ranks exchange) or ``send_recv`` (one-way flows) per bucket.

Cost model, per rank, in bytes: received and sent (ring all-gather: ``(m-1)/m`` of the gathered
buffer each way; broadcast: a pipelined chain along pp, every member but the last forwards the
payload once). The choice is made per *family*: the parameters whose placements differ only by pp
stage (the same weight of every layer), since buckets take one layer per stage in turn and the
stages' traffic overlaps. For each strategy valid for the whole family, sum the per-rank bytes over
the family; minimise, lexicographically, the busiest rank's ``max(sent, received)`` (time on a full-
duplex link), the busiest rank's received bytes, then prefer the simpler collective (slice/p2p
without traffic, all_gather, broadcast, p2p). So an all-gather-then-slice is taken only when nothing
is cheaper; when a p2p pattern beats it, the plan names the all-gather alternative and its bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from rlflow.sharding import geometry as geo

PREFERENCE = {"slice": 0, "all_gather": 1, "broadcast": 2, "p2p": 3}


@dataclass(frozen=True, eq=False)
class Candidate:
    kind: str  # slice | all_gather | broadcast | p2p
    axes: tuple[str, ...]  # source axes all-gathered first (all_gather, broadcast)
    stage: int  # source stage
    recv: np.ndarray  # [world] elements received
    sent: np.ndarray  # [world] elements sent
    tmp: np.ndarray  # [world] elements of temporary buffers during the collective
    keep: np.ndarray  # [world] elements of them still held after it (p2p frees its send buffer)

    @property
    def key(self) -> tuple[str, tuple[str, ...]]:
        """Same for every member of a family: slice and p2p are one strategy (p2p without traffic)."""
        return ("p2p" if self.kind == "slice" else self.kind, self.axes)

    @property
    def label(self) -> str:
        return f"{self.kind}({','.join(self.axes)})" if self.axes else self.kind


def _ro(*arrays):
    for a in arrays:
        a.setflags(write=False)


def _contained(dlo, dhi, glo, ghi) -> bool:
    return bool(np.all(dlo >= glo) and np.all(dhi <= ghi))


@functools.lru_cache(maxsize=8192)
def candidates(src: tuple, dst: tuple) -> tuple[Candidate, ...]:
    """Every valid way of moving a parameter from placement ``src`` to ``dst`` (elements, not bytes);
    the first is p2p (or slice), always valid."""
    smesh, sspec, stage, view = src
    world = smesh.size
    sb, db = geo.blocks(*src), geo.blocks(*dst)
    local = int(np.prod(sb.chunk, dtype=np.int64))
    dlo = db.lo
    dhi = dlo + np.asarray(db.chunk, dtype=np.int64)
    cands: list[Candidate] = []

    t = geo.transfers(src, dst)
    recv, sent = t.recv_numel(), t.send_numel()
    kind = "p2p" if t.remote.any() else "slice"
    tmp = recv + sent if kind == "p2p" else np.zeros(world, dtype=np.int64)
    cands.append(Candidate(kind, (), stage, recv, sent, tmp, recv if kind == "p2p" else tmp))

    rows = sb.row_of[db.ranks]
    axes_options = geo.gather_axes_candidates(smesh, sspec)
    if np.all(rows >= 0):
        for axes in axes_options:
            glo, ghi = geo.gathered(src, axes)
            if not _contained(dlo, dhi, glo[rows], ghi[rows]):
                continue
            m = smesh.axis_size(axes)
            move = np.zeros(world, dtype=np.int64)
            move[sb.ranks] = (m - 1) * local
            buf = np.zeros(world, dtype=np.int64)
            buf[sb.ranks] = m * local
            cands.append(Candidate("all_gather", axes, stage, move, move.copy(), buf, buf))

    if smesh.pp > 1:
        per_stage = world // smesh.pp
        pp_of = smesh.coord_array[:, 0]
        roots = db.ranks % per_stage + stage * per_stage
        for axes in [()] + axes_options:
            if axes:
                glo, ghi = geo.gathered(src, axes)
            else:
                glo, ghi = sb.lo, sb.lo + np.asarray(sb.chunk, dtype=np.int64)
            rr = sb.row_of[roots]
            if not _contained(dlo, dhi, glo[rr], ghi[rr]):
                continue
            m = smesh.axis_size(axes) if axes else 1
            payload = m * local
            is_root = pp_of == stage
            recv = np.where(is_root, (m - 1) * local, payload).astype(np.int64)
            pos = (pp_of - stage) % smesh.pp
            sent = np.where(pos < smesh.pp - 1, payload, 0).astype(np.int64)
            sent = sent + np.where(is_root, (m - 1) * local, 0)
            tmp = np.full(world, payload, dtype=np.int64)
            cands.append(Candidate("broadcast", axes, stage, recv, sent, tmp, tmp))

    for c in cands:
        _ro(c.recv, c.sent, c.tmp, c.keep)
    return tuple(cands)


def cost(recv: np.ndarray, sent: np.ndarray, kind: str) -> tuple[int, int, int]:
    return (int(np.maximum(recv, sent).max(initial=0)), int(recv.max(initial=0)), PREFERENCE[kind])


@dataclass(frozen=True)
class FamilyChoice:
    key: tuple[str, tuple[str, ...]]  # chosen strategy (kind, axes), kind in p2p|all_gather|broadcast
    alt: tuple[str, tuple[str, ...]] | None  # cheapest all-gather-based strategy, when p2p won
    costs: tuple  # ((key, cost), ...) of every strategy valid for the family


def choose_family(members) -> FamilyChoice:
    """``members``: ``[(candidates of one placement pair, bytes per element summed over its params)]``.
    Returns the strategy with the least summed cost (see the module docstring)."""
    valid = None
    for cands, _ in members:
        keys = {c.key for c in cands}
        valid = keys if valid is None else valid & keys
    costs = {}
    for key in sorted(valid):
        recv = sum(next(c for c in cands if c.key == key).recv * w for cands, w in members)
        sent = sum(next(c for c in cands if c.key == key).sent * w for cands, w in members)
        costs[key] = cost(recv, sent, key[0])
    best = min(costs, key=costs.get)
    alt = None
    if best[0] == "p2p":
        gathers = [k for k in costs if k[0] != "p2p"]
        alt = min(gathers, key=costs.get) if gathers else None
    return FamilyChoice(best, alt, tuple(costs.items()))


def pick(cands: tuple[Candidate, ...], key) -> Candidate:
    return next(c for c in cands if c.key == key)
