"""Qwen3-MoE executed in a layout: TP, EP, PP and DP around the blocks of ``rlflow.models.qwen3_moe``.

Legend: B batch, T tokens, D model dim, H / K query / key-value heads, Hl / Kl the local ones, d head dim,
N tokens, E experts, Tp / Tr prompt / response tokens.

A rank holds ``shard_params(full, layout, rank)``: its shard of every parameter of its pp stage, cut by
the layout's specs (``rlflow.sharding.execute.shard_tensor``). ``context(layout, cfg)`` checks that the
layout is one this module executes, makes the process groups, and records where the rank sits.

Per layer, with tp > 1 (Megatron):
- attention: ``copy_to`` the normed input, ``attention_block`` on the local heads (a config with
  ``H / tp`` heads and the local kv heads), ``reduce_from`` the row-parallel ``o_proj`` output. kv heads
  are sharded over tp when the layout says so (``K % tp == 0``) or replicated (rule ``kv_heads: None``,
  Megatron's kv replication when tp > K): each rank then slices the kv heads its query heads use from a
  ``copy_to`` of the full weight. Replicated weights used on local heads (q_norm, k_norm, replicated
  kv) enter through ``copy_to`` so their gradients are summed over tp.
- MoE: route with the replicated gate on the replicated input (full gradients), ``copy_to`` the input
  and the routing weights into the expert region (expert hidden dim sharded over tp, experts over ep),
  ``ep.moe`` (all-to-all dispatch, local experts, all-to-all combine, weights), ``reduce_from`` over tp.
- dense MLP layers: column-parallel gate/up, row-parallel down (``mlp_block`` on the local shard).
- embedding and head: vocab-parallel (``tp.vocab_embedding``, ``tp.vocab_logprobs``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rlflow.models import qwen3_moe as qm
from rlflow.models.config import ModelConfig
from rlflow.ops import at_mask, causal_padding_mask, rmsnorm, rope_cos_sin
from rlflow.parallel import dp, ep, pp, tp
from rlflow.parallel.collectives import copy_to, reduce_from
from rlflow.sharding.execute import shard_tensor
from rlflow.sharding.layout import Layout

# Effective spec (axes of size > 1 per view dim) each parameter may have.
_N, _T, _E = (), ("tp",), ("ep",)
ALLOWED = (
    (r"(embed_tokens|lm_head)\.weight$", {(_N, _N), (_T, _N)}),
    (r"norm\.weight$", {(_N,)}),
    (r"\.mlp\.gate\.weight$", {(_N, _N)}),
    (r"\.self_attn\.[qkv]_proj\.weight$", {(_N, _N, _N), (_T, _N, _N)}),
    (r"\.self_attn\.[qkv]_proj\.bias$", {(_N, _N), (_T, _N)}),
    (r"\.self_attn\.o_proj\.weight$", {(_N, _N, _N), (_N, _T, _N)}),
    (r"\.mlp\.experts\.gate_up_proj$", {(e, _N, f, _N) for e in (_N, _E) for f in (_N, _T)}),
    (r"\.mlp\.experts\.down_proj$", {(e, _N, f) for e in (_N, _E) for f in (_N, _T)}),
    (r"\.mlp\.(gate|up)_proj\.weight$", {(_N, _N), (_T, _N)}),
    (r"\.mlp\.down_proj\.weight$", {(_N, _N), (_N, _T)}),
)


def effective(layout: Layout, name: str) -> tuple[tuple[str, ...], ...]:
    """Per view dim, the axes of size > 1 the spec names (an axis of size 1 splits nothing)."""
    spec, mesh = layout[name].spec, layout.mesh
    return tuple(tuple(a for a in spec.dim_axes(e) if getattr(mesh, a) > 1) for e in spec)


def _on(layout: Layout, name: str, dim: int, axis: str) -> bool:
    return axis in effective(layout, name)[dim]


def check_layout(layout: Layout, cfg: ModelConfig) -> None:
    """Raise ``ValueError`` naming the parameter unless every spec is one this module executes and the
    paired parameters agree (q_proj/o_proj heads, expert gate_up/down, dense gate/up/down)."""
    for p in layout.params:
        allowed = next((ok for pat, ok in ALLOWED if re.search(pat, p.name)), None)
        eff = effective(layout, p.name)
        if allowed is None or eff not in allowed:
            raise ValueError(f"param {p.name}: spec {p.spec!r} (split over {eff} on {layout.mesh}) is not one "
                             f"rlflow.parallel executes; expected one of {sorted(allowed or ())}")
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        q_tp = _on(layout, a + "q_proj.weight", 0, "tp")
        kv_tp = _on(layout, a + "k_proj.weight", 0, "tp")
        want = {a + "o_proj.weight": (1, q_tp), a + "v_proj.weight": (0, kv_tp)}
        if cfg.attention_bias:
            want |= {a + "q_proj.bias": (0, q_tp), a + "k_proj.bias": (0, kv_tp), a + "v_proj.bias": (0, kv_tp)}
        for n, (d, split) in want.items():
            if _on(layout, n, d, "tp") != split:
                raise ValueError(f"param {n}: its heads must {'' if split else 'not '}be split over tp, as those "
                                 f"of {a}{'q' if 'o_proj' in n or 'q_proj' in n else 'k'}_proj.weight")
        if kv_tp and not q_tp:
            raise ValueError(f"param {a}k_proj.weight: kv heads split over tp need the query heads split too")
        if cfg.is_moe_layer(i):
            gu, dn = effective(layout, m + "experts.gate_up_proj"), effective(layout, m + "experts.down_proj")
            if (gu[0], gu[2]) != (dn[0], dn[2]):
                raise ValueError(f"params {m}experts: gate_up_proj {gu} and down_proj {dn} are split differently")
        elif effective(layout, m + "down_proj.weight")[1] != effective(layout, m + "gate_proj.weight")[0] or \
                effective(layout, m + "up_proj.weight") != effective(layout, m + "gate_proj.weight"):
            raise ValueError(f"params {m}gate/up/down_proj: the MLP width must be split alike")
    if cfg.tie_word_embeddings and layout.mesh.pp > 1:
        raise ValueError("tied embeddings on pp > 1 stages are not supported (the head's gradient would "
                         "have to be summed between the first and the last stage)")


@dataclass(frozen=True, eq=False)
class Ctx:
    """Where this rank sits in the layout, and its process groups (None for an axis of size 1)."""

    cfg: ModelConfig
    layout: Layout
    rank: int
    coords: dict
    tp: object
    ep: object
    loss_group: object  # ranks with this rank's tp index: every loss term once
    layers: tuple[int, ...]

    @property
    def pp_stage(self) -> int:
        return self.coords["pp"]

    @property
    def pp_stages(self) -> int:
        return self.layout.mesh.pp

    def peer(self, stage: int) -> int | None:
        if not 0 <= stage < self.pp_stages:
            return None
        return self.layout.mesh.rank(**{**self.coords, "pp": stage})


def context(layout: Layout, cfg: ModelConfig, rank: int | None = None) -> Ctx:
    """Check the layout and make every process group it needs, in the same order on every rank."""
    check_layout(layout, cfg)
    mesh = layout.mesh
    rank = dist.get_rank() if rank is None else rank
    grp = {}
    for axes in (("tp",), ("ep",), ("pp", "dp", "ep")):
        grp[axes] = mesh.group(axes) if mesh.axis_size(axes) > 1 else None
    dp.make_groups(layout)
    c = mesh.coords(rank)
    return Ctx(cfg=cfg, layout=layout, rank=rank, coords=c, tp=grp[("tp",)], ep=grp[("ep",)],
               loss_group=grp[("pp", "dp", "ep")], layers=pp.layers_of_stage(layout, cfg.num_hidden_layers, c["pp"]))


def shard_params(full: qm.Params, layout: Layout, rank: int) -> qm.Params:
    """Rank ``rank``'s shards of ``full`` (the parameters of its stage only), stored shapes."""
    out = {}
    for n in layout.names:
        t = shard_tensor(full[n], layout, n, rank)
        if t is not None:
            out[n] = t
    return out


