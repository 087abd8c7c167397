"""The checks of what a run trains and evaluates on (``checks.problems`` calls them): the dataset or built-in
task, the chat template, the reward functions, and the eval set; each returns (field, why) pairs naming the flag."""

from __future__ import annotations

import dataclasses
import math

from rlflow import rewards
from rlflow.data import TASKS, PromptSource, apply_chat_template, eval_task, load_examples
from rlflow.recipe.flags import Recipe
from rlflow.recipe.pieces import chat_template, reward_specs, reward_weights
from rlflow.tokenizer import CharTokenizer


def data_problems(r: Recipe) -> list[tuple[str, str]]:
    """(field, why) for the dataset, the chat template and the reward functions: each is loaded, the first
    prompt rendered and the reward functions' signatures checked against the dataset's columns."""
    out = []
    if r.dataset is None:
        out += [("dataset_split", "needs --dataset")] if r.dataset_split != "train" else []
        if r.eval_dataset is None:  # the keys name the eval set's columns too
            out += [(name, "needs --dataset or --eval-dataset") for name, default in (("prompt_key", "prompt"),
                                                                                     ("answer_key", "answer"))
                    if getattr(r, name) != default]
    specs = reward_specs(r)
    if r.reward_weights is not None:
        try:
            weights = reward_weights(r)
        except ValueError:
            out.append(("reward_weights", "expected comma-separated numbers, e.g. 0.5,1"))
        else:
            if len(weights) != len(specs):
                out.append(("reward_weights", f"gives {len(weights)} weights for {len(specs)} --reward functions "
                                              f"({', '.join(specs)})"))
            elif not all(math.isfinite(w) for w in weights):
                out.append(("reward_weights", "weights must be finite"))
    reward = None
    try:
        reward = rewards.CombinedReward.load(specs, None)
    except ValueError as e:
        out.append(("reward", str(e)))
    try:
        examples = load_examples(r.dataset, prompt_key=r.prompt_key, answer_key=r.answer_key,
                                 split=r.dataset_split) if r.dataset else [PromptSource(task=r.task).take(1)[0]]
    except ValueError as e:
        return out + [("dataset" if r.dataset else "task", str(e))]
    if r.dataset and r.model is None:  # the built-in tokenizer: every row, before a run dies at the row drawn
        out += unencodable(examples, "dataset")
    if not r.dataset and r.model is None and TASKS[r.task].text:
        out.append(("task", "has natural-language prompts: it needs a --model with its tokenizer (e.g. --model "
                            "smollm2-135m-instruct), not the built-in character tokenizer"))
    try:
        chat = chat_template(r)
    except ValueError as e:
        return out + [("model", str(e))]
    if chat is None:
        if r.system_prompt is not None:
            out.append(("system_prompt", "needs a chat template: a --model that has one, without --no-chat-template "
                                         "(the built-in tasks use none)"))
        chats = [i for i, ex in enumerate(examples) if ex.messages is not None]
        if chats:
            out.append(("dataset", f"its prompts are chat messages (row {chats[0]}, {len(chats)} in all); they need a "
                                   "chat template: a --model that has one, without --no-chat-template"))
    else:
        try:
            apply_chat_template(examples[:1], chat, system_prompt=r.system_prompt)
        except ValueError as e:
            out.append(("system_prompt" if r.system_prompt is not None else "dataset" if r.dataset else "model",
                        str(e)))
    if reward is not None:
        try:
            reward.check_columns(list(examples[0].extra))
        except ValueError as e:
            out.append(("reward", str(e)))
    return out


def unencodable(examples, field: str) -> list[tuple[str, str]]:
    """(field, why) for the first example whose prompt has characters the built-in tokenizer lacks."""
    known = set(CharTokenizer.CHARS)
    for i, ex in enumerate(examples):
        bad = sorted(set(ex.prompt) - known)
        if bad:
            return [(field, f"row {i}'s prompt {ex.prompt[:60]!r} has characters the built-in tokenizer does not have "
                            f"({''.join(bad[:10])!r}); it knows {CharTokenizer.CHARS!r}: pass a --model with "
                            "its tokenizer, or clean the data")]
    return []


def eval_problems(r: Recipe) -> list[tuple[str, str]]:
    """(field, why) for the --eval-* flags; the eval set is checked as --dataset is (loaded, its first prompt
    rendered, the reward functions' signatures against its columns)."""
    out = []
    if r.eval_samples < 1:
        out.append(("eval_samples", "must be >= 1"))
    if r.eval_max_prompts is not None and r.eval_max_prompts < 1:
        out.append(("eval_max_prompts", "must be >= 1 (leave it out for all)"))
    if r.eval_every < 0:
        out.append(("eval_every", "must be >= 0"))
    if not r.eval_temperature > 0:
        out.append(("eval_temperature", "must be > 0 (--eval-samples 1 is the greedy evaluation)"))
    if r.eval_dataset is None:
        return out + [(f.name, "needs --eval-dataset") for f in dataclasses.fields(r)
                      if f.name.startswith("eval_") and f.name != "eval_dataset" and getattr(r, f.name) != f.default]
    if r.eval_only and r.resume:
        out.append(("resume", "--eval-only trains nothing; evaluate a checkpoint with --model DIR"))
    try:
        examples = load_examples(r.eval_dataset, prompt_key=r.prompt_key, answer_key=r.answer_key,
                                 split=r.eval_split, held_out=True)
    except ValueError as e:
        return out + [("eval_dataset", str(e))]
    if r.model is None:
        out += unencodable(examples, "eval_dataset")
    task = TASKS.get(eval_task(r.eval_dataset))  # loaded above: a task: path names a task
    if task is not None and not r.reward and reward_specs(r) != [task.reward]:  # the run's reward scores the eval
        out.append(("eval_dataset", f"the task is scored by {task.reward!r}, the run by {reward_specs(r)[0]!r}: pass "
                                    f"--reward {task.reward} (or the reward you want both scored by)"))
    try:
        reward, chat = rewards.CombinedReward.load(reward_specs(r), None), chat_template(r)
    except ValueError:  # a bad --reward or --model: data_problems names it
        return out
    chats = [i for i, ex in enumerate(examples) if ex.messages is not None]
    if chat is None and chats:
        out.append(("eval_dataset", f"its prompts are chat messages (row {chats[0]}, {len(chats)} in all); they need "
                                    "a chat template: a --model that has one, without --no-chat-template"))
    try:
        if chat is not None:
            apply_chat_template(examples[:1], chat, system_prompt=r.system_prompt)
        reward.check_columns(list(examples[0].extra))
    except ValueError as e:
        out.append(("eval_dataset", str(e)))
    return out
