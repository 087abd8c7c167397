"""Token sampling with temperature, top-k and top-p, reproducible under a torch.Generator.

Legend: B batch, V vocab.
"""

import torch
from torch import Tensor


def sample(logits_BV: Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Returns (tokens_B, logprobs_B). temperature == 0 is greedy.

    The log-prob is that of the chosen token under softmax(logits / temperature), the distribution the
    policy loss recomputes (top-k / top-p only restrict which tokens may be drawn).
    """
    logits = logits_BV.float()
    if temperature == 0.0:
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    if temperature != 1.0:
        logits = logits / temperature
    logp_full = torch.log_softmax(logits, -1)
    masked = logits
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(masked, top_k, dim=-1).values[:, -1:]
        masked = masked.masked_fill(masked < kth, float("-inf"))
    if top_p < 1.0:
        srt, order = torch.sort(masked, descending=True, dim=-1)
        cum = torch.softmax(srt, -1).cumsum(-1)
        drop = cum - torch.softmax(srt, -1) > top_p  # keep the smallest prefix with mass >= top_p
        srt = srt.masked_fill(drop, float("-inf"))
        masked = torch.full_like(masked, float("-inf")).scatter(-1, order, srt)
    # multinomial takes unnormalized weights: without truncation, exp(log-probs) is the distribution
    probs = logp_full.exp() if masked is logits else torch.softmax(masked, -1)
    tok = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tok, logp_full.gather(-1, tok[:, None])[:, 0]