# ---- blocks ----
def _attention(params, ctx: Ctx, i: int, x, cos, sin, mask):
    cfg, lay = ctx.cfg, ctx.layout
    p = f"model.layers.{i}.self_attn."
    if ctx.tp is None or not _on(lay, p + "q_proj.weight", 0, "tp"):
        return qm.attention_block(params, cfg, p, x, cos, sin, mask, None, i)
    g, n, ti, d = ctx.tp, lay.mesh.tp, ctx.coords["tp"], cfg.head_dim
    H, K = cfg.num_attention_heads, cfg.num_key_value_heads
    Hl, per_kv = H // n, H // K
    loc = {p + "q_proj.weight": params[p + "q_proj.weight"], p + "o_proj.weight": params[p + "o_proj.weight"]}
    names = ["q_proj.bias"] if cfg.attention_bias else []
    if _on(lay, p + "k_proj.weight", 0, "tp"):
        Kl = K // n
        names += ["k_proj.weight", "v_proj.weight"] + (["k_proj.bias", "v_proj.bias"] if cfg.attention_bias else [])
    else:  # kv heads replicated: the ones this rank's query heads use
        if Hl % per_kv and per_kv % Hl:
            raise ValueError(f"attention on tp={n}: {Hl} local query heads straddle groups of {per_kv} "
                             "query heads per kv head")
        lo, hi = ti * Hl // per_kv, ((ti + 1) * Hl - 1) // per_kv + 1
        Kl = hi - lo
        for w in ("k_proj.weight", "v_proj.weight") + (("k_proj.bias", "v_proj.bias") if cfg.attention_bias else ()):
            loc[p + w] = copy_to(params[p + w], g)[lo * d:hi * d]
    for w in names:
        loc[p + w] = params[p + w]
    if cfg.qk_norm:
        for w in ("q_norm.weight", "k_norm.weight"):
            loc[p + w] = copy_to(params[p + w], g)
    lcfg = cfg.replace(num_attention_heads=Hl, num_key_value_heads=Kl)
    return reduce_from(qm.attention_block(loc, lcfg, p, copy_to(x, g), cos, sin, mask, None, i), g)


