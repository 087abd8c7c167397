"""Rotary position embeddings (the "rotate half" form used by Qwen / Llama / DeepSeek), with the frequency
scalings transformers implements for these families (``RopeScaling``: linear, YaRN).

Legend: B batch, T tokens, H heads, d head dim; ... any leading dims.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlflow.ops import registry
from rlflow.ops.norm import rmsnorm


@dataclass(frozen=True)
class RopeScaling:
    """A long-context frequency scaling, as transformers' ``rope_parameters`` name it (``rope_type``
    'linear', 'yarn' or 'llama3'; the fields keep transformers' names and defaults)."""

    kind: str
    factor: float
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None

    # each kind's fields in config.json's rope settings, beside rope_type and factor
    FIELDS = {"linear": (),
              "yarn": ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                       "attention_factor", "truncate"),
              "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}
    KINDS = tuple(FIELDS)

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"rope scaling rope_type={self.kind!r} is not implemented by rlflow; known: {self.KINDS}")
        if not self.factor or self.factor <= 0:
            raise ValueError(f"rope scaling factor={self.factor!r} must be > 0")
        if "original_max_position_embeddings" in self.FIELDS[self.kind] and not self.original_max_position_embeddings:
            raise ValueError(f"{self.kind} rope scaling needs original_max_position_embeddings")
        if self.kind == "llama3" and not (0 < (self.low_freq_factor or 0) < (self.high_freq_factor or 0)):
            raise ValueError(f"llama3 rope scaling needs 0 < low_freq_factor={self.low_freq_factor} < "
                             f"high_freq_factor={self.high_freq_factor}")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 when the factor does not extend)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                     device: torch.device | str | None = None) -> tuple[Tensor, float]:
    """(inv_freq [d/2] in float32 on ``device``, the factor cos/sin are scaled by), as transformers'
    ``ROPE_INIT_FUNCTIONS`` compute them: default theta^(-2i/d); linear divides by the factor; YaRN
    interpolates the low frequencies, keeps the high ones and ramps between them; llama3 divides the
    wavelengths longer than original / low_freq_factor by the factor, keeps those shorter than
    original / high_freq_factor and blends in between. Built on the positions'
    device: every forward calls it, a decode step included, and a host tensor would be copied over."""
    exps = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    if scaling is None:
        return 1.0 / (theta ** exps), 1.0
    if scaling.kind == "linear":
        return 1.0 / (theta ** exps) / scaling.factor, 1.0
    s = scaling
    if s.kind == "llama3":
        inv_freq = 1.0 / (theta ** exps)
        old = s.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        slow = torch.where(wavelen > old / s.low_freq_factor, inv_freq / s.factor, inv_freq)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * slow / s.factor + smooth * slow
        medium = (wavelen >= old / s.high_freq_factor) & (wavelen <= old / s.low_freq_factor)
        return torch.where(medium, blended, slow), 1.0
    att = s.attention_factor
    if att is None:
        att = (yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
               if s.mscale and s.mscale_all_dim else yarn_mscale(s.factor))

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** exps
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(att)


def rope_cos_sin(positions_BT: Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: RopeScaling | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin [B, T, d] for integer positions: angle = pos * inv_freq_i (``rope_frequencies``), duplicated
    over halves, with the sign of rotate-half folded into sin's first half (what ``apply_rope`` expects)."""
    inv_freq, att = rope_frequencies(head_dim, theta, scaling, positions_BT.device)
    ang = positions_BT.float()[..., None] * inv_freq  # [B, T, d/2]
    cos, sin = ang.cos(), ang.sin()
    if att != 1.0:
        cos, sin = cos * att, sin * att
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)


def deinterleave(x: Tensor) -> Tensor:
    """[x0, x2, x4, ..., x1, x3, ...]: DeepSeek's rotary dims come in adjacent pairs (x0, x1), ...; reordered
    so, rotate-half rotates the same pairs (q and k alike, so their dot products are unchanged)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], -1)


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
