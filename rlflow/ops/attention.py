"""Grouped-query attention over torch SDPA.

Legend: B batch, H query heads, K key/value heads (H % K == 0), T query tokens, S key tokens, d head dim.
Masks are boolean, True where a query may attend.
"""

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

# CPU flash attention's backward in bfloat16/float16 has a large cost per (batch, head) pair: for the
# tiny preset's training shapes (128 rows x 4 heads, 44 tokens) forward + backward take 52 ms against
# 9 ms with the math path (5.6 ms in float32 with flash). Where the [B, H, T, S] scores are small, the
# math path runs instead (it stores the scores for the backward); longer sequences keep flash, which
# is 2-6x faster there (e.g. 8 x 16 heads x 300 tokens: 62 vs 154 ms).
MATH_MAX_SCORES = 4 * 2**20  # B * H * T * S elements


def causal_padding_mask(key_valid_BS: Tensor, q_offset: int, T: int) -> Tensor:
    """[B, 1, T, S] mask: query t (absolute position q_offset + t) sees valid keys s <= q_offset + t.

    A query always sees itself, so rows that are all padding (left-padded prompts) stay finite; their
    outputs are garbage and are masked out downstream.
    """
    S = key_valid_BS.shape[1]
    q_abs = torch.arange(q_offset, q_offset + T, device=key_valid_BS.device)[:, None]
    k_abs = torch.arange(S, device=key_valid_BS.device)[None, :]
    causal = k_abs <= q_abs  # [T, S]
    mask = causal[None] & key_valid_BS[:, None, :]
    mask = mask | (k_abs == q_abs)[None]
    return mask[:, None]


def attention(q_BHTd: Tensor, k_BKSd: Tensor, v_BKSd: Tensor, mask_B1TS: Tensor | None,
              *, is_causal: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(d) + mask) v, with K < H key/value heads shared by groups of H/K queries.

    A single query token (decode) takes three batched matmul-sized kernels over [B, K, H/K, S] instead
    of SDPA's general path, which dominates a decode step for small models.
    """
    B, H, T, d = q_BHTd.shape
    K = k_BKSd.shape[1]
    if T == 1 and mask_B1TS is not None:
        q = q_BHTd.reshape(B, K, H // K, d)
        scores = torch.matmul(q, k_BKSd.transpose(-1, -2)) * d ** -0.5  # [B, K, H/K, S]
        scores = scores.masked_fill(~mask_B1TS, float("-inf"))
        return torch.matmul(torch.softmax(scores, -1), v_BKSd).reshape(B, H, 1, d)
    kw = dict(attn_mask=mask_B1TS, is_causal=is_causal and mask_B1TS is None, enable_gqa=H != K)
    if (q_BHTd.device.type == "cpu" and q_BHTd.dtype in (torch.bfloat16, torch.float16) and torch.is_grad_enabled()
            and (q_BHTd.requires_grad or k_BKSd.requires_grad or v_BKSd.requires_grad)
            and B * H * T * k_BKSd.shape[2] <= MATH_MAX_SCORES):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q_BHTd, k_BKSd, v_BKSd, **kw)
    return F.scaled_dot_product_attention(q_BHTd, k_BKSd, v_BKSd, **kw)
