"""Shared-prompt forward for GRPO training: the G samples of a prompt share its tokens, so the prompt
runs through the model once and its G responses attend to its keys/values.

Legend: P prompts, Tp prompt tokens (left-padded), B = sum(counts_P) rows (grouped: counts_P[p]
consecutive rows answer prompt p), R response tokens (right-padded), D model dim.

Exact: with causal attention a prompt token's states do not depend on what follows it, so they equal
the states each of its rows would compute on its own; only the work is divided by G (the prompt part
of the forward and backward). Tested against the plain forward in tests/test_prefix.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlflow.models.config import ModelConfig
from rlflow.models.qwen3_moe import Params, mlp_block, positions_from_valid, qkv_heads, real_tokens
from rlflow.ops import attention, causal_padding_mask, rmsnorm, rope_cos_sin


def forward(params: Params, cfg: ModelConfig, prompt_ids_PT: Tensor, prompt_valid_PT: Tensor, counts_P: Tensor,
            resp_ids_BR: Tensor, resp_valid_BR: Tensor) -> tuple[Tensor, Tensor]:
    """(h_last [B, D], h_resp [B, R, D]): final hidden states (after the last norm) of each row's last
    prompt token and of its response tokens, as ``qwen3_moe.forward`` on [prompt | response] gives them.

    The prompt and response tokens run packed, as one [N, D] sequence of N = P*Tp + B*R tokens, through
    everything but the attention itself (norms, projections, rope, MoE): one kernel per op for both, and
    the MoE routes them together. Only attention splits them: prompts attend causally among themselves,
    responses to their prompt's keys/values (repeated over its rows) and causally to their own."""
    P, Tp = prompt_ids_PT.shape
    B, R = resp_ids_BR.shape
    Np, Nr = P * Tp, B * R
    dtype = params["model.embed_tokens.weight"].dtype
    rep = lambda t: t.repeat_interleave(counts_P, 0)  # noqa: E731  (per prompt -> per row)
    eps = cfg.rms_norm_eps
    h = F.embedding(torch.cat([prompt_ids_PT.reshape(-1), resp_ids_BR.reshape(-1)]), params["model.embed_tokens.weight"])
    pos_r = rep(prompt_valid_PT.sum(-1))[:, None] + torch.arange(R, device=resp_ids_BR.device)
    pos = torch.cat([positions_from_valid(prompt_valid_PT).reshape(-1), pos_r.reshape(-1)])
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, dtype)  # [N, d]
    mask_p = causal_padding_mask(prompt_valid_PT, 0, Tp)
    mask_r = causal_padding_mask(torch.cat([rep(prompt_valid_PT), resp_valid_BR], 1), Tp, R)  # prompt, then causal
    valid = torch.cat([prompt_valid_PT.reshape(-1), resp_valid_BR.reshape(-1)])[None]
    real = real_tokens(valid) if cfg.is_moe else None

    def heads(t: Tensor, rows: int) -> Tensor:  # [rows * T, heads, d] -> [rows, heads, T, d]
        return t.unflatten(0, (rows, -1)).transpose(1, 2)

    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        q, k, v = qkv_heads(params, cfg, a, rmsnorm(h, params[f"model.layers.{i}.input_layernorm.weight"], eps),
                            cos, sin)
        (q_p, q_r), (k_p, k_r), (v_p, v_r) = (t.split([Np, Nr]) for t in (q, k, v))
        k_p, v_p = heads(k_p, P), heads(v_p, P)
        o_p = attention(heads(q_p, P), k_p, v_p, mask_p, is_causal=True)
        o_r = attention(heads(q_r, B), torch.cat([rep(k_p), heads(k_r, B)], 2),
                        torch.cat([rep(v_p), heads(v_r, B)], 2), mask_r, is_causal=True)
        o = torch.cat([o_p.transpose(1, 2).reshape(Np, -1), o_r.transpose(1, 2).reshape(Nr, -1)])
        h = h + F.linear(o, params[a + "o_proj.weight"])
        y, _ = mlp_block(params, cfg, m, i, rmsnorm(h, params[f"model.layers.{i}.post_attention_layernorm.weight"],
                                                      eps)[None], real, False)
        h = h + y[0]
    h_p, h_r = h.split([Np, Nr])
    final = params["model.norm.weight"]
    return rep(rmsnorm(h_p.view(P, Tp, -1)[:, -1], final, eps)), rmsnorm(h_r, final, eps).view(B, R, -1)
