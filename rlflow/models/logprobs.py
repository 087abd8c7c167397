"""The policy's log-probs of its responses: the one model's forward over prompt + response, and the
log-softmax of the response tokens (``ops.token_logprobs`` through the execution context). The same
forward serves one process, a layout's rank (``ex``) and a pipeline stage; the critic reads its hidden
states (``sequence_hidden``).

Legend: B samples, Tp prompt tokens, Tr response tokens, D model dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlflow.batch import RolloutBatch
from rlflow.models import prefix
from rlflow.models import decoder as model
from rlflow.models.config import ModelConfig
from rlflow.models.execution import LOCAL, Exec
from rlflow.ops import at_mask


def response_logprobs(params: model.Params, cfg: ModelConfig, batch: RolloutBatch, *, temperature: float = 1.0,
                      with_entropy: bool = False, remat: bool = False,
                      with_aux: bool = True, ex: Exec = LOCAL, h_in: Tensor | None = None,
                      replay: bool = True, routing_stats: dict | None = None
                      ) -> tuple[Tensor, Tensor | None, Tensor]:
    """log pi(response token | prefix) [B, Tr] (0 on padding), the entropy [B, Tr] if asked, and the router
    aux loss. The sequence is prompt (left-padded) + response (right-padded); hidden state t predicts t+1.

    Rows that share a prompt (same group id and prompt tokens) run it once (``models/prefix.py``),
    unless the router aux loss or remat is asked for, or the attention is MLA; the result is the same
    either way.

    ``ex``: the execution context (one rank of a layout). On a pipeline stage other than the last
    (``ex.last`` False) the first value is the stage's output hidden states [B, Tp + Tr - 1, D] to
    send on, and the entropy None; a stage after the first starts from ``h_in``.

    A batch that carries the rollout's expert choices (``prompt_routes_BTpMK``, ``response_routes_BTrMK``)
    routes its tokens by them (Rollout Routing Replay) when ``replay``, else only compares them; out of
    "compared" (token, MoE layer) pairs, those routed to other experts than the rollout's ("flipped")
    and those whose router top-k differs from the rollout's ("router_flipped") add up in
    ``routing_stats``."""
    pipelined = not (ex.first and ex.last)
    routing = None
    if batch.response_routes_BTrMK is not None:
        routes = torch.cat([batch.prompt_routes_BTpMK, batch.response_routes_BTrMK], 1)[:, :-1]
        routing = model.Routing(rollout=routes, replay=replay)
    shared = None if (with_aux or remat or pipelined or cfg.mla or routing is not None) else _prompt_groups(batch)
    if shared is not None:
        order, first, counts = shared
        b = batch.select(order)
        last, h_r = prefix.forward(params, cfg, b.prompt_ids_BTp[first], b.prompt_mask_BTp[first], counts,
                                   b.response_ids_BTr[:, :-1], b.response_mask_BTr[:, :-1], ex)
        h_resp = torch.cat([last[:, None], h_r], 1)  # predicts response tokens 0..Tr-1
        aux = h_r.new_zeros((), dtype=torch.float32)
        lp, ent = _token_logprobs(params, cfg, b, h_resp, temperature, with_entropy, ex)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(len(order), device=order.device)
        return lp[inv], (None if ent is None else ent[inv]), aux
    h, aux = sequence_hidden(params, cfg, batch, remat=remat, with_aux=with_aux, ex=ex, h_in=h_in, routing=routing)
    Tp = batch.prompt_ids_BTp.shape[1]
    if routing is not None and routing_stats is not None:
        for k in ("flipped", "router_flipped", "compared"):
            routing_stats[k] = routing_stats.get(k, 0) + getattr(routing, k)
    if not ex.last:
        return h, None, aux
    # h[Tp - 1] predicts response token 0
    lp, ent = _token_logprobs(params, cfg, batch, h[:, Tp - 1:], temperature, with_entropy, ex)
    return lp, ent, aux


def sequence_hidden(params: model.Params, cfg: ModelConfig, batch: RolloutBatch, *, remat: bool = False,
                    with_aux: bool = False, ex: Exec = LOCAL, h_in: Tensor | None = None,
                    routing: model.Routing | None = None) -> tuple[Tensor, Tensor]:
    """The final hidden states [B, Tp + Tr - 1, D] of each row's prompt + response but its last token (state t
    predicts token t + 1: ``[:, Tp - 1:]`` are the states before each response token) and the router aux loss."""
    ids = torch.cat([batch.prompt_ids_BTp, batch.response_ids_BTr], 1)
    valid = torch.cat([batch.prompt_mask_BTp, batch.response_mask_BTr], 1)
    h, aux, _ = model.forward(params, cfg, ids[:, :-1], model.positions_from_valid(valid)[:, :-1],
                              valid_BT=valid[:, :-1], remat=remat, with_aux=with_aux, ex=ex, h_in=h_in, routing=routing)
    return h, aux


def _prompt_groups(batch: RolloutBatch) -> tuple[Tensor, Tensor, Tensor] | None:
    """(row order grouping rows by prompt, first row of each group in that order, group sizes), or None
    when no two rows share a prompt (or groups' rows differ in prompt tokens, or responses are 1 token)."""
    if batch.response_ids_BTr.shape[1] < 2:
        return None
    order = torch.argsort(batch.group_B, stable=True)
    _, counts = torch.unique_consecutive(batch.group_B[order], return_counts=True)
    if len(counts) == batch.size:
        return None
    first = counts.cumsum(0) - counts
    ids, mask = batch.prompt_ids_BTp[order], batch.prompt_mask_BTp[order]
    each = lambda t: t[first].repeat_interleave(counts, 0, output_size=batch.size)  # noqa: E731  (no host sync)
    if not bool((((ids == each(ids)) | ~mask) & (mask == each(mask))).all()):  # one read: same tokens, same mask
        return None
    return order, first, counts


def _token_logprobs(params, cfg, batch, h_resp, temperature, with_entropy, ex: Exec):
    """Log-probs (and entropies) [B, Tr] of the sampled response tokens from the states that predict them,
    computed on those tokens only (``loss_mask``) and 0 elsewhere: padding, and a multi-turn row's observations."""
    return at_mask(lambda h, t: ex.logprobs(params, cfg, h, t, temperature=temperature, with_entropy=with_entropy),
                   h_resp, batch.response_ids_BTr, batch.loss_mask)


__all__ = ["response_logprobs", "sequence_hidden"]
