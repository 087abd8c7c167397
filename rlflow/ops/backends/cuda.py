"""CUDA backend: plain torch paths that avoid host synchronization and per-row copies.

- ``moe_experts``: the grouped expert path without a host sync per layer: torch's grouped GEMM
  (``F.grouped_mm``, jagged groups by device-side offsets) where this build has it for the dtype
  (bfloat16 on SM >= 80), else a sort-and-index path with static shapes (each expert's tokens scattered
  into a [E, C, D] buffer, C = a chunk's tokens, and batched matmuls). Counts come from index_add, not
  bincount (whose CUDA kernel reads the maximum on the host). Few tokens on small experts keep the
  reference's dense path, which has no sync either.
- ``rmsnorm``: torch's fused RMSNorm (``aten._fused_rms_norm``: CUDA builds have its kernel and backward) for a
  weight over the last dim, where the reference issues six kernels (casts, square, mean, rsqrt, two products): a
  decode step runs a few hundred norms. It rounds once, after the weight's product, where the reference
  rounds the normalized row before it: within a unit of the last place of the reference in half precision.
- ``prefix_attention`` (also the NPU's): the shared-prompt attention without copying a prompt's keys and
  values for each of its rows: the rows' queries are grouped by prompt ([P, rows, ...]) and scored
  against the prompt's keys once, their own keys separately, one softmax over both.

Plain torch, so tests run them on CPU tensors (tests/test_ops_registry.py) against the references.
Not timed here (no GPU was available when they were written).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlflow.ops import moe, registry
from rlflow.ops.attention import attention

CHUNK_BYTES = 256 * 2**20  # the sort-and-index path's [E, C, max(2F, D)] buffers, per chunk of tokens


def grouped_mm_ok(x: Tensor, down_EDF: Tensor) -> bool:
    """torch's grouped GEMM on CUDA: on SM >= 80, for the operands ``grouped_mm_takes``."""
    return (x.device.type == "cuda" and grouped_mm_takes(x, down_EDF)
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


def grouped_mm_takes(x: Tensor, down_EDF: Tensor) -> bool:
    """The operands CUDA's grouped GEMM takes: bfloat16, rows of D and F elements a multiple of 16 bytes."""
    _, D, Fd = down_EDF.shape
    return (hasattr(F, "grouped_mm") and x.dtype == torch.bfloat16
            and (D * x.element_size()) % 16 == 0 and (Fd * x.element_size()) % 16 == 0)


@registry.fused("moe_experts", "cuda")
def moe_experts(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF, prepared):
    if moe.dense_fits(idx_NK, gate_up_E2FD, down_EDF):
        return None  # the reference's dense path: no sync
    return moe_experts_nosync(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF,
                              grouped_mm=grouped_mm_ok(x_ND, down_EDF))


def moe_experts_nosync(x_ND: Tensor, w_NK: Tensor, idx_NK: Tensor, gate_up_E2FD: Tensor, down_EDF: Tensor, *,
                       grouped_mm: bool, chunk_bytes: int = CHUNK_BYTES) -> Tensor:
    """``ops.moe_experts`` without reading anything on the host. ``grouped_mm``: one grouped GEMM per
    projection; else the sort-and-index path (requires a token's K experts to be distinct, as top-k
    routing gives), E/K times the routed FLOPs, in chunks of tokens that bound its buffers."""
    N, K = idx_NK.shape
    E, F2, D = gate_up_E2FD.shape
    if grouped_mm:
        return grouped(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF)
    C = max(1, chunk_bytes // max(1, E * max(F2, D) * x_ND.element_size()))
    if N <= C:
        return _sorted_padded(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF)
    return torch.cat([_sorted_padded(x_ND[s:s + C], w_NK[s:s + C], idx_NK[s:s + C], gate_up_E2FD, down_EDF)
                      for s in range(0, N, C)])


@registry.fused("rmsnorm", "cuda")
def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    if weight.dim() != 1 or x.shape[-1:] != weight.shape or x.dtype != weight.dtype:
        return None  # a weight over more dims ([heads, d]) normalizes the last alone: the reference's broadcast
    return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]


def _sort(idx_NK: Tensor, E: int):
    """(order, sorted experts, tokens, counts [E]) of the (token, slot) pairs, device-side only."""
    K = idx_NK.shape[1]
    flat = idx_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    return order, flat.index_select(0, order), order // K, counts


def _torch_grouped_mm(a_MK: Tensor, b_EKN: Tensor, ends_E: Tensor) -> Tensor:
    return F.grouped_mm(a_MK, b_EKN, offs=ends_E.to(torch.int32))


def grouped(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF, grouped_mm=_torch_grouped_mm):
    """The (token, slot) pairs sorted by expert on the device, each projection one grouped GEMM
    ``grouped_mm(rows [M, K] in groups, weights [E, K, N], each group's end [E]) -> [M, N]`` (torch's;
    the NPU backend passes its own)."""
    order, _, tok, counts = _sort(idx_NK, gate_up_E2FD.shape[0])
    ends = counts.cumsum(0)
    xs = x_ND.index_select(0, tok)
    g, u = grouped_mm(xs, gate_up_E2FD.transpose(1, 2), ends).chunk(2, dim=-1)
    ys = grouped_mm(F.silu(g) * u, down_EDF.transpose(1, 2), ends)
    w_sorted = w_NK.reshape(-1).index_select(0, order)
    return torch.zeros_like(x_ND).index_add_(0, tok, ys * w_sorted[:, None])


def _sorted_padded(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF):
    """Pair j (sorted by expert) goes to row pos_j of its expert's block of C = N rows ([E * N, D]); every
    expert runs on its block (batched matmuls, static shapes); each pair's row comes back weighted."""
    N, K = idx_NK.shape
    E, F2, D = gate_up_E2FD.shape
    order, e_sorted, tok, counts = _sort(idx_NK, E)
    starts = counts.cumsum(0) - counts
    pos = torch.arange(N * K, device=x_ND.device) - starts.index_select(0, e_sorted)
    slot = e_sorted * N + pos
    xb = x_ND.new_zeros(E * N, D).index_copy(0, slot, x_ND.index_select(0, tok)).view(E, N, D)
    g, u = torch.bmm(xb, gate_up_E2FD.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, F] each
    ys = torch.bmm(F.silu(g) * u, down_EDF.transpose(1, 2)).view(E * N, D).index_select(0, slot)
    w_sorted = w_NK.reshape(-1).index_select(0, order)
    return torch.zeros_like(x_ND).index_add_(0, tok, ys * w_sorted[:, None])


def _prompt_slots(layout) -> tuple[Tensor | None, int]:
    """(slot_B: row b's slot p * G + its rank among prompt p's rows, or None when the rows already are
    [P, G] in order; G the most rows of a prompt). One host read of the counts per forward."""
    counts = [int(c) for c in layout.counts_P.tolist()]
    G = max(counts, default=0)
    if all(c == G for c in counts):
        return None, G
    slot = [p * G + r for p, c in enumerate(counts) for r in range(c)]
    return torch.tensor(slot, dtype=torch.int64, device=layout.resp_valid_BR.device), G


@registry.fused("prefix_attention", "cuda")
@registry.fused("prefix_attention", "npu")
def prefix_attention(qk_NHd: Tensor, v_NKd: Tensor, n_q: int, layout) -> Tensor | None:
    (P, Tp), (B, R) = layout.prompt_valid_PT.shape, layout.resp_valid_BR.shape
    N, HK, d = qk_NHd.shape
    K = HK - n_q
    if B == 0 or P == 0 or K < 1 or n_q % K or layout.counts_P.shape != (P,):
        return None
    Gq = n_q // K  # query heads per key/value head
    Np, Nr = P * Tp, B * R
    slot_B, G = layout.derived("shared_prompt_slots", lambda: _prompt_slots(layout))

    def heads(t: Tensor, rows: int) -> Tensor:  # [rows * T, heads, d] -> [rows, heads, T, d]
        return t.unflatten(0, (rows, -1)).transpose(1, 2)

    q, k = qk_NHd.split([n_q, K], dim=1)
    (q_p, q_r), (k_p, k_r), (v_p, v_r) = (t.split([Np, Nr]) for t in (q, k, v_NKd))
    mask_p, mask_r = layout.masks
    o_p = attention(heads(q_p, P), heads(k_p, P), heads(v_p, P), mask_p, is_causal=True)

    def to_slots(t: Tensor) -> Tensor:  # [B, ...] -> [P * G, ...] (padding slots zero)
        return t if slot_B is None else t.new_zeros((P * G, *t.shape[1:])).index_copy(0, slot_B, t)

    def to_rows(t: Tensor) -> Tensor:  # [P * G, ...] -> [B, ...]
        return t if slot_B is None else t.index_select(0, slot_B)

    def by_prompt(t: Tensor) -> Tensor:  # [P * G, R, K, Gq, X] -> [P, K, G * R * Gq, X]
        return t.unflatten(0, (P, G)).permute(0, 3, 1, 2, 4, 5).reshape(P, K, G * R * Gq, t.shape[-1])

    def by_row(t: Tensor) -> Tensor:  # the inverse: [P, K, G * R * Gq, X] -> [P * G, R, K, Gq, X]
        return t.view(P, K, G, R, Gq, t.shape[-1]).permute(0, 2, 3, 1, 4, 5).reshape(P * G, R, K, Gq, t.shape[-1])

    scale = d ** -0.5
    qr = q_r.view(B, R, K, Gq, d)
    kp, vp = k_p.view(P, Tp, K, d).transpose(1, 2), v_p.view(P, Tp, K, d).transpose(1, 2)  # [P, K, Tp, d] views
    s_prompt = to_rows(by_row(by_prompt(to_slots(qr)) @ kp.transpose(-1, -2)))  # [B, R, K, Gq, Tp]
    s_own = torch.einsum("brkgd,bskd->brkgs", qr, k_r.view(B, R, K, d))  # [B, R, K, Gq, R]
    s = torch.cat([s_prompt, s_own], -1)
    s = s.to(torch.promote_types(s.dtype, torch.float32)) * scale  # softmax in float32 at least
    s = s.masked_fill(~mask_r[:, 0, :, None, None, :], float("-inf"))  # mask [B, 1, R, Tp + R]
    p = torch.softmax(s, -1).to(v_NKd.dtype)
    p_prompt, p_own = p.split([Tp, R], -1)
    o_r = (to_rows(by_row(by_prompt(to_slots(p_prompt)) @ vp))
           + torch.einsum("brkgs,bskd->brkgd", p_own, v_r.view(B, R, K, d)))
    return torch.cat([o_p.transpose(1, 2).reshape(Np, n_q, d), o_r.reshape(Nr, n_q, d)])
