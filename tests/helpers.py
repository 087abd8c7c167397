"""Shared test inputs."""

import torch
import torch.nn.functional as F

from rlflow.batch import PromptBatch, pad


def random_prompts(vocab_size: int, P: int, g: torch.Generator, *, answers: bool = False) -> PromptBatch:
    """P left-padded prompts of 2 to 8 random non-special tokens, one group each."""
    seqs = [torch.randint(3, vocab_size, (int(n),), generator=g) for n in torch.randint(2, 9, (P,), generator=g)]
    ids, mask = pad(seqs, 0, left=True)
    idx = torch.arange(P)
    return PromptBatch(prompt_ids_BTp=ids, prompt_mask_BTp=mask, index_B=idx, group_B=idx,
                       answers=("x",) * P if answers else ())


def moe_reference(x, w, idx, gate_up, down):
    """sum_k w_nk expert_{idx_nk}(x_n), token by token, slot by slot: the loop the MoE paths are held to."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(idx.shape[1]):
            g, u = (gate_up[idx[n, k]] @ x[n]).chunk(2)
            out[n] = out[n] + w[n, k] * (down[idx[n, k]] @ (F.silu(g) * u))
    return out


def recipe_module():
    """The GRPO recipe's machinery (``rlflow.recipe``: ``main``, ``parse_args``, ``build``, ...), which
    recipes/grpo_qwen3_moe.py runs."""
    import rlflow.recipe
    return rlflow.recipe