def _mlp(params, ctx: Ctx, i: int, x_BTD: Tensor, real_N: Tensor | None):
    cfg, lay = ctx.cfg, ctx.layout
    p = f"model.layers.{i}.mlp."
    if not cfg.is_moe_layer(i):
        g = ctx.tp if _on(lay, p + "gate_proj.weight", 0, "tp") else None
        y, aux = qm.mlp_block(params, cfg, p, i, copy_to(x_BTD, g), real_N, False)
        return reduce_from(y, g), aux
    gt = ctx.tp if _on(lay, p + "experts.gate_up_proj", 2, "tp") else None
    ge = ctx.ep if _on(lay, p + "experts.gate_up_proj", 0, "ep") else None

    def experts(x_ND, w_NK, idx_NK):
        y = ep.moe(copy_to(x_ND, gt), copy_to(w_NK, gt), idx_NK, params[p + "experts.gate_up_proj"],
                   params[p + "experts.down_proj"], cfg.num_experts, ge)
        return reduce_from(y, gt)

    return qm.mlp_block(params, cfg, p, i, x_BTD, real_N, True, experts=experts)


def decoder_layer(params, ctx: Ctx, i: int, h, cos, sin, mask, real_N):
    """``qwen3_moe.decoder_layer`` on this rank's shards (same residual structure)."""
    cfg, p = ctx.cfg, f"model.layers.{i}."
    h = h + _attention(params, ctx, i, rmsnorm(h, params[p + "input_layernorm.weight"], cfg.rms_norm_eps),
                       cos, sin, mask)
    m, aux = _mlp(params, ctx, i, rmsnorm(h, params[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps),
                  real_N)
    return h + m, aux


# ---- one pp stage on one micro-batch ----
@dataclass(frozen=True)
class PPStageOut:
    h: Tensor | None = None  # [B, T, D] hidden states to send (not the last stage)
    logprobs: Tensor | None = None  # [B, Tr] (last stage), 0 on padding
    entropy: Tensor | None = None  # [B, Tr] (last stage, if asked)
    aux_sum: Tensor | None = None  # sum of this stage's MoE layers' router aux losses


def inputs(batch):
    """(ids, positions, valid) [B, Tp + Tr - 1] as ``stages.response_logprobs`` builds them."""
    ids = torch.cat([batch.prompt_ids_BTp, batch.response_ids_BTr], 1)
    valid = torch.cat([batch.prompt_mask_BTp, batch.response_mask_BTr], 1)
    return ids[:, :-1], qm.positions_from_valid(valid)[:, :-1], valid[:, :-1]


def pp_stage_forward(params, ctx: Ctx, batch, h_in: Tensor | None = None, *, temperature: float = 1.0,
                  with_entropy: bool = False, remat: bool = False) -> PPStageOut:
    """This rank's stage of ``stages.response_logprobs`` on ``batch`` (every stage gets the batch; stage
    0 embeds the ids, later stages start from ``h_in``; the last stage returns the log-probs)."""
    cfg, lay = ctx.cfg, ctx.layout
    ids, pos, valid = inputs(batch)
    dtype = next(iter(params.values())).dtype
    if ctx.pp_stage == 0:
        w = params["model.embed_tokens.weight"]
        g = ctx.tp if _on(lay, "model.embed_tokens.weight", 0, "tp") else None
        h = tp.vocab_embedding(ids, w, cfg.vocab_size, g)
    else:
        h = h_in
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, dtype)
    mask = causal_padding_mask(valid, 0, ids.shape[1])
    aux = h.new_zeros((), dtype=torch.float32)
    real_N = qm.real_tokens(valid) if cfg.is_moe else None
    for i in ctx.layers:
        args = (params, ctx, i, h, cos, sin, mask, real_N)
        h, a = checkpoint(decoder_layer, *args, use_reentrant=False) if remat and torch.is_grad_enabled() \
            else decoder_layer(*args)
        if cfg.is_moe_layer(i):
            aux = aux + a
    if ctx.pp_stage < ctx.pp_stages - 1:
        return PPStageOut(h=h, aux_sum=aux)
    h = rmsnorm(h, params["model.norm.weight"], cfg.rms_norm_eps)
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    g = ctx.tp if _on(lay, head, 0, "tp") else None
    lp, ent = at_mask(lambda h_N, t_N: tp.vocab_logprobs(h_N, params[head], t_N, cfg.vocab_size, g,
                                                         temperature=temperature, with_entropy=with_entropy),
                      h[:, batch.prompt_ids_BTp.shape[1] - 1:], batch.response_ids_BTr, batch.response_mask_BTr)
    return PPStageOut(logprobs=lp, entropy=ent, aux_sum=aux)


