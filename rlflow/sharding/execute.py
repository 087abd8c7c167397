"""Executors of plans, and the per-rank packing both of them share.

``simulate(plan, shards)`` is the reference: one process, ``shards[r]`` is rank ``r``'s dict of
stored-shape local tensors; collectives are emulated over the list. ``rlflow.sharding.dist.execute``
runs the same per-rank code with real ``torch.distributed`` collectives. Both move raw bytes, so the
result is bitwise whatever the dtype.

Buffers are flat ``uint8`` tensors made of *segments* ``(param, box)``: the elements of ``box`` of the
param's view, row-major, each segment starting on a 16-byte boundary.

Swap plans take ownership of the dicts they are given: ``swap_out train`` moves a shard from
``shards[r]`` to ``states[r].host["train"]`` (pinned host memory on an accelerator, the same tensor on
CPU), ``free rollout`` empties ``shards[r]``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from rlflow.ops.registry import computes_as
from rlflow.optim import AdamWState, map_state
from rlflow.sharding import geometry as geo
from rlflow.sharding.layout import Layout
from rlflow.sharding.plan import COLLECTIVES, Bucket, Plan

ALIGN = 16
Segs = list  # list[tuple[str, geo.Box]]


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the next ``ALIGN`` boundary (where a buffer's next piece starts)."""
    return -(-nbytes // ALIGN) * ALIGN


class HostArena:
    """One host buffer per rank (pinned on an accelerator) that every swap-out carves its tensors from, reused
    step after step: ``torch.empty(pin_memory=True)`` per tensor goes through the caching host allocator,
    which rounds each to a power of two and never gives memory back (up to twice the ledger's host bytes).
    ``reserve(n)`` before a swap-out makes it hold ``n`` bytes (it grows, never shrinks); ``take(t)`` is
    ``t``'s place in it; ``reset()`` once everything taken is back on the device."""

    def __init__(self, pin: bool):
        self.pin, self.buf, self.pos = pin, None, 0

    @staticmethod
    def size_of(tensors) -> int:
        """The bytes ``take`` needs for ``tensors`` (each on an ``ALIGN`` boundary)."""
        return sum(aligned(t.numel() * t.element_size()) for t in tensors)

    def reserve(self, nbytes: int) -> None:
        if self.pos:
            raise RuntimeError("HostArena.reserve: its tensors are still in use (reset it first)")
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = None  # the old buffer goes before the new one is made
            self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        if self.buf is None or self.pos + n > self.buf.numel():
            raise RuntimeError(f"HostArena.take: {n} bytes past its {0 if self.buf is None else self.buf.numel()} "
                               f"(reserve the swap-out's bytes first)")
        out = self.buf[self.pos:self.pos + n].view(t.dtype).view(t.shape)
        self.pos += aligned(n)
        return out

    def reset(self) -> None:
        self.pos = 0


@dataclass
class TrainState:
    """One rank's optimizer-side state; what swap steps move between device and host: the gradients kept
    between steps (if any) and the optimizer's own state (``optim.AdamWState``: moments and float32
    masters). ``host`` holds what is swapped out: train shards and gradients by name, the AdamW state
    whole; ``arena``, where they live on an accelerator's host (None: a buffer per tensor)."""

    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    optim: AdamWState | None = None
    host: dict = field(default_factory=lambda: {"train": {}, "grads": {}, "optim": None})
    arena: HostArena | None = None


# ---- segments ----
def _itemsize(layout: Layout, name: str) -> int:
    return layout[name].itemsize


def offsets(layout: Layout, segs: Segs) -> tuple[list[int], int]:
    offs, pos = [], 0
    for name, box in segs:
        offs.append(pos)
        pos += aligned(geo.box_numel(box) * _itemsize(layout, name))
    return offs, pos


# Where each segment's bytes come from and go to depends on the plan alone, so the index arithmetic runs once
# per (plan, segments, rank) and every later call only copies: ``*_moves`` compute, ``pack`` / ``unpack`` /
# ``copy_local`` run them. The caches are keyed by the plan (compared by identity; a Layout would be hashed
# over all its parameters on every call).
@functools.lru_cache(maxsize=16384)
def pack_moves(plan: Plan, segs: tuple, rank: int) -> tuple[tuple, int]:
    """((name, the shard's view shape, the segment's index in it, byte offset, bytes) per segment, total
    bytes) of packing ``segs`` from this rank's shards under the plan's source layout."""
    layout = plan.src
    offs, total = offsets(layout, segs)
    moves = []
    for (name, box), off in zip(segs, offs):
        lo = geo.blocks(*geo.placement(layout, name)).box_of(rank)
        moves.append((name, layout[name].local_view(layout.mesh), geo.rel(box, lo), off,
                      geo.box_numel(box) * _itemsize(layout, name)))
    return tuple(moves), total


def pack(plan: Plan, segs: Segs, shards: dict, rank: int, device, out: torch.Tensor | None = None):
    """Flat byte buffer of ``segs`` cut from this rank's shards under the plan's source layout (written into
    ``out`` when given, e.g. a slice of a larger send buffer)."""
    moves, total = pack_moves(plan, tuple(segs), rank)
    buf = torch.empty(total, dtype=torch.uint8, device=device) if out is None else out
    for name, view, idx, off, n in moves:
        src = shards[name].reshape(view)[idx]
        buf[off:off + n].view(src.dtype).view(src.shape).copy_(src)
    return buf


@functools.lru_cache(maxsize=16384)
def _local_moves(plan: Plan, segs: tuple, rank: int) -> tuple:
    moves = []
    for name, box in segs:
        slo = geo.blocks(*geo.placement(plan.src, name)).box_of(rank)
        dlo = geo.blocks(*geo.placement(plan.dst, name)).box_of(rank)
        moves.append((name, plan.src[name].local_view(plan.src.mesh), geo.rel(box, slo), geo.rel(box, dlo)))
    return tuple(moves)


def copy_local(plan: Plan, segs: Segs, shards: dict, out: dict, rank: int) -> None:
    """Copy pieces this rank holds in both layouts straight from its source shard to its destination."""
    for name, view, sidx, didx in _local_moves(plan, tuple(segs), rank):
        out[name][didx] = shards[name].reshape(view)[sidx]


@functools.lru_cache(maxsize=16384)
def unpack_moves(plan: Plan, segs: tuple, rank: int) -> tuple:
    """(name, byte offset, bytes, the segment's shape, its part this rank's destination holds, where that goes)
    per segment of ``segs`` (packed under the source layout) that overlaps this rank's destination shard."""
    layout_src, layout_dst = plan.src, plan.dst
    offs, _ = offsets(layout_src, segs)
    moves = []
    for (name, box), off in zip(segs, offs):
        dbox = geo.blocks(*geo.placement(layout_dst, name)).box_of(rank)
        inter = None if dbox is None else geo.intersect(box, dbox)
        if inter is None:
            continue
        n = geo.box_numel(box) * layout_dst[name].itemsize
        moves.append((name, off, n, tuple(hi - lo for lo, hi in box), geo.rel(inter, box), geo.rel(inter, dbox)))
    return tuple(moves)


def unpack(plan: Plan, segs: Segs, buf: torch.Tensor, out: dict, rank: int) -> None:
    """Copy what ``out``'s destination boxes need from the segments of ``buf``."""
    for name, off, n, shape, sidx, didx in unpack_moves(plan, tuple(segs), rank):
        if name in out:
            dt = out[name].dtype
            out[name][didx] = buf[off:off + n].view(dt).view(shape)[sidx]


# ---- what each rank does for a bucket ----
def held(layout: Layout, names, rank: int) -> list[str]:
    pp = layout.mesh.coords(rank)["pp"]
    return [n for n in names if layout[n].stage == pp]


# What a rank does for a bucket is a function of the plan: computed once per (plan, bucket, rank) and shared
# (read-only) by every execution of the plan.
@functools.lru_cache(maxsize=16384)
def own_segs(plan: Plan, b: Bucket, rank: int) -> tuple:
    """This rank's source blocks of the bucket's params (what it contributes to an all-gather)."""
    return tuple((n, geo.blocks(*geo.placement(plan.src, n)).box_of(rank)) for n in held(plan.src, b.params, rank))


@functools.lru_cache(maxsize=16384)
def gather_group(plan: Plan, b: Bucket, rank: int) -> tuple[int, ...]:
    return geo.group_of(plan.src.mesh, b.axes, rank)


def bcast_root(plan: Plan, b: Bucket, rank: int) -> int:
    per_stage = plan.world // plan.src.mesh.pp
    return rank % per_stage + b.stage * per_stage


def bcast_group(plan: Plan, b: Bucket, rank: int) -> tuple[int, ...]:
    return plan.src.mesh.group_ranks(("pp",), rank)


@functools.lru_cache(maxsize=16384)
def p2p_segs(plan: Plan, b: Bucket, rank: int) -> tuple[dict[int, Segs], dict[int, Segs], Segs]:
    """(segments to send per peer, segments to receive per peer, local copies), canonical order (read-only)."""
    send: dict[int, Segs] = {}
    recv: dict[int, Segs] = {}
    local: Segs = []
    for n in b.params:
        t = geo.transfers(geo.placement(plan.src, n), geo.placement(plan.dst, n))
        for k in t.by_send.get(rank, ()):
            r = int(t.recv[k])
            if r != rank:
                send.setdefault(r, []).append((n, t.boxes[k]))
        for k in t.by_recv.get(rank, ()):
            s = int(t.send[k])
            (local if s == rank else recv.setdefault(s, [])).append((n, t.boxes[k]))
    return send, recv, local


@functools.lru_cache(maxsize=16384)
def _dst_shapes(plan: Plan, b: Bucket, rank: int) -> tuple:
    """(name, view shape, stored shape, dtype) of each destination shard of the bucket this rank holds."""
    mesh = plan.dst.mesh
    return tuple((n, plan.dst[n].local_view(mesh), plan.dst[n].local_shape(mesh), plan.dst[n].dtype)
                 for n in held(plan.dst, b.params, rank))


def alloc_dst(plan: Plan, b: Bucket, rank: int, device, into: dict | None = None) -> dict[str, torch.Tensor]:
    """This rank's destination shards of bucket ``b``: new, or ``into[name]`` where given (memory the shard is
    to live in, e.g. an engine's own parameter: contiguous, of the shard's dtype and size)."""
    out = {}
    for n, view, _, dt in _dst_shapes(plan, b, rank):
        t = None if into is None else into.get(n)
        if t is None:
            out[n] = torch.empty(view, dtype=dt, device=device)
        elif t.dtype != dt or t.numel() != math.prod(view) or not t.is_contiguous():
            raise ValueError(f"{n}: the destination given is {t.dtype} {tuple(t.shape)}"
                             f"{'' if t.is_contiguous() else ' non-contiguous'}; the plan's shard is {dt} {view}")
        else:
            out[n] = t.view(view)
    return out


def finish_dst(plan: Plan, b: Bucket, out: dict, rank: int) -> dict[str, torch.Tensor]:
    return {n: out[n].reshape(shape) for n, _, shape, _ in _dst_shapes(plan, b, rank) if n in out}


def to_host(t: torch.Tensor, arena: HostArena | None = None) -> torch.Tensor:
    """``t`` in host memory (the same tensor on a CPU, or a dry run's posing as one: ``registry.computes_as``): in
    ``arena`` when given, else a pinned buffer of its own."""
    if computes_as(t) == "cpu":
        return t
    h = arena.take(t) if arena is not None else torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    h.copy_(t, non_blocking=True)
    return h


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    return t if computes_as(torch.device(device)) == "cpu" else t.to(device, non_blocking=True)


def _moved(d: dict, move) -> dict:
    """``d``'s tensors moved (``move``), each popped from ``d`` as it goes (the old copy freed at once)."""
    return {n: move(d.pop(n)) for n in list(d)}


def swap_step(plan: Plan, step, rank: int, shards: dict, state: TrainState, out: dict, device) -> None:
    """The swap_out / swap_in / free(rollout) steps for one rank."""
    put = functools.partial(to_host, arena=state.arena)
    if step.op == "swap_out" and step.what == "train":
        for n in held(plan.src, plan.buckets[step.bucket].params, rank):
            state.host["train"][n] = put(shards.pop(n))
    elif step.op == "swap_out" and step.what == "optim":
        if state.optim is not None:
            state.host["optim"], state.optim = map_state(state.optim, lambda d: _moved(d, put)), None
    elif step.op == "swap_out":
        state.host[step.what].update(_moved(getattr(state, step.what), put))
    elif step.op == "swap_in" and step.what == "optim":
        if state.host["optim"] is not None:
            state.optim = map_state(state.host["optim"], lambda d: _moved(d, lambda t: to_device(t, device)))
            state.host["optim"] = None
    elif step.op == "swap_in":
        (out if step.what == "train" else getattr(state, step.what)).update(
            _moved(state.host[step.what], lambda t: to_device(t, device)))
    elif step.op == "free" and step.what == "rollout":
        shards.clear()
    else:
        raise ValueError(f"not a swap step: {step}")


# ---- the simulated executor ----
def simulate(plan: Plan, shards: list[dict], states: list[TrainState] | None = None) -> list[dict]:
    """Run ``plan`` over every rank in this process; returns each rank's destination shards."""
    world = plan.world
    if len(shards) != world:
        raise ValueError(f"simulate: {len(shards)} shard dicts for a plan over {world} ranks")
    states = states if states is not None else [TrainState() for _ in range(world)]
    device = next((t.device for d in shards for t in d.values()), torch.device("cpu"))
    outs: list[dict] = [{} for _ in range(world)]
    tmp: list[dict] = [{} for _ in range(world)]  # rank -> bucket -> list of (segs, buffer)
    for step in plan.steps:
        b = plan.buckets[step.bucket] if step.bucket is not None and plan.buckets else None
        if step.op in COLLECTIVES:
            _sim_collective(plan, b, shards, tmp, device)
        elif step.op == "slice":
            for r in range(world):
                out = alloc_dst(plan, b, r, device)
                if out:
                    if b.kind in ("slice", "all_to_all", "send_recv"):
                        copy_local(plan, p2p_segs(plan, b, r)[2], shards[r], out, r)
                    for segs, buf in tmp[r].get(b.index, ()):
                        unpack(plan, segs, buf, out, r)
                outs[r].update(finish_dst(plan, b, out, r))
        elif step.op == "free" and step.what == "tmp":
            for r in range(world):
                tmp[r].pop(b.index, None)
        else:
            for r in range(world):
                swap_step(plan, step, r, shards[r], states[r], outs[r], device)
    return outs


def _sim_collective(plan: Plan, b: Bucket, shards, tmp, device) -> None:
    world = plan.world
    if b.kind in ("all_gather", "broadcast"):
        gathered = {}  # rank -> (segs, buffer) after the all-gather phase
        ranks = range(world) if b.kind == "all_gather" else \
            [r for r in range(world) if plan.src.mesh.coords(r)["pp"] == b.stage]
        for r in ranks:
            group = gather_group(plan, b, r)
            segs = [s for m in group for s in own_segs(plan, b, m)]
            if not segs:
                continue
            bufs = [pack(plan, own_segs(plan, b, m), shards[m], m, device) for m in group]
            gathered[r] = (segs, torch.cat(bufs))
        if b.kind == "all_gather":
            for r, v in gathered.items():
                tmp[r].setdefault(b.index, []).append(v)
        else:
            for r in range(world):
                root = bcast_root(plan, b, r)
                if root in gathered:
                    segs, buf = gathered[root]
                    tmp[r].setdefault(b.index, []).append((segs, buf.clone() if r != root else buf))
    else:  # all_to_all / send_recv
        for r in range(world):
            send, _, _ = p2p_segs(plan, b, r)
            for peer, segs in sorted(send.items()):
                tmp[peer].setdefault(b.index, []).append((segs, pack(plan, segs, shards[r], r, device)))
