"""Log-probs and entropy of target tokens from hidden states, chunked over tokens.

Legend: N tokens, D model dim, V vocab, C chunk of tokens.
The [N, V] logits are never materialized: each chunk's [C, V] logits are computed, reduced to a log-prob
and an entropy, and (under autograd) recomputed in the backward pass instead of being stored.
"""

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


Head = Tensor | tuple[Tensor, Tensor]


def head_linear(h: Tensor, w: Head) -> Tensor:
    """The logits ``h w^T`` [..., V] of a head ``w`` [V, D]; of a low-rank-adapted head ``w = (W [V, D], B [V, r])``
    with ``h = [x | u]`` [..., D + r] (``models/lora.py: head``), ``x W^T + u B^T``: one fused multiply-add over the
    rank-wide ``u``, no adapted [V, D] weight."""
    if isinstance(w, Tensor):
        return F.linear(h, w)
    W, B = w
    D = W.shape[1]
    z = F.linear(h[..., :D], W)
    return torch.addmm(z.view(-1, z.shape[-1]), h[..., D:].reshape(-1, B.shape[1]), B.t().to(z.dtype)).view(z.shape)


def requires_grad(w: Head) -> bool:
    return any(t.requires_grad for t in ((w,) if isinstance(w, Tensor) else w))


def rows(w: Head) -> int:
    """The head's vocab rows (this rank's, when split)."""
    return (w if isinstance(w, Tensor) else w[0]).shape[0]


def _chunk(h_CD: Tensor, w_VD: Head, t_C: Tensor, temperature: float, with_entropy: bool):
    logits = head_linear(h_CD, w_VD).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_CV = torch.log_softmax(logits, -1)
    lp = logp_CV.gather(-1, t_C[:, None])[:, 0]
    if with_entropy:
        ent = -(logp_CV.exp() * logp_CV).sum(-1)
        return lp, ent
    return lp, torch.zeros_like(lp)


def token_logprobs(hidden_ND: Tensor, weight_VD: Head, targets_N: Tensor, *, temperature: float = 1.0,
                   chunk: int = 2048, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log softmax(h W^T / temperature)[target] per token, and the entropy of that distribution (``weight_VD``
    an adapted head: ``head_linear``'s logits)."""
    return chunked(_chunk, hidden_ND, weight_VD, targets_N, temperature, with_entropy, chunk=chunk,
                   with_entropy=with_entropy)


# What autograd may keep for the backward instead of recomputing it chunk by chunk: the float32
# log-softmax of the [N, V] logits and its exp (8 bytes per entry). Below this, recomputation costs
# more than the memory it saves (a 32-token vocabulary's logits are tiny).
KEEP_LOGITS_BYTES = 64 * 2**20


def chunked(fn, hidden_ND: Tensor, weight_VD: Head, targets_N: Tensor, *extra, chunk: int,
            with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """Run ``fn(h_CD, w, t_C, *extra) -> (logprobs_C, entropy_C)`` over chunks of C tokens, each chunk
    recomputed in the backward instead of keeping its [C, V] logits, unless all the [N, V] logits fit
    in ``KEEP_LOGITS_BYTES`` (the vocab-parallel version passes its own ``fn``)."""
    lps, ents = [], []
    grad = (torch.is_grad_enabled() and (hidden_ND.requires_grad or requires_grad(weight_VD))
            and hidden_ND.shape[0] * rows(weight_VD) * 8 > KEEP_LOGITS_BYTES)
    for s in range(0, hidden_ND.shape[0], chunk):
        args = (hidden_ND[s:s + chunk], weight_VD, targets_N[s:s + chunk], *extra)
        lp, ent = checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args)
        lps.append(lp)
        ents.append(ent)
    if not lps:  # no token: an empty result still joined to the hidden states, so that a backward through a
        # micro-batch with nothing to train on runs (zero gradients, and every collective of the forward's layers)
        z = hidden_ND.float().sum(-1)
        return z, (z if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def at_mask(fn, hidden_BTD: Tensor, targets_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor | None]:
    """``fn(hidden_ND, targets_N) -> (logprobs_N, entropy_N or None)`` on the positions where ``mask_BT``
    is True, put back as [B, T] float32 (0 elsewhere). index_select / index_copy rather than boolean
    indexing: their backward is index_add, not a sorting index_put."""
    at = mask_BT.reshape(-1).nonzero()[:, 0]
    lp_N, ent_N = fn(hidden_BTD.reshape(-1, hidden_BTD.shape[-1]).index_select(0, at),
                     targets_BT.reshape(-1).index_select(0, at))
    zeros = torch.zeros(mask_BT.numel(), dtype=torch.float32, device=hidden_BTD.device)
    lp = zeros.index_copy(0, at, lp_N).view(mask_BT.shape)
    return lp, (None if ent_N is None else zeros.index_copy(0, at, ent_N).view(mask_BT.shape))
