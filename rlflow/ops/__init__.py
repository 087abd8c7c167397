"""Numeric kernels with a shape legend (see each module). The plain torch path is the reference;
fused accelerator kernels, where added, are chosen in this package only."""

from rlflow.ops.attention import PrefixLayout, attention, causal_padding_mask, prefix_attention
from rlflow.ops.logprobs import at_mask, token_logprobs
from rlflow.ops.moe import moe_experts, prepare_experts, route
from rlflow.ops.norm import rmsnorm
from rlflow.ops.rope import apply_rope, qk_norm_rope, rope_cos_sin
from rlflow.ops.sampling import exponential_noise, sample

__all__ = ["attention", "causal_padding_mask", "PrefixLayout", "prefix_attention", "token_logprobs", "at_mask",
           "moe_experts", "prepare_experts", "route", "rmsnorm", "apply_rope", "qk_norm_rope", "rope_cos_sin", "exponential_noise", "sample"]
