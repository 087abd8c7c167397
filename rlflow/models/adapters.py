"""LoRA adapters on disk as peft saves them, the merged model, and a checkpoint's weights either way (``export``).

A directory holds ``adapter_config.json`` (peft's ``LoraConfig``: ``r``, ``lora_alpha``, ``target_modules``,
``lora_dropout``, ``base_model_name_or_path`` ...) and ``adapter_model.safetensors`` (the factors under peft's
names: ``base_model.model.`` + rlflow's, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``),
so ``peft.PeftModel.from_pretrained(transformers_model, dir)`` loads what rlflow trained, and ``load`` reads what
peft saved. A peft option rlflow does not implement (DoRA, rsLoRA, bias, modules_to_save, per-layer ranks, a
regex of targets, ...) is refused by name. ``merged`` is the base with each adapter added into its weight
(``W + alpha / r * B A``): the model transformers loads without peft.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlflow.models import hf, lora
from rlflow.models.config import ModelConfig
from rlflow.models.lora import LoraConfig
from rlflow.models.shapes import param_shapes

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX, BASE_LAYER = "base_model.model.", ".base_layer.weight"

# peft LoraConfig fields and the only value rlflow runs them with (None / False / "none" / {} / [] alike: off)
_OFF = ("use_dora", "use_rslora", "fan_in_fan_out", "modules_to_save", "layers_to_transform", "layers_pattern",
        "rank_pattern", "alpha_pattern", "trainable_token_indices", "target_parameters", "exclude_modules",
        "lora_bias", "use_qalora", "megatron_config", "layer_replication", "alora_invocation_tokens", "arrow_config")


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG))


def read_config(path: str) -> LoraConfig:
    """The ``LoraConfig`` of a peft adapter directory; raises ``ValueError`` naming the file and field of what
    rlflow does not run."""
    file = os.path.join(path, CONFIG)
    try:
        with open(file) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no {CONFIG} (not a peft adapter directory)") from None
    except ValueError as e:
        raise ValueError(f"{file}: not JSON ({e})") from None
    if d.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type={d['peft_type']!r}: rlflow trains LoRA adapters only")
    if d.get("bias", "none") != "none":
        raise ValueError(f"{file}: bias={d['bias']!r}: rlflow's adapters train no bias (bias='none')")
    for k in _OFF:
        if d.get(k):
            raise ValueError(f"{file}: {k}={d[k]!r} is not implemented by rlflow")
    targets = d.get("target_modules")
    if not isinstance(targets, list):
        raise ValueError(f"{file}: target_modules={targets!r}: rlflow reads a list of module names (not a regex "
                         "nor 'all-linear')")
    try:
        ordered = tuple(t for t in lora.TARGETS if t in targets) + tuple(t for t in targets if t not in lora.TARGETS)
        return LoraConfig(rank=int(d["r"]), alpha=float(d.get("lora_alpha", 8)), targets=ordered,
                          dropout=float(d.get("lora_dropout", 0.0)))
    except KeyError:
        raise ValueError(f"{file}: has no 'r'") from None
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def save(path: str, cfg, params: dict[str, torch.Tensor], *, base_model: str | None = None) -> None:
    """Write ``params``' adapters (whole tensors) as peft's adapter directory of ``cfg.lora`` into ``path``."""
    lc = cfg.lora
    targets = sorted({lora.module_of(k).rsplit(".", 1)[-1] for k in params if lora.is_adapter(k)})
    os.makedirs(path, exist_ok=True)
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": lc.rank,
            "lora_alpha": lc.alpha, "lora_dropout": lc.dropout, "target_modules": targets, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
            "use_dora": False, "modules_to_save": None}
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(conf, f, indent=2)
    tensors = {PREFIX + k: v.detach().to("cpu").contiguous() for k, v in params.items() if lora.is_adapter(k)}
    save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})


def load(path: str, cfg, *, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The adapters of peft directory ``path`` for a model of config ``cfg`` (``cfg.lora`` set), float32 on
    ``device``, and an adapted head's weight where peft saved one beside them (in its dtype); raises
    ``ValueError`` naming the tensor when they are not this model's adapters of this rank."""
    shapes = lora.with_adapters(cfg, param_shapes(cfg))
    want = {k: s for k, s in shapes.items() if lora.is_adapter(k)}
    file = os.path.join(path, WEIGHTS)
    if not os.path.isfile(file):
        raise ValueError(f"{path}: no {WEIGHTS}")
    out = {}
    with safe_open(file, framework="pt", device="cpu") as f:
        for key in f.keys():
            name = key.removeprefix(PREFIX).replace(".default.weight", ".weight")
            if name.endswith(BASE_LAYER):  # peft's copy of an adapted head's own weight (an "embedding layer" to
                # peft, saved beside its adapters): the caller checks it is the model's
                name = name[:-len(BASE_LAYER)] + ".weight"
                t = f.get_tensor(key)
                if name[:-len(".weight")] + lora.A not in want or tuple(t.shape) != shapes[name]:
                    raise ValueError(f"{file}: {key} {tuple(t.shape)} is no adapted module's weight of this "
                                     f"{cfg.model_type} model (another base model)")
                out[name] = t.to(device=device)
                continue
            if name not in want:
                raise ValueError(f"{file}: {key} is no adapter of this {cfg.model_type} model with targets "
                                 f"{', '.join(cfg.lora.targets or lora.TARGETS)} (another base model)")
            t = f.get_tensor(key)
            if tuple(t.shape) != want[name]:
                raise ValueError(f"{file}: {key} has shape {tuple(t.shape)}, this model's rank-{cfg.lora.rank} "
                                 f"adapter {want[name]} (another base model or rank)")
            out[name] = t.to(device=device, dtype=torch.float32)
    if missing := sorted(set(want) - set(out)):
        raise ValueError(f"{file}: missing {missing[0]} (and {len(missing) - 1} more)")
    return out


def merged(params: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """The base with each adapter added into its weight, W + alpha / r * B A (in float32, then the weight's
    dtype): the adapted model as plain weights."""
    out = lora.base(params)
    for k in params:
        if k.endswith(lora.A):
            m = lora.module_of(k)
            w = out[m + ".weight"]
            delta = (params[m + lora.B].float() @ params[k].float()) * cfg.lora.scale
            out[m + ".weight"] = (w.float() + delta).to(w.dtype)
    return out

def export(path: str, cfg: ModelConfig, params: dict, *, merge: bool = False, base_model: str | None = None) -> None:
    """The weights of checkpoint ``path``: in transformers' format, or a LoRA run's adapters as peft saves them
    beside the base's config.json (``merge``: and the merged model's weights, which ``--model`` loads)."""
    if not lora.has_adapters(params):
        hf.save(path, cfg, params)
        return
    save(path, cfg, params, base_model=base_model)
    plain, base = cfg.replace(lora=None), lora.base(params)
    if merge:
        hf.save(path, plain, merged(params, cfg))
    else:
        hf.save_config(path, plain, next(iter(base.values())).dtype if base else torch.float32)


def config_of(path: str) -> ModelConfig:
    """Checkpoint ``path``'s model config: its config.json, and a LoRA run's adapters (``cfg.lora``)."""
    cfg = hf.load_config(path)
    return cfg.replace(lora=read_config(path)) if is_adapter_dir(path) else cfg


__all__ = ["CONFIG", "WEIGHTS", "config_of", "export", "is_adapter_dir", "load", "merged", "read_config", "save"]
