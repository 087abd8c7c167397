"""The training-side glue of a layout: one rank's log-probs, and its forward and backward over micro-batches
through the pipeline schedule (``pp.run``), with the loss counted once over tp.

The forward is ``logprobs.response_logprobs`` of the one model with the rank's execution context
(``parallel.context.LayoutExec``): a pipeline stage other than the last returns its hidden states, the
last stage the log-probs. Legend: B batch, Tp / Tr prompt / response tokens, D model dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from rlflow.models import logprobs, lora
from rlflow.parallel import pp
from rlflow.parallel.context import LayoutExec

EMBED = "model.embed_tokens.weight"


@dataclass(frozen=True)
class PPStageOut:
    h: Tensor | None = None  # [B, Tp + Tr - 1, D] hidden states to send (not the last stage)
    logprobs: Tensor | None = None  # [B, Tr] (last stage), 0 on padding
    entropy: Tensor | None = None  # [B, Tr] (last stage, if asked)
    aux: Tensor | None = None  # this stage's share of the router aux loss (the stages' shares add up)


def pp_stage_forward(params, ctx: LayoutExec, batch, h_in: Tensor | None = None, *, temperature: float = 1.0,
                     with_entropy: bool = False, remat: bool = False, replay: bool = True) -> PPStageOut:
    """This rank's stage of ``logprobs.response_logprobs`` on ``batch`` (every stage gets the batch; stage 0
    embeds the ids, later stages start from ``h_in``; the last stage returns the log-probs). ``replay``:
    a batch's rollout routes are replayed (``logprobs.response_logprobs``)."""
    out, ent, aux = logprobs.response_logprobs(params, ctx.cfg, batch, temperature=temperature,
                                               with_entropy=with_entropy, remat=remat, with_aux=True, ex=ctx,
                                               h_in=h_in, replay=replay)
    if not ctx.last:
        return PPStageOut(h=out, aux=aux)
    return PPStageOut(logprobs=out, entropy=ent, aux=aux)


def response_logprobs(params, ctx: LayoutExec, batch, *, temperature: float = 1.0, with_entropy: bool = False,
                      remat: bool = False, with_aux: bool = True) -> tuple[Tensor, Tensor | None, Tensor]:
    """``logprobs.response_logprobs`` in a layout without pp: (log-probs, entropy, router aux mean)."""
    if ctx.pp_stages != 1:
        raise ValueError(f"response_logprobs runs one stage; {ctx.layout.mesh} has pp={ctx.pp_stages} "
                         "(use forward_backward's pipeline)")
    return logprobs.response_logprobs(params, ctx.cfg, batch, temperature=temperature, with_entropy=with_entropy,
                                      remat=remat, with_aux=with_aux, ex=ctx)


def _pipe_kw(ctx: LayoutExec, params, micro_batches) -> dict:
    t = next(iter(params.values()))

    def recv_shape(m: int):
        mb = micro_batches[m]
        return (mb.size, mb.prompt_ids_BTp.shape[1] + mb.response_ids_BTr.shape[1] - 1, ctx.cfg.hidden_size)
    return dict(stage=ctx.pp_stage, n_stages=ctx.pp_stages, prev_rank=ctx.peer(ctx.pp_stage - 1),
                next_rank=ctx.peer(ctx.pp_stage + 1), recv_shape=recv_shape, dtype=t.dtype, device=t.device)


def _tied(ctx: LayoutExec) -> bool:
    """The head is the embedding and they sit on different stages: rank pairs (first, last stage) share it."""
    return ctx.cfg.tie_word_embeddings and ctx.pp_stages > 1 and (ctx.first or ctx.last)


def _trains_embedding(params) -> bool:
    """The stage's embedding (or the head borrowing it) takes a gradient: not a frozen LoRA base."""
    return not lora.has_adapters(params)


def _lend_embedding(params, ctx: LayoutExec) -> tuple[dict, Tensor | None]:
    """Tied embeddings on pp > 1: the first stage sends its shard of the embedding to the last stage (the
    rank with its dp, ep and tp coordinates), which computes the head with it as a leaf of its own. One copy
    of the weight and of its optimizer state stays on the first stage; ``_return_head_grad`` sends the
    head's gradient back to be added to the embedding's (Megatron keeps a replica on the last stage and
    all-reduces the two gradients: the same sum, with a second optimizer state). Returns (the params the
    stage's forward reads, the borrowed leaf on the last stage or None)."""
    if not _tied(ctx):
        return params, None
    if ctx.first:
        dist.send(params[EMBED].detach().contiguous(), ctx.peer(ctx.pp_stages - 1))
        return params, None
    like = next(iter(params.values()))
    w = torch.empty(ctx.layout[EMBED].local_shape(ctx.layout.mesh), dtype=ctx.layout[EMBED].dtype, device=like.device)
    dist.recv(w, ctx.peer(0))
    return {**params, EMBED: w.requires_grad_(_trains_embedding(params))}, w


