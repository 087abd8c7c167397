"""DeepSeek-V3 / R1 parameter shapes (the forward pass is not written yet).

``param_shapes(cfg)`` has the same contract as ``rlflow.models.config.param_shapes``: every
parameter's transformers name and shape, in forward order. Attention is MLA: q is low-rank
(``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``), k/v share one compressed latent
(``kv_a_proj_with_mqa`` gives the latent and the shared rope key, ``kv_a_layernorm``, ``kv_b_proj``).
The first ``first_k_dense_replace`` layers have a dense MLP; the others route to ``n_routed_experts``
experts (stacked as ``mlp.experts.gate_up_proj`` [E, 2F, D] and ``mlp.experts.down_proj`` [E, D, F],
as for Qwen3-MoE) plus ``n_shared_experts`` shared experts of width ``F * n_shared_experts``. The
multi-token-prediction layer of the checkpoint (layer 61) is not part of the model transformers
loads, and is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.models.config import count, expert_shapes, head_shapes, swiglu_shapes


@dataclass(frozen=True, kw_only=True)
class DeepseekConfig:
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432  # dense MLP width (first_k_dense_replace layers)
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    tie_word_embeddings: bool = False
    model_type: str = "deepseek_v3"

    def __post_init__(self):
        for k, v in self.__dict__.items():
            if isinstance(v, int) and not isinstance(v, bool) and v < 0:
                raise ValueError(f"DeepseekConfig.{k}={v} must be >= 0")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"DeepseekConfig.num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, n_routed_experts={self.n_routed_experts}]")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


def param_shapes(cfg: DeepseekConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in forward order (embedding, layers, final norm, head)."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, D)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (D,)
        a = p + "self_attn."
        out[a + "q_a_proj.weight"] = (cfg.q_lora_rank, D)
        out[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        out[a + "q_b_proj.weight"] = (H * cfg.qk_head_dim, cfg.q_lora_rank)
        out[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, D)
        out[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        out[a + "kv_b_proj.weight"] = (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        out[a + "o_proj.weight"] = (D, H * cfg.v_head_dim)
        out[p + "post_attention_layernorm.weight"] = (D,)
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            E, F = cfg.n_routed_experts, cfg.moe_intermediate_size
            out[m + "gate.weight"] = (E, D)
            out[m + "gate.e_score_correction_bias"] = (E,)
            out.update(expert_shapes(m, E, F, D))
            out.update(swiglu_shapes(m + "shared_experts.", F * cfg.n_shared_experts, D))
        else:
            out.update(swiglu_shapes(m, cfg.intermediate_size, D))
    out.update(head_shapes(cfg.vocab_size, D, cfg.tie_word_embeddings))
    return out


def num_params(cfg: DeepseekConfig) -> int:
    return count(param_shapes(cfg))


PRESETS: dict[str, DeepseekConfig] = {
    "deepseek-r1-671b": DeepseekConfig(),
    # Same structure, small enough for tests: 1 dense layer + 3 MoE layers.
    "deepseek-tiny": DeepseekConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=8,
        qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1),
}


def get_config(name: str) -> DeepseekConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown DeepSeek model name {name!r}; known: {sorted(PRESETS)}") from None
