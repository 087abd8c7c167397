"""RMSNorm. Legend: ... any leading dims, D the normalized dim."""

import torch
from torch import Tensor

from rlflow.ops import registry


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """y = w * x / sqrt(mean(x^2) + eps), normalized in float32 and cast back (as transformers does).
    ``weight`` broadcasts against x's trailing dims (e.g. [D], or [heads, d] for per-head norms)."""
    fused = registry.run("rmsnorm", x.device, x, weight, eps)
    return fused if fused is not None else rmsnorm_reference(x, weight, eps)


@registry.reference("rmsnorm")
def rmsnorm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x if x.dtype == torch.float32 else x.float()
    y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return weight * (y if x.dtype == torch.float32 else y.to(x.dtype))
