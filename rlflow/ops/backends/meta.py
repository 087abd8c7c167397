"""Meta tensors (dry runs, ``rlflow/dryrun/``): the computation an accelerator's kernels do, in shapes and memory.

On meta tensors the references take the paths torch picks for a device it knows nothing of, which are not an
accelerator's: SDPA's math path builds the whole [B, H, T, S] scores and keeps them for the backward (2.5 TB
for a DeepSeek-V3 micro-batch of 2 x 5120 tokens), where a GPU's memory-efficient kernel (the one SDPA runs
with a mask) keeps the output and a log-sum-exp per query. These entries run those kernels' own aten ops,
whose meta implementations give the outputs, and the tensors autograd saves, an accelerator's shapes. The
experts take CUDA's grouped GEMM, one per projection, where a loop over them would issue a few kernels per
expert (48 layers x 128 experts in a Qwen3-30B-A3B decode step); RMSNorm CUDA's fused kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlflow.ops import moe, registry
from rlflow.ops.backends import cuda
from rlflow.ops.attention import cpu_takes_f32, fused_kernel_heads


@registry.fused("attention", "meta")
def attention(q_BHTd: Tensor, k_BKSd: Tensor, v_BKSd: Tensor, mask_B1TS: Tensor | None, *, is_causal: bool = False,
              scale: float | None = None) -> Tensor | None:
    """SDPA's memory-efficient kernel, as CUDA's SDPA runs it for a mask or causal attention: the keys and
    values repeated to the query heads where they are grouped (``fused_kernel_heads``), a boolean mask as an
    additive bias of the query's dtype. A decode step (one query) takes the reference's matmuls, as on a GPU."""
    B, H, T, _ = q_BHTd.shape
    if T == 1 and mask_B1TS is not None:
        return None
    if registry.computes_as(q_BHTd) == "cpu":
        return _cpu(q_BHTd, k_BKSd, v_BKSd, mask_B1TS, is_causal, scale)
    k, v, gqa = fused_kernel_heads(q_BHTd, k_BKSd, v_BKSd, mask_B1TS)
    if gqa:  # grouped heads without a mask: flash attention takes them as they are; the same memory
        k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
    bias = None
    if mask_B1TS is not None:
        bias = torch.zeros(mask_B1TS.shape, dtype=q_BHTd.dtype, device=q_BHTd.device).masked_fill_(
            ~mask_B1TS, float("-inf")).expand(B, H, T, k.shape[2])
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHTd, k, v))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q_BHTd, k, v, bias, grad, 0.0, is_causal and mask_B1TS is None, scale=scale)[0]


def _cpu(q_BHTd: Tensor, k_BKSd: Tensor, v_BKSd: Tensor, mask_B1TS: Tensor | None, is_causal: bool,
         scale: float | None) -> Tensor | None:
    """Meta tensors posing as the CPU's (``registry.posing``): the reference's float32 matmuls where it takes
    them (None: the reference runs), else the CPU's SDPA kernel, flash attention, the keys and values repeated
    to the query heads where they are grouped."""
    if cpu_takes_f32(q_BHTd, k_BKSd, v_BKSd):
        return None
    H, K = q_BHTd.shape[1], k_BKSd.shape[1]
    k, v = (k_BKSd, v_BKSd) if H == K else (k_BKSd.repeat_interleave(H // K, 1), v_BKSd.repeat_interleave(H // K, 1))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_BHTd, k, v, 0.0, is_causal and mask_B1TS is None, attn_mask=mask_B1TS, scale=scale)[0]


def _posed(name: str, x: Tensor, *args):
    """Meta tensors posing as another kind than meta (``registry.posing``): that kind's entry for op ``name`` (None:
    it has none, the reference runs)."""
    entry = registry.lookup(name, registry.computes_as(x))
    return None if entry is None else entry(x, *args)


@registry.fused("rmsnorm", "meta")
def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """CUDA's entry: torch's fused RMSNorm."""
    if registry.computes_as(x) != "meta":
        return _posed("rmsnorm", x, weight, eps)
    return cuda.rmsnorm(x, weight, eps)


@registry.fused("moe_experts", "meta")
def moe_experts(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF, prepared):
    """CUDA's entry as a GPU of SM >= 80 runs it (``cuda.grouped_mm_ok``): the grouped GEMM where it takes the
    operands, the sort-and-index path elsewhere, the dense path for few tokens on small experts."""
    if registry.computes_as(x_ND) != "meta":
        return _posed("moe_experts", x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF, prepared)
    if moe.dense_fits(idx_NK, gate_up_E2FD, down_EDF):
        return None
    return cuda.moe_experts_nosync(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF,
                                   grouped_mm=cuda.grouped_mm_takes(x_ND, down_EDF))
