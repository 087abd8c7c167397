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
    """recipes/grpo_qwen3_moe.py imported as a module (its ``main`` and ``parse_args``)."""
    import importlib.util
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("grpo_recipe", os.path.join(root, "recipes", "grpo_qwen3_moe.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod
