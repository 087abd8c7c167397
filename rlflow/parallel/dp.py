"""Data parallelism: gradient all-reduce, and reduce-scatter where the optimizer state is sharded.

The process groups are made by ``rlflow.sharding.dist.create_groups`` (``parallel.context.context`` does,
for its layout), once per run, before any reduction.

Who holds what: the batch is split over ``("dp", "ep")`` (rank r takes slice
``mesh.data_parallel_index(r)`` of ``dp * ep``). A parameter's gradient is summed over the batch axes
its spec does not name: dense parameters over ``("dp", "ep")`` (MoE parallel folding), expert
parameters (sharded over ``ep``) over ``dp`` only; the expert all-to-all already summed the gradients
of the tokens of every ep rank.

Normalization: rlflow's losses take the normalizers of the whole mini-batch (``n_tokens``, ``n_seqs``
of ``grpo.policy_loss``), as gradient accumulation in ``stages.update`` does; each data-parallel rank's
loss is then its share of the full-batch loss, and the full-batch gradient is the *sum* over ranks
(``average=False``, the default). ``average=True`` divides by the group size: the DDP convention, for
losses that are a per-rank mean over equal shares of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from rlflow import optim
from rlflow.parallel.collectives import _reduce_scatter_single
from rlflow.sharding.dist import all_reduce, mesh_group
from rlflow.sharding.layout import Layout
from rlflow.sharding.mesh import BATCH_AXES


def reduce_axes(layout: Layout, name: str) -> tuple[str, ...]:
    """The batch axes (size > 1) over which ``name``'s gradient is summed: those its spec does not name."""
    spec_axes = set(layout[name].spec.axes)
    return tuple(a for a in BATCH_AXES if a not in spec_axes and getattr(layout.mesh, a) > 1)


def _buckets(grads: dict[str, Tensor], layout: Layout) -> dict[tuple[str, ...], list[str]]:
    out: dict[tuple[str, ...], list[str]] = {}
    for n in grads:
        out.setdefault(reduce_axes(layout, n), []).append(n)
    return out


def all_reduce_grads(grads: dict[str, Tensor], layout: Layout, *, average: bool = False) -> dict[str, Tensor]:
    """Sum (or average) this rank's gradients over their data-parallel groups: one flat buffer and one
    all-reduce per group of parameters sharing the same axes. Every rank calls it with the gradients
    of the parameters it holds; returns new tensors."""
    out = dict(grads)
    for axes, names in _buckets(grads, layout).items():
        if not axes:
            continue
        flat = torch.cat([grads[n].reshape(-1) for n in names])
        dist.all_reduce(flat, group=mesh_group(layout.mesh, axes))
        if average:
            flat /= layout.mesh.axis_size(axes)
        pos = 0
        for n in names:
            k = grads[n].numel()
            out[n] = flat[pos:pos + k].view_as(grads[n])
            pos += k
    return out


class OverlappedGrads:
    """``all_reduce_grads`` started during a backward, as DDP does: the gradients in buckets (by the axes
    they are summed over; the parameters in reverse order, as the backward reaches them; the first bucket
    ``first_bucket_bytes``, the others up to ``bucket_bytes``, DDP's sizes), each all-reduced asynchronously once all
    its parameters have their gradient *and* every bucket before it is on its way, so that every rank
    issues the same collectives in the same order whatever order its gradients come in. ``start`` before
    the backward, ``ready(j, grads)`` as leaf ``j``'s gradient is final (``stages.accumulate`` calls it from
    a gradient hook), ``finish(grads)`` after it: the buckets not sent yet go (a parameter without a
    gradient counts as zeros), every reduction is waited for and ``grads`` get the sums."""

    def __init__(self, names: list[str], leaves: list[Tensor], layout: Layout, *, first_bucket_bytes: int = 1 << 20,
                 bucket_bytes: int = 25 << 20):
        self.layout, self.leaves = layout, leaves
        by_axes: dict[tuple[str, ...], list[int]] = {}
        for j in reversed(range(len(names))):
            axes = reduce_axes(layout, names[j])
            if axes:
                by_axes.setdefault(axes, []).append(j)
        self.buckets: list[tuple[tuple[str, ...], list[int]]] = []
        for axes, js in by_axes.items():
            cur, size = [], 0
            for j in js:
                cap = first_bucket_bytes if not self.buckets else bucket_bytes
                if cur and size >= cap:
                    self.buckets.append((axes, cur))
                    cur, size = [], 0
                cur.append(j)
                size += leaves[j].numel() * 4  # float32 gradients
            if cur:
                self.buckets.append((axes, cur))
        self.buckets.sort(key=lambda b: -max(b[1]))  # the last parameters' gradients come first
        self.bucket_of = {j: i for i, (_, js) in enumerate(self.buckets) for j in js}
        self.started = False

    def start(self) -> None:
        self.missing = [set(js) for _, js in self.buckets]
        self.next, self.works, self.started = 0, [], True

    def ready(self, j: int, grads: list) -> None:
        i = self.bucket_of.get(j)
        if i is not None:
            self.missing[i].discard(j)
            self._send(grads, final=False)

    def _send(self, grads: list, final: bool) -> None:
        while self.next < len(self.buckets) and (final or not self.missing[self.next]):
            axes, js = self.buckets[self.next]
            flat = torch.cat([(torch.zeros(self.leaves[j].numel(), dtype=torch.float32, device=self.leaves[j].device)
                               if grads[j] is None else grads[j].reshape(-1)) for j in js])
            work = dist.all_reduce(flat, group=mesh_group(self.layout.mesh, axes), async_op=True)
            self.works.append((work, flat, js))
            self.next += 1

    def finish(self, grads: list) -> list:
        self._send(grads, final=True)
        for work, flat, js in self.works:
            work.wait()
            pos = 0
            for j in js:
                k = self.leaves[j].numel()
                grads[j] = flat[pos:pos + k].view(self.leaves[j].shape)
                pos += k
        self.works, self.started = [], False
        return grads


