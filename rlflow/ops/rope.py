"""Rotary position embeddings (the "rotate half" form used by Qwen / Llama).

Legend: B batch, T tokens, H heads, d head dim; ... any leading dims.
"""

import torch
from torch import Tensor

from rlflow.ops import registry
from rlflow.ops.norm import rmsnorm


def rope_cos_sin(positions_BT: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [B, T, d] for integer positions: angle = pos * theta^(-2i/d), duplicated over halves, with
    the sign of rotate-half folded into sin's first half (what ``apply_rope`` expects)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions_BT.device, dtype=torch.float32)
                                / head_dim))
    ang = positions_BT.float()[..., None] * inv_freq  # [B, T, d/2]
    cos, sin = ang.cos(), ang.sin()
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)


def apply_rope(x_THd: Tensor, cos_Td: Tensor, sin_Td: Tensor) -> Tensor:
    """x cos + rotate_half(x) sin, with rotate_half(x) = [-x2, x1] = roll(x, d/2) * [-1, 1] (sign in sin).
    Token-major: x is [..., T, heads, d] and cos/sin [..., T, d] (the same angles for every head)."""
    fused = registry.run("apply_rope", x_THd.device, x_THd, cos_Td, sin_Td)
    return fused if fused is not None else apply_rope_reference(x_THd, cos_Td, sin_Td)


@registry.reference("apply_rope")
def apply_rope_reference(x_THd: Tensor, cos_Td: Tensor, sin_Td: Tensor) -> Tensor:
    cos, sin = cos_Td.unsqueeze(-2), sin_Td.unsqueeze(-2)
    return x_THd * cos + x_THd.roll(x_THd.shape[-1] // 2, -1) * sin


def qk_norm_rope(qkv_THd: Tensor, norm_Hd: Tensor | None, cos_Td: Tensor, sin_Td: Tensor, n_qk: int,
                 eps: float) -> tuple[Tensor, Tensor]:
    """From the fused q/k/v projection's heads [..., T, n_qk + n_v, d] (q and k heads first): the q/k heads
    [..., T, n_qk, d] per-head RMSNorm'ed with ``norm_Hd`` [n_qk, d] (None: not normed, as Qwen2) and
    rotated, and the v heads [..., T, n_v, d]."""
    fused = registry.run("qk_norm_rope", qkv_THd.device, qkv_THd, norm_Hd, cos_Td, sin_Td, n_qk, eps)
    return fused if fused is not None else qk_norm_rope_reference(qkv_THd, norm_Hd, cos_Td, sin_Td, n_qk, eps)


@registry.reference("qk_norm_rope")
def qk_norm_rope_reference(qkv_THd: Tensor, norm_Hd: Tensor | None, cos_Td: Tensor, sin_Td: Tensor, n_qk: int,
                           eps: float) -> tuple[Tensor, Tensor]:
    qk, v = qkv_THd.split([n_qk, qkv_THd.shape[-2] - n_qk], dim=-2)  # split: the backward is one cat
    if norm_Hd is not None:
        qk = rmsnorm(qk, norm_Hd, eps)
    return apply_rope(qk, cos_Td, sin_Td), v
