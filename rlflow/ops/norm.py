"""RMSNorm. Legend: ... any leading dims, D the normalized dim."""

import torch
from torch import Tensor


def rmsnorm(x: Tensor, weight_D: Tensor, eps: float) -> Tensor:
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 and cast back (as transformers does)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight_D * x32.to(dtype)
