"""Ascend NPU backend: torch_npu's fused operators. NOT RUN HERE: no NPU (nor torch_npu) was available
where this was written; tests/test_ops_registry.py checks only the wiring (which torch_npu function each
op reaches, with which arguments) against a stand-in module, nothing about the device's numerics (the
stand-in's grouped matmul computes what the documentation says, so the experts' gradients are checked
against our reading of it).

torch_npu is imported on the first call of an entry, only where it is installed; without it every
entry returns None and the ops run their torch references. Signatures as torch_npu's documentation
(Ascend "ptaoplist" API pages) gives them:

- ``npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``
- ``npu_rotary_mul(x, r1, r2)``: x * r1 + rotate_half(x) * r2, x [B, S, N, D], r1/r2 [B, S, 1, D]
- ``npu_fusion_attention(query, key, value, head_num, input_layout, ..., atten_mask, scale, ...)``:
  returns a tuple whose first element is the attention; atten_mask True where a query may NOT attend
- ``npu_moe_gating_top_k_softmax(x, finished=None, k=1) -> (y, expert_idx int32, row_idx int32)``
- ``npu_moe_init_routing(x, row_idx, expert_idx, active_num) -> (expanded_x, expanded_row_idx,
  expanded_expert_idx)``
- ``npu_grouped_matmul(x: list, weight: list, *, group_list, split_item, group_type, ...) -> list``
- ``npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
  export_for_source_row) -> Tensor``

The MoE routing operators are documented for inference only: under autograd, ``moe_experts`` sorts the
tokens in torch and runs ``npu_grouped_matmul`` in an autograd function whose backward is two more of them
(the input's gradient in the same row groups; the weights' grouped along the contraction, ``group_type=2``).
``prefix_attention``'s NPU entry is the CUDA backend's torch path (no per-row copies).
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from rlflow.ops import registry
from rlflow.ops.backends import cuda  # also registers the shared prefix_attention entry for npu


def _npu():
    """torch_npu, or None where it is not installed."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        return None


