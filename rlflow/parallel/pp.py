"""Pipeline parallelism: layers split by stage, and a GPipe or 1F1B schedule over micro-batches for the
training forward and backward, with activations sent forward and their gradients sent back.

Who holds what: rank r runs stage ``coords(r).pp``: the layers a layout puts on that stage (the
embedding on stage 0, the final norm and the head on the last). Stage s sends the hidden states of each
micro-batch [b, T, D] to the rank with the same (dp, ep, tp) coordinates on stage s + 1, and receives
their gradient from it in the backward.

Schedules (``F m`` forward of micro-batch m, ``B m`` its backward), for S stages and M micro-batches:

    gpipe   F0 F1 ... F(M-1)  B0 B1 ... B(M-1)                 (M activations in flight per stage)
    1f1b    min(S - 1 - s, M) warm-up forwards, then F/B pairs, then the remaining backwards
            (at most S - s activations in flight on stage s)

Sends are non-blocking (``isend``, waited at the end of the schedule) and receives blocking, so no
ordering of the two schedules can deadlock; messages between two ranks go one way per direction, in
micro-batch order on both sides.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from rlflow.sharding.layout import Layout

SCHEDULES = ("gpipe", "1f1b")


def layers_of_stage(layout: Layout, num_layers: int, stage: int) -> tuple[int, ...]:
    """Indices of the decoder layers on ``stage``, read from the layout (the stage of each layer's
    ``input_layernorm.weight``). Raises if a layer's parameters are on different stages."""
    out = []
    for i in range(num_layers):
        p = f"model.layers.{i}."
        stages = {q.stage for q in layout.params if q.name.startswith(p)}
        if len(stages) != 1:
            raise ValueError(f"layout puts the params of layer {i} on stages {sorted(stages)}; a layer must "
                             "be on one stage")
        if stages.pop() == stage:
            out.append(i)
    return tuple(out)


def schedule(kind: str, n_micro: int, stage: int, n_stages: int) -> tuple[tuple[str, int], ...]:
    """The actions of ``stage``: ``("F", m)`` and ``("B", m)`` in order (see the module docstring)."""
    if kind not in SCHEDULES:
        raise ValueError(f"pipeline schedule {kind!r}: expected one of {SCHEDULES}")
    if not 0 <= stage < n_stages or n_micro < 1:
        raise ValueError(f"pipeline schedule: stage={stage} of {n_stages}, n_micro={n_micro}")
    if kind == "gpipe":
        return tuple(("F", m) for m in range(n_micro)) + tuple(("B", m) for m in range(n_micro))
    warm = min(n_stages - 1 - stage, n_micro)
    out = [("F", m) for m in range(warm)]
    for m in range(n_micro - warm):
        out += [("F", warm + m), ("B", m)]
    out += [("B", m) for m in range(n_micro - warm, n_micro)]
    return tuple(out)


def run(forward: Callable[[int, Tensor | None], tuple[Tensor, Tensor | None]], n_micro: int, *, stage: int,
        n_stages: int, prev_rank: int | None, next_rank: int | None, recv_shape: Callable[[int], tuple],
        dtype: torch.dtype, device, kind: str = "1f1b") -> Tensor:
    """Run the schedule on this rank; gradients accumulate into the parameters' ``.grad``.

    ``forward(m, x)``: stage 0 gets ``x = None``, later stages the received hidden states (a leaf that
    requires grad). It returns ``(out, extra)``: on the last stage ``out`` is micro-batch m's scalar
    loss, elsewhere the hidden states to send; ``extra`` is a scalar loss term computed on this stage
    (e.g. router aux loss), or None. ``recv_shape(m)``: the shape of the hidden states stage s receives.
    Returns the sum of this stage's loss terms (the last stage's losses plus every ``extra``)."""
    last = stage == n_stages - 1
    saved: dict[int, tuple] = {}
    sends: list = []
    total = torch.zeros((), dtype=torch.float32, device=device)
    for op, m in schedule(kind, n_micro, stage, n_stages):
        if op == "F":
            x = None
            if stage > 0:
                x = torch.empty(recv_shape(m), dtype=dtype, device=device)
                dist.recv(x, src=prev_rank)
                x.requires_grad_(True)
            out, extra = forward(m, x)
            if not last:
                h = out.detach().contiguous()
                sends.append((dist.isend(h, dst=next_rank), h))
            for t in (out if last else None, extra):
                if t is not None:
                    total = total + t.detach().float()
            saved[m] = (x, out, extra)
        else:
            x, out, extra = saved.pop(m)
            if last:
                tensors, grads = [out], [None]
            else:
                g = torch.empty(out.shape, dtype=out.dtype, device=device)
                dist.recv(g, src=next_rank)
                tensors, grads = [out], [g]
            if extra is not None and extra.requires_grad:
                tensors.append(extra)
                grads.append(None)
            torch.autograd.backward(tensors, grads)
            if stage > 0:
                gx = x.grad if x.grad is not None else torch.zeros_like(x)
                gx = gx.contiguous()
                sends.append((dist.isend(gx, dst=prev_rank), gx))
    for w, _ in sends:
        w.wait()
    return total


@torch.no_grad()
def run_forward(forward: Callable[[int, Tensor | None], Tensor], n_micro: int, *, stage: int, n_stages: int,
                prev_rank: int | None, next_rank: int | None, recv_shape: Callable[[int], tuple],
                dtype: torch.dtype, device) -> list:
    """Forward only (log-probs of the old / reference policy): micro-batches flow through the stages in
    order, no gradients kept. ``forward(m, x)`` as in ``run``; returns the last stage's outputs in
    micro-batch order (an empty list on the other stages)."""
    outs, sends = [], []
    for m in range(n_micro):
        x = None
        if stage > 0:
            x = torch.empty(recv_shape(m), dtype=dtype, device=device)
            dist.recv(x, src=prev_rank)
        out = forward(m, x)
        if stage < n_stages - 1:
            h = out.contiguous()
            sends.append((dist.isend(h, dst=next_rank), h))
        else:
            outs.append(out)
    for w, _ in sends:
        w.wait()
    return outs


__all__ = ["SCHEDULES", "layers_of_stage", "schedule", "run", "run_forward"]
