"""The model families rlflow runs, one row each: what config.json calls it, transformers' class for it, the
switches of the one decoder (``models/decoder.py``) its config.json sets, what it refuses, and whether vLLM and
GGUF files reach it. Adding a family that is a set of those switches is one row here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


def _refuse_llama_json(d: dict) -> None:
    """The Llama fields rlflow does not implement, refused by name: biases on the MLP's or the attention's
    projections. (``pretraining_tp`` only splits the same matmuls: read as any value.)"""
    if d.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not implemented by rlflow for llama (the MLP has no bias)")
    if d.get("attention_bias"):
        raise ValueError("config.json attention_bias=true is not implemented by rlflow for llama (Llama's bias "
                         "covers o_proj too; rlflow's attention bias is Qwen2's, on q/k/v only)")


def _refuse_llama_config(cfg) -> None:
    if cfg.qk_norm or cfg.attention_bias or cfg.num_experts:
        raise ValueError(f"ModelConfig: llama has no qk_norm (got {cfg.qk_norm}), attention_bias (got "
                         f"{cfg.attention_bias}) nor experts (got num_experts={cfg.num_experts}); set them off")


@dataclass(frozen=True)
class Family:
    """``qk_norm``: RMSNorm over head_dim on q and k (Qwen3); ``attention_bias``: config.json's default for the
    q/k/v biases (Qwen2); ``experts``: config.json's MoE keys are read (Qwen3-MoE); ``mla``: DeepSeek's MLA and
    DeepSeekMoE, from its own keys; ``hf_extra``: keys ``to_hf`` writes for it; ``refuse_json`` /
    ``refuse_config``: what it does not implement, refused by name; ``vllm``: vLLM loads the config.json rlflow
    writes for it (``engines/vllm.py``); ``gguf``: GGUF's ``general.architecture`` for it (``models/gguf.py``)."""
    model_type: str
    hf_architecture: str
    qk_norm: bool = False
    attention_bias: bool = False
    experts: bool = False
    mla: bool = False
    hf_extra: dict = field(default_factory=dict)
    refuse_json: Callable[[dict], None] = lambda d: None
    refuse_config: Callable[[object], None] = lambda cfg: None
    vllm: bool = False
    gguf: str | None = None


FAMILIES = {f.model_type: f for f in (
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, experts=True, vllm=True, gguf="qwen3moe"),
    Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, gguf="qwen3"),
    Family("qwen2", "Qwen2ForCausalLM", attention_bias=True, vllm=True, gguf="qwen2"),
    Family("llama", "LlamaForCausalLM", hf_extra={"mlp_bias": False, "pretraining_tp": 1},
           refuse_json=_refuse_llama_json, refuse_config=_refuse_llama_config, vllm=True, gguf="llama"),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", mla=True, vllm=True),
)}


def vllm_model_types() -> tuple[str, ...]:
    return tuple(t for t, f in FAMILIES.items() if f.vllm)


def gguf_architectures() -> tuple[str, ...]:
    return tuple(f.gguf for f in FAMILIES.values() if f.gguf)


__all__ = ["FAMILIES", "Family", "gguf_architectures", "vllm_model_types"]
