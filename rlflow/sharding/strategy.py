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

Cost model, per rank, in elements: received and sent (ring all-gather: ``(m-1)/m`` of the gathered
buffer each way; broadcast: a pipelined chain along pp, every member but the last forwards the
payload once). The choice minimises, lexicographically, the busiest rank's received elements, the
busiest rank's sent elements, then prefers the simpler collective (slice, all_gather, broadcast,
p2p). So an all-gather-then-slice is taken only when nothing moves less; when a p2p pattern beats it,
the plan says so and by how much.
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
    tmp: np.ndarray  # [world] elements of temporary buffers

    @property
    def cost(self):
        return (int(self.recv.max(initial=0)), int(self.sent.max(initial=0)), PREFERENCE[self.kind])

    @property
    def label(self) -> str:
        return f"{self.kind}({','.join(self.axes)})" if self.axes else self.kind


@dataclass(frozen=True, eq=False)
class Choice:
    best: Candidate
    alt: Candidate | None  # the cheapest all-gather-based candidate, when the best is not one


def _ro(*arrays):
    for a in arrays:
        a.setflags(write=False)


def _contained(dlo, dhi, glo, ghi) -> bool:
    return bool(np.all(dlo >= glo) and np.all(dhi <= ghi))


@functools.lru_cache(maxsize=8192)
def choose(src: tuple, dst: tuple) -> Choice:
    """Best candidate for moving a parameter from placement ``src`` to ``dst`` (elements, not bytes)."""
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
    cands.append(Candidate(kind, (), stage, recv, sent, tmp))

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
            cands.append(Candidate("all_gather", axes, stage, move, move.copy(), buf))

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
            cands.append(Candidate("broadcast", axes, stage, recv, sent, tmp))

    for c in cands:
        _ro(c.recv, c.sent, c.tmp)
    best = min(cands, key=lambda c: c.cost)
    alt = None
    if best.kind == "p2p":
        gathers = [c for c in cands if c.kind in ("all_gather", "broadcast")]
        alt = min(gathers, key=lambda c: c.cost) if gathers else None
    return Choice(best, alt)