def response_logprobs(params, ctx: Ctx, batch, *, temperature: float = 1.0, with_entropy: bool = False,
                      remat: bool = False) -> tuple[Tensor, Tensor | None, Tensor]:
    """``stages.response_logprobs`` in a layout without pp: (log-probs, entropy, router aux mean)."""
    if ctx.pp_stages != 1:
        raise ValueError(f"response_logprobs runs one stage; {ctx.layout.mesh} has pp={ctx.pp_stages} "
                         "(use forward_backward's pipeline)")
    out = pp_stage_forward(params, ctx, batch, temperature=temperature, with_entropy=with_entropy, remat=remat)
    n_moe = sum(ctx.cfg.is_moe_layer(i) for i in range(ctx.cfg.num_hidden_layers))
    return out.logprobs, out.entropy, out.aux_sum / max(n_moe, 1)


def _recv_shape(ctx: Ctx, micro_batches: list):
    def shape(m: int):
        mb = micro_batches[m]
        return (mb.size, mb.prompt_ids_BTp.shape[1] + mb.response_ids_BTr.shape[1] - 1, ctx.cfg.hidden_size)
    return shape


def _pipe_kw(ctx: Ctx, params, micro_batches) -> dict:
    t = next(iter(params.values()))
    return dict(stage=ctx.pp_stage, n_stages=ctx.pp_stages, prev_rank=ctx.peer(ctx.pp_stage - 1),
                next_rank=ctx.peer(ctx.pp_stage + 1), recv_shape=_recv_shape(ctx, micro_batches), dtype=t.dtype,
                device=t.device)


