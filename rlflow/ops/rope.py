"""Rotary position embeddings (the "rotate half" form used by Qwen / Llama).

Legend: B batch, T tokens, H heads, d head dim; ... any leading dims.
"""

import torch
from torch import Tensor


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
    cos, sin = cos_Td.unsqueeze(-2), sin_Td.unsqueeze(-2)
    return x_THd * cos + x_THd.roll(x_THd.shape[-1] // 2, -1) * sin
