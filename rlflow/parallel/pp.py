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

Every message goes through an exchange: one ``batch_isend_irecv`` of the ops with one peer, waited at once
(``program``: the schedule with its exchanges). NCCL runs a pair of ranks' point-to-point ops in order on
one stream, and a send larger than its buffer waits for the matching receive; so a send queued before a
receive the peer needs first deadlocks at real sizes (gloo buffers, and hides it). In the steady 1F1B
phase the forward's send and the backward's receive with the next stage are one exchange, the
backward's send and the next forward's receive with the previous stage another (Megatron's
``send_forward_recv_backward`` / ``send_backward_recv_forward``): the two directions progress together.
tests/test_gpu_readiness.py checks every program under those rendezvous semantics.
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


# An exchange's ops: ("send" | "recv", "act" | "grad", micro-batch). Activations go to the next stage and
# come from the previous one; gradients the other way. All ops of one exchange are with one peer.
PEER = {("send", "act"): +1, ("recv", "act"): -1, ("send", "grad"): -1, ("recv", "grad"): +1}


def program(kind: str, n_micro: int, stage: int, n_stages: int, *, backward: bool = True) -> tuple[tuple, ...]:
    """``stage``'s steps: ``("F", m)``, ``("B", m)`` in ``schedule`` order (forwards only without
    ``backward``), and ``("X", ops)``, an exchange with one peer (see ``PEER``) done before the next step.
    What a step receives is exchanged just before it, what it sends just after; a send and the next step's
    receive with the same peer are one exchange."""
    acts = schedule(kind, n_micro, stage, n_stages) if backward else tuple(("F", m) for m in range(n_micro))
    first, last = stage == 0, stage == n_stages - 1
    out, pending = [], ()
    for op, m in acts:
        need = ((("recv", "act", m),) if op == "F" and not first else
                (("recv", "grad", m),) if op == "B" and not last else ())
        if pending and need and PEER[pending[0][:2]] == PEER[need[0][:2]]:
            out.append(("X", pending + need))
        else:
            out += [("X", ops) for ops in (pending, need) if ops]
        out.append((op, m))
        pending = ((("send", "act", m),) if op == "F" and not last else
                   (("send", "grad", m),) if op == "B" and not first else ())
    if pending:
        out.append(("X", pending))
    return tuple(out)


def _exchange(ops, bufs: dict, like: Callable[[str, int], tuple], *, prev_rank, next_rank, device) -> None:
    """One exchange, waited here: each send's ``bufs[(what, m)]`` goes (and is dropped), each receive's is
    allocated (``like(what, m)``: its shape and dtype) and filled."""
    for d, what, m in ops:
        if d == "recv":
            shape, dt = like(what, m)
            bufs[(what, m)] = torch.empty(shape, dtype=dt, device=device)
    p2p = [dist.P2POp(dist.isend if d == "send" else dist.irecv, bufs[(what, m)],
                      next_rank if PEER[(d, what)] > 0 else prev_rank) for d, what, m in ops]
    for w in dist.batch_isend_irecv(p2p):
        w.wait()
    for d, what, m in ops:
        if d == "send":
            del bufs[(what, m)]


def run(forward: Callable[[int, Tensor | None], tuple[Tensor, Tensor | None]], n_micro: int, *, stage: int,
        n_stages: int, prev_rank: int | None, next_rank: int | None, recv_shape: Callable[[int], tuple],
        dtype: torch.dtype, device, kind: str = "1f1b") -> Tensor:
    """Run the schedule's ``program`` on this rank; gradients accumulate into the parameters' ``.grad``.

    ``forward(m, x)``: stage 0 gets ``x = None``, later stages the received hidden states (a leaf that
    requires grad). It returns ``(out, extra)``: on the last stage ``out`` is micro-batch m's scalar
    loss, elsewhere the hidden states to send; ``extra`` is a scalar loss term computed on this stage
    (e.g. router aux loss), or None. ``recv_shape(m)``: the shape of the hidden states stage s receives.
    Returns the sum of this stage's loss terms (the last stage's losses plus every ``extra``)."""
    last = stage == n_stages - 1
    peers = dict(prev_rank=prev_rank, next_rank=next_rank, device=device)
    saved: dict[int, tuple] = {}
    bufs: dict[tuple[str, int], Tensor] = {}  # what the exchanges send and receive, until they are done
    total = torch.zeros((), dtype=torch.float32, device=device)
    for op, m in program(kind, n_micro, stage, n_stages):
        if op == "X":
            _exchange(m, bufs, lambda what, k: (recv_shape(k), dtype) if what == "act" else
                      (saved[k][1].shape, saved[k][1].dtype), **peers)
        elif op == "F":
            x = bufs.pop(("act", m)).requires_grad_(True) if stage > 0 else None
            out, extra = forward(m, x)
            if not last:
                bufs[("act", m)] = out.detach().contiguous()
            for t in (out if last else None, extra):
                if t is not None:
                    total = total + t.detach().float()
            saved[m] = (x, out, extra)
        else:
            x, out, extra = saved.pop(m)
            tensors, grads = [out], [None if last else bufs.pop(("grad", m))]
            if extra is not None and extra.requires_grad:
                tensors.append(extra)
                grads.append(None)
            torch.autograd.backward(tensors, grads)
            if stage > 0:
                gx = x.grad if x.grad is not None else torch.zeros_like(x)
                bufs[("grad", m)] = gx.contiguous()
    return total


@torch.no_grad()
def run_forward(forward: Callable[[int, Tensor | None], Tensor], n_micro: int, *, stage: int, n_stages: int,
                prev_rank: int | None, next_rank: int | None, recv_shape: Callable[[int], tuple],
                dtype: torch.dtype, device) -> list:
    """Forward only (log-probs of the old / reference policy): micro-batches flow through the stages in
    order, no gradients kept (``program(..., backward=False)``). ``forward(m, x)`` as in ``run``; returns the
    last stage's outputs in micro-batch order (an empty list on the other stages)."""
    outs, bufs = [], {}
    peers = dict(prev_rank=prev_rank, next_rank=next_rank, device=device)
    for op, m in program("gpipe", n_micro, stage, n_stages, backward=False):
        if op == "X":
            _exchange(m, bufs, lambda what, k: (recv_shape(k), dtype), **peers)
            continue
        out = forward(m, bufs.pop(("act", m)) if stage > 0 else None)
        if stage < n_stages - 1:
            bufs[("act", m)] = out.contiguous()
        else:
            outs.append(out)
    return outs


__all__ = ["PEER", "SCHEDULES", "layers_of_stage", "program", "schedule", "run", "run_forward"]
