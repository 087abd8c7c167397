"""Model configuration for the model families rlflow runs: Llama (Llama 2/3, SmolLM, ...), Qwen2 / Qwen2.5
dense, Qwen3 dense, Qwen3-MoE and DeepSeek-V3 / R1.

One frozen dataclass covers all of them, each family a set of switches over one decoder (its row in
``models/families.py`` says which):
``num_experts == 0`` is a dense model (Llama: dense, no bias, no qk norm); ``qk_norm`` is Qwen3's per-head
RMSNorm on q and k; ``attention_bias`` Qwen2's bias on q/k/v; ``kv_lora_rank > 0`` is DeepSeek's Multi-head
Latent Attention (``mla``); ``scoring_func == "sigmoid"`` DeepSeek-V3's group-limited sigmoid routing, with
``n_shared_experts`` and ``first_k_dense_replace``. ``from_hf`` / ``to_hf`` read and write transformers'
``config.json`` (both the 4.x keys and 5.x's ``rope_parameters`` / ``num_local_experts``), refusing by
name any field value rlflow does not implement. ``models/shapes.py`` gives every parameter's shape from the
config alone, so the sharding planner can work on full-size models without allocating them.

Parameter names are transformers' module names. Experts are stacked, as transformers 5 holds them in
memory: ``mlp.experts.gate_up_proj`` [E, 2F, D] and ``mlp.experts.down_proj`` [E, D, F]; checkpoints on
disk keep one tensor per expert (``mlp.experts.{e}.gate_proj.weight``) and ``models/hf.py`` converts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlflow.models import lora, shapes
from rlflow.models.families import FAMILIES
from rlflow.models.lora import LoraConfig
from rlflow.ops import RopeScaling, yarn_mscale


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (dense models, mlp_only_layers, first_k_dense_replace layers)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 0  # 0: as many as query heads
    head_dim: int = 0  # 0: hidden_size // num_attention_heads; with MLA, the rotary dims (qk_rope_head_dim)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = True  # Qwen3: RMSNorm over head_dim on q and k
    # MLA (DeepSeek): kv_lora_rank > 0. q_lora_rank None: a direct q_proj
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True  # DeepSeek's rotary dims in adjacent pairs
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    # DeepSeekMoE: sigmoid scores, group-limited top-k, shared experts, the first layers dense
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    model_type: str = "qwen3_moe"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    lora: LoraConfig | None = None  # low-rank adapters trained on the frozen model (``models/lora.py``); not HF's

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.model_type not in FAMILIES:
            raise ValueError(f"ModelConfig.model_type={self.model_type!r} is not supported; known: {sorted(FAMILIES)}")
        if not self.num_key_value_heads:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.qk_rope_head_dim if self.mla else
                               self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.mla:
            for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be > 0 with MLA (kv_lora_rank > 0)")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"ModelConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even")
            if self.head_dim != self.qk_rope_head_dim or self.num_key_value_heads != self.num_attention_heads:
                raise ValueError(f"ModelConfig: with MLA head_dim={self.head_dim} must be qk_rope_head_dim="
                                 f"{self.qk_rope_head_dim} and num_key_value_heads={self.num_key_value_heads} "
                                 f"num_attention_heads={self.num_attention_heads}")
            if self.qk_norm or self.attention_bias:
                raise ValueError("ModelConfig: MLA has no qk_norm nor attention_bias (set both False)")
        FAMILIES[self.model_type].refuse_config(self)
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"ModelConfig.scoring_func={self.scoring_func!r} is not implemented by rlflow "
                             "(softmax: Qwen3-MoE; sigmoid: DeepSeek-V3)")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} must be in "
                                 f"[1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"ModelConfig.moe_intermediate_size={self.moe_intermediate_size} must be > 0 "
                                 "for an MoE model")
            if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"ModelConfig.n_group={self.n_group} must divide num_experts={self.num_experts} "
                                 f"and topk_group={self.topk_group} be in [1, n_group]")
            per_group = self.num_experts // self.n_group
            if self.n_group > 1 and (per_group < 2 or self.num_experts_per_tok > self.topk_group * per_group):
                raise ValueError(f"ModelConfig: {self.n_group} groups of {per_group} experts, {self.topk_group} "
                                 f"kept, cannot give num_experts_per_tok={self.num_experts_per_tok} (a group "
                                 "scores its two best experts)")
            if self.routed_scaling_factor != 1.0 and self.scoring_func != "sigmoid":
                raise ValueError(f"ModelConfig.routed_scaling_factor={self.routed_scaling_factor}: the routed weights' "
                                 "scale is DeepSeek's (scoring_func='sigmoid'); softmax routing does not apply it")
            if self.n_group > 1 and self.scoring_func != "sigmoid":
                raise ValueError(f"ModelConfig.n_group={self.n_group}: group-limited routing is DeepSeek's "
                                 "(scoring_func='sigmoid')")
        if self.lora is not None:  # every target names a module of this model (raises naming it otherwise); the
            # targets are those it has, in one order (two configs of the same adapters compare equal)
            adapted = {m.rsplit(".", 1)[-1] for m in lora.modules(self, shapes.param_shapes(self))}
            object.__setattr__(self, "lora", dataclasses.replace(self.lora, targets=tuple(
                t for t in lora.ADAPTABLE if t in adapted)))

    @property
    def mla(self) -> bool:
        """Multi-head Latent Attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """The attention's score scale: 1/sqrt(q·k dims), times YaRN's mscale(mscale_all_dim)^2 with MLA
        (transformers' ``yarn_apply_mscale``)."""
        if not self.mla:
            return self.head_dim ** -0.5
        scale = self.qk_head_dim ** -0.5
        r = self.rope_scaling
        if r is not None and r.mscale_all_dim:
            scale *= yarn_mscale(r.factor, r.mscale_all_dim) ** 2
        return scale

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers and layer >= self.first_k_dense_replace
                and (layer + 1) % self.decoder_sparse_step == 0)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- transformers config.json ----
    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        mt = d.get("model_type", "qwen3_moe")
        if mt not in FAMILIES:
            raise ValueError(f"config.json model_type={mt!r} is not supported ({', '.join(sorted(FAMILIES))})")
        fam = FAMILIES[mt]
        theta, scaling = _rope_from_hf(d)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act={act!r} is not implemented by rlflow (only 'silu')")
        if d.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window=true is not implemented by rlflow (full attention "
                             "only); set it to false only if the model was trained without it")
        if d.get("quantization_config"):
            q = d["quantization_config"]
            raise ValueError(f"config.json quantization_config (quant_method="
                             f"{q.get('quant_method') if isinstance(q, dict) else q!r}) is not implemented by rlflow: "
                             "dequantize the checkpoint to bfloat16 first")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        common = dict(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", 0) or 0,
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=d.get("tie_word_embeddings", False), model_type=mt,
            bos_token_id=d.get("bos_token_id"), eos_token_id=eos[0] if isinstance(eos, list) else eos)
        if fam.mla:
            return cls(**common, **_deepseek_from_hf(d))
        fam.refuse_json(d)
        n_exp = d.get("num_experts", d.get("num_local_experts", 0)) if fam.experts else 0
        return cls(
            **common, num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            attention_bias=d.get("attention_bias", fam.attention_bias),
            qk_norm=fam.qk_norm,
            num_experts=n_exp or 0, num_experts_per_tok=d.get("num_experts_per_tok", 0) if n_exp else 0,
            moe_intermediate_size=d.get("moe_intermediate_size", 0) if n_exp else 0,
            # transformers' Qwen3MoeConfig defaults it to False when config.json leaves it out (a dense model has
            # no routing: the field's own default, so that a dense config round-trips)
            norm_topk_prob=d.get("norm_topk_prob", False) if n_exp else True,
            decoder_sparse_step=d.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            router_aux_loss_coef=d.get("router_aux_loss_coef", 0.001),
        )

    def to_hf(self) -> dict:
        fam = FAMILIES[self.model_type]
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            r = self.rope_scaling
            rope = {**rope, "rope_type": r.kind, "factor": r.factor,
                    **{k: getattr(r, k) for k in r.FIELDS[r.kind] if getattr(r, k) is not None}}
        d = dict(
            architectures=[fam.hf_architecture], model_type=self.model_type, vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_parameters=rope,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.attention_bias,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id, torch_dtype="float32",
        )
        if self.rope_scaling is not None:  # transformers 4.x reads the scaling from here (the key "type" before 4.45)
            d["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"} | {"type": self.rope_scaling.kind}
        if fam.mla:
            d.update(q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                     qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                     v_head_dim=self.v_head_dim, rope_interleave=self.rope_interleave,
                     n_routed_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     n_shared_experts=self.n_shared_experts, first_k_dense_replace=self.first_k_dense_replace,
                     n_group=self.n_group, topk_group=self.topk_group,
                     routed_scaling_factor=self.routed_scaling_factor, scoring_func="sigmoid",
                     topk_method="noaux_tc", num_nextn_predict_layers=0)
            return d
        d.update(head_dim=self.head_dim, **fam.hf_extra)
        if fam.experts:
            d.update(num_experts=self.num_experts, num_local_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                     router_aux_loss_coef=self.router_aux_loss_coef)
        return d


