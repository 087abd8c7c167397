"""LoRA: low-rank adapters trained on a frozen base, as data (``ModelConfig.lora``) and one function (the
output an adapted module adds, ``add_delta``), in peft's names, shapes and initialization.

An adapted module ``m`` (e.g. ``model.layers.3.self_attn.q_proj``) has beside its ``m.weight`` [out, in]
the factors ``m.lora_A.weight`` [r, in] and ``m.lora_B.weight`` [out, r] (peft's keys, less its
``base_model.model.`` prefix); its output becomes ``x W^T + s dropout(x) A^T B^T`` with ``s = alpha / r``.
A starts as peft's (kaiming-uniform, bound 1 / sqrt(in)) and B as zeros, so a fresh adapter leaves the
base's outputs exactly as they are.

The adapters are parameters like any other: ``models/sharding.py`` derives their rows from their base's
(A splits its ``in`` like the base, B its ``out``; the rank is never split), so they follow the base in
every layout and the transition plans move them. A run's params hold the base and the adapters; when
they hold adapters the base is frozen (``frozen``: no gradient, no optimizer state) and the reference
policy of KL is the base itself (``base``: the adapters left out), never a second copy.

Targets are peft's ``target_modules`` names of the decoder's linear projections (``TARGETS``, the default)
and of the output head (``HEAD``, when asked: an untied head's [V, D] weight, adapted like a projection; its
logits are computed by ``ops.head_linear`` from the hidden states with the adapter's rank-wide intermediate
beside them, ``head``, so the chunked and vocab-parallel log-probs never build the adapted [V, D] weight). The
routed experts (stacked parameters, not modules), the router, the embedding, a head tied to it, and MLA's
projections are not adapted and are refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = TARGETS[:4]
HEAD = "lm_head"
ADAPTABLE = TARGETS + (HEAD,)  # every name a target may take, in forward order
A, B = ".lora_A.weight", ".lora_B.weight"

# peft names that are not a dense projection rlflow adapts, and why
_REFUSED = {
    "experts": "the routed experts are stacked parameters, not modules",
    "gate": "the MoE router is not adapted (its choices would drift from the rollout's routes)",
    "embed_tokens": "the embedding is not adapted",
}


@dataclass(frozen=True)
class LoraConfig:
    """``rank`` r, ``alpha`` (the scale is alpha / r, peft's), ``targets`` (peft's ``target_modules``, the
    module names' last part; None: every one of ``TARGETS`` the model has; ``HEAD`` adapts the head) and
    ``dropout`` on the adapters' input while training."""
    rank: int
    alpha: float
    targets: tuple[str, ...] | None = None
    dropout: float = 0.0

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank={self.rank!r}: must be an int >= 1")
        if not 0 < self.alpha < math.inf:
            raise ValueError(f"LoraConfig.alpha={self.alpha!r}: must be finite and > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoraConfig.dropout={self.dropout!r}: must be in [0, 1)")
        if self.targets is not None:
            if not self.targets:
                raise ValueError("LoraConfig.targets=(): name at least one module (or None: all of them)")
            for t in self.targets:
                if t in _REFUSED:
                    raise ValueError(f"LoraConfig.targets: {t!r}: {_REFUSED[t]}; adaptable: "
                                     f"{', '.join(ADAPTABLE)}")
                if t not in ADAPTABLE:
                    raise ValueError(f"LoraConfig.targets: {t!r} is no linear projection of the decoder; adaptable: "
                                     f"{', '.join(ADAPTABLE)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def is_adapter(name: str) -> bool:
    return name.endswith((A, B))


def module_of(name: str) -> str:
    """The adapted module of an adapter factor's name (``...q_proj.lora_A.weight`` -> ``...q_proj``)."""
    return name[:-len(A)]


def modules(cfg, base_shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The modules ``cfg.lora`` adapts, in forward order, from the base's parameter shapes. Raises naming the
    target when one names no module of the model, or an MLA projection."""
    lc = cfg.lora
    wanted = lc.targets or TARGETS
    out, hit = [], set()
    for n in base_shapes:
        if not (n.endswith(".weight") and ".layers." in n):
            continue
        m = n[:-len(".weight")]
        last = m.rsplit(".", 1)[1]
        if last in wanted and len(base_shapes[n]) == 2:
            if cfg.mla and last in ATTENTION:
                raise ValueError(f"LoraConfig.targets: {last!r} is an MLA projection of {cfg.model_type}; rlflow "
                                 "adapts the MLP's projections of MLA models only")
            out.append(m)
            hit.add(last)
    if HEAD in wanted:
        if cfg.tie_word_embeddings:
            raise ValueError(f"LoraConfig.targets: {HEAD!r}: this {cfg.model_type} model's head is its embedding "
                             "(tied), which is not adapted")
        out.append(HEAD)
        hit.add(HEAD)
    if lc.targets is not None and (missing := [t for t in lc.targets if t not in hit]):
        raise ValueError(f"LoraConfig.targets: {missing[0]!r} names no module of this {cfg.model_type} model"
                         + (" (its MLP layers are all routed experts)" if missing[0] in TARGETS[4:] else ""))
    if not out:
        raise ValueError(f"LoraConfig.targets: none of {', '.join(wanted)} is a module of this model")
    return out


def with_adapters(cfg, base_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``base_shapes`` with each adapted module's A [r, in] and B [out, r] after its weight (forward order);
    ``base_shapes`` itself when ``cfg.lora`` is None."""
    if cfg.lora is None:
        return base_shapes
    r, adapted = cfg.lora.rank, set(modules(cfg, base_shapes))
    out = {}
    for n, s in base_shapes.items():
        out[n] = s
        if n.endswith(".weight") and n[:-len(".weight")] in adapted:
            m = n[:-len(".weight")]
            out[m + A], out[m + B] = (r, s[1]), (s[0], r)
    return out


def init(cfg, base_shapes: dict[str, tuple[int, ...]], *, seed: int = 0,
         device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """Fresh adapters, float32 (as peft keeps them): A ~ U(-1/sqrt(in), 1/sqrt(in)) (peft's kaiming-uniform
    with a = sqrt(5)), B = 0."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for n, s in with_adapters(cfg, base_shapes).items():
        if n.endswith(A):
            bound = 1 / math.sqrt(s[1])
            out[n] = (torch.rand(s, generator=g) * 2 - 1).mul_(bound).to(device)
        elif n.endswith(B):
            out[n] = torch.zeros(s, device=device)
    return out


def add_delta(params: dict[str, Tensor], cfg, module: str, x: Tensor, y: Tensor, lo: int = 0) -> Tensor:
    """``y`` with what ``module``'s adapters output for input ``x`` [..., in] added into its columns from ``lo``
    (``y`` [..., out or more], contiguous: a projection's output, which no backward reads): one fused
    multiply-add over the rank-wide intermediate (computed in the adapters' dtype and scaled), no output-sized
    temporary; out of place for a whole output (a gradient copy fewer in the backward), in place into a
    stacked output's columns. ``y`` itself when ``module`` is not adapted or its adapters are not in ``params``
    (the base alone)."""
    a = params.get(module + A)
    if a is None:
        return y
    lc, b = cfg.lora, params[module + B]
    h = x.reshape(-1, x.shape[-1]).to(a.dtype)
    if lc.dropout and torch.is_grad_enabled():
        h = F.dropout(h, lc.dropout)
    xa = (F.linear(h, a) * lc.scale).to(y.dtype)  # [N, r]
    y2 = y.view(-1, y.shape[-1])
    if lo == 0 and b.shape[0] == y2.shape[1]:
        return torch.addmm(y2, xa, b.t().to(y.dtype)).view(y.shape)
    y2[:, lo:lo + b.shape[0]].addmm_(xa, b.t().to(y.dtype))
    return y


def head(params: dict[str, Tensor], cfg, h: Tensor, w: Tensor) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor]]:
    """The output head as ``ops.head_linear`` takes it: ``(h, w)`` (the head's weight ``w`` [V, D], or this
    rank's vocab rows of it), or with the head's adapters ``([h | s dropout(h) A^T], (w, B))``, the hidden
    states [..., D] and the rank-wide intermediate side by side [..., D + r]: the logits' ``h w^T + u B^T``
    with no adapted copy of the [V, D] weight."""
    a = params.get(HEAD + A)
    if a is None:
        return h, w
    x = h.to(a.dtype)
    if cfg.lora.dropout and torch.is_grad_enabled():
        x = F.dropout(x, cfg.lora.dropout)
    return torch.cat([h, (F.linear(x, a) * cfg.lora.scale).to(h.dtype)], -1), (w, params[HEAD + B])


def linear(params: dict[str, Tensor], cfg, module: str, x: Tensor) -> Tensor:
    """``module``'s output: its weight and bias, plus its adapters'."""
    y = F.linear(x, params[module + ".weight"], params.get(module + ".bias"))
    return y if cfg.lora is None else add_delta(params, cfg, module, x, y)


def add_stacked(params: dict[str, Tensor], cfg, modules_: list[str], widths: list[int], y: Tensor, x: Tensor
                ) -> Tensor:
    """``y`` [..., sum(widths)], the output of modules whose weights are stacked into one matmul (q, k, v), with
    each adapted module's adapters added into its columns."""
    if cfg.lora is not None:
        for m, lo in zip(modules_, [sum(widths[:i]) for i in range(len(widths))]):
            add_delta(params, cfg, m, x, y, lo)
    return y


def base(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """``params`` without the adapters: the base model (LoRA's reference policy)."""
    return {k: v for k, v in params.items() if not is_adapter(k)}


def adapters(params: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in params.items() if is_adapter(k)}


def has_adapters(params) -> bool:
    return any(map(is_adapter, params))


def frozen(params) -> set[str]:
    """The names a run does not train: the base when ``params`` hold adapters, else none."""
    return {k for k in params if not is_adapter(k)} if has_adapters(params) else set()


def stages_problem(layout, cfg) -> str | None:
    """Why ``cfg.lora``'s adapters cannot train in ``layout`` (a ``sharding.Layout``), or None: each pipeline
    stage must hold some, since a rank tells its frozen weights from its params (``frozen``) and one with no
    adapters would train them all (``lm_head`` alone sits on the last stage)."""
    held = {layout[n].stage for n in layout.names if is_adapter(n)}
    if missing := sorted(set(range(layout.mesh.pp)) - held):
        return (f"pipeline stage {missing[0]} of {layout.mesh.pp} holds none of the LoRA adapters of "
                f"{', '.join(cfg.lora.targets or TARGETS)}: adapt a per-layer projection too, or train without pp")
    return None


def trainable(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """What the optimizer steps: the adapters when there are any, else every parameter."""
    off = frozen(params)
    return {k: v for k, v in params.items() if k not in off}


__all__ = ["A", "ADAPTABLE", "ATTENTION", "B", "HEAD", "LoraConfig", "TARGETS", "adapters", "add_delta",
           "add_stacked", "base", "frozen", "has_adapters", "head", "init", "is_adapter", "linear", "module_of",
           "modules", "stages_problem", "trainable", "with_adapters"]
