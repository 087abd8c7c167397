"""Model configuration for the Qwen family (Qwen2 / Qwen2.5 dense, Qwen3 dense, Qwen3-MoE).

One frozen dataclass covers all of them: ``num_experts == 0`` is a dense model, ``qk_norm`` is Qwen3's
per-head RMSNorm on q and k, ``attention_bias`` is Qwen2's bias on q/k/v. ``from_hf`` / ``to_hf`` read
and write transformers' ``config.json`` (both the 4.x keys and 5.x's ``rope_parameters`` /
``num_local_experts``). ``param_shapes`` gives every parameter's shape from the config alone, so the
sharding planner can work on full-size models without allocating them.

Parameter names are transformers' module names. Experts are stacked, as transformers 5 holds them in
memory: ``mlp.experts.gate_up_proj`` [E, 2F, D] and ``mlp.experts.down_proj`` [E, D, F]; checkpoints on
disk keep one tensor per expert (``mlp.experts.{e}.gate_proj.weight``) and ``models/hf.py`` converts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (dense models and mlp_only_layers)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = True  # Qwen3: RMSNorm over head_dim on q and k
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    model_type: str = "qwen3_moe"
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} must be in "
                                 f"[1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"ModelConfig.moe_intermediate_size={self.moe_intermediate_size} must be > 0 "
                                 "for an MoE model")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- transformers config.json ----
    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        mt = d.get("model_type", "qwen3_moe")
        if mt not in ("qwen3_moe", "qwen3", "qwen2"):
            raise ValueError(f"config.json model_type={mt!r} is not supported (qwen2, qwen3, qwen3_moe)")
        rope = d.get("rope_parameters") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or {}
        for where, r in (("rope_parameters", rope), ("rope_scaling", scaling)):
            kind = r.get("rope_type") or r.get("type") or "default"  # "type": the key before transformers 4.45
            if kind != "default":
                raise ValueError(f"config.json {where}: rope type {kind!r} is not implemented by rlflow (only "
                                 "'default'); a model trained on it would get wrong logits")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act={act!r} is not implemented by rlflow (only 'silu')")
        if d.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window=true is not implemented by rlflow (full attention "
                             "only); set it to false only if the model was trained without it")
        n_exp = d.get("num_experts", d.get("num_local_experts", 0)) if mt.endswith("moe") else 0
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", 0) or 0,
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", mt.startswith("qwen2")),
            qk_norm=mt.startswith("qwen3"),
            num_experts=n_exp or 0, num_experts_per_tok=d.get("num_experts_per_tok", 0) if n_exp else 0,
            moe_intermediate_size=d.get("moe_intermediate_size", 0) if n_exp else 0,
            # transformers' Qwen3MoeConfig defaults it to False when config.json leaves it out
            norm_topk_prob=d.get("norm_topk_prob", False), decoder_sparse_step=d.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            router_aux_loss_coef=d.get("router_aux_loss_coef", 0.001), model_type=mt,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )

    def to_hf(self) -> dict:
        arch = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        d = dict(
            architectures=[arch], model_type=self.model_type, vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.attention_bias,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id, torch_dtype="float32",
        )
        if self.model_type == "qwen3_moe":
            d.update(num_experts=self.num_experts, num_local_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                     router_aux_loss_coef=self.router_aux_loss_coef)
        return d


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in forward order (embedding, layers, final norm, head)."""
    D, hd = cfg.hidden_size, cfg.head_dim
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, D)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (D,)
        out[p + "self_attn.q_proj.weight"] = (H * hd, D)
        out[p + "self_attn.k_proj.weight"] = (KV * hd, D)
        out[p + "self_attn.v_proj.weight"] = (KV * hd, D)
        if cfg.attention_bias:
            out[p + "self_attn.q_proj.bias"] = (H * hd,)
            out[p + "self_attn.k_proj.bias"] = (KV * hd,)
            out[p + "self_attn.v_proj.bias"] = (KV * hd,)
        out[p + "self_attn.o_proj.weight"] = (D, H * hd)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "post_attention_layernorm.weight"] = (D,)
        if cfg.is_moe_layer(i):
            out[p + "mlp.gate.weight"] = (cfg.num_experts, D)
            out.update(expert_shapes(p + "mlp.", cfg.num_experts, cfg.moe_intermediate_size, D))
        else:
            out.update(swiglu_shapes(p + "mlp.", cfg.intermediate_size, D))
    out.update(head_shapes(cfg.vocab_size, D, cfg.tie_word_embeddings))
    return out


# Shape tables shared by the model families (``models/deepseek.py`` too), in forward order.

def swiglu_shapes(prefix: str, F: int, D: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP of width F: gate, up, down projections."""
    return {prefix + "gate_proj.weight": (F, D), prefix + "up_proj.weight": (F, D), prefix + "down_proj.weight": (D, F)}


def expert_shapes(prefix: str, E: int, F: int, D: int) -> dict[str, tuple[int, ...]]:
    """E routed SwiGLU experts of width F, stacked (gate and up fused)."""
    return {prefix + "experts.gate_up_proj": (E, 2 * F, D), prefix + "experts.down_proj": (E, D, F)}


def head_shapes(vocab_size: int, D: int, tied: bool) -> dict[str, tuple[int, ...]]:
    """The final norm and, unless tied to the embedding, the output projection."""
    return {"model.norm.weight": (D,), **({} if tied else {"lm_head.weight": (vocab_size, D)})}


def count(shapes: dict[str, tuple[int, ...]]) -> int:
    """Number of elements in a shape table (any model family's ``param_shapes``)."""
    return sum(math.prod(s) for s in shapes.values())


def num_params(cfg: ModelConfig) -> int:
    return count(param_shapes(cfg))


# ---- named configs: the paper's models and the small ones the recipe and tests use ----
PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-7b": ModelConfig(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
        attention_bias=True, qk_norm=False, eos_token_id=151643),
    "qwen2.5-32b": ModelConfig(
        model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        attention_bias=True, qk_norm=False, eos_token_id=151643),
    "qwen3-moe-30b-a3b": ModelConfig(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        eos_token_id=151645),
    # The recipe's default: small enough to train on 2 CPU cores in minutes.
    "qwen3-moe-tiny": ModelConfig(
        model_type="qwen3_moe", vocab_size=32, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False),
    # About 0.5B parameters, for GPU benchmarks.
    "qwen3-moe-0.5b": ModelConfig(
        model_type="qwen3_moe", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
        num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=704, norm_topk_prob=True,
        rope_theta=10000.0, max_position_embeddings=4096),
}


def get_config(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model name {name!r}; known: {sorted(PRESETS)}") from None

