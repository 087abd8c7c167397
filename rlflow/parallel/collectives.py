"""Collectives for model code inside autograd, each with the backward its placements call for.

Placements of a tensor over the ranks of one process group (one mesh axis, or several):

    replicated   every rank holds the same full tensor
    partial      every rank holds a summand; the value is the sum over the group
    sharded(d)   every rank holds one contiguous chunk along dim d, chunk i on the group's i-th rank
                 (group ranks in mesh-index order, which for Megatron rank order is rank order)
    rows         every rank holds its own rows (tokens), unrelated to the others' (all_to_all)

Gradients follow Megatron's convention: the loss is computed identically on every rank of a tensor-
parallel group and counted once, so the gradient of a replicated tensor is itself replicated (every rank
holds the full gradient), and the gradient of a partial tensor is replicated too (every summand receives
the full upstream gradient). Hence the pairs (forward / backward):

    copy_to          replicated -> replicated, used partially   identity   /  all-reduce sum   (Megatron f)
    reduce_from      partial    -> replicated                   all-reduce /  identity         (Megatron g)
    all_gather       sharded(d) -> replicated, used partially   all-gather /  reduce-scatter
    reduce_scatter   partial    -> sharded(d)                   reduce-sc. /  all-gather
    all_to_all       rows       -> rows (by split sizes)        all-to-all /  the reverse all-to-all

``group=None`` (an axis of size 1) makes every function the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from rlflow.sharding.dist import all_gather_single, reduce_scatter_single

# module names, so that a benchmark can time them (bench/decode_tp.py)
_all_gather_single, _reduce_scatter_single = all_gather_single, reduce_scatter_single


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# ---- no-grad helpers ----
@torch.no_grad()
def exchange_counts(send_counts: Tensor, group) -> Tensor:
    """int64 [n] rows this rank sends to each group rank -> [n] rows it receives from each."""
    if group_size(group) == 1:
        return send_counts.clone()
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv


@torch.no_grad()
def all_to_all_rows(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """``all_to_all`` without autograd (integer payloads such as expert ids)."""
    if group_size(group) == 1:
        return x.clone()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


# ---- autograd functions ----
class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _CopyToMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group, ctx.meta = group, [(x.shape, x.dtype) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        gs = [torch.zeros(shape, dtype=dt, device=_device(gs)) if g is None else g
              for g, (shape, dt) in zip(gs, ctx.meta)]
        out: list = [None] * len(gs)
        for dt in dict.fromkeys(g.dtype for g in gs):  # one all-reduce per dtype
            at = [i for i, g in enumerate(gs) if g.dtype == dt]
            flat = torch.cat([gs[i].reshape(-1) for i in at])
            dist.all_reduce(flat, group=ctx.group)
            for i, part in zip(at, flat.split([gs[i].numel() for i in at])):
                out[i] = part.view(gs[i].shape)
        return (None, *out)


def _device(gs):
    return next(g.device for g in gs if g is not None)


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _gather0(x: Tensor, group) -> Tensor:
    n = group_size(group)
    out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def _scatter0(x: Tensor, group) -> Tensor:
    n = group_size(group)
    if x.shape[0] % n:
        raise ValueError(f"reduce_scatter: dim of size {x.shape[0]} does not divide by the group size {n}")
    out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather0(x.movedim(dim, 0), group).movedim(0, dim)

    @staticmethod
    def backward(ctx, g):
        return _scatter0(g.movedim(ctx.dim, 0), ctx.group).movedim(0, ctx.dim), None, None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather0(x[None], group)

    @staticmethod
    def backward(ctx, g):
        return g[group_rank(ctx.group)].clone(), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _scatter0(x.movedim(dim, 0), group).movedim(0, dim)

    @staticmethod
    def backward(ctx, g):
        return _gather0(g.movedim(ctx.dim, 0), ctx.group).movedim(0, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        gi = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
        dist.all_to_all_single(gi, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return gi, None, None, None


def copy_to(x: Tensor, group) -> Tensor:
    """replicated -> replicated, entering a region where each rank computes a part (column-parallel
    input, replicated weights used on local heads). Forward identity; backward all-reduce sum of the
    partial gradients into the full one."""
    return x if group_size(group) == 1 else _CopyTo.apply(x, group)


def copy_to_many(xs: list[Tensor], group) -> list[Tensor]:
    """``copy_to`` of several tensors entering the same region, whose gradients are summed over tp in one
    all-reduce (per dtype) instead of one each."""
    return list(xs) if group_size(group) == 1 else list(_CopyToMany.apply(group, *xs))


def reduce_from(x: Tensor, group) -> Tensor:
    """partial -> replicated (row-parallel output, vocab-parallel sums). Forward all-reduce sum;
    backward identity (the replicated gradient is every summand's gradient)."""
    return x if group_size(group) == 1 else _ReduceFrom.apply(x, group)


def all_gather(x: Tensor, dim: int, group) -> Tensor:
    """sharded(dim) -> replicated, used partially downstream. Forward all-gather along ``dim``;
    backward reduce-scatter (sum the ranks' partial gradients, keep this rank's chunk)."""
    return x if group_size(group) == 1 else _AllGather.apply(x, dim, group)


def gather_replicated(x: Tensor, group) -> Tensor:
    """partial -> every rank's part, [group size, *x.shape], for a computation every rank then runs
    identically (combining per-rank partial statistics in one collective where several all-reduces would
    take one each). Forward all-gather; backward this rank's slot of the gradient, no communication (the
    replicated computation hands every rank the whole gradient of its own part, as ``reduce_from`` does)."""
    return x[None] if group_size(group) == 1 else _GatherReplicated.apply(x, group)


def reduce_scatter(x: Tensor, dim: int, group) -> Tensor:
    """partial -> sharded(dim). Forward reduce-scatter along ``dim``; backward all-gather (each rank's
    summand gets the full gradient, assembled from the chunks)."""
    return x if group_size(group) == 1 else _ReduceScatter.apply(x, dim, group)


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """rows -> rows: ``in_splits[j]`` rows of ``x`` (in order) go to group rank j; ``out_splits[j]``
    rows arrive from group rank j, concatenated in rank order. Backward: the reverse all-to-all of the
    gradient (splits swapped)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


__all__ = ["copy_to", "copy_to_many", "reduce_from", "all_gather", "gather_replicated", "reduce_scatter", "all_to_all",
           "exchange_counts", "all_to_all_rows", "group_size", "group_rank"]
