"""The weight push between separate device pools (``plan.PushPlan``): what each train rank sends, where each
rollout rank receives it, and the simulated delivery. The same per-rank code runs simulated and distributed
(``runtime/pools.py``).
"""

from __future__ import annotations

import torch

from rlflow.sharding import geometry as geo
from rlflow.sharding.plan import PushPlan


def push_pieces(plan: PushPlan, rank: int, shards: dict) -> list[tuple[int, torch.Tensor]]:
    """(rollout rank, piece) of everything train rank ``rank`` sends, in the plan's order: its shards' parts,
    each a contiguous copy in the rollout layout's dtype (the update may change the shards while they travel)."""
    out = []
    for name, t in plan.pieces:
        ks = t.by_send.get(rank)
        if not ks:
            continue
        p, dt = plan.src[name], plan.dst[name].dtype
        own = geo.blocks(*geo.placement(plan.src, name)).box_of(rank)
        v = shards[name].reshape(p.local_view(plan.src.mesh))
        for k in ks:
            out.append((int(t.recv[k]), v[geo.rel(t.boxes[k], own)].to(dt, copy=True).contiguous()))
    return out


def push_slots(plan: PushPlan, rank: int, shards: dict) -> list[tuple[int, torch.Tensor, torch.Tensor | None]]:
    """(train rank, receive buffer, where it is copied to: None when the buffer is that place itself) of
    everything rollout rank ``rank`` receives into its shards ``shards`` (the rollout layout's), in the order
    each train rank sends it (``push_pieces``)."""
    out = []
    for name, t in plan.pieces:
        ks = t.by_recv.get(rank)
        if not ks:
            continue
        q = plan.dst[name]
        own = geo.blocks(*geo.placement(plan.dst, name)).box_of(rank)
        v = shards[name].reshape(q.local_view(plan.dst.mesh))
        for k in ks:
            place = v[geo.rel(t.boxes[k], own)]
            if t.boxes[k] == own and v.is_contiguous():
                out.append((int(t.send[k]), v, None))
            else:
                out.append((int(t.send[k]), torch.empty(place.shape, dtype=q.dtype, device=v.device), place))
    return out


def push_place(slots: list) -> None:
    """The received buffers of ``push_slots`` into their places."""
    for _, buf, place in slots:
        if place is not None:
            place.copy_(buf)


def simulate_push(plan: PushPlan, train_shards: list[dict], rollout_shards: list[dict]) -> None:
    """Every train rank's pieces delivered to the rollout ranks' shards (in place), as the distributed push
    does: per (sender, receiver) pair in the order sent."""
    queues: dict[tuple[int, int], list] = {}
    for s, shards in enumerate(train_shards):
        for d, piece in push_pieces(plan, s, shards):
            queues.setdefault((s, d), []).append(piece)
    for d, shards in enumerate(rollout_shards):
        slots = push_slots(plan, d, shards)
        for s, buf, _ in slots:
            piece = queues[(s, d)].pop(0)
            if piece.shape != buf.shape or piece.dtype != buf.dtype:
                raise AssertionError(f"push: rank {s} -> {d}: sent {piece.dtype} {tuple(piece.shape)}, "
                                     f"expected {buf.dtype} {tuple(buf.shape)}")
            buf.copy_(piece)
        push_place(slots)
    left = {k: len(v) for k, v in queues.items() if v}
    if left:
        raise AssertionError(f"push: pieces sent but never received: {left}")