def _needs_grad(*ts: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


@registry.fused("rmsnorm", "npu")
def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    npu = _npu()
    if npu is None or weight.dim() > x.dim() or tuple(x.shape[-weight.dim():]) != tuple(weight.shape):
        return None
    return npu.npu_rms_norm(x, weight, epsilon=eps)[0]


@registry.fused("apply_rope", "npu")
def apply_rope(x_THd: Tensor, cos_Td: Tensor, sin_Td: Tensor) -> Tensor | None:
    npu = _npu()
    if npu is None or x_THd.dim() < 3:
        return None
    *lead, T, H, d = x_THd.shape
    h = d // 2
    # ours folds rotate-half's sign into sin's first half ([-sin, sin]); npu_rotary_mul takes [sin, sin]
    sin_plain = torch.cat([-sin_Td[..., :h], sin_Td[..., h:]], -1)
    x4 = x_THd.reshape(-1, T, H, d)
    r1, r2 = (t.reshape(-1, T, 1, d) for t in (cos_Td, sin_plain))
    return npu.npu_rotary_mul(x4, r1, r2).view(x_THd.shape)


@registry.fused("attention", "npu")
def attention(q_BHTd: Tensor, k_BKSd: Tensor, v_BKSd: Tensor, mask_B1TS: Tensor | None, *,
              is_causal: bool = False, scale: float | None = None) -> Tensor | None:
    npu = _npu()
    B, H, T, d = q_BHTd.shape
    dv = v_BKSd.shape[-1]
    if npu is None or dv > d:
        return None
    if dv < d:  # MLA's narrower values (DeepSeek: 128 against 192) padded with zeros to the queries' width, as
        # MindSpeed does for the fused kernel: the output's extra columns are zeros, sliced off
        v_BKSd = torch.nn.functional.pad(v_BKSd, (0, d - dv))
    S = k_BKSd.shape[2]
    if mask_B1TS is not None:
        masked = ~mask_B1TS
    elif is_causal:  # SDPA's top-left aligned causal mask
        masked = torch.ones(T, S, dtype=torch.bool, device=q_BHTd.device).triu(1)
    else:
        masked = None
    scale = d ** -0.5 if scale is None else scale
    # views of [B, S, N, d] projections, each token's heads side by side (training, prefill): given as they lie
    # (BSND), the kernel's output comes back in that layout, which the output projection reads as it is; BNSD would
    # come back [B, N, S, d] and be copied for that projection (a [T, D] activation more a layer, kept for the
    # backward). A KV cache's keys and values [B, N, S, d] go as BNSD
    bsnd = all(t.stride(3) == 1 and t.stride(1) == t.shape[3] for t in (q_BHTd, k_BKSd, v_BKSd))
    qkv = [t.transpose(1, 2) if bsnd else t for t in (q_BHTd, k_BKSd, v_BKSd)]
    out = npu.npu_fusion_attention(*qkv, H, "BSND" if bsnd else "BNSD", atten_mask=masked, scale=scale,
                                   keep_prob=1.0)[0]
    out = out.transpose(1, 2) if bsnd else out
    return out if dv == d else out[..., :dv]


@registry.fused("route_logits", "npu")
def route(logits_NE: Tensor, k: int, norm: bool, with_aux: bool) -> tuple[Tensor, Tensor] | None:
    npu = _npu()
    if npu is None or with_aux or _needs_grad(logits_NE):
        return None
    w, idx, _row_idx = npu.npu_moe_gating_top_k_softmax(logits_NE.float(), None, k=k)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    return w, idx.long()


class _GroupedMatmul(torch.autograd.Function):
    """rows [M, K] in groups (each group's end, cumulative: ``ends`` [E]) times weights [E, K, N] -> [M, N]."""

    @staticmethod
    def forward(ctx, a_MK: Tensor, b_EKN: Tensor, ends_E: Tensor) -> Tensor:
        ctx.save_for_backward(a_MK, b_EKN, ends_E)
        return _npu().npu_grouped_matmul([a_MK], [b_EKN], group_list=ends_E, split_item=2, group_type=0)[0]

    @staticmethod
    def backward(ctx, dy_MN: Tensor):
        a_MK, b_EKN, ends_E = ctx.saved_tensors
        npu = _npu()
        da = npu.npu_grouped_matmul([dy_MN], [b_EKN.transpose(1, 2)], group_list=ends_E, split_item=2,
                                    group_type=0)[0]
        db = npu.npu_grouped_matmul([a_MK.t()], [dy_MN], group_list=ends_E, split_item=3, group_type=2)[0]
        return da, db.view(b_EKN.shape), None


@registry.fused("moe_experts", "npu")
def moe_experts(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF, prepared):
    npu = _npu()
    if npu is None:
        return None
    if _needs_grad(x_ND, w_NK, gate_up_E2FD, down_EDF):  # half precision: the grouped matmul's training dtypes
        if x_ND.dtype not in (torch.bfloat16, torch.float16):
            return None
        return cuda.grouped(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF, grouped_mm=_GroupedMatmul.apply)
    N, K = idx_NK.shape
    E = gate_up_E2FD.shape[0]
    # the grouped matmul's layout (x @ w: gate_up [E, D, 2F], down [E, F, D]) as transposed views, which the kernel
    # takes (MindSpeed-MM's GMM passes one in its backward, as ``_GroupedMatmul`` does): a contiguous copy would
    # hold every expert's weights twice through a generation (docs/dryrun.md)
    gu_t, dn_t = gate_up_E2FD.transpose(1, 2), down_EDF.transpose(1, 2)
    idx32 = idx_NK.to(torch.int32)
    row_idx = torch.arange(N * K, dtype=torch.int32, device=x_ND.device).view(K, N).t().contiguous()
    xs, expanded_row_idx, expanded_expert_idx = npu.npu_moe_init_routing(x_ND, row_idx, idx32, N)
    ends = torch.zeros(E, dtype=torch.int64, device=x_ND.device).index_add_(
        0, idx_NK.reshape(-1), torch.ones(N * K, dtype=torch.int64, device=x_ND.device)).cumsum(0)
    gu = npu.npu_grouped_matmul([xs], [gu_t], group_list=ends, split_item=2, group_type=0)[0]
    g, u = gu.chunk(2, dim=-1)
    ys = npu.npu_grouped_matmul([torch.nn.functional.silu(g) * u], [dn_t], group_list=ends, split_item=2,
                                group_type=0)[0]
    return npu.npu_moe_finalize_routing(ys, None, None, None, w_NK.to(ys.dtype), expanded_row_idx, idx32)
