"""Prompt sources: built-in tasks with verifiable answers, and JSONL datasets.

A source yields ``Example(prompt, answer)``; ``prompt_batch`` tokenizes examples into a left-padded
``PromptBatch``. Built-in tasks are generated from a seed, so a run is reproducible without data files.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Callable

import torch

from rlflow.batch import PromptBatch, pad


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def _max_digit(rng: random.Random, n: int = 6) -> Example:
    digits = "".join(rng.choice("0123456789") for _ in range(n))
    return Example(f"max:{digits}=", max(digits))


def _sum_mod10(rng: random.Random) -> Example:
    a, b = rng.randrange(10), rng.randrange(10)
    return Example(f"{a}+{b}=", str((a + b) % 10))


def _first_digit(rng: random.Random, n: int = 6) -> Example:
    digits = "".join(rng.choice("0123456789") for _ in range(n))
    return Example(f"first:{digits}=", digits[0])


TASKS: dict[str, Callable[[random.Random], Example]] = {
    "max_digit": _max_digit,  # the largest of six digits (one-token answer)
    "sum_mod10": _sum_mod10,  # (a + b) mod 10
    "first_digit": _first_digit,
}


class PromptSource:
    """Seeded stream of examples from a built-in task or a fixed list (a dataset), shuffled per epoch."""

    def __init__(self, *, task: str | None = None, examples: list[Example] | None = None, seed: int = 0):
        if (task is None) == (examples is None):
            raise ValueError("PromptSource: give exactly one of task= or examples=")
        if task is not None and task not in TASKS:
            raise ValueError(f"PromptSource: unknown task {task!r}; built-in tasks: {sorted(TASKS)}")
        if examples is not None and not examples:
            raise ValueError("PromptSource: examples is empty")
        self.task, self.examples = task, examples
        self.rng = random.Random(seed)
        self._order: list[int] = []

    def take(self, n: int) -> list[Example]:
        if self.task is not None:
            return [TASKS[self.task](self.rng) for _ in range(n)]
        out = []
        while len(out) < n:
            if not self._order:
                self._order = list(range(len(self.examples)))
                self.rng.shuffle(self._order)
            out.append(self.examples[self._order.pop()])
        return out


def load_jsonl(path: str, *, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Example]:
    """Read ``{"prompt": ..., "answer": ...}`` lines (GSM8K's ``question``/``answer`` keys also work). A line
    that is not UTF-8, not a JSON object, or lacks (or nulls) a key is an error naming the file and line."""
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with keys {prompt_key!r} and "
                                 f"{answer_key!r}, got a {type(row).__name__}")
            pk = prompt_key if prompt_key in row else "question" if "question" in row else prompt_key
            for k in (pk, answer_key):
                if k not in row:
                    raise ValueError(f"{path}:{lineno}: needs keys {prompt_key!r} (or 'question') and "
                                     f"{answer_key!r}; got {sorted(row)}")
                if row[k] is None:
                    raise ValueError(f"{path}:{lineno}: key {k!r} is null")
            out.append(Example(str(row[pk]), str(row[answer_key])))
    if not out:
        raise ValueError(f"{path}: no examples")
    return out


def prompt_batch(examples: list[Example], tokenizer, *, first_index: int = 0,
                 max_prompt_len: int | None = None) -> PromptBatch:
    """Tokenize (BOS first when the tokenizer has one) and left-pad into a PromptBatch.
    Prompts longer than ``max_prompt_len`` keep their last tokens."""
    if max_prompt_len is not None and max_prompt_len < 1:
        raise ValueError(f"prompt_batch: max_prompt_len must be >= 1, got {max_prompt_len}")
    seqs = []
    for ex in examples:
        ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(ex.prompt)
        if max_prompt_len is not None:
            ids = ids[-max_prompt_len:]
        seqs.append(torch.tensor(ids, dtype=torch.long))
    ids_BT, mask_BT = pad(seqs, tokenizer.pad_id, left=True)
    idx = torch.arange(first_index, first_index + len(examples))
    return PromptBatch(prompt_ids_BTp=ids_BT, prompt_mask_BTp=mask_BT, index_B=idx, group_B=idx.clone(),
                       answers=tuple(ex.answer for ex in examples))
