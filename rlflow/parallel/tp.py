"""Tensor parallelism (Megatron): column- and row-parallel linears, vocab-parallel embedding and
vocab-parallel log-probs / entropy. ``group`` is the calling rank's ``tp`` process group (None: tp = 1).

Legend: N tokens, C a chunk of tokens, D model dim, V vocab, Vl = V / tp the local vocab, Fo/Fi output /
input features, Fl = F / tp.

Who holds what (spec over the weight's logical view, see rlflow/models/sharding.py): tp rank i holds rows
[i Fo/tp, (i+1) Fo/tp) of a column-parallel weight ``P("tp", None)``, columns [i Fi/tp, (i+1) Fi/tp) of a
row-parallel weight ``P(None, "tp")``, vocab rows [i V/tp, (i+1) V/tp) of the embedding and of the head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlflow.ops import token_logprobs
from rlflow.ops.logprobs import Head, chunked, head_linear, rows
from rlflow.parallel.collectives import copy_to, gather_replicated, group_rank, group_size, reduce_from


def column_linear(x_ND: Tensor, w_FlD: Tensor, b_Fl: Tensor | None, group) -> Tensor:
    """x replicated -> y sharded(-1): ``copy_to(x) W_local^T + b_local``. The gradient of x is
    all-reduced over tp (each rank holds only its output columns' part of it)."""
    return F.linear(copy_to(x_ND, group), w_FlD, b_Fl)


def row_linear(x_NFl: Tensor, w_DFl: Tensor, b_D: Tensor | None, group) -> Tensor:
    """x sharded(-1) -> y replicated: ``reduce_from(x_local W_local^T) + b`` (bias added once, after
    the sum)."""
    y = reduce_from(F.linear(x_NFl, w_DFl), group)
    return y if b_D is None else y + b_D


def vocab_start(vocab: int, group) -> int:
    """First vocab row this tp rank holds (``vocab`` is the full size)."""
    return group_rank(group) * (vocab // group_size(group))


def vocab_embedding(ids: Tensor, w_VlD: Tensor, vocab: int, group) -> Tensor:
    """ids replicated -> embeddings replicated [..., D]. Each rank looks up the ids in its vocab range
    (zeros elsewhere), then ``reduce_from`` sums: one rank contributes each row. Backward: the full
    gradient reaches every rank; each rank's weight gradient has only its own rows."""
    if group_size(group) == 1:
        return F.embedding(ids, w_VlD)
    lo = vocab_start(vocab, group)
    own = (ids >= lo) & (ids < lo + w_VlD.shape[0])
    h = F.embedding((ids - lo).clamp(0, w_VlD.shape[0] - 1), w_VlD) * own[..., None].to(w_VlD.dtype)
    return reduce_from(h, group)


def _chunk(h_CD: Tensor, w_VlD: Head, t_C: Tensor, lo: int, temperature: float, with_entropy: bool, group):
    z = head_linear(h_CD, w_VlD).float()  # local logits [C, Vl]
    Vl = z.shape[-1]
    if temperature != 1.0:
        z = z / temperature
    m = z.detach().max(-1).values  # the local max (a constant: log-softmax ignores it)
    e = (z - m[:, None]).exp()
    own = (t_C >= lo) & (t_C < lo + Vl)
    zt = z.gather(-1, (t_C - lo).clamp(0, Vl - 1)[:, None])[:, 0]
    parts = [m, e.sum(-1), torch.where(own, zt, torch.zeros_like(zt))] + (
        [(e * (z - m[:, None])).sum(-1)] if with_entropy else [])
    g = gather_replicated(torch.stack(parts), group)  # every rank's [k, C] statistics: one collective
    M = g[:, 0].max(0).values  # the global max
    w = (g[:, 0] - M).exp()  # rescales each rank's sums to the global max
    s = (g[:, 1] * w).sum(0)  # sum over the full vocab of exp(z - M)
    lse = M + s.log()
    lp = g[:, 2].sum(0) - lse  # the target's logit comes from the one rank that owns it
    if not with_entropy:
        return lp, torch.zeros_like(lp)
    # H = -sum p log p = lse - sum_v p_v z_v,  p_v = exp(z_v - M) / s; each rank's sum is of exp(z - m_r) (z - m_r):
    # sum_v p_v (z_v - M) = sum_r w_r (ez_r + (m_r - M) s_r) / s, small terms (no cancellation of large logits)
    return lp, s.log() - (w * (g[:, 3] + (g[:, 0] - M) * g[:, 1])).sum(0) / s


def vocab_logprobs(hidden_ND: Tensor, w_VlD: Head, targets_N: Tensor, vocab: int, group, *,
                   temperature: float = 1.0, chunk: int = 2048, with_entropy: bool = False
                   ) -> tuple[Tensor, Tensor | None]:
    """log softmax(h W^T / temperature)[target] and the entropy, the head's vocab dim sharded over tp,
    never gathering the full vocab: each rank's per-token statistics (its local max, its sum of exp
    relative to it, the target's logit where it owns the target, its sum of ``exp(z - m) (z - m)`` for the
    entropy) in one all-gather, combined alike on every rank (the backward needs no collective for them).
    hidden and targets replicated -> log-probs and entropies replicated [N] (float32).

    Chunked over tokens like ``rlflow.ops.token_logprobs``: each chunk's [C, Vl] logits are recomputed
    in the backward (the recomputation repeats the chunk's collectives, in the same order on every rank).
    With tp = 1 it is ``token_logprobs``."""
    if group_size(group) == 1:
        return token_logprobs(hidden_ND, w_VlD, targets_N, temperature=temperature, chunk=chunk,
                              with_entropy=with_entropy)
    lo = vocab_start(vocab, group)
    h = copy_to(hidden_ND, group)  # once: the hidden gradient is all-reduced in one piece
    return chunked(_chunk, h, w_VlD, targets_N, lo, temperature, with_entropy, group, chunk=chunk,
                   with_entropy=with_entropy)


__all__ = ["column_linear", "row_linear", "vocab_start", "vocab_embedding", "vocab_logprobs"]
