"""The decoder of every model family rlflow runs, as pure functions over a params dict: Qwen3-MoE, dense
Qwen2 / Qwen2.5 / Qwen3, and DeepSeek-V3 (its attention is MLA, ``models/deepseek.py``; its MoE block
routes by sigmoid scores in groups and adds shared experts). The config's switches pick the variant.

Legend: B batch, T tokens of this call, S key positions (cache), D model dim, H query heads,
K key/value heads, d head dim, V vocab, N = B*T tokens, E experts.

``params`` maps transformers' parameter names (see ``models/shapes.py: param_shapes``) to tensors. The
functions hold no layout code: where a layout changes the computation (the q/k/v and output
projections, the experts, the embedding and the head, the layers of a pipeline stage) they call the
execution context ``ex`` (``models/execution.py``; unsharded by default, one rank of a layout with
``rlflow.parallel.context``). The same functions train and generate, sharded or not. The per-model
table of logical dims and executable specs is ``models/sharding.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rlflow.models import deepseek, lora
from rlflow.models.config import ModelConfig
from rlflow.models.execution import EXPERTS_PREPARED, LOCAL, Exec, Params, View, n_moe_layers
from rlflow.models.shapes import keeps_float32, param_shapes
from rlflow.ops import (attention, causal_padding_mask, prepare_experts, qk_norm_rope, replay_routes, rmsnorm,
                        rope_cos_sin, route, route_grouped)


def init_params(cfg: ModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", std: float = 0.02) -> Params:
    """Random init as transformers does: N(0, std) for matrices, ones for norms, zeros for biases."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out: Params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias") or name.endswith("e_score_correction_bias"):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=g) * std
        out[name] = t.to(device=device, dtype=torch.float32 if keeps_float32(cfg, name) else dtype)
    return out


@dataclass
class KVCache:
    """Preallocated keys/values per layer, [B, K, S_max, d] (K: the kv heads this process computes; None
for the layers of other pipeline stages), written in place by ``forward``. With MLA a layer's ``k`` is
the latent and the shared rotary key [B, 1, S_max, r + p] and its ``v`` None (``models/deepseek.py``).

    Each row is stored unpadded from column 0; ``lengths_B`` counts its filled positions, so rows may be
    at different lengths (continuous batching refills a row while others decode). ``bound`` is a
    host-side upper bound on ``lengths_B.max()``: attention spans columns [0, bound + T) only.
    """

    k: list[Tensor]
    v: list[Tensor]
    lengths_B: Tensor  # int64
    bound: int = 0

    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, max_len: int, *, dtype: torch.dtype,
                 device: torch.device | str, ex: Exec = LOCAL) -> "KVCache":
        mine = set(ex.layers(cfg))

        def buf(i, width):
            heads = 1 if cfg.mla else ex.heads(cfg, i)[1]
            return torch.zeros((batch, heads, max_len, width), dtype=dtype, device=device) if i in mine else None
        L = cfg.num_hidden_layers
        if cfg.mla:
            k, v = [buf(i, cfg.kv_lora_rank + cfg.qk_rope_head_dim) for i in range(L)], [None] * L
        else:
            k, v = [buf(i, cfg.head_dim) for i in range(L)], [buf(i, cfg.head_dim) for i in range(L)]
        return cls(k=k, v=v, lengths_B=torch.zeros(batch, dtype=torch.long, device=device))

    @property
    def max_len(self) -> int:
        return next(t for t in self.k if t is not None).shape[2]

    def buffers(self) -> list[Tensor]:
        """Every allocated buffer (the lengths included)."""
        return [t for t in (*self.k, *self.v) if t is not None] + [self.lengths_B]

    def copy_rows(self, dst_B: Tensor, src: "KVCache", src_B: Tensor, n: int) -> None:
        """Rows ``dst_B`` take ``src``'s rows ``src_B``, their first n positions and their lengths."""
        for mine, theirs in zip((*self.k, *self.v), (*src.k, *src.v)):
            if mine is not None:
                mine[dst_B, :, :n] = theirs[src_B]
        self.lengths_B[dst_B] = src.lengths_B[src_B]