def forward_only(params, ctx: Ctx, micro_batches: list, *, temperature: float = 1.0, with_entropy: bool = False
                 ) -> list[tuple[Tensor, Tensor | None]]:
    """Log-probs (and entropies) of every micro-batch without gradients, through the pipeline: on the
    last stage a list of ``(logprobs_BTr, entropy_BTr)``, elsewhere an empty list (the old_logprob and
    ref_logprob stages)."""
    last = ctx.pp_stage == ctx.pp_stages - 1

    def fwd(m: int, x):
        out = pp_stage_forward(params, ctx, micro_batches[m], x, temperature=temperature, with_entropy=with_entropy)
        return (out.logprobs, out.entropy) if last else out.h

    return pp.run_forward(fwd, len(micro_batches), **_pipe_kw(ctx, params, micro_batches))


def forward_backward(params, ctx: Ctx, micro_batches: list, loss_fn: Callable, *,
                     aux_weights: list[float] | None = None, schedule: str = "1f1b", temperature: float = 1.0,
                     with_entropy: bool = False, remat: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    """Forward and backward of this rank's micro-batches through the pipeline (one stage when pp = 1).

    params: this rank's shards as leaves that require grad. ``loss_fn(logprobs_BTr, entropy_BTr, mb)``:
    micro-batch ``mb``'s scalar loss with the normalizers of the whole batch (see ``dp``).
    ``aux_weights[m]``: weight of micro-batch m's router aux loss (mean over the MoE layers, as
    ``stages.response_logprobs`` returns it), e.g. ``coef * b_m / B``; each stage adds its layers' part.
    Returns (this rank's loss terms, summed; gradients of ``params``, not yet reduced over dp / ep; see
    ``dp.all_reduce_grads`` and ``total_loss``)."""
    cfg = ctx.cfg
    for t in params.values():
        t.grad = None
    n_moe = max(sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)), 1)
    last = ctx.pp_stage == ctx.pp_stages - 1

    def fwd(m: int, x):
        out = pp_stage_forward(params, ctx, micro_batches[m], x, temperature=temperature, with_entropy=with_entropy,
                            remat=remat)
        extra = None
        if aux_weights is not None and aux_weights[m]:
            extra = aux_weights[m] * out.aux_sum / n_moe
        if last:
            return loss_fn(out.logprobs, out.entropy, micro_batches[m]), extra
        return out.h, extra

    total = pp.run(fwd, len(micro_batches), kind=schedule, **_pipe_kw(ctx, params, micro_batches))
    grads = {n: (t.grad if t.grad is not None else torch.zeros_like(t)) for n, t in params.items()}
    return total, grads


def total_loss(local: Tensor, ctx: Ctx) -> Tensor:
    """The full loss on every rank: the sum of ``forward_backward``'s terms over pp stages and data ranks
    (tp ranks hold identical copies, counted once)."""
    out = local.detach().clone()
    if ctx.loss_group is not None:
        dist.all_reduce(out, group=ctx.loss_group)
    return out


__all__ = ["ALLOWED", "Ctx", "PPStageOut", "check_layout", "context", "decoder_layer", "effective", "forward_backward",
           "forward_only", "inputs", "response_logprobs", "shard_params", "pp_stage_forward", "total_loss"]
