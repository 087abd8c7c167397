"""DeepSeek-V3 / R1 Multi-head Latent Attention (MLA) as pure functions over a params dict.

Legend: B batch, T tokens of this call, S key positions, D model dim, H the view's query heads, r the kv
latent (``kv_lora_rank``), n / p the per-head non-rotary / rotary q·k dims (``qk_nope_head_dim`` /
``qk_rope_head_dim``), v the value dims.

The decoder around it is ``models/decoder.py`` (one decoder for every family; DeepSeekMoE is its MoE
block with sigmoid group-limited routing and shared experts). MLA as transformers'
``DeepseekV3Attention`` computes it:

    q      = q_b(norm(q_a(x)))  (or q_proj(x) when q_lora_rank is None), per head [n | p]
    c, k_p = kv_a_proj_with_mqa(x) split [r | p];  c = kv_a_layernorm(c)
    k, v   = kv_b(c) per head [n | v];  k = [k | rope(k_p)] (one rotary key shared by all heads)
    o      = o_proj(softmax(q k^T * scale) v)

The KV cache holds only ``[c | rope(k_p)]`` per token (r + p numbers, not 2 H (n + v)). A decode step
uses the inference form that never expands it: kv_b's key half folds into the query
(q_lat = q_n W_uk, [H, r]), the scores are [q_lat | q_p] · [c | k_p] over the latent, attention runs as
one key/value head (the latent), and kv_b's value half folds into the output (o = o_lat W_uv^T).
Prefill (several tokens) expands the latent, which is cheaper there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlflow.models.config import ModelConfig
from rlflow.models.execution import View
from rlflow.ops import apply_rope, attention, deinterleave, rmsnorm


# The latent norms (q_a_layernorm, kv_a_layernorm) keep this eps whatever the config's rms_norm_eps says, as
# transformers' DeepseekV3 and DeepSeek's own code build them
LATENT_NORM_EPS = 1e-6


def _queries(P: dict, cfg: ModelConfig, a: str, x: Tensor, heads: int) -> Tensor:
    """[B, T, H, n + p]."""
    if cfg.q_lora_rank:
        q = F.linear(rmsnorm(F.linear(x, P[a + "q_a_proj.weight"]), P[a + "q_a_layernorm.weight"], LATENT_NORM_EPS),
                     P[a + "q_b_proj.weight"])
    else:
        q = F.linear(x, P[a + "q_proj.weight"])
    return q.unflatten(-1, (heads, cfg.qk_head_dim))


def latent(P: dict, cfg: ModelConfig, a: str, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """What the cache stores of x's tokens: [B, T, r + p], the normed latent then the rotated shared key."""
    c, k_p = F.linear(x, P[a + "kv_a_proj_with_mqa.weight"]).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
    if cfg.rope_interleave:
        k_p = deinterleave(k_p)
    return torch.cat([rmsnorm(c, P[a + "kv_a_layernorm.weight"], LATENT_NORM_EPS),
                      apply_rope(k_p[..., None, :], cos, sin)[..., 0, :]], -1)


def _expanded(P: dict, cfg: ModelConfig, a: str, q: Tensor, kv_BSL: Tensor, heads: int, mask: Tensor | None
              ) -> Tensor:
    """Attention with the latent expanded to per-head keys and values: [B, T, H, v]."""
    n, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    c, k_p = kv_BSL.split([r, cfg.qk_rope_head_dim], -1)
    k_n, v = F.linear(c, P[a + "kv_b_proj.weight"]).unflatten(-1, (heads, n + cfg.v_head_dim)).split(
        [n, cfg.v_head_dim], -1)  # [B, S, H, n], [B, S, H, v]
    k = torch.cat([k_n, k_p[:, :, None].expand(-1, -1, heads, -1)], -1)
    o = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, is_causal=True,
                  scale=cfg.softmax_scale)
    return o.transpose(1, 2)


def _absorbed(P: dict, cfg: ModelConfig, a: str, q: Tensor, kv_BSL: Tensor, heads: int, mask: Tensor | None
              ) -> Tensor:
    """Attention over the latent itself (kv_b folded into the query and the output): [B, T, H, v]."""
    n, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    w_uk, w_uv = P[a + "kv_b_proj.weight"].view(heads, n + cfg.v_head_dim, r).split([n, cfg.v_head_dim], 1)
    q_n, q_p = q.split([n, cfg.qk_rope_head_dim], -1)
    q_lat = torch.einsum("bthn,hnr->bhtr", q_n, w_uk)
    kv = kv_BSL[:, None]  # one key/value "head": [B, 1, S, r + p]
    o_lat = attention(torch.cat([q_lat, q_p.transpose(1, 2)], -1), kv, kv[..., :r], mask, is_causal=True,
                      scale=cfg.softmax_scale)  # [B, H, T, r]
    return torch.einsum("bhtr,hvr->bthv", o_lat, w_uv)


def attention_block(view: View, cfg: ModelConfig, layer: int, x_BTD: Tensor, cos: Tensor, sin: Tensor,
                    mask: Tensor | None, cache=None, cache_slots=None) -> Tensor:
    """MLA of x's tokens (and, with a cache, of the cached ones before them) on the view's heads, before
    ``view.leave``. The cache's layer buffer is [B, 1, S_max, r + p] (``decoder.KVCache``)."""
    a = f"model.layers.{layer}.self_attn."
    P, H = view.params, view.heads
    q = _queries(P, cfg, a, x_BTD, H)
    q_n, q_p = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
    q = torch.cat([q_n, apply_rope(deinterleave(q_p) if cfg.rope_interleave else q_p, cos, sin)], -1)
    kv = latent(P, cfg, a, x_BTD, cos, sin)  # [B, T, r + p]
    if cache is None:
        o = _expanded(P, cfg, a, q, kv, H, mask)
    else:
        rows, cols, span = cache_slots
        cache.k[layer][rows, :, cols] = kv[:, :, None]
        kv_all = cache.k[layer][:, 0, :span]
        o = (_absorbed if x_BTD.shape[1] == 1 else _expanded)(P, cfg, a, q, kv_all, H, mask)
    return F.linear(o.flatten(2), P[a + "o_proj.weight"])
