"""Checkpoints in transformers' own format: ``config.json`` + safetensors (one file, or shards with
``model.safetensors.index.json``), for every family of ``models/config.py`` (Qwen2/2.5, Qwen3,
Qwen3-MoE, DeepSeek-V3; DeepSeek's multi-token-prediction layers are skipped on load, as transformers does).

On disk experts are one tensor per expert (``mlp.experts.{e}.gate_proj.weight`` [F, D], ``up_proj``,
``down_proj`` [D, F]); in memory they are stacked (``mlp.experts.gate_up_proj`` [E, 2F, D],
``mlp.experts.down_proj`` [E, D, F]), as transformers 5 holds them. Load and save convert.
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlflow.models.config import ModelConfig
from rlflow.models.shapes import keeps_float32, param_shapes

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
log = logging.getLogger(__name__)
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def load_config(path: str) -> ModelConfig:
    with open(os.path.join(path, "config.json")) as f:
        return ModelConfig.from_hf(json.load(f))


def _checkpoint_files(path: str) -> list[str]:
    if os.path.exists(os.path.join(path, INDEX)):
        with open(os.path.join(path, INDEX)) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.exists(os.path.join(path, SINGLE)):
        return [SINGLE]
    raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX} found")


def load(path: str, *, dtype: torch.dtype | None = torch.float32,
         device: torch.device | str = "cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a transformers checkpoint directory into (config, params) with experts stacked."""
    cfg = load_config(path)
    raw: dict[str, torch.Tensor] = {}
    for fn in _checkpoint_files(path):
        file = os.path.join(path, fn)
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for k in f.keys():
                    raw[k] = f.get_tensor(k)
        except FileNotFoundError:
            raise FileNotFoundError(f"{file}: listed in the checkpoint but missing") from None
        except Exception as e:  # safetensors raises its own errors for a truncated or foreign file
            raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    extra = sorted({int(m.group(1)) for k in raw if (m := _LAYER.match(k)) and int(m.group(1)) >= cfg.num_hidden_layers})
    if extra and cfg.model_type == "deepseek_v3":  # the multi-token-prediction module(s), as transformers skips them
        log.info("%s: skipping layer(s) %s (DeepSeek's multi-token-prediction module, not part of the model)",
                 path, extra)
        raw = {k: t for k, t in raw.items() if not ((m := _LAYER.match(k)) and int(m.group(1)) >= cfg.num_hidden_layers)}
    if cfg.model_type == "deepseek_v3" and not cfg.n_shared_experts:
        # n_shared_experts 0: transformers writes zero-width shared-expert weights (their output is 0)
        raw = {k: t for k, t in raw.items() if not (".mlp.shared_experts." in k and t.numel() == 0)}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    params: dict[str, torch.Tensor] = {}
    for k, t in raw.items():
        m = _EXPERT.match(k)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        else:
            params[k] = t
    for prefix, parts in experts.items():
        n = len(parts["down_proj"])
        if sorted(parts["down_proj"]) != list(range(n)) or any(len(parts[p]) != n for p in parts):
            raise ValueError(f"{path}: experts under {prefix} are incomplete")
        gate = torch.stack([parts["gate_proj"][e] for e in range(n)])
        up = torch.stack([parts["up_proj"][e] for e in range(n)])
        params[prefix + ".gate_up_proj"] = torch.cat([gate, up], dim=1)
        params[prefix + ".down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    expected = param_shapes(cfg)
    missing = sorted(set(expected) - set(params))
    unexpected = sorted(set(params) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match its config: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}")
    for k, shape in expected.items():
        if tuple(params[k].shape) != shape:
            raise ValueError(f"{path}: parameter {k} has shape {tuple(params[k].shape)}, config says {shape}")
        want = torch.float32 if keeps_float32(cfg, k) else dtype or params[k].dtype
        params[k] = params[k].to(device=device, dtype=want)
    return cfg, {k: params[k] for k in expected}


def dtype_kwarg(dtype: torch.dtype) -> dict:
    """transformers' ``from_pretrained`` keyword for ``dtype``: ``dtype=`` from 4.56, ``torch_dtype=`` before
    (deprecated after)."""
    import transformers
    from packaging.version import Version  # transformers' own dependency
    return {"dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype": dtype}


def to_disk_names(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unstack experts into transformers' per-expert checkpoint names."""
    out: dict[str, torch.Tensor] = {}
    for k, t in params.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e]
                out[f"{base}{e}.up_proj.weight"] = up[e]
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[k] = t
    return out


def save_config(path: str, cfg: ModelConfig, dtype: torch.dtype) -> None:
    """Write config.json (``torch_dtype``: the weights' dtype)."""
    os.makedirs(path, exist_ok=True)
    d = cfg.to_hf()
    d["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f, indent=2)


def save(path: str, cfg: ModelConfig, params: dict[str, torch.Tensor], *,
         max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write config.json and safetensors (sharded with an index when larger than max_shard_bytes)."""
    save_config(path, cfg, next(iter(params.values())).dtype)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in to_disk_names(params).items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nb
    meta = {"format": "pt"}
    old = _previous_weight_files(path)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE), metadata=meta)
        _remove(path, old - {SINGLE})
        return [SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(path, name), metadata=meta)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    _remove(path, old - set(names) - {INDEX})
    return names


_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _previous_weight_files(path: str) -> set[str]:
    """The weight files of a checkpoint already in ``path`` (its index, the files the index lists, a single
    file, shards by transformers' naming): the new checkpoint replaces them all, so that ``load`` never
    reads a stale index or shard beside the new weights."""
    out = {n for n in os.listdir(path) if n in (INDEX, SINGLE) or _SHARD.match(n)}
    if INDEX in out:
        try:
            with open(os.path.join(path, INDEX)) as f:
                out |= set(json.load(f).get("weight_map", {}).values())
        except (OSError, ValueError):
            pass
    return out


def _remove(path: str, names: set[str]) -> None:
    for n in names:
        try:
            os.remove(os.path.join(path, n))
        except FileNotFoundError:
            pass
