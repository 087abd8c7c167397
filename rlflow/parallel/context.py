"""One rank of a layout as the model's execution context: the seams of ``rlflow.models.execution`` with
TP, EP and PP (Megatron), so ``models/decoder.py`` trains and generates sharded with no code of its own.

Legend: B batch, T tokens, D model dim, H / K query / key-value heads, Hl / Kl the local ones, d head dim,
N tokens, E experts, V vocab.

A rank holds ``shard_params(full, layout, rank)``: its shard of every parameter of its pp stage, cut by
the layout's specs (``rlflow.sharding.reference.shard_tensor``). ``context(layout, cfg)`` checks that the
layout is one the model executes (the ``executes`` column of ``models/sharding.py``), makes the process
groups, and records where the rank sits.

The seams, with tp > 1:
- attention: the block's input enters through ``copy_to`` (its gradient is summed over tp), the q/k/v
  projections of the local heads run, the row-parallel ``o_proj`` output leaves through ``reduce_from``.
  kv heads are sharded over tp when the layout says so (``K % tp == 0``) or replicated (rule
  ``kv_heads: None``, Megatron's kv replication when tp > K): each rank then slices the kv heads its
  query heads use from a ``copy_to`` of the full weight. Replicated weights used on local heads
  (q_norm, k_norm, replicated kv) enter through ``copy_to`` so their gradients are summed over tp.
- MoE: the router (replicated) runs on the replicated input; the experts' input and routing weights
  enter the expert region through ``copy_to`` (expert hidden dim over tp, experts over ep), ``ep.moe``
  dispatches by all-to-all, the output leaves through ``reduce_from`` over tp.
- MLA (DeepSeek): the query heads (``q_b_proj`` or ``q_proj``), the latent's expansion ``kv_b_proj`` and
  ``o_proj`` are split by heads; the latent projections and their norms are replicated and enter through
  ``copy_to`` (each rank uses them for its heads only). The latent KV cache is whole on every rank.
- dense MLP and DeepSeek's shared experts: column-parallel gate/up, row-parallel down.
- embedding and head: vocab-parallel (``tp.vocab_embedding``, ``tp.vocab_logprobs``); the logits for
  sampling are all-gathered over tp.
With ep > 1 the ranks of an ep group hold different rows, and every forward is an all-to-all among
them: ``any_rank`` lets the rollout engine keep them in lockstep.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from rlflow.models import lora
from rlflow.models.config import ModelConfig
from rlflow.models.execution import Exec, Params, View, lm_head
from rlflow.models.decoder import QKV_W
from rlflow.models.sharding import executable_specs
from rlflow.ops import head_linear
from rlflow.parallel import ep, pp, tp
from rlflow.parallel.collectives import all_gather, copy_to, copy_to_many, reduce_from
from rlflow.sharding.dist import all_reduce, create_groups, mesh_group
from rlflow.sharding.reference import shard_tensor
from rlflow.sharding.layout import Layout


def effective(layout: Layout, name: str) -> tuple[tuple[str, ...], ...]:
    """Per view dim, the axes of size > 1 the spec names (an axis of size 1 splits nothing)."""
    spec, mesh = layout[name].spec, layout.mesh
    return tuple(tuple(a for a in spec.dim_axes(e) if getattr(mesh, a) > 1) for e in spec)


def _on(layout: Layout, name: str, dim: int, axis: str) -> bool:
    return axis in effective(layout, name)[dim]


def query_weight(cfg: ModelConfig, layer: int) -> str:
    """The parameter that holds a layer's query heads (its split over tp is the attention's)."""
    q = "q_b_proj" if cfg.mla and cfg.q_lora_rank else "q_proj"
    return f"model.layers.{layer}.self_attn.{q}.weight"


def _check_mlp(layout: Layout, m: str) -> None:
    if effective(layout, m + "down_proj.weight")[1] != effective(layout, m + "gate_proj.weight")[0] or \
            effective(layout, m + "up_proj.weight") != effective(layout, m + "gate_proj.weight"):
        raise ValueError(f"params {m}gate/up/down_proj: the MLP width must be split alike")


def check_layout(layout: Layout, cfg: ModelConfig) -> None:
    """Raise ``ValueError`` naming the parameter unless every spec is one the model executes and the
    paired parameters agree (query/o_proj heads, expert gate_up/down, dense gate/up/down)."""
    for p in layout.params:
        allowed = executable_specs(cfg, p.name)
        eff = effective(layout, p.name)
        if allowed is None or eff not in allowed:
            raise ValueError(f"param {p.name}: spec {p.spec!r} (split over {eff} on {layout.mesh}) is not one "
                             f"rlflow.parallel executes; expected one of {sorted(allowed or ())}")
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        if cfg.is_moe_layer(i):
            gu, dn = effective(layout, m + "experts.gate_up_proj"), effective(layout, m + "experts.down_proj")
            if (gu[0], gu[2]) != (dn[0], dn[2]):
                raise ValueError(f"params {m}experts: gate_up_proj {gu} and down_proj {dn} are split differently")
            if cfg.n_shared_experts:
                _check_mlp(layout, m + "shared_experts.")
        else:
            _check_mlp(layout, m)
        if cfg.mla:
            q = query_weight(cfg, i)
            q_tp = _on(layout, q, 0, "tp")
            for n, d in ((a + "kv_b_proj.weight", 0), (a + "o_proj.weight", 1)):
                if _on(layout, n, d, "tp") != q_tp:
                    raise ValueError(f"param {n}: its heads must {'' if q_tp else 'not '}be split over tp, as "
                                     f"those of {q}")
            continue
        q_tp = _on(layout, a + "q_proj.weight", 0, "tp")
        kv_tp = _on(layout, a + "k_proj.weight", 0, "tp")
        want = {a + "o_proj.weight": (1, q_tp), a + "v_proj.weight": (0, kv_tp)}
        if cfg.attention_bias:
            want |= {a + "q_proj.bias": (0, q_tp), a + "k_proj.bias": (0, kv_tp), a + "v_proj.bias": (0, kv_tp)}
        for n, (d, split) in want.items():
            if _on(layout, n, d, "tp") != split:
                raise ValueError(f"param {n}: its heads must {'' if split else 'not '}be split over tp, as those "
                                 f"of {a}{'q' if 'o_proj' in n or 'q_proj' in n else 'k'}_proj.weight")
        if kv_tp and not q_tp:
            raise ValueError(f"param {a}k_proj.weight: kv heads split over tp need the query heads split too")
        if q_tp and not kv_tp:
            H, K, n = cfg.num_attention_heads, cfg.num_key_value_heads, layout.mesh.tp
            Hl, per_kv = H // n, H // K
            if Hl % per_kv and per_kv % Hl:
                raise ValueError(f"param {a}q_proj.weight: on tp={n}, {Hl} local query heads straddle groups of "
                                 f"{per_kv} query heads per kv head")


@dataclass(frozen=True, eq=False)
class LayoutExec(Exec):
    """Rank ``rank`` of ``layout``: where it sits, its process groups (None for an axis of size 1), and
    the seams of the model computed on its shards."""

    cfg: ModelConfig
    layout: Layout
    rank: int
    coords: dict
    tp: object
    ep: object
    loss_group: object  # ranks with this rank's tp index: every loss term once
    pp_group: object  # this rank's pipeline peers (the same data and tp index)
    stage_layers: tuple[int, ...]

    # ---- where the rank sits ----
    @property
    def pp_stage(self) -> int:
        return self.coords["pp"]

    @property
    def pp_stages(self) -> int:
        return self.layout.mesh.pp

    @property
    def first(self) -> bool:
        return self.pp_stage == 0

    @property
    def last(self) -> bool:
        return self.pp_stage == self.pp_stages - 1

    def peer(self, stage: int) -> int | None:
        if not 0 <= stage < self.pp_stages:
            return None
        return self.layout.mesh.rank(**{**self.coords, "pp": stage})

    def layers(self, cfg: ModelConfig) -> tuple[int, ...]:
        return self.stage_layers

    @property
    def collective_forward(self) -> bool:
        return self.tp is not None or self.ep is not None

    @property
    def tp_only(self) -> bool:
        return self.tp is not None and self.ep is None and self.pp_stages == 1

    @functools.cached_property
    def _effective(self) -> dict[str, tuple[tuple[str, ...], ...]]:
        """``effective`` of every parameter, once: the seams ask at every layer of every decode step."""
        return {p.name: effective(self.layout, p.name) for p in self.layout.params}

    def _split(self, name: str, dim: int, axis: str) -> bool:
        return axis in self._effective[name][dim]

    def _tp_if(self, name: str, dim: int):
        return self.tp if self.tp is not None and self._split(name, dim, "tp") else None

    def _adapters(self, params: Params, module: str, g, rows: tuple[int, int] | None = None) -> Params:
        """``module``'s LoRA factors as this rank uses them in a block split over tp (group ``g``): a factor the
        layout replicates (A of a column-parallel weight, B of a row-parallel one, both of a replicated kv
        weight) enters through ``copy_to``, since each rank's gradient of it is a part of the whole; ``rows``:
        the output rows this rank uses of a replicated B (the kv heads its query heads read)."""
        out = {}
        for f in (lora.A, lora.B):
            n = module + f
            if n in params:
                t = params[n]
                if not any("tp" in e for e in self._effective[n]):
                    t = copy_to(t, g)
                    if rows is not None and f == lora.B:
                        t = t[rows[0]:rows[1]]
                out[n] = t
        return out

    # ---- attention ----
    def _kv_slice(self, cfg: ModelConfig, layer: int) -> tuple[int, int] | None:
        """[lo, hi) of the kv heads this rank's query heads use, when kv heads are replicated over a tp
        that splits the query heads; None when they are split alike (or tp does not split them)."""
        a = f"model.layers.{layer}.self_attn."
        if cfg.mla or self._tp_if(a + "q_proj.weight", 0) is None or self._split(a + "k_proj.weight", 0, "tp"):
            return None
        n, ti = self.layout.mesh.tp, self.coords["tp"]
        Hl, per_kv = cfg.num_attention_heads // n, cfg.num_attention_heads // cfg.num_key_value_heads
        return ti * Hl // per_kv, ((ti + 1) * Hl - 1) // per_kv + 1

    def heads(self, cfg: ModelConfig, layer: int) -> tuple[int, int]:
        H, K = cfg.num_attention_heads, cfg.num_key_value_heads
        if self._tp_if(query_weight(cfg, layer), 0) is None:
            return H, K
        kv = self._kv_slice(cfg, layer)
        n = self.layout.mesh.tp
        return H // n, (K // n if kv is None else kv[1] - kv[0])

    def attention_view(self, params: Params, cfg: ModelConfig, layer: int) -> View:
        a = f"model.layers.{layer}.self_attn."
        g = self._tp_if(query_weight(cfg, layer), 0)
        Hl, Kl = self.heads(cfg, layer)
        if g is None:
            return View(params, Hl, Kl)
        enter, leave = (lambda x: copy_to(x, g)), (lambda y: reduce_from(y, g))
        if cfg.mla:  # the replicated latent weights serve this rank's heads: their gradients sum over tp
            shared = ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight") + (
                ("q_a_proj.weight", "q_a_layernorm.weight") if cfg.q_lora_rank else ())
            loc = {a + w: copy_to(params[a + w], g) for w in shared}
            for w in (query_weight(cfg, layer), a + "kv_b_proj.weight", a + "o_proj.weight"):
                loc[w] = params[w]
            return View(loc, Hl, Kl, enter, leave)
        if a + QKV_W in params:  # ``fuse_for_inference`` stacked this rank's weights already
            return View(params, Hl, Kl, enter, leave)
        loc = {a + "q_proj.weight": params[a + "q_proj.weight"], a + "o_proj.weight": params[a + "o_proj.weight"]}
        names = ["q_proj.bias"] if cfg.attention_bias else []
        kv = self._kv_slice(cfg, layer)
        kv_names = ["k_proj.weight", "v_proj.weight"] + (["k_proj.bias", "v_proj.bias"] if cfg.attention_bias else [])
        d = cfg.head_dim
        if kv is None:
            names += kv_names
        else:  # kv heads replicated: the ones this rank's query heads use
            for w in kv_names:
                loc[a + w] = copy_to(params[a + w], g)[kv[0] * d:kv[1] * d]
        for w in names:
            loc[a + w] = params[a + w]
        if cfg.lora is not None:
            rows = None if kv is None else (kv[0] * d, kv[1] * d)
            for m, r in (("q_proj", None), ("k_proj", rows), ("v_proj", rows), ("o_proj", None)):
                loc.update(self._adapters(params, a + m, g, r))
        if cfg.qk_norm:
            norms = [a + "q_norm.weight", a + "k_norm.weight"]
            loc.update(zip(norms, copy_to_many([params[w] for w in norms], g)))
        return View(loc, Hl, Kl, enter, leave)

    # ---- MLP and experts ----
    def mlp_view(self, params: Params, cfg: ModelConfig, layer: int, prefix: str = "mlp.") -> View:
        p = f"model.layers.{layer}.{prefix}"
        g = self._tp_if(p + "gate_proj.weight", 0)
        if g is None:
            return View(params)
        if cfg.lora is not None:
            loc = {p + m + ".weight": params[p + m + ".weight"] for m in ("gate_proj", "up_proj", "down_proj")}
            for m in ("gate_proj", "up_proj", "down_proj"):
                loc.update(self._adapters(params, p + m, g))
            params = loc
        return View(params, enter=lambda x: copy_to(x, g), leave=lambda y: reduce_from(y, g))

    def experts(self, params: Params, cfg: ModelConfig, layer: int, x_ND: Tensor, w_NK: Tensor,
                idx_NK: Tensor) -> Tensor:
        m = f"model.layers.{layer}.mlp."
        gt = self._tp_if(m + "experts.gate_up_proj", 2)
        ge = self.ep if self.ep is not None and self._split(m + "experts.gate_up_proj", 0, "ep") else None
        if gt is None and ge is None:
            return super().experts(params, cfg, layer, x_ND, w_NK, idx_NK)
        x_ND, w_NK = copy_to_many([x_ND, w_NK], gt)
        y = ep.moe(x_ND, w_NK, idx_NK, params[m + "experts.gate_up_proj"],
                   params[m + "experts.down_proj"], cfg.num_experts, ge)
        return reduce_from(y, gt)

    # ---- embedding and head ----
    def embed(self, params: Params, cfg: ModelConfig, ids: Tensor) -> Tensor:
        return tp.vocab_embedding(ids, params["model.embed_tokens.weight"], cfg.vocab_size,
                                  self._tp_if("model.embed_tokens.weight", 0))

    def _head_group(self, cfg: ModelConfig):
        return self._tp_if("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight", 0)

    def logits(self, params: Params, cfg: ModelConfig, h: Tensor) -> Tensor:
        z = head_linear(*lora.head(params, cfg, h, lm_head(params, cfg)))  # [..., Vl]
        return all_gather(z, z.dim() - 1, self._head_group(cfg))

    def logprobs(self, params: Params, cfg: ModelConfig, h_ND: Tensor, targets_N: Tensor, *,
                 temperature: float = 1.0, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        # the head's adapter A enters replicated: vocab_logprobs sums the hidden states' gradient (hence A's) over tp
        return tp.vocab_logprobs(*lora.head(params, cfg, h_ND, lm_head(params, cfg)), targets_N, cfg.vocab_size,
                                 self._head_group(cfg), temperature=temperature, with_entropy=with_entropy)

    # ---- lockstep ----
    def any_rank(self, flag: bool) -> bool:
        if self.ep is None:
            return flag
        return bool(all_reduce(torch.tensor([int(flag)]), op=dist.ReduceOp.MAX, group=self.ep).item())


def context(layout: Layout, cfg: ModelConfig, rank: int | None = None) -> LayoutExec:
    """Check the layout, make every process group it needs (``create_groups``: the same calls in the same
    order on every rank), and return this rank's execution context."""
    check_layout(layout, cfg)
    mesh = layout.mesh
    create_groups([mesh])
    rank = dist.get_rank() if rank is None else rank
    c = mesh.coords(rank)
    return LayoutExec(cfg=cfg, layout=layout, rank=rank, coords=c, tp=mesh_group(mesh, ("tp",)),
                      ep=mesh_group(mesh, ("ep",)), loss_group=mesh_group(mesh, ("pp", "dp", "ep")),
                      pp_group=mesh_group(mesh, ("pp",)),
                      stage_layers=pp.layers_of_stage(layout, cfg.num_hidden_layers, c["pp"]))


def shard_params(full: Params, layout: Layout, rank: int) -> Params:
    """Rank ``rank``'s shards of ``full`` (the parameters of its stage only), stored shapes."""
    out = {}
    for n in layout.names:
        t = shard_tensor(full[n], layout, n, rank)
        if t is not None:
            out[n] = t
    return out


__all__ = ["LayoutExec", "check_layout", "context", "effective", "shard_params"]
