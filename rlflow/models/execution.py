"""The seams where a layout changes the model's computation, and the unsharded execution.

Legend: B batch, T tokens, N tokens of a packed sequence, D model dim, V vocab, H / K query / key-value
heads, d head dim, E experts, K top-k (in ``w_NK``, ``idx_NK``).

The model functions (``models/decoder.py``, ``models/prefix.py``) hold no layout code. They compute
every layer the same way and call an ``Exec`` at the few places a layout changes what one process
computes:

    layers(cfg)          the decoder layers this process runs (a pipeline stage: a slice of them)
    heads(cfg, layer)    the query and key/value heads it computes (tensor parallel: its share)
    first / last         whether it embeds the ids / applies the final norm and the head
    embed(ids)           the token embedding (vocab-parallel: a lookup in the local rows, summed)
    attention_view(p)    the attention weights of the local heads, and how the block enters and
                         leaves the region where each process computes its part (copy / all-reduce)
    mlp_view(p)          the same for a dense MLP or shared experts (column- then row-parallel)
    experts(p, x, w, i)  the routed experts of a MoE layer (expert-parallel: all-to-all dispatch)
    logits(h)            full-vocab logits, for sampling
    logprobs(h, t)       log-probs (and entropies) of target tokens, never gathering the full vocab
    any_rank(flag)       whether the flag is set on any process that must step in lockstep with
                         this one (expert parallelism: every decode step is a collective)

``LOCAL`` is one process holding every parameter: every seam is the plain computation. The
execution of one rank of a ``rlflow.sharding.Layout`` is ``rlflow.parallel.context.LayoutExec``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn.functional as F
from torch import Tensor

from rlflow.models import lora
from rlflow.models.config import ModelConfig
from rlflow.ops import head_linear, moe_experts, token_logprobs

Params = dict[str, Tensor]

# the experts' inference form (``ops.prepare_experts``), added by ``decoder.fuse_for_inference``
EXPERTS_PREPARED = "experts.prepared"


def _same(x: Tensor) -> Tensor:
    return x


@dataclass(frozen=True)
class View:
    """One block's weights as this process computes them: ``params`` holds the local shards (for
    attention: the q/k/v and o projections of ``heads`` query and ``kv_heads`` key/value heads);
    ``enter`` is applied to the block's input, ``leave`` to its output."""

    params: Params
    heads: int = 0
    kv_heads: int = 0
    enter: Callable[[Tensor], Tensor] = _same
    leave: Callable[[Tensor], Tensor] = _same


def lm_head(params: Params, cfg: ModelConfig) -> Tensor:
    """The [V, D] output projection (the embedding when tied)."""
    return params["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]


class Exec:
    """Unsharded execution (one process, every parameter whole). Subclasses override the seams."""

    first = True
    last = True

    def layers(self, cfg: ModelConfig) -> range | tuple[int, ...]:
        return range(cfg.num_hidden_layers)

    def embed(self, params: Params, cfg: ModelConfig, ids: Tensor) -> Tensor:
        return F.embedding(ids, params["model.embed_tokens.weight"])

    def heads(self, cfg: ModelConfig, layer: int) -> tuple[int, int]:
        """(query heads, key/value heads) this process computes in ``layer`` (the KV cache's size)."""
        return cfg.num_attention_heads, cfg.num_key_value_heads

    def attention_view(self, params: Params, cfg: ModelConfig, layer: int) -> View:
        return View(params, *self.heads(cfg, layer))

    def mlp_view(self, params: Params, cfg: ModelConfig, layer: int, prefix: str = "mlp.") -> View:
        return View(params)

    def experts(self, params: Params, cfg: ModelConfig, layer: int, x_ND: Tensor, w_NK: Tensor,
                idx_NK: Tensor) -> Tensor:
        m = f"model.layers.{layer}.mlp."
        return moe_experts(x_ND, w_NK, idx_NK, params[m + "experts.gate_up_proj"], params[m + "experts.down_proj"],
                           prepared=params.get(m + EXPERTS_PREPARED))

    def logits(self, params: Params, cfg: ModelConfig, h: Tensor) -> Tensor:
        return head_linear(*lora.head(params, cfg, h, lm_head(params, cfg)))

    def logprobs(self, params: Params, cfg: ModelConfig, h_ND: Tensor, targets_N: Tensor, *,
                 temperature: float = 1.0, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        return token_logprobs(*lora.head(params, cfg, h_ND, lm_head(params, cfg)), targets_N, temperature=temperature,
                              with_entropy=with_entropy)

    def any_rank(self, flag: bool) -> bool:
        return flag

    @property
    def collective_forward(self) -> bool:
        """The forward calls collectives (a layout with tp or ep > 1)."""
        return False

    @property
    def tp_only(self) -> bool:
        """The layout splits the model over tp alone (no ep, one pipeline stage)."""
        return False


LOCAL = Exec()


def n_moe_layers(cfg: ModelConfig) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


__all__ = ["EXPERTS_PREPARED", "Exec", "LOCAL", "View", "lm_head", "n_moe_layers"]
