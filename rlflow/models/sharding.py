"""Per-model tables: the logical dim names of every parameter, and the default rules mapping them to
mesh axes (Megatron's: heads, MLP width and vocab over ``tp``; experts over ``ep``).

A table row is ``(regex on the param name, dims, executes)``; ``dims`` has one entry per stored dim: a
logical name, or a tuple of names when the stored dim is several logical dims flattened (major to minor), e.g.
``q_proj.weight`` [H*hd, D] is ``(("heads", "head_dim"), "embed")``. The sizes of the inner parts come
from the config (``head_dim``, ``gate_up`` = 2 ...); the one unknown part is inferred. A parameter no
row matches is an error that names it. ``executes`` is the set of effective specs (per view dim, the
mesh axes of size > 1 splitting it) that ``rlflow.parallel`` runs the model in (``executable_specs``), or
None where the parameter is planned but not executed yet.

``model_shapes(name)`` and ``logical_params(name)`` take a preset's name (``rlflow.models.config``) or a
config; MLA models (DeepSeek) take ``MLA_TABLE``, the others ``QWEN_TABLE``.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from rlflow.models import lora
from rlflow.models.config import ModelConfig, get_config
from rlflow.models.shapes import critic_shapes, keeps_float32, param_shapes
from rlflow.sharding.layout import Layout, Logical
from rlflow.sharding.mesh import Mesh

# Effective specs (per view dim, the axes of size > 1 that split it) that ``rlflow.parallel`` executes;
# None: planned only (no executor yet).
_N, _T, _E = (), ("tp",), ("ep",)
_REPL2, _COL, _ROW = {(_N, _N)}, {(_N, _N), (_T, _N)}, {(_N, _N), (_N, _T)}

_COMMON = (
    (r"(^|\.)embed_tokens\.weight$", ("vocab", "embed"), _COL),
    (r"(^|\.)lm_head\.weight$", ("vocab", "embed"), _COL),
    (r"(input_layernorm|post_attention_layernorm|(^|\.)norm)\.weight$", ("embed",), {(_N,)}),
    (r"^value_head\.weight$", ("value", "embed"), _REPL2),  # a critic's head: replicated, like a norm
    (r"\.mlp\.gate\.weight$", ("router", "embed"), _REPL2),
    (r"\.mlp\.gate\.e_score_correction_bias$", ("router",), {(_N,)}),
    (r"\.mlp\.experts\.gate_up_proj$", ("experts", ("gate_up", "expert_mlp"), "embed"),
     {(e, _N, f, _N) for e in (_N, _E) for f in (_N, _T)}),
    (r"\.mlp\.experts\.down_proj$", ("experts", "embed", "expert_mlp"),
     {(e, _N, f) for e in (_N, _E) for f in (_N, _T)}),
    (r"\.mlp\.(shared_experts\.)?(gate|up)_proj\.weight$", ("mlp", "embed"), _COL),
    (r"\.mlp\.(shared_experts\.)?down_proj\.weight$", ("embed", "mlp"), _ROW),
)

_HEADS = {(_N, _N, _N), (_T, _N, _N)}
QWEN_TABLE = _COMMON + (
    (r"\.self_attn\.q_proj\.weight$", (("heads", "head_dim"), "embed"), _HEADS),
    (r"\.self_attn\.[kv]_proj\.weight$", (("kv_heads", "head_dim"), "embed"), _HEADS),
    (r"\.self_attn\.q_proj\.bias$", (("heads", "head_dim"),), _COL),
    (r"\.self_attn\.[kv]_proj\.bias$", (("kv_heads", "head_dim"),), _COL),
    (r"\.self_attn\.o_proj\.weight$", ("embed", ("heads", "head_dim")), {(_N, _N, _N), (_N, _T, _N)}),
    (r"\.self_attn\.[qk]_norm\.weight$", ("head_dim",), {(_N,)}),
)

# MLA: the query heads (q_b_proj or q_proj), the latent's expansion (kv_b_proj) and o_proj split by heads
# over tp; the latent projections and their norms replicated (every head reads the whole latent).
MLA_TABLE = _COMMON + (
    (r"\.self_attn\.q_a_proj\.weight$", ("q_lora", "embed"), _REPL2),
    (r"\.self_attn\.q_a_layernorm\.weight$", ("q_lora",), {(_N,)}),
    (r"\.self_attn\.q_(b_)?proj\.weight$", (("heads", "qk_head_dim"), "q_in"), _HEADS),
    (r"\.self_attn\.kv_a_proj_with_mqa\.weight$", ("kv_a", "embed"), _REPL2),
    (r"\.self_attn\.kv_a_layernorm\.weight$", ("kv_lora",), {(_N,)}),
    (r"\.self_attn\.kv_b_proj\.weight$", (("heads", "kv_head_dim"), "kv_lora"), _HEADS),
    (r"\.self_attn\.o_proj\.weight$", ("embed", ("heads", "v_head_dim")), {(_N, _N, _N), (_N, _T, _N)}),
)

# Logical name -> None | axis | tuple of axes. Dense params never name ``ep``: they are replicated
# over it (MoE parallel folding, see rlflow/sharding/mesh.py).
RULES: dict[str, object] = {
    "vocab": "tp", "embed": None, "heads": "tp", "kv_heads": "tp", "head_dim": None, "mlp": "tp",
    "experts": "ep", "expert_mlp": "tp", "gate_up": None, "router": None,
    "q_lora": None, "q_in": None, "kv_lora": None, "kv_a": None, "qk_head_dim": None, "kv_head_dim": None,
    "v_head_dim": None, "value": None, "lora_rank": None,
}


HEADS = ("lm", "value")  # the policy's LM head, or a critic's value head (``algos/critic.py``)


def _family(name_or_cfg, head: str = "lm"):
    """(config, shapes, table, known inner sizes) for a model name or config, with ``head`` (``HEADS``)."""
    cfg = get_config(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"expected a model name or a ModelConfig, got {type(cfg).__name__}")
    if head not in HEADS:
        raise ValueError(f"head={head!r}: expected one of {HEADS}")
    shapes = lora.with_adapters(cfg, param_shapes(cfg)) if head == "lm" else critic_shapes(cfg)
    if cfg.mla:
        sizes = {"qk_head_dim": cfg.qk_head_dim, "kv_head_dim": cfg.qk_nope_head_dim + cfg.v_head_dim,
                 "v_head_dim": cfg.v_head_dim, "gate_up": 2}
        return cfg, shapes, MLA_TABLE, sizes
    return cfg, shapes, QWEN_TABLE, {"head_dim": cfg.head_dim, "gate_up": 2}


def model_shapes(name_or_cfg, head: str = "lm") -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, for Qwen and DeepSeek presets alike (``head="value"``: a critic's)."""
    return _family(name_or_cfg, head)[1]


