"""Every parameter's name and shape from a ``ModelConfig`` alone (``param_shapes``; a critic's,
``critic_shapes``), in transformers' names, so the sharding planner and the memory ledger work on
full-size models without allocating them; and which parameters stay float32 in a low-precision model
(``keeps_float32``)."""

from __future__ import annotations

import math

from typing import TYPE_CHECKING

from rlflow.models.lora import is_adapter

if TYPE_CHECKING:  # the config's own checks read the shapes (a LoRA config's targets)
    from rlflow.models.config import ModelConfig


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in forward order (embedding, layers, final norm, head)."""
    D, hd = cfg.hidden_size, cfg.head_dim
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, D)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (D,)
        a = p + "self_attn."
        if cfg.mla:
            if cfg.q_lora_rank:
                out[a + "q_a_proj.weight"] = (cfg.q_lora_rank, D)
                out[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
                out[a + "q_b_proj.weight"] = (H * cfg.qk_head_dim, cfg.q_lora_rank)
            else:
                out[a + "q_proj.weight"] = (H * cfg.qk_head_dim, D)
            out[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, D)
            out[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
            out[a + "kv_b_proj.weight"] = (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
            out[a + "o_proj.weight"] = (D, H * cfg.v_head_dim)
        else:
            out[a + "q_proj.weight"] = (H * hd, D)
            out[a + "k_proj.weight"] = (KV * hd, D)
            out[a + "v_proj.weight"] = (KV * hd, D)
            if cfg.attention_bias:
                out[a + "q_proj.bias"] = (H * hd,)
                out[a + "k_proj.bias"] = (KV * hd,)
                out[a + "v_proj.bias"] = (KV * hd,)
            out[a + "o_proj.weight"] = (D, H * hd)
            if cfg.qk_norm:
                out[a + "q_norm.weight"] = (hd,)
                out[a + "k_norm.weight"] = (hd,)
        out[p + "post_attention_layernorm.weight"] = (D,)
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            E, F = cfg.num_experts, cfg.moe_intermediate_size
            out[m + "gate.weight"] = (E, D)
            if cfg.scoring_func == "sigmoid":
                out[m + "gate.e_score_correction_bias"] = (E,)
            out.update(expert_shapes(m, E, F, D))
            if cfg.n_shared_experts:
                out.update(swiglu_shapes(m + "shared_experts.", F * cfg.n_shared_experts, D))
        else:
            out.update(swiglu_shapes(m, cfg.intermediate_size, D))
    out.update(head_shapes(cfg.vocab_size, D, cfg.tie_word_embeddings))
    return out


def keeps_float32(cfg: ModelConfig, name: str) -> bool:
    """Whether parameter ``name`` stays float32 whatever the model's dtype: DeepSeek-V3's router, its gate and
    its load-balancing bias, as transformers keeps them (``_keep_in_fp32_modules_strict``). In bfloat16 the
    bias's per-expert offsets (often below bf16's resolution at the sigmoid scores' scale) would round and
    change which experts are chosen. LoRA's adapters (``models/lora.py``) too, as peft keeps them: their small
    updates would round away in bfloat16."""
    return (cfg.model_type == "deepseek_v3" and name.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))
            or is_adapter(name))


# Shape tables shared by the model families (``models/deepseek.py`` too), in forward order.

def swiglu_shapes(prefix: str, F: int, D: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP of width F: gate, up, down projections."""
    return {prefix + "gate_proj.weight": (F, D), prefix + "up_proj.weight": (F, D), prefix + "down_proj.weight": (D, F)}


def expert_shapes(prefix: str, E: int, F: int, D: int) -> dict[str, tuple[int, ...]]:
    """E routed SwiGLU experts of width F, stacked (gate and up fused)."""
    return {prefix + "experts.gate_up_proj": (E, 2 * F, D), prefix + "experts.down_proj": (E, D, F)}


def head_shapes(vocab_size: int, D: int, tied: bool) -> dict[str, tuple[int, ...]]:
    """The final norm and, unless tied to the embedding, the output projection."""
    return {"model.norm.weight": (D,), **({} if tied else {LM_HEAD: (vocab_size, D)})}


LM_HEAD = "lm_head.weight"  # the output projection (absent when tied to the embedding)
VALUE_HEAD = "value_head.weight"  # a critic's one-output head (``algos/critic.py``)


def critic_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A critic's parameter shapes: the model's with the LM head replaced by the value head [1, D]."""
    out = {k: v for k, v in param_shapes(cfg).items() if k != LM_HEAD}
    out[VALUE_HEAD] = (1, cfg.hidden_size)
    return out


def num_params(cfg: ModelConfig) -> int:
    return sum(math.prod(s) for s in param_shapes(cfg).values())