def batch_sum(t: Tensor, layout: Layout) -> Tensor:
    """A per-rank tensor summed over the ranks that split the batch (``("dp", "ep")``); a new tensor."""
    if layout.mesh.axis_size(BATCH_AXES) > 1:
        return all_reduce(t, group=mesh_group(layout.mesh, BATCH_AXES))
    return t.clone()


def batch_total(x: float, layout: Layout) -> float:
    """Sum of a per-rank count over the ranks that split the batch: the normalizers of a loss whose batch is
    spread over data-parallel ranks."""
    return float(batch_sum(torch.tensor([x], dtype=torch.float64), layout)[0])


def grad_norm(grads: dict[str, Tensor], layout: Layout) -> Tensor:
    """Global L2 norm of the full gradient, on every rank, from this rank's *reduced* gradients (after
    ``all_reduce_grads``): each shard is counted once, by the replica at coordinate 0 along every axis
    (dp, ep, tp) its spec does not name; a float32 scalar all-reduced over the world. The norm
    ``optim.clip_by_global_norm`` would compute on the gathered gradients."""
    c = layout.mesh.coords(dist.get_rank())
    s = torch.zeros((), dtype=torch.float32, device=next(iter(grads.values())).device if grads else None)
    # one pipeline stage and no parameter sharded over an axis of more than one rank: every rank holds the
    # whole reduced gradient
    whole = layout.mesh.pp == 1 and all(layout.mesh.axis_size(tuple(layout[n].spec.axes)) == 1 for n in grads)
    for n, g in grads.items():
        named = set(layout[n].spec.axes)
        if whole or all(c[a] == 0 for a in ("dp", "ep", "tp") if a not in named):
            s = s + g.float().square().sum()
    if dist.get_world_size() > 1 and not whole:
        dist.all_reduce(s)
    return s.sqrt()


def clip_grads(grads: dict[str, Tensor], layout: Layout, max_norm: float) -> tuple[dict[str, Tensor], Tensor]:
    """``optim.clip_by_global_norm`` on sharded, reduced gradients: (grads scaled in place, norm before
    clipping)."""
    return optim.clip_by_global_norm(grads, max_norm, norm=grad_norm(grads, layout))


@dataclass(frozen=True)
class GradShard:
    """This rank's part of a flat gradient bucket after reduce-scatter (ZeRO-style sharded optimizer):
    elements [start, start + len(flat)) of the bucket ``names`` flattened in order and zero-padded to a
    multiple of the group size."""

    axes: tuple[str, ...]
    names: tuple[str, ...]
    numels: tuple[int, ...]
    start: int
    flat: Tensor


def reduce_scatter_grads(grads: dict[str, Tensor], layout: Layout, *, average: bool = False
                         ) -> list[GradShard]:
    """Like ``all_reduce_grads`` but each rank of a data-parallel group keeps only chunk
    ``mesh.index(axes, rank)`` of the summed bucket (half the bytes of an all-reduce). Buckets with no
    axis to reduce over are returned whole (start 0)."""
    mesh, rank = layout.mesh, dist.get_rank()
    out = []
    for axes, names in _buckets(grads, layout).items():
        flat = torch.cat([grads[n].reshape(-1) for n in names])
        numels = tuple(grads[n].numel() for n in names)
        if not axes:
            out.append(GradShard(axes, tuple(names), numels, 0, flat))
            continue
        k = mesh.axis_size(axes)
        pad = -flat.numel() % k
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        shard = flat.new_empty(flat.numel() // k)
        _reduce_scatter_single(shard, flat, group=mesh_group(mesh, axes))
        if average:
            shard /= k
        out.append(GradShard(axes, tuple(names), numels, mesh.index(axes, rank) * shard.numel(), shard))
    return out


__all__ = ["reduce_axes", "all_reduce_grads", "OverlappedGrads", "grad_norm", "clip_grads", "GradShard",
           "reduce_scatter_grads"]
