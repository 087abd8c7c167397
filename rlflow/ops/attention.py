"""Grouped-query attention over torch SDPA.

Legend: B batch, H query heads, K key/value heads (H % K == 0), T query tokens, S key tokens, d head dim.
Masks are boolean, True where a query may attend.
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from rlflow.ops import registry

# CPU flash attention's backward in bfloat16/float16 has a large cost per (batch, head) pair: for the
# tiny preset's training shapes (128 rows x 4 heads, 44 tokens) forward + backward take 52 ms against
# 9-14 ms computed in float32 with plain matmuls (5.6 ms in float32 with flash). Short keys and small
# score tensors take that path (``_attention_f32``: it stores the float32 scores for the backward);
# from ~256 keys flash is faster again (e.g. 16 x 4 heads x 256 tokens: 24.5 vs 36 ms).
F32_MAX_KEYS = 128
F32_MAX_SCORES = 4 * 2**20  # B * H * T * S elements (16 MiB of float32 scores)


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
              *, is_causal: bool = False, scale: float | None = None) -> Tensor:
    """softmax(q k^T * scale + mask) v, with K < H key/value heads shared by groups of H/K queries; scale
    defaults to 1/sqrt(d). v's head dim may differ from q's and k's (MLA: [B, H, T, dv] out).

    A single query token (decode) takes three batched matmul-sized kernels over [B, K, H/K, S] instead
    of SDPA's general path, which dominates a decode step for small models.
    """
    fused = registry.run("attention", q_BHTd.device, q_BHTd, k_BKSd, v_BKSd, mask_B1TS, is_causal=is_causal,
                         scale=scale)
    return fused if fused is not None else attention_reference(q_BHTd, k_BKSd, v_BKSd, mask_B1TS,
                                                               is_causal=is_causal, scale=scale)


@registry.reference("attention")
def attention_reference(q_BHTd: Tensor, k_BKSd: Tensor, v_BKSd: Tensor, mask_B1TS: Tensor | None,
                        *, is_causal: bool = False, scale: float | None = None) -> Tensor:
    if q_BHTd.shape[2] == 1 and mask_B1TS is not None:
        return _attention_matmul(q_BHTd, k_BKSd, v_BKSd, mask_B1TS, False, scale)
    if cpu_takes_f32(q_BHTd, k_BKSd, v_BKSd):
        return _attention_f32(q_BHTd, k_BKSd, v_BKSd, mask_B1TS, is_causal, scale)
    k_BKSd, v_BKSd, gqa = fused_kernel_heads(q_BHTd, k_BKSd, v_BKSd, mask_B1TS)
    return F.scaled_dot_product_attention(q_BHTd, k_BKSd, v_BKSd, attn_mask=mask_B1TS,
                                          is_causal=is_causal and mask_B1TS is None, enable_gqa=gqa, scale=scale)


def cpu_takes_f32(q_BHTd: Tensor, k_BKSd: Tensor, v_BKSd: Tensor) -> bool:
    """Half-precision attention with a gradient on the CPU, at sizes where it pays: computed in float32 with
    plain matmuls (``attention_reference``)."""
    (B, H, T, _), S = q_BHTd.shape, k_BKSd.shape[2]
    return (registry.computes_as(q_BHTd) == "cpu" and q_BHTd.dtype in (torch.bfloat16, torch.float16)
            and torch.is_grad_enabled() and (q_BHTd.requires_grad or k_BKSd.requires_grad or v_BKSd.requires_grad)
            and S <= F32_MAX_KEYS and B * H * T * S <= F32_MAX_SCORES)


def fused_kernel_heads(q_BHTd: Tensor, k_BKSd: Tensor, v_BKSd: Tensor, mask_B1TS: Tensor | None
                       ) -> tuple[Tensor, Tensor, bool]:
    """(k, v, enable_gqa) for SDPA. On an accelerator a mask with ``enable_gqa`` rules out every fused kernel
    (flash takes no mask, the memory-efficient and cuDNN ones no grouped heads) and SDPA builds the whole
    [B, H, T, S] scores: there the keys and values are repeated to the query heads (H/K times their bytes,
    far less than the scores), which keeps the memory-efficient kernel. The CPU's kernels take both."""
    H, K = q_BHTd.shape[1], k_BKSd.shape[1]
    if H == K or mask_B1TS is None or registry.computes_as(q_BHTd) == "cpu":
        return k_BKSd, v_BKSd, H != K
    return k_BKSd.repeat_interleave(H // K, 1), v_BKSd.repeat_interleave(H // K, 1), False


def _attention_f32(q_BHTd: Tensor, k_BKSd: Tensor, v_BKSd: Tensor, mask_B1TS: Tensor | None,
                   is_causal: bool, scale: float | None) -> Tensor:
    """``attention`` computed in float32 with plain matmuls, returned in q's dtype."""
    return _attention_matmul(q_BHTd.float(), k_BKSd.float(), v_BKSd.float(), mask_B1TS, is_causal,
                             scale).to(q_BHTd.dtype)


def _attention_matmul(q_BHTd: Tensor, k_BKSd: Tensor, v_BKSd: Tensor, mask_B1TS: Tensor | None,
                      is_causal: bool, scale: float | None) -> Tensor:
    """``attention`` as two batched matmuls with the query heads grouped by their key/value head
    ([B, K, H/K * T, d]); ``is_causal`` without a mask is SDPA's (top-left aligned: query t sees keys s <= t)."""
    B, H, T, d = q_BHTd.shape
    K, S = k_BKSd.shape[1], k_BKSd.shape[2]
    q = q_BHTd.reshape(B, K, H // K * T, d)
    scores = (q @ k_BKSd.transpose(-1, -2) * (d ** -0.5 if scale is None else scale)).view(B, H, T, S)
    if mask_B1TS is None and is_causal:
        mask_B1TS = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    if mask_B1TS is not None:
        scores = scores.masked_fill(~mask_B1TS, float("-inf"))
    return (torch.softmax(scores, -1).view(B, K, H // K * T, S) @ v_BKSd).view(B, H, T, v_BKSd.shape[-1])


class PrefixLayout:
    """The packed shared-prompt sequence of ``models/prefix.py``: N = P*Tp + B*R tokens, the P prompts'
    (left-padded, ``prompt_valid_PT``) first, then the B rows' (right-padded, ``resp_valid_BR``) responses,
    the rows of prompt p being the counts_P[p] after those of prompt p-1. Built once per forward: what
    each attention path derives from it (masks, the kernel's plan) is computed on first use and shared
    by the layers."""

    def __init__(self, prompt_valid_PT: Tensor, resp_valid_BR: Tensor, counts_P: Tensor):
        self.prompt_valid_PT, self.resp_valid_BR, self.counts_P = prompt_valid_PT, resp_valid_BR, counts_P
        self._derived: dict = {}

    def derived(self, key: str, make):
        """``make()``, computed on the first call for ``key`` and shared by the layers (a backend's plan)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def per_row(self, t_P: Tensor) -> Tensor:
        """A per-prompt tensor repeated for each of the prompt's rows."""
        return t_P.repeat_interleave(self.counts_P, 0, output_size=self.resp_valid_BR.shape[0])  # no host sync

    @functools.cached_property
    def masks(self) -> tuple[Tensor, Tensor]:
        """The prompts' causal mask [P, 1, Tp, Tp] and the responses' [B, 1, R, Tp + R] (prompt, then causal)."""
        (_, Tp), (_, R) = self.prompt_valid_PT.shape, self.resp_valid_BR.shape
        return (causal_padding_mask(self.prompt_valid_PT, 0, Tp),
                causal_padding_mask(torch.cat([self.per_row(self.prompt_valid_PT), self.resp_valid_BR], 1), Tp, R))


def prefix_attention(qk_NHd: Tensor, v_NKd: Tensor, n_q: int, layout: PrefixLayout) -> Tensor:
    """Attention of the packed shared-prompt sequence (``layout``). ``qk_NHd`` [N, n_q + K, d]: each token's
    query heads, then its key heads; ``v_NKd`` [N, K, d]. Returns [N, n_q, d].

    Prompt tokens attend causally among their prompt's valid tokens; response tokens to their prompt's
    valid tokens and causally to their row's; every token sees itself (``causal_padding_mask``)."""
    fused = registry.run("prefix_attention", qk_NHd.device, qk_NHd, v_NKd, n_q, layout)
    return fused if fused is not None else prefix_attention_reference(qk_NHd, v_NKd, n_q, layout)


@registry.reference("prefix_attention")
def prefix_attention_reference(qk_NHd: Tensor, v_NKd: Tensor, n_q: int, layout: PrefixLayout) -> Tensor:
    """Two attention calls, the prompts' keys and values repeated for each of their rows."""
    (P, Tp), (B, R) = layout.prompt_valid_PT.shape, layout.resp_valid_BR.shape
    Np, Nr = P * Tp, B * R

    def heads(t: Tensor, rows: int) -> Tensor:  # [rows * T, heads, d] -> [rows, heads, T, d]
        return t.unflatten(0, (rows, -1)).transpose(1, 2)

    q, k = qk_NHd.split([n_q, qk_NHd.shape[1] - n_q], dim=1)
    (q_p, q_r), (k_p, k_r), (v_p, v_r) = (t.split([Np, Nr]) for t in (q, k, v_NKd))
    k_p, v_p = heads(k_p, P), heads(v_p, P)
    mask_p, mask_r = layout.masks
    o_p = attention(heads(q_p, P), k_p, v_p, mask_p, is_causal=True)
    o_r = attention(heads(q_r, B), torch.cat([layout.per_row(k_p), heads(k_r, B)], 2),
                    torch.cat([layout.per_row(v_p), heads(v_r, B)], 2), mask_r, is_causal=True)
    return torch.cat([o_p.transpose(1, 2).reshape(Np, n_q, -1), o_r.transpose(1, 2).reshape(Nr, n_q, -1)])
