"""Numeric kernels with a shape legend (see each module). The plain torch path is the reference;
fused implementations per device kind are chosen in this package only (``registry``, ``backends/``,
docs/ops.md)."""

from rlflow.ops.attention import PrefixLayout, attention, causal_padding_mask, prefix_attention
from rlflow.ops.logprobs import at_mask, head_linear, token_logprobs
from rlflow.ops.moe import moe_experts, prepare_experts, replay_routes, route, route_grouped
from rlflow.ops.norm import rmsnorm
from rlflow.ops.rope import RopeScaling, apply_rope, deinterleave, qk_norm_rope, rope_cos_sin, yarn_mscale
from rlflow.ops.sampling import counter_keys, counter_noise, exponential_noise, sample
from rlflow.ops import registry as _registry

_registry.import_backends()

__all__ = ["attention", "causal_padding_mask", "PrefixLayout", "prefix_attention", "token_logprobs", "head_linear",
           "at_mask", "moe_experts", "prepare_experts", "replay_routes", "route", "route_grouped", "rmsnorm", "RopeScaling", "apply_rope", "deinterleave", "qk_norm_rope", "rope_cos_sin", "yarn_mscale", "exponential_noise", "counter_keys", "counter_noise", "sample"]
