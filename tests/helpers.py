"""Shared test inputs."""

import torch

from rlflow.batch import PromptBatch, pad


def random_prompts(vocab_size: int, P: int, g: torch.Generator, *, answers: bool = False) -> PromptBatch:
    """P left-padded prompts of 2 to 8 random non-special tokens, one group each."""
    seqs = [torch.randint(3, vocab_size, (int(n),), generator=g) for n in torch.randint(2, 9, (P,), generator=g)]
    ids, mask = pad(seqs, 0, left=True)
    idx = torch.arange(P)
    return PromptBatch(prompt_ids_BTp=ids, prompt_mask_BTp=mask, index_B=idx, group_B=idx,
                       answers=("x",) * P if answers else ())
