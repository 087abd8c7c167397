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
from torch import Tensor

from rlflow.models import lora
from rlflow.models.config import ModelConfig
from rlflow.models.execution import LOCAL, Exec
from rlflow.models.decoder import Params, mlp_block, positions_from_valid, qk_v_heads, real_tokens
from rlflow.ops import PrefixLayout, prefix_attention, rmsnorm, rope_cos_sin


def forward(params: Params, cfg: ModelConfig, prompt_ids_PT: Tensor, prompt_valid_PT: Tensor, counts_P: Tensor,
            resp_ids_BR: Tensor, resp_valid_BR: Tensor, ex: Exec = LOCAL) -> tuple[Tensor, Tensor]:
    """(h_last [B, D], h_resp [B, R, D]): final hidden states (after the last norm) of each row's last
    prompt token and of its response tokens, as ``decoder.forward`` on [prompt | response] gives them.

    The prompt and response tokens run packed, as one [N, D] sequence of N = P*Tp + B*R tokens, through
    everything (norms, projections, rope, MoE: one kernel per op for both, and the MoE routes them
    together); ``ops.prefix_attention`` gives prompts causal attention among themselves and responses
    attention to their prompt's keys/values and causally to their own. ``ex``: the execution context
    (tensor and expert parallel; not a pipeline stage: the packed sequence runs every layer)."""
    if not (ex.first and ex.last):
        raise ValueError("prefix.forward runs every layer: a pipeline stage takes decoder.forward")
    if cfg.mla:
        raise ValueError("prefix.forward: MLA (DeepSeek) attention has no packed form here; use decoder.forward")
    P, Tp = prompt_ids_PT.shape
    B, R = resp_ids_BR.shape
    Np, Nr = P * Tp, B * R
    layout = PrefixLayout(prompt_valid_PT, resp_valid_BR, counts_P)  # the attention's masks / plan, built once
    eps = cfg.rms_norm_eps
    h = ex.embed(params, cfg, torch.cat([prompt_ids_PT.reshape(-1), resp_ids_BR.reshape(-1)]))
    pos_r = layout.per_row(prompt_valid_PT.sum(-1))[:, None] + torch.arange(R, device=resp_ids_BR.device)
    pos = torch.cat([positions_from_valid(prompt_valid_PT).reshape(-1), pos_r.reshape(-1)])
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, h.dtype, cfg.rope_scaling)  # [N, d]
    valid = torch.cat([prompt_valid_PT.reshape(-1), resp_valid_BR.reshape(-1)])[None]
    real = real_tokens(valid) if cfg.is_moe else None

    for i in ex.layers(cfg):
        a = f"model.layers.{i}.self_attn."
        view = ex.attention_view(params, cfg, i)
        x = view.enter(rmsnorm(h, params[f"model.layers.{i}.input_layernorm.weight"], eps))
        qk, v = qk_v_heads(view, cfg, a, x, cos, sin)
        o = prefix_attention(qk, v, view.heads, layout)  # [N, H, d] (H: the view's query heads)
        h = h + view.leave(lora.linear(view.params, cfg, a + "o_proj", o.flatten(1)))
        y, _ = mlp_block(params, cfg, i, rmsnorm(h, params[f"model.layers.{i}.post_attention_layernorm.weight"],
                                                 eps)[None], real, False, ex)
        h = h + y[0]
    h_p, h_r = h.split([Np, Nr])
    final = params["model.norm.weight"]
    return layout.per_row(rmsnorm(h_p.view(P, Tp, -1)[:, -1], final, eps)), rmsnorm(h_r, final, eps).view(B, R, -1)