def _rope_from_hf(d: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from config.json's ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x;
    its key ``type`` before 4.45). A rope type rlflow does not implement is refused by name."""
    rope = d.get("rope_parameters") or {}
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    found = [(where, r) for where, r in (("rope_parameters", rope), ("rope_scaling", d.get("rope_scaling") or {}))
             if (r.get("rope_type") or r.get("type") or "default") != "default"]
    if not found:
        return theta, None
    where, r = found[0]
    kind = r.get("rope_type") or r.get("type")
    if kind not in RopeScaling.KINDS:
        raise ValueError(f"config.json {where}: rope type {kind!r} is not implemented by rlflow (default, "
                         f"{', '.join(RopeScaling.KINDS)}); a model trained on it would get wrong logits")
    factor = r.get("factor")
    orig = r.get("original_max_position_embeddings", d.get("original_max_position_embeddings",
                                                             d.get("max_position_embeddings")))
    if factor is None and kind == "yarn":
        factor = d["max_position_embeddings"] / orig
    # linear: yarn's fields too, read and ignored (rlflow before the Llama family wrote them for linear scaling)
    known = {"rope_type", "type", "rope_theta", "factor", *RopeScaling.FIELDS["yarn" if kind == "linear" else kind]}
    extra = sorted(set(r) - known)
    if extra:
        raise ValueError(f"config.json {where}: field(s) {extra} of rope type {kind!r} are not implemented by rlflow")
    if kind == "llama3":
        missing = [k for k in ("factor", *RopeScaling.FIELDS[kind]) if r.get(k) is None]
        if missing:
            raise ValueError(f"config.json {where}: rope type 'llama3' needs {missing}")
        return theta, RopeScaling(kind=kind, factor=float(factor), original_max_position_embeddings=r[
            "original_max_position_embeddings"], low_freq_factor=float(r["low_freq_factor"]),
            high_freq_factor=float(r["high_freq_factor"]))
    return theta, RopeScaling(
        kind=kind, factor=float(factor), original_max_position_embeddings=orig if kind == "yarn" else None,
        beta_fast=float(r.get("beta_fast") or 32), beta_slow=float(r.get("beta_slow") or 1),
        mscale=r.get("mscale"), mscale_all_dim=r.get("mscale_all_dim"), attention_factor=r.get("attention_factor"),
        truncate=bool(r.get("truncate", True)))


def _deepseek_from_hf(d: dict) -> dict:
    """The DeepSeek-V3 fields of config.json; values rlflow does not implement are refused by name."""
    refuse = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "moe_layer_freq": (1,),
              "attention_bias": (False,)}
    for key, ok in refuse.items():
        if key in d and d[key] not in ok:
            raise ValueError(f"config.json {key}={d[key]!r} is not implemented by rlflow for deepseek_v3 "
                             f"(only {', '.join(map(repr, ok))})")
    # num_key_value_heads is not read: MLA has one latent per token, expanded to every query head
    return dict(
        num_key_value_heads=d["num_attention_heads"], head_dim=d.get("qk_rope_head_dim", 64), qk_norm=False,
        q_lora_rank=d.get("q_lora_rank", 1536), kv_lora_rank=d.get("kv_lora_rank", 512),
        qk_nope_head_dim=d.get("qk_nope_head_dim", 128), qk_rope_head_dim=d.get("qk_rope_head_dim", 64),
        v_head_dim=d.get("v_head_dim", 128), rope_interleave=d.get("rope_interleave", True),
        num_experts=d.get("n_routed_experts", d.get("num_local_experts", 256)),
        num_experts_per_tok=d.get("num_experts_per_tok", 8),
        moe_intermediate_size=d.get("moe_intermediate_size", 2048), norm_topk_prob=d.get("norm_topk_prob", True),
        scoring_func="sigmoid", n_group=d.get("n_group", 8), topk_group=d.get("topk_group", 4),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 2.5)),
        n_shared_experts=d.get("n_shared_experts", 1), first_k_dense_replace=d.get("first_k_dense_replace", 3),
        router_aux_loss_coef=0.0)


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
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False),
    # The dense recipe's default (recipes/grpo_qwen25_dense.py): the Qwen2.5 structure at qwen3-moe-tiny's size.
    "qwen2.5-tiny": ModelConfig(
        model_type="qwen2", vocab_size=32, hidden_size=64, intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        attention_bias=True, qk_norm=False, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=False),
    # The Llama structure at the recipe's size (no bias, no qk norm), untied so that it takes pp layouts too.
    "llama-tiny": ModelConfig(
        model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, qk_norm=False, rope_theta=10000.0,
        max_position_embeddings=512),
    # SmolLM2-135M(-Instruct)'s shape, for benchmarks at a real size without its checkpoint
    # (the checkpoint itself: --model smollm2-135m-instruct, models/gguf.py).
    "smollm2-135m": ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, qk_norm=False, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2),
    # About 0.5B parameters, for GPU benchmarks.
    "qwen3-moe-0.5b": ModelConfig(
        model_type="qwen3_moe", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
        num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=704, norm_topk_prob=True,
        rope_theta=10000.0, max_position_embeddings=4096),
    # The paper's largest model (DeepSeek-V3 architecture); its multi-token-prediction layer is not loaded.
    "deepseek-r1-671b": ModelConfig(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        num_hidden_layers=61, num_attention_heads=128, qk_norm=False, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=2048, norm_topk_prob=True, scoring_func="sigmoid", n_group=8, topk_group=4,
        routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=3, router_aux_loss_coef=0.0,
        rope_theta=10000.0, max_position_embeddings=163840,
        rope_scaling=RopeScaling(kind="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                                 mscale_all_dim=1.0),
        bos_token_id=0, eos_token_id=1),
    # The same structure at the recipe's size: 1 dense layer + 3 MoE layers, 2 groups of 4 experts.
    "deepseek-tiny": ModelConfig(
        model_type="deepseek_v3", vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, qk_norm=False, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True, scoring_func="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5,
        n_shared_experts=1, first_k_dense_replace=1, router_aux_loss_coef=0.0, rope_theta=10000.0,
        max_position_embeddings=512),
}


def get_config(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model name {name!r}; known: {sorted(PRESETS)}") from None

