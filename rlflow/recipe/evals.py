"""Evaluation: the eval set prepared as the training prompts are, --eval-only's one evaluation in this
process, and a run's evaluation over its ranks (every rank gathers the whole weights,
``runtime.weights.full_weights``, and scores a share of the prompts)."""

from __future__ import annotations

import json
import os

import torch

from rlflow import eval as rl_eval
from rlflow import rewards
from rlflow.data import Example, load_examples
from rlflow.recipe.flags import Recipe
from rlflow.recipe.pieces import chat_template, concrete, load_model, prompt_transform, reward_specs, reward_weights
from rlflow.runtime.weights import full_weights



def eval_examples(r: Recipe) -> list[Example]:
    """The first --eval-max-prompts examples of --eval-dataset, prepared as the training prompts are."""
    examples = load_examples(r.eval_dataset, prompt_key=r.prompt_key, answer_key=r.answer_key, split=r.eval_split,
                             held_out=True)
    return prompt_transform(r, rewards.CombinedReward.load(reward_specs(r), reward_weights(r)), chat_template(r))(
        examples[:r.eval_max_prompts])


def eval_settings(r: Recipe) -> dict:
    """``rl_eval.evaluate``'s settings: the training's response budget and prompt truncation, a step's prompts
    per generate call."""
    return dict(samples=r.eval_samples, temperature=r.eval_temperature, max_new_tokens=r.max_new_tokens,
                batch_size=r.prompts_per_step, seed=r.seed, max_prompt_len=r.max_prompt_len)


def eval_line(m: dict) -> str:
    shown = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.items()
                      if k not in ("eval/prompts", "eval/unscored"))
    unscored = f", {m['eval/unscored']} samples unscored" if m["eval/unscored"] else ""
    return f"{shown} ({m['eval/prompts']} prompts{unscored})"


def evaluate_only(r: Recipe) -> dict[str, float]:
    """--eval-only: the eval/* metrics of --model (or a random --preset), printed and written to --out/eval.json."""
    torch.manual_seed(r.seed)
    r = concrete(r)
    cfg, params, tok, _ = load_model(r)
    reward = rewards.CombinedReward.load(reward_specs(r), reward_weights(r))
    m = rl_eval.evaluate(params, cfg, tok, eval_examples(r), reward.score, **eval_settings(r))
    print(f"eval of {r.model or r.preset} on {r.eval_dataset}: {eval_line(m)}")
    if r.out:
        path = os.path.join(r.out, "eval.json")
        with open(path, "w") as f:
            json.dump(m, f, indent=2)
        print(f"wrote {path}")
    return m


def evaluation(r: Recipe, cfg, tok, examples: list[Example], reward_fn, params, where, rank: int,
               world: int) -> dict[str, float]:
    """The eval/* metrics of the policy whose train shards this rank holds (``where`` None: one process, the
    whole weights). With several ranks every rank gathers the whole weights (as checkpoints do) and scores a
    contiguous share of the prompts on its own, unsharded; the shares' per-sample scores are gathered on every
    rank and summed up there. Every rank makes the same two collective calls, whatever its share; a prompt
    samples what it would in one process (its noise is keyed by its index in the eval set)."""
    if where is not None:
        params = full_weights(cfg, where.train, params)
    lo, hi = rank * len(examples) // world, (rank + 1) * len(examples) // world
    part = rl_eval.sample_scores(params, cfg, tok, examples[lo:hi], reward_fn, first_index=lo,
                                 **eval_settings(r)) if hi > lo else None
    parts = [part]
    if where is not None:
        parts = [None] * world
        torch.distributed.all_gather_object(parts, part)
    return rl_eval.summarize(rl_eval.cat([p for p in parts if p is not None]))
