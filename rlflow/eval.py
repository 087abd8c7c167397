"""Evaluation of a policy on a fixed prompt set: one greedy response per prompt, or k sampled ones, scored by
the training reward and summed up as the ``eval/*`` metrics.

A sample is correct when its reward is exactly 1 (what the registry verifiers give a right answer; with
weighted or shaped rewards, correctness means what the rewards make of it). The per-sample figures
(``sample_scores``) of consecutive shares of a prompt set concatenate (``cat``) before they are summed up
(``summarize``): a world of ranks can split the prompts and get the one-process result.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from rlflow.algos import stages
from rlflow.data import Example, check_positions, prompt_batch
from rlflow.models.config import ModelConfig
from rlflow.models.execution import LOCAL, Exec
from rlflow.rollout import SamplingConfig, generate


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate of one problem from ``n`` samples of which ``c`` are correct (Chen et al.
    2021, "Evaluating Large Language Models Trained on Code", Eq. 1)::

        pass@k = 1 - C(n - c, k) / C(n, k)

    the chance that k of the n samples, drawn without replacement, include a correct one (1 when
    n - c < k). Exact integer binomials: no cancellation for large n."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} correct samples must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in [1, n={n}]")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class Scores(NamedTuple):
    """Each sample's figures, [P, k] (a prompt's k samples in a row): the reward (0 where unscored), whether
    the reward scored it (a reward function's None: no score), its response tokens (EOS included)."""
    rewards_PK: Tensor
    scored_PK: Tensor
    lengths_PK: Tensor


def sample_scores(params, cfg: ModelConfig, tokenizer, examples: list[Example], reward, *, samples: int = 1,
                  temperature: float = 1.0, max_new_tokens: int, batch_size: int, seed: int = 0,
                  max_prompt_len: int | None = None, first_index: int = 0, ex: Exec = LOCAL) -> Scores:
    """``samples`` responses per example (1: greedy; more: sampled at ``temperature``), ``batch_size``
    prompts per ``generate`` call, scored by ``reward`` (the loop's batched ``reward(completions, answers)``,
    ``stages.score_rows``). ``first_index``: the examples' position in the whole prompt set; a row's sampling
    noise is keyed by its prompt's index (``rollout.generate``), so a share scored on its own samples what
    the whole set's call samples, and the shares' ``Scores`` concatenate (``cat``) to the whole set's."""
    if samples < 1:
        raise ValueError(f"evaluate: samples={samples} must be >= 1")
    if batch_size < 1:
        raise ValueError(f"evaluate: batch_size={batch_size} must be >= 1")
    if not examples:
        raise ValueError("evaluate: no examples")
    scfg = SamplingConfig(max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                          temperature=0.0 if samples == 1 else temperature)
    dev = params["model.embed_tokens.weight"].device
    parts = []
    for i in range(0, len(examples), batch_size):
        prompts = prompt_batch(examples[i:i + batch_size], tokenizer, first_index=first_index + i,
                               max_prompt_len=max_prompt_len).to(dev)
        check_positions(prompts, max_new_tokens, cfg)
        rollout = generate(params, cfg, prompts, scfg, group_size=samples, seed=seed, ex=ex)
        rewards_B, scored_B = stages.score_rows(rollout, tokenizer, reward)
        parts.append(Scores(*(t.view(-1, samples) for t in (rewards_B, scored_B,
                                                              rollout.response_mask_BTr.sum(-1).cpu()))))
    return cat(parts)


def cat(parts: list[Scores]) -> Scores:
    """The ``Scores`` of consecutive shares of a prompt set as one."""
    return Scores(*(torch.cat(ts) for ts in zip(*parts)))


def summarize(s: Scores) -> dict[str, float]:
    """The ``eval/*`` metrics of ``Scores``: ``eval/reward_mean`` over the scored samples, ``eval/pass@1`` and
    (k > 1) ``eval/pass@k``: ``pass_at_k`` with n = k averaged over prompts, an unscored sample counting as
    not correct; greedy (k == 1): ``eval/accuracy``, the share of correct responses; ``eval/response_len``
    (tokens per response), ``eval/prompts`` and ``eval/unscored`` (samples)."""
    P, k = s.rewards_PK.shape
    n_scored = int(s.scored_PK.sum())
    c_P = (s.scored_PK & (s.rewards_PK == 1.0)).sum(-1).tolist()
    out = {"eval/reward_mean": float(s.rewards_PK.double().sum()) / max(n_scored, 1),
           "eval/pass@1": sum(pass_at_k(k, c, 1) for c in c_P) / P}
    if k == 1:
        out["eval/accuracy"] = out["eval/pass@1"]
    else:
        out[f"eval/pass@{k}"] = sum(pass_at_k(k, c, k) for c in c_P) / P
    out.update({"eval/response_len": float(s.lengths_PK.double().mean()), "eval/prompts": P,
                "eval/unscored": P * k - n_scored})
    return out


def evaluate(params, cfg: ModelConfig, tokenizer, examples: list[Example], reward, *, samples: int = 1,
             temperature: float = 1.0, max_new_tokens: int, batch_size: int, seed: int = 0,
             max_prompt_len: int | None = None, first_index: int = 0, ex: Exec = LOCAL) -> dict[str, float]:
    """The ``eval/*`` metrics (``summarize``) of ``params`` on ``examples`` (prompts rendered and answers
    carried as the training prompts are): ``sample_scores``' responses, greedy for ``samples`` == 1.
    ``ex``: the execution context of a layout (``params`` then this rank's shards), as for ``generate``."""
    return summarize(sample_scores(params, cfg, tokenizer, examples, reward, samples=samples, temperature=temperature,
                                   max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                                   max_prompt_len=max_prompt_len, first_index=first_index, ex=ex))


__all__ = ["Scores", "cat", "evaluate", "pass_at_k", "sample_scores", "summarize"]