@dataclass
class Routing:
    """What one forward does with its MoE layers' expert choices (M: the model's MoE layers, K: top-k).

    ``record``: the rollout keeps each token's experts in ``chosen`` [B, T, M, K] (int16, -1 on padding
    and on the MoE layers of other pipeline stages). ``rollout`` [B, T, M, K] (-1: no record for that
    token): the experts the rollout chose for these tokens; with ``replay`` the tokens go to them
    (Rollout Routing Replay, ``ops.replay_routes``), otherwise they are only compared. Out of
    ``compared`` (token, layer) pairs with a record, ``router_flipped`` counts those whose router top-k
    (as a set) differs from the rollout's, ``flipped`` those routed to other experts than the rollout's
    (the same without replay; none with it)."""

    record: bool = False
    rollout: Tensor | None = None
    replay: bool = False
    chosen: Tensor | None = None
    flipped: Tensor | int = 0  # tensors: no host sync per layer
    router_flipped: Tensor | int = 0
    compared: Tensor | int = 0

    def route(self, cfg: ModelConfig, layer: int, x_ND: Tensor, gate_ED: Tensor, w_NK: Tensor, idx_NK: Tensor,
              sel_N: Tensor | None, BT: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """The weights and experts of MoE layer ``layer``'s tokens (``sel_N``: their positions in the [B*T]
        flattening, None: all), given the router's own (w_NK, idx_NK)."""
        m, K = moe_index(cfg, layer), idx_NK.shape[1]
        if self.rollout is not None:
            r_NK = self.rollout[:, :, m].reshape(-1, K)
            r_NK = r_NK if sel_N is None else r_NK.index_select(0, sel_N)
            seen = (r_NK >= 0).all(-1)
            want = r_NK.long().sort(-1)[0]

            def differs(idx):
                return ((idx.sort(-1)[0] != want).any(-1) & seen).sum()
            # a remat recompute counts twice, the numerators and the denominator alike: the shares hold
            self.router_flipped = self.router_flipped + differs(idx_NK)
            self.compared = self.compared + seen.sum()
            if self.replay:
                w_NK, idx_NK = replay_routes(x_ND, gate_ED, idx_NK, r_NK, sigmoid=cfg.scoring_func == "sigmoid",
                                             norm_topk_prob=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor)
            self.flipped = self.flipped + differs(idx_NK)
        if self.record:
            if self.chosen is None:
                self.chosen = torch.full((*BT, n_moe_layers(cfg), K), -1, dtype=torch.int16, device=idx_NK.device)
            flat = self.chosen.view(-1, self.chosen.shape[2], K)[:, m]
            if sel_N is None:
                flat.copy_(idx_NK)
            else:
                flat.index_copy_(0, sel_N, idx_NK.to(torch.int16))
        return w_NK, idx_NK


def moe_index(cfg: ModelConfig, layer: int) -> int:
    """The ordinal of MoE layer ``layer`` among the model's MoE layers."""
    return sum(cfg.is_moe_layer(i) for i in range(layer))


# Derived keys that ``fuse_for_inference`` adds; the forward uses them when present, else builds them
# (``EXPERTS_PREPARED``: the experts' inference form, handed to ``moe_experts`` when present).
QKV_W, QKV_B, QK_NORM = "qkv_proj.weight", "qkv_proj.bias", "qk_norm.weight"


def fused_attention_weights(view: View, cfg: ModelConfig, p: str) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The view's q/k/v projections stacked [(H + 2K) d, D] (one matmul), and q_norm/k_norm as one
    [(H + K), d] weight, H and K being the view's heads."""
    params, H, K = view.params, view.heads, view.kv_heads
    w = params.get(p + QKV_W)
    if w is None:
        w = torch.cat([params[p + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")])
    bias = params.get(p + QKV_B)
    if bias is None and cfg.attention_bias:
        bias = torch.cat([params[p + n + ".bias"] for n in ("q_proj", "k_proj", "v_proj")])
    norm = params.get(p + QK_NORM)
    if norm is None and cfg.qk_norm:
        norm = torch.cat([params[p + "q_norm.weight"].expand(H, -1), params[p + "k_norm.weight"].expand(K, -1)])
    return w, bias, norm


def fuse_for_inference(params: Params, cfg: ModelConfig, ex: Exec = LOCAL) -> Params:
    """params plus the stacked attention weights, computed once (the rollout engine's decode loop would
    otherwise stack them at every token), and each MoE layer's experts in the form the inference kernels
    want (``ops.prepare_experts``, opaque here). The extra keys are derived and never saved. In a layout
    (``ex``): of this process's layers and heads."""
    out = dict(params)
    for i in ex.layers(cfg):
        p = f"model.layers.{i}.self_attn."
        if not cfg.mla:  # MLA's projections stay apart (models/deepseek.py)
            w, b, n = fused_attention_weights(ex.attention_view(params, cfg, i), cfg, p)
            out[p + QKV_W] = w
            if b is not None:
                out[p + QKV_B] = b
            if n is not None:
                out[p + QK_NORM] = n
        m = f"model.layers.{i}.mlp."
        if cfg.is_moe_layer(i):
            prep = prepare_experts(params[m + "experts.gate_up_proj"], params[m + "experts.down_proj"])
            if prep is not None:
                out[m + EXPERTS_PREPARED] = prep
    return out


def qk_v_heads(view: View, cfg: ModelConfig, p: str, x_TD: Tensor, cos_Td: Tensor, sin_Td: Tensor
               ) -> tuple[Tensor, Tensor]:
    """qk [..., T, H + K, d] (the query heads, then the key heads) and v [..., T, K, d] of x's tokens for
    the view's H query and K key/value heads, token-major (any leading dims: [B, T, D] or packed [N, D]);
    q and k per-head normed (Qwen3) and rotated by cos/sin [..., T, d]."""
    H, K, d = view.heads, view.kv_heads, cfg.head_dim
    w, bias, norm = fused_attention_weights(view, cfg, p)
    qkv = lora.add_stacked(view.params, cfg, [p + "q_proj", p + "k_proj", p + "v_proj"], [H * d, K * d, K * d],
                           F.linear(x_TD, w, bias), x_TD).unflatten(-1, (H + 2 * K, d))
    return qk_norm_rope(qkv, norm, cos_Td, sin_Td, H + K, cfg.rms_norm_eps)  # per-head norm weights [H+K, d]


def attention_block(params: Params, cfg: ModelConfig, layer: int, x_BTD: Tensor, cos: Tensor, sin: Tensor,
                    mask: Tensor | None, cache: KVCache | None, cache_slots=None, ex: Exec = LOCAL) -> Tensor:
    """Self-attention of x's tokens (and, with a cache, of the cached ones before them), on the heads
    ``ex`` gives this process."""
    p = f"model.layers.{layer}.self_attn."
    view = ex.attention_view(params, cfg, layer)
    if cfg.mla:
        return view.leave(deepseek.attention_block(view, cfg, layer, view.enter(x_BTD), cos, sin, mask, cache,
                                                   cache_slots))
    qk, v = qk_v_heads(view, cfg, p, view.enter(x_BTD), cos, sin)  # [B, T, heads, d]
    q, k = qk.split([view.heads, view.kv_heads], dim=-2)
    if cache is not None:
        rows, cols, span = cache_slots  # index_put_ (not scatter_): torch.compile keeps it in place
        cache.k[layer][rows, :, cols] = k  # [B, T, K, d] at each row's own columns
        cache.v[layer][rows, :, cols] = v
        k, v = cache.k[layer][:, :, :span], cache.v[layer][:, :, :span]
    else:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    o = attention(q.transpose(1, 2), k, v, mask, is_causal=True)  # [B, H, T, d]
    return view.leave(lora.linear(view.params, cfg, p + "o_proj", o.transpose(1, 2).flatten(2)))


def real_tokens(valid_BT: Tensor | None) -> Tensor | None:
    """Flat indices of the real (unpadded) tokens of [B, T], or None when there is no padding to drop
    (no mask, one token per row, or all valid). Computed once per forward: it syncs with the host."""
    if valid_BT is None or valid_BT.shape[1] == 1 or bool(valid_BT.all()):
        return None
    return valid_BT.reshape(-1).nonzero()[:, 0]


def swiglu(params: Params, cfg: ModelConfig, layer: int, x: Tensor, ex: Exec = LOCAL, *,
           prefix: str = "mlp.") -> Tensor:
    """A dense SwiGLU MLP (a layer's ``mlp.``, or DeepSeek's ``mlp.shared_experts.``) on this process's
    part of its width."""
    p = f"model.layers.{layer}.{prefix}"
    view = ex.mlp_view(params, cfg, layer, prefix)
    x = view.enter(x)
    h = F.silu(lora.linear(view.params, cfg, p + "gate_proj", x)) * lora.linear(view.params, cfg, p + "up_proj", x)
    return view.leave(lora.linear(view.params, cfg, p + "down_proj", h))


def mlp_block(params: Params, cfg: ModelConfig, layer: int, x_BTD: Tensor, real_N: Tensor | None,
              with_aux: bool, ex: Exec = LOCAL, routing: Routing | None = None) -> tuple[Tensor, Tensor]:
    """Dense SwiGLU MLP, or the MoE block: padding tokens dropped (``real_N``: ``real_tokens(valid)``),
    top-k routing with the (replicated) router (softmax; DeepSeek's sigmoid in groups; ``routing``:
    recorded, or replayed from the rollout), the routed experts through ``ex.experts``, plus the shared
    experts when the model has them."""
    p = f"model.layers.{layer}.mlp."
    if not cfg.is_moe_layer(layer):
        return swiglu(params, cfg, layer, x_BTD, ex), x_BTD.new_zeros((), dtype=torch.float32)
    B, T, D = x_BTD.shape
    x_ND = x_BTD.reshape(B * T, D)
    sel = real_N
    if sel is not None:  # padding tokens are neither routed nor computed
        x_ND = x_ND.index_select(0, sel)
    if cfg.scoring_func == "sigmoid":
        w_NK, idx_NK, aux = route_grouped(x_ND, params[p + "gate.weight"], params[p + "gate.e_score_correction_bias"],
                                          cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                                          cfg.routed_scaling_factor)
    else:
        w_NK, idx_NK, aux = route(x_ND, params[p + "gate.weight"], cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                  with_aux=with_aux)
    if routing is not None:
        w_NK, idx_NK = routing.route(cfg, layer, x_ND, params[p + "gate.weight"], w_NK, idx_NK, sel, (B, T))
    y = ex.experts(params, cfg, layer, x_ND, w_NK, idx_NK)
    if cfg.n_shared_experts:
        y = y + swiglu(params, cfg, layer, x_ND, ex, prefix="mlp.shared_experts.")
    if sel is not None:
        y = x_BTD.new_zeros(B * T, D).index_copy(0, sel, y)
    return y.view(B, T, D), aux


@dataclass(frozen=True)
class LayerInputs:
    """What every decoder layer of one forward shares besides the hidden states: the rotary tables, the
    attention mask, the KV cache and the slots this forward writes, the real tokens (MoE), whether the router
    aux loss is computed, the execution context and the MoE routing (recorded or replayed)."""
    cos: Tensor
    sin: Tensor
    mask: Tensor | None
    cache: KVCache | None
    cache_slots: tuple | None
    real_N: Tensor | None
    with_aux: bool
    ex: Exec
    routing: Routing | None = None


def decoder_layer(params: Params, cfg: ModelConfig, i: int, h: Tensor, x: LayerInputs) -> tuple[Tensor, Tensor]:
    p = f"model.layers.{i}."
    h = h + attention_block(params, cfg, i, rmsnorm(h, params[p + "input_layernorm.weight"], cfg.rms_norm_eps),
                            x.cos, x.sin, x.mask, x.cache, x.cache_slots, x.ex)
    m, aux = mlp_block(params, cfg, i, rmsnorm(h, params[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps),
                       x.real_N, x.with_aux, x.ex, x.routing)
    return h + m, aux


def forward(params: Params, cfg: ModelConfig, ids_BT: Tensor, positions_BT: Tensor, *,
            valid_BT: Tensor | None = None, cache: KVCache | None = None, with_aux: bool = True,
            remat: bool = False, ex: Exec = LOCAL, h_in: Tensor | None = None,
            routing: Routing | None = None) -> tuple[Tensor, Tensor, KVCache | None]:
    """Final hidden states [B, T, D] (after the last norm), the router aux loss, and the cache.

    positions_BT: rotary positions (for left-padded rows, ``cumsum(valid) - 1``; with a cache,
    ``cache.lengths_B[:, None] + arange(T)``).
    valid_BT: True on real tokens. Without a cache, rows are left-padded and None means no padding.
    With a cache, rows are right-padded: row b's tokens go to columns lengths_B[b] + t, each query sees
    the columns up to its own, and lengths_B advances by the row's valid count (padding written past
    it is overwritten later). The returned cache is the same buffers with lengths and bound advanced.
    with_aux: compute the router load-balancing loss (off in decode, where nothing uses it). It is the
    sum over this process's MoE layers divided by the model's number of MoE layers: the mean over the
    layers, and over pipeline stages the stages' values add up to it.
    remat: recompute each layer's activations in the backward pass instead of storing them
    (activation checkpointing, for long sequences).
    ex: the execution context (``models/execution.py``). A pipeline stage other than the first starts
    from ``h_in`` [B, T, D] (the previous stage's output); one other than the last returns its layers'
    output without the final norm.
    routing: the MoE layers' expert choices recorded, or replayed from the rollout (``Routing``).
    """
    B, T = ids_BT.shape
    if ex.first:
        h = ex.embed(params, cfg, ids_BT)
    elif h_in is None:
        raise ValueError("forward: a pipeline stage after the first needs h_in, the previous stage's output")
    else:
        h = h_in
    cos, sin = rope_cos_sin(positions_BT, cfg.head_dim, cfg.rope_theta, h.dtype, cfg.rope_scaling)
    cache_slots = None
    if cache is not None:
        span = min(cache.bound + T, cache.max_len)
        if T > cache.max_len:
            raise ValueError(f"KVCache overflow: {T} tokens > max_len {cache.max_len}")
        cols = cache.lengths_B[:, None] + torch.arange(T, device=ids_BT.device)  # [B, T]
        mask = (torch.arange(span, device=ids_BT.device) <= cols[:, :, None])[:, None]  # [B, 1, T, span]
        torch._assert_async((cols[:, -1] < cache.max_len).all(), "KVCache overflow: a row would write past max_len")
        cache_slots = (torch.arange(B, device=ids_BT.device)[:, None], cols, span)
    else:
        mask = None if valid_BT is None else causal_padding_mask(valid_BT, 0, T)
    aux_total = h.new_zeros((), dtype=torch.float32)
    real_N = real_tokens(valid_BT) if cfg.is_moe else None
    shared = LayerInputs(cos, sin, mask, cache, cache_slots, real_N, with_aux, ex, routing)
    for i in ex.layers(cfg):
        if remat and torch.is_grad_enabled():
            h, aux = checkpoint(decoder_layer, params, cfg, i, h, shared, use_reentrant=False)
        else:
            h, aux = decoder_layer(params, cfg, i, h, shared)
        if cfg.is_moe_layer(i):
            aux_total = aux_total + aux
    if ex.last:
        h = rmsnorm(h, params["model.norm.weight"], cfg.rms_norm_eps)
    if cache is not None:
        cache.lengths_B += T if valid_BT is None else valid_BT.sum(-1)
        cache.bound = span
    return h, aux_total / max(n_moe_layers(cfg), 1), cache


def logits(params: Params, cfg: ModelConfig, hidden: Tensor, ex: Exec = LOCAL) -> Tensor:
    """Full-vocab logits [..., V] of the final hidden states."""
    return ex.logits(params, cfg, hidden)


def positions_from_valid(valid_BT: Tensor) -> Tensor:
    """Rotary positions for left-padded rows: 0 at each row's first real token."""
    return (valid_BT.long().cumsum(-1) - 1).clamp_min(0)
