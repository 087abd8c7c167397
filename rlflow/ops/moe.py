"""Mixture-of-experts routing and grouped expert computation.

Legend: N tokens, D model dim, E experts, K top-k, F expert hidden dim.
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def route(x_ND: Tensor, gate_ED: Tensor, top_k: int, norm_topk_prob: bool,
          valid_N: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax top-k routing (Qwen3-MoE). Returns (weights_NK in x's dtype, experts_NK, aux_loss).

    p = softmax(x W_g^T) in float32; keep the top-k; renormalize them to sum 1 when ``norm_topk_prob``.
    aux_loss is the Switch-Transformer load-balancing loss  E * sum_e f_e * P_e, with f_e the fraction
    of (token, slot) assignments to expert e and P_e the mean router probability of e, over valid tokens.
    """
    logits_NE = F.linear(x_ND, gate_ED)
    probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
    w_NK, idx_NK = torch.topk(probs_NE, top_k, dim=-1)
    if norm_topk_prob:
        w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
    E = gate_ED.shape[0]
    with torch.no_grad():
        onehot_NE = torch.zeros_like(probs_NE).scatter_(1, idx_NK, 1.0)
    if valid_N is not None:
        v = valid_N.to(probs_NE.dtype)[:, None]
        n = v.sum().clamp_min(1.0)
        f_E = (onehot_NE * v).sum(0) / (n * top_k)
        p_E = (probs_NE * v).sum(0) / n
    else:
        f_E = onehot_NE.mean(0) / top_k
        p_E = probs_NE.mean(0)
    aux = E * (f_E * p_E).sum()
    return w_NK.to(x_ND.dtype), idx_NK, aux


def moe_experts(x_ND: Tensor, w_NK: Tensor, idx_NK: Tensor, gate_up_E2FD: Tensor, down_EDF: Tensor) -> Tensor:
    """sum_k w_nk * down_e(silu(gate_e x_n) * up_e x_n) with e = idx_nk, computed grouped by expert.

    The N*K (token, slot) pairs are sorted by expert so each expert runs one matmul over a contiguous
    block of its tokens; there is no loop over tokens.
    """
    N, K = idx_NK.shape
    E = gate_up_E2FD.shape[0]
    flat = idx_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    xs = x_ND[tok]  # [N*K, D], grouped by expert
    counts = torch.bincount(flat, minlength=E).tolist()
    outs, start = [], 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        g, u = F.linear(xs[start:start + c], gate_up_E2FD[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(g) * u, down_EDF[e]))
        start += c
    ys = torch.cat(outs) * w_NK.reshape(-1)[order, None]
    return torch.zeros_like(x_ND).index_add_(0, tok, ys)