def _return_head_grad(grads: dict[str, Tensor], ctx: LayoutExec, borrowed: Tensor | None) -> None:
    """The other half of ``_lend_embedding`` after a backward: the last stage sends the head's gradient,
    the first stage adds it to the embedding's in ``grads``."""
    if not _tied(ctx) or (EMBED not in grads if ctx.first else not borrowed.requires_grad):  # a frozen base
        return
    if ctx.last:
        dist.send(borrowed.grad if borrowed.grad is not None else torch.zeros_like(borrowed), ctx.peer(0))
        return
    g = torch.empty_like(grads[EMBED])
    dist.recv(g, ctx.peer(ctx.pp_stages - 1))
    grads[EMBED] = grads[EMBED] + g


def forward_only(params, ctx: LayoutExec, micro_batches: list, *, temperature: float = 1.0,
                 with_entropy: bool = False, replay: bool = True) -> list[tuple[Tensor, Tensor | None]]:
    """Log-probs (and entropies) of every micro-batch without gradients, through the pipeline: on the
    last stage a list of ``(logprobs_BTr, entropy_BTr)``, elsewhere an empty list (the old_logprob and
    ref_logprob stages)."""
    kw = _pipe_kw(ctx, params, micro_batches)
    params, _ = _lend_embedding(params, ctx)

    def fwd(m: int, x):
        out = pp_stage_forward(params, ctx, micro_batches[m], x, temperature=temperature, with_entropy=with_entropy,
                               replay=replay)
        return (out.logprobs, out.entropy) if ctx.last else out.h

    return pp.run_forward(fwd, len(micro_batches), **kw)


def forward_backward(params, ctx: LayoutExec, micro_batches: list, loss_fn: Callable, *,
                     aux_weights: list[float] | None = None, schedule: str = "1f1b", temperature: float = 1.0,
                     with_entropy: bool = False, remat: bool = False, replay: bool = True
                     ) -> tuple[Tensor, dict[str, Tensor]]:
    """Forward and backward of this rank's micro-batches through the pipeline (one stage when pp = 1).

    params: this rank's shards as leaves that require grad. ``loss_fn(logprobs_BTr, entropy_BTr, mb)``:
    micro-batch ``mb``'s scalar loss with the normalizers of the whole batch (see ``dp``).
    ``aux_weights[m]``: weight of micro-batch m's router aux loss (mean over the MoE layers, as
    ``logprobs.response_logprobs`` returns it), e.g. ``coef * b_m / B``; each stage adds its layers' part.
    Returns (this rank's loss terms, summed; gradients of those ``params`` that require grad (LoRA: the
    adapters), not yet reduced over dp / ep; see
    ``dp.all_reduce_grads`` and ``total_loss``)."""
    for t in params.values():
        t.grad = None
    kw = _pipe_kw(ctx, params, micro_batches)
    stage_params, borrowed = _lend_embedding(params, ctx)

    def fwd(m: int, x):
        out = pp_stage_forward(stage_params, ctx, micro_batches[m], x, temperature=temperature, with_entropy=with_entropy,
                               remat=remat, replay=replay)
        extra = None
        if aux_weights is not None and aux_weights[m]:
            extra = aux_weights[m] * out.aux
        if ctx.last:
            return loss_fn(out.logprobs, out.entropy, micro_batches[m]), extra
        return out.h, extra

    total = pp.run(fwd, len(micro_batches), kind=schedule, **kw)
    grads = {n: (t.grad if t.grad is not None else torch.zeros_like(t)) for n, t in params.items() if t.requires_grad}
    _return_head_grad(grads, ctx, borrowed)
    return total, grads


def total_loss(local: Tensor, ctx: LayoutExec) -> Tensor:
    """The full loss on every rank: the sum of ``forward_backward``'s terms over pp stages and data ranks
    (tp ranks hold identical copies, counted once)."""
    out = local.detach().clone()
    if ctx.loss_group is not None:
        dist.all_reduce(out, group=ctx.loss_group)
    return out


__all__ = ["PPStageOut", "forward_backward", "forward_only", "pp_stage_forward", "response_logprobs", "total_loss"]
