"""Reference slicing: every rank's shards of whole tensors, whole tensors from shards, and one rank's shards
read from another layout's (a checkpoint written in another layout). The executors' results are checked
against these, and loading and the rollout engines' start use them.
"""

from __future__ import annotations

import numpy as np
import torch

from rlflow.sharding import geometry as geo
from rlflow.sharding.layout import Layout


def shard_tensor(full: torch.Tensor, layout: Layout, name: str, rank: int) -> torch.Tensor | None:
    """Rank ``rank``'s stored-shape shard of ``full`` under ``layout`` (None if it holds none)."""
    p = layout[name]
    box = geo.blocks(*geo.placement(layout, name)).box_of(rank)
    if box is None:
        return None
    v = full.reshape(p.view)[tuple(slice(lo, hi) for lo, hi in box)].contiguous()
    if v.untyped_storage().nbytes() > v.numel() * v.element_size():  # a slice along the first axis is a view:
        v = v.clone()  # kept, it would hold the whole tensor on every rank
    return v.reshape(p.local_shape(layout.mesh))


def shard(full: dict[str, torch.Tensor], layout: Layout) -> list[dict[str, torch.Tensor]]:
    """Every rank's shards of the full tensors ``full``."""
    out = []
    for r in range(layout.mesh.size):
        d = {}
        for n in layout.names:
            t = shard_tensor(full[n], layout, n, r)
            if t is not None:
                d[n] = t
        out.append(d)
    return out


def full_from_shards(shards: list[dict], layout: Layout) -> dict[str, torch.Tensor]:
    """Reassemble full tensors from every rank's shards (checks that replicas agree bitwise)."""
    out = {}
    for p in layout.params:
        full = torch.empty(p.view, dtype=p.dtype)
        seen = torch.zeros(p.view, dtype=torch.bool)
        bl = geo.blocks(*geo.placement(layout, p.name))
        for row, r in enumerate(bl.ranks.tolist()):
            sl = tuple(slice(lo, hi) for lo, hi in bl.box(row))
            piece = shards[r][p.name].reshape(p.local_view(layout.mesh)).cpu()
            if seen[sl].any() and not np.array_equal(_bytes(full[sl]), _bytes(piece)):
                raise AssertionError(f"replicas of {p.name} disagree on rank {r}")
            full[sl] = piece
            seen[sl] = True
        out[p.name] = full.reshape(p.shape)
    return out


def reshard(shards: list[dict], src: Layout, dst: Layout | None, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s stored-shape shards under ``dst`` (None: whole tensors) of what the ranks of ``src``
    hold (``shards[r]``: rank r's dict under ``src``, e.g. memory-mapped files; a name none of them holds is
    left out). Each source block is read only where it overlaps the rank's own block (a replicated block
    from its first holder), so a rank reads about what it keeps."""
    out = {}
    for n in src.names:
        p, bl = src[n], geo.blocks(*geo.placement(src, n))
        if n not in shards[int(bl.ranks[0])] or (dst is not None and not dst.holds(n, rank)):
            continue
        box = tuple((0, v) for v in p.view) if dst is None else geo.blocks(*geo.placement(dst, n)).box_of(rank)
        local, seen = None, set()
        for row, r in enumerate(bl.ranks.tolist()):
            sbox = bl.box(row)
            part = geo.intersect(sbox, box)
            if part is None or sbox in seen:
                continue
            seen.add(sbox)
            piece = shards[r][n].reshape(p.local_view(src.mesh))
            if local is None:
                local = torch.empty(tuple(hi - lo for lo, hi in box), dtype=piece.dtype)
            local[geo.rel(part, box)] = piece[geo.rel(part, sbox)]
        out[n] = local.reshape(p.shape if dst is None else dst[n].local_shape(dst.mesh))
    return out


def _bytes(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return (t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)).numpy()
