"""Rotary position embeddings (the "rotate half" form used by Qwen / Llama).

Legend: B batch, T tokens, H heads, d head dim.
"""

import torch
from torch import Tensor


def rope_cos_sin(positions_BT: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [B, T, d] for integer positions: angle = pos * theta^(-2i/d), duplicated over halves."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions_BT.device, dtype=torch.float32)
                                / head_dim))
    ang = positions_BT.float()[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_BHTd: Tensor, cos_BTd: Tensor, sin_BTd: Tensor) -> Tensor:
    cos, sin = cos_BTd[:, None], sin_BTd[:, None]
    x1, x2 = x_BHTd.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return x_BHTd * cos + rot * sin
