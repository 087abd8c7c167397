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
from rlflow.models.qwen3_moe import Params, attention_block, mlp_block, positions_from_valid, real_tokens
from rlflow.ops import causal_padding_mask, rmsnorm, rope_cos_sin


def forward(params: Params, cfg: ModelConfig, prompt_ids_PT: Tensor, prompt_valid_PT: Tensor, counts_P: Tensor,
            resp_ids_BR: Tensor, resp_valid_BR: Tensor) -> tuple[Tensor, Tensor]:
    """(h_last [B, D], h_resp [B, R, D]): final hidden states (after the last norm) of each row's last
    prompt token and of its response tokens, as ``qwen3_moe.forward`` on [prompt | response] gives them."""
    P, Tp = prompt_ids_PT.shape
    R = resp_ids_BR.shape[1]
    dtype = params["model.embed_tokens.weight"].dtype
    rep = lambda t: t.repeat_interleave(counts_P, 0)  # noqa: E731  (per prompt -> per row)
    eps = cfg.rms_norm_eps
    h_p = F.embedding(prompt_ids_PT, params["model.embed_tokens.weight"])
    h_r = F.embedding(resp_ids_BR, params["model.embed_tokens.weight"])
    cos_p, sin_p = rope_cos_sin(positions_from_valid(prompt_valid_PT), cfg.head_dim, cfg.rope_theta, dtype)
    pos_r = rep(prompt_valid_PT.sum(-1))[:, None] + torch.arange(R, device=resp_ids_BR.device)
    cos_r, sin_r = rope_cos_sin(pos_r, cfg.head_dim, cfg.rope_theta, dtype)
    mask_p = causal_padding_mask(prompt_valid_PT, 0, Tp)
    mask_r = causal_padding_mask(torch.cat([rep(prompt_valid_PT), resp_valid_BR], 1), Tp, R)  # prompt, then causal
    real_p, real_r = (real_tokens(prompt_valid_PT), real_tokens(resp_valid_BR)) if cfg.is_moe else (None, None)
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        norm_in = params[f"model.layers.{i}.input_layernorm.weight"]
        norm_post = params[f"model.layers.{i}.post_attention_layernorm.weight"]
        kv: list = []
        h_p = h_p + attention_block(params, cfg, a, rmsnorm(h_p, norm_in, eps), cos_p, sin_p, mask_p, None, i,
                                    kv_out=kv)
        k_p, v_p = kv[0]
        h_r = h_r + attention_block(params, cfg, a, rmsnorm(h_r, norm_in, eps), cos_r, sin_r, mask_r, None, i,
                                    prefix_kv=(rep(k_p), rep(v_p)))
        h_p = h_p + mlp_block(params, cfg, m, i, rmsnorm(h_p, norm_post, eps), real_p, False)[0]
        h_r = h_r + mlp_block(params, cfg, m, i, rmsnorm(h_r, norm_post, eps), real_r, False)[0]
    final = params["model.norm.weight"]
    return rep(rmsnorm(h_p[:, -1], final, eps)), rmsnorm(h_r, final, eps)