def _row(name: str, table) -> tuple:
    if lora.is_adapter(name):  # LoRA's factors follow their base: A [r, in] splits in as it, B [out, r] out
        pattern, (out_dim, in_dim), executes = _row(lora.module_of(name) + ".weight", table)
        a, n_out = name.endswith(lora.A), 1 if isinstance(out_dim, str) else len(out_dim)  # out's view dims
        dims = ("lora_rank", in_dim) if a else (out_dim, "lora_rank")
        return pattern, dims, None if executes is None else \
            {(_N, *e[n_out:]) if a else (*e[:n_out], _N) for e in executes}
    for row in table:
        if re.search(row[0], name):
            return row
    raise ValueError(f"param {name}: no row of the sharding table matches it")


def executable_specs(name_or_cfg, param: str) -> set | None:
    """The effective specs ``rlflow.parallel`` executes for ``param`` (see the table rows), or None."""
    return _row(param, _family(name_or_cfg)[2])[2]


def _logical(name: str, shape: tuple[int, ...], table, sizes: dict[str, int]) -> Logical:
    dims = _row(name, table)[1]
    if len(dims) != len(shape):
        raise ValueError(f"param {name}: table gives {len(dims)} dims {dims} for shape {shape}")
    names, view, merge = [], [], []
    for n, d in zip(shape, dims):
        parts = (d,) if isinstance(d, str) else tuple(d)
        unknown = [p for p in parts if p not in sizes or len(parts) == 1]
        if len(parts) > 1 and len(unknown) != 1:
            raise ValueError(f"param {name}: cannot split dim of size {n} into {parts}")
        known = int(np.prod([sizes[p] for p in parts if p not in unknown], dtype=np.int64))
        if n % known:
            raise ValueError(f"param {name}: dim of size {n} does not split into {parts} ({known} inner)")
        for p in parts:
            names.append(p)
            view.append(n // known if p in unknown else sizes[p])
        merge.append(len(parts))
    return Logical(shape=tuple(shape), dims=tuple(names), view=tuple(view), merge=tuple(merge))


def logical_params(name_or_cfg, head: str = "lm") -> dict[str, Logical]:
    """Param name -> stored shape, logical dims and view, in forward order."""
    _, shapes, table, sizes = _family(name_or_cfg, head)
    return {n: _logical(n, s, table, sizes) for n, s in shapes.items()}


def layout(name_or_cfg, mesh: Mesh, rules: dict | None = None, *, dtype: torch.dtype = torch.bfloat16,
           layers_per_stage: tuple[int, ...] | None = None, name: str = "", head: str = "lm") -> Layout:
    """The layout of a model on ``mesh`` under ``rules`` (default ``RULES``, overrides merged in);
    ``head="value"``: its critic's (``HEADS``)."""
    unknown = sorted(set(rules or {}) - set(RULES))
    if unknown:  # a misspelt rule would silently keep the default placement
        raise ValueError(f"unknown logical dim(s) {unknown} in the rules; known: {sorted(RULES)}")
    r = dict(RULES)
    r.update(rules or {})
    label = name or (name_or_cfg if isinstance(name_or_cfg, str) else "")
    cfg, logical = _family(name_or_cfg, head)[0], logical_params(name_or_cfg, head)
    dtypes = {n: torch.float32 if keeps_float32(cfg, n) else dtype for n in logical}
    return Layout.build(mesh, logical, r, dtype=dtypes,
                        layers_per_stage=layers_per_stage, name=label)
