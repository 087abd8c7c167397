"""Prompt sources: built-in tasks with verifiable answers, and datasets (JSONL, JSON, CSV, Parquet, Hugging Face
``datasets`` folders).

A source yields ``Example(prompt, answer)``; ``prompt_batch`` tokenizes examples into a left-padded
``PromptBatch``. Built-in tasks are generated from a seed, so a run is reproducible without data files.
"""

from __future__ import annotations

import csv
import decimal
import json
import math
import numbers
import os
import random
import re
import zlib
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from rlflow.batch import PromptBatch, pad
from rlflow.models.config import ModelConfig


@dataclass(frozen=True)
class Example:
    prompt: str  # the text the model is given: with messages, their rendering ("" until a chat template renders them)
    answer: str
    messages: tuple[dict, ...] | None = field(default=None, hash=False)  # the chat form: {role, content} dicts
    extra: dict = field(default_factory=dict, hash=False)  # the dataset's other columns, for reward functions


def _max_digit(rng: random.Random, n: int = 6) -> Example:
    digits = "".join(rng.choice("0123456789") for _ in range(n))
    return Example(f"max:{digits}=", max(digits))


def _sum_mod10(rng: random.Random) -> Example:
    a, b = rng.randrange(10), rng.randrange(10)
    return Example(f"{a}+{b}=", str((a + b) % 10))


def _first_digit(rng: random.Random, n: int = 6) -> Example:
    digits = "".join(rng.choice("0123456789") for _ in range(n))
    return Example(f"first:{digits}=", digits[0])


def _addition(rng: random.Random) -> Example:
    a, b = rng.randrange(25), rng.randrange(25)
    return Example(f"What is {a} + {b}?", str(a + b))


@dataclass(frozen=True)
class Task:
    """A built-in task: ``make`` draws an example from a seeded generator. ``reward``: its default --reward.
    ``held_out`` k > 0: one question in k (by a hash of ``question(example)``, by default the prompt) is never
    drawn for training and makes the task's eval split (``held_out_examples``, ``--eval-dataset task:NAME``);
    ``question`` names what makes two prompts the same question (7 + 15 and 15 + 7), so that neither form of a
    held-out one is trained on. ``text``: natural-language prompts, for a model with a real tokenizer
    (``--model``), not the built-in character one."""

    make: Callable[[random.Random], Example]
    reward: str = "exact"
    held_out: int = 0
    text: bool = False
    question: Callable[[Example], str] = lambda ex: ex.prompt

    def is_held_out(self, ex: Example) -> bool:
        return self.held_out > 0 and zlib.crc32(self.question(ex).encode()) % self.held_out == 0

    def draw(self, rng: random.Random) -> Example:
        """A training example: a held-out one is drawn again."""
        while True:
            ex = self.make(rng)
            if not self.is_held_out(ex):
                return ex


TASKS: dict[str, Task] = {
    "max_digit": Task(_max_digit),  # the largest of six digits (one-token answer)
    "sum_mod10": Task(_sum_mod10),  # (a + b) mod 10
    "first_digit": Task(_first_digit),
    # "What is 7 + 15?" for a pretrained chat model: a, b in [0, 24], 625 prompts; 1 in 5 unordered pairs held out
    # with both orders; the reward is the last number of the reply (math)
    "addition": Task(_addition, reward="math", held_out=5, text=True,
                     question=lambda ex: "+".join(sorted(re.findall(r"\d+", ex.prompt), key=int))),
}
EVAL_TASK = "task:"  # --eval-dataset task:NAME: the held-out split of built-in task NAME
HELD_OUT_SEED = 0x5EED


def eval_task(path: str) -> str | None:
    """NAME of a ``task:NAME`` dataset (a built-in task's held-out split), else None."""
    return path[len(EVAL_TASK):] if path.startswith(EVAL_TASK) else None


def held_out_examples(name: str, limit: int = 1000) -> list[Example]:
    """The eval split of built-in task ``name``: up to ``limit`` distinct held-out examples, in the order a
    fixed generator (not the run's seed) first draws them, so that every run evaluates on the same prompts."""
    task = TASKS.get(name)
    if task is None:
        raise ValueError(f"unknown built-in task {name!r}; built-in tasks: {sorted(TASKS)}")
    if not task.held_out:
        raise ValueError(f"built-in task {name!r} has no held-out split (tasks with one: "
                         f"{sorted(n for n, t in TASKS.items() if t.held_out)})")
    rng, seen = random.Random(HELD_OUT_SEED), {}
    for _ in range(max(20_000, 50 * limit)):
        ex = task.make(rng)
        if task.is_held_out(ex):
            seen.setdefault(ex.prompt, ex)
            if len(seen) == limit:
                break
    return list(seen.values())


class PromptSource:
    """Seeded stream of examples from a built-in task or a fixed list (a dataset), shuffled per epoch.
    ``transform`` maps each batch taken (a chat template, what the reward needs carried), so a large dataset is
    rendered a batch at a time."""

    def __init__(self, *, task: str | None = None, examples: list[Example] | None = None, seed: int = 0,
                 transform: Callable[[list[Example]], list[Example]] | None = None):
        if (task is None) == (examples is None):
            raise ValueError("PromptSource: give exactly one of task= or examples=")
        if task is not None and task not in TASKS:
            raise ValueError(f"PromptSource: unknown task {task!r}; built-in tasks: {sorted(TASKS)}")
        if examples is not None and not examples:
            raise ValueError("PromptSource: examples is empty")
        self.task, self.examples, self.transform = task, examples, transform
        self.rng = random.Random(seed)
        self._order: list[int] = []

    def take(self, n: int) -> list[Example]:
        if self.task is not None:
            out = [TASKS[self.task].draw(self.rng) for _ in range(n)]
        else:
            out = []
            while len(out) < n:
                if not self._order:
                    self._order = list(range(len(self.examples)))
                    self.rng.shuffle(self._order)
                out.append(self.examples[self._order.pop()])
        return out if self.transform is None else self.transform(out)


def _example(row: dict, where: str, prompt_key: str, answer_key: str) -> Example:
    """One dataset row as an Example; ``where`` ("file:line" or "file: row i") starts every error."""
    pk = prompt_key if prompt_key in row else "question" if "question" in row else prompt_key
    for k in (pk, answer_key):
        if k not in row:
            raise ValueError(f"{where}: needs keys {prompt_key!r} (or 'question') and {answer_key!r}; "
                             f"got {sorted(row)}")
        if row[k] is None:
            raise ValueError(f"{where}: key {k!r} is null")
    p, messages = row[pk], None
    if isinstance(p, (list, tuple)):
        for i, m in enumerate(p):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and m.get("content") is not None):
                raise ValueError(f"{where}: key {pk!r}: message {i} is {m!r}; chat messages are "
                                 "{'role': str, 'content': ...} dicts")
        if not p:
            raise ValueError(f"{where}: key {pk!r} is an empty list of chat messages")
        p, messages = "", tuple(dict(m) for m in p)
    elif isinstance(p, dict):
        raise ValueError(f"{where}: key {pk!r} is a dict; expected text or a list of chat messages")
    extra = {k: v for k, v in row.items() if k not in (pk, answer_key)}
    return Example(str(p), answer_text(row[answer_key], where, answer_key), messages, extra)


def answer_text(a, where: str, key: str) -> str:
    """A dataset's answer as the reward sees it: text as it is, an integer in decimal, a float in decimal with
    an integral one (below 2**53) written as the integer (3.0 -> "3", as a math verifier compares it), a
    decimal by its own digits. Anything else (a
    list, a dict, a bool) is refused: stringified, ``[1.0]`` would be scored against that."""
    if isinstance(a, str):
        return a
    if isinstance(a, numbers.Integral) and not isinstance(a, bool):
        return str(int(a))
    if isinstance(a, (numbers.Real, decimal.Decimal)) and not isinstance(a, bool):
        if isinstance(a, decimal.Decimal):  # Parquet / Arrow decimal columns: their own digits
            if not a.is_finite():
                raise ValueError(f"{where}: key {key!r} is {a}; answers are text or a finite number")
            return str(int(a)) if a == a.to_integral_value() else str(a.normalize())
        f = float(a)
        if not math.isfinite(f):
            raise ValueError(f"{where}: key {key!r} is {f}; answers are text or a finite number")
        return str(int(f)) if f.is_integer() and abs(f) < 2 ** 53 else repr(f)
    raise ValueError(f"{where}: key {key!r} is a {type(a).__name__} ({str(a)[:40]}); answers are text or a "
                     "number (convert the column, e.g. take the list's element)")


def load_jsonl(path: str, *, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Example]:
    """Read ``{"prompt": ..., "answer": ...}`` lines (GSM8K's ``question``/``answer`` keys also work; a prompt may
    be a list of chat messages; other keys become ``Example.extra``, null where a line lacks them). A line that
    is not UTF-8, not a JSON object, or lacks (or nulls) a key is an error naming the file and line."""
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
            out.append(_example(row, f"{path}:{lineno}", prompt_key, answer_key))
    if not out:
        raise ValueError(f"{path}: no examples")
    keys = {k: None for ex in out for k in ex.extra}  # every row gets every column, as in a table
    return [ex if len(ex.extra) == len(keys) else replace(ex, extra={**keys, **ex.extra}) for ex in out]


DATA_FILES = {".parquet": "parquet", ".json": "json", ".csv": "csv"}  # besides .jsonl (load_jsonl)


def load_examples(path: str, *, prompt_key: str = "prompt", answer_key: str = "answer",
                  split: str = "train", held_out: bool = False) -> list[Example]:
    """The examples of a dataset: a ``.jsonl`` file (``load_jsonl``; its one split is "train"), a ``.parquet``,
    ``.json`` or ``.csv`` file (``datasets.load_dataset(<format>, data_files=path, split=split)``: split "train",
    or a slice of it like "train[:100]"), a ``save_to_disk`` folder (``datasets.load_from_disk``) or a folder of
    data files (``datasets.load_dataset(path, split=split)``). CSV cells are read as text (an empty one is null).
    Errors name the file, the line or row (``dataset[i]``, from 0), the key and the value. With ``held_out`` (an
    eval set), ``task:NAME`` is the held-out split of built-in task NAME (``held_out_examples``); a training set
    never is (it would train on what the evaluation holds out)."""
    task = eval_task(path)
    if task is not None:
        if not held_out:
            raise ValueError(f"{path} is a built-in task's held-out split, for --eval-dataset only; train on the "
                             f"task with --task {task}")
        if split != "train":
            raise ValueError(f"{path} is one split already: split {split!r} does not apply")
        return held_out_examples(task)
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file or directory")
    ext = os.path.splitext(path)[1].lower()
    if os.path.isfile(path) and ext == ".jsonl":
        if split != "train":
            raise ValueError(f"{path}: unknown split {split!r}; a JSONL file has one split, 'train'")
        return load_jsonl(path, prompt_key=prompt_key, answer_key=answer_key)
    if os.path.isfile(path) and ext not in DATA_FILES:
        raise ValueError(f"{path}: unknown dataset format {ext or '(no extension)'!r}; expected a .jsonl, "
                         f"{', '.join(DATA_FILES)} file or a Hugging Face datasets folder")
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path}: reading {ext or 'a folder'} needs the `datasets` package (pip install datasets); "
                         "JSONL files need nothing") from None
    ds = _load_dataset(datasets, path, ext, split)
    cols = ds.column_names
    pk = prompt_key if prompt_key in cols else "question" if "question" in cols else prompt_key
    for k in (pk, answer_key):
        if k not in cols:
            raise ValueError(f"{path}: split {split!r}: needs columns {prompt_key!r} (or 'question') and "
                             f"{answer_key!r}; got {cols}")
    out = [_example(row, f"{path}: row {i}", prompt_key, answer_key) for i, row in enumerate(ds)]
    if not out:
        raise ValueError(f"{path}: split {split!r} has no rows")
    return out


def _load_dataset(datasets, path: str, ext: str, split: str):
    """``path`` as a ``datasets.Dataset`` of split ``split``."""
    saved = os.path.isdir(path) and any(os.path.exists(os.path.join(path, n))
                                        for n in ("dataset_dict.json", "state.json"))
    try:
        if saved:
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f"unknown split {split!r}; splits: {sorted(ds)}")
                return ds[split]
            if split not in ("train", str(ds.split)):
                raise ValueError(f"unknown split {split!r}; this save_to_disk folder holds one split "
                                 f"({ds.split or 'unnamed'}: pass 'train')")
            return ds
        if os.path.isdir(path):
            return datasets.load_dataset(path, split=split)
        kw = {}
        if ext == ".csv":  # every cell as text: an answer "007" stays "007", a column with a gap stays text
            with open(path, newline="", encoding="utf-8") as f:
                header = next(csv.reader(f), [])
            kw = dict(features=datasets.Features({c: datasets.Value("string") for c in header}),
                      keep_default_na=False, na_values=[""])
        return datasets.load_dataset(DATA_FILES[ext], data_files=path, split=split, **kw)
    except ValueError as e:  # an unknown split or a bad slice: the message names it
        raise ValueError(f"{path}: {e}") from None
    except (datasets.exceptions.DatasetsError, OSError, UnicodeDecodeError) as e:
        cause = e.__cause__ or e
        raise ValueError(f"{path}: cannot read it as {DATA_FILES.get(ext, 'a datasets folder')} "
                         f"({type(cause).__name__}: {cause})") from None


def apply_chat_template(examples: list[Example], template, *, system_prompt: str | None = None,
                        tools: list[dict] | None = None) -> list[Example]:
    """``examples`` with each prompt rendered by ``template`` (``rlflow.tokenizer.ChatTemplate``) and its
    messages kept: a text prompt is one user message, a chat-form example's messages are used as they are;
    ``system_prompt`` goes first unless the messages start with a system message of their own; ``tools``: the
    schemas of the tools the model may call (``envs.tools.schema``), shown as the template shows them."""
    out = []
    for ex in examples:
        msgs = list(ex.messages) if ex.messages is not None else [{"role": "user", "content": ex.prompt}]
        if system_prompt is not None and msgs[0].get("role") != "system":
            msgs.insert(0, {"role": "system", "content": system_prompt})
        out.append(replace(ex, prompt=template.render(msgs, tools=tools), messages=tuple(msgs)))
    return out


def prompt_batch(examples: list[Example], tokenizer, *, first_index: int = 0,
                 max_prompt_len: int | None = None) -> PromptBatch:
    """Tokenize (BOS first when the tokenizer has one, except for chat-form prompts: the template wrote the
    special tokens it wants, as with transformers' ``apply_chat_template``) and left-pad into a PromptBatch.
    Prompts longer than ``max_prompt_len`` keep their last tokens."""
    if max_prompt_len is not None and max_prompt_len < 1:
        raise ValueError(f"prompt_batch: max_prompt_len must be >= 1, got {max_prompt_len}")
    seqs = []
    for ex in examples:
        if ex.messages is not None and not ex.prompt:
            raise ValueError(f"prompt_batch: an example in chat form has no prompt text (render it with a chat "
                             f"template first: rlflow.tokenizer.ChatTemplate); messages {list(ex.messages)!r}")
        bos = [tokenizer.bos_id] if tokenizer.bos_id is not None and ex.messages is None else []
        ids = bos + tokenizer.encode(ex.prompt)
        if max_prompt_len is not None:
            ids = ids[-max_prompt_len:]
        seqs.append(torch.tensor(ids, dtype=torch.long))
    ids_BT, mask_BT = pad(seqs, tokenizer.pad_id, left=True)
    idx = torch.arange(first_index, first_index + len(examples))
    return PromptBatch(prompt_ids_BTp=ids_BT, prompt_mask_BTp=mask_BT, index_B=idx, group_B=idx.clone(),
                       answers=tuple(ex.answer for ex in examples))


class PromptTooLong(ValueError):
    """A prompt whose tokens plus the response budget exceed the model's positions."""


def check_positions(prompts: PromptBatch, max_new_tokens: int, cfg: ModelConfig) -> None:
    """Refuse prompts whose tokens plus the response budget exceed the model's ``max_position_embeddings``
    (rope positions past it were trained on without a word): ``PromptTooLong`` naming the first."""
    lengths = prompts.prompt_mask_BTp.sum(-1)
    over = (lengths + max_new_tokens > cfg.max_position_embeddings).nonzero()[:, 0]
    if len(over):
        i = int(over[0])
        raise PromptTooLong(f"prompt {int(prompts.index_B[i])} has {int(lengths[i])} tokens; with max_new_tokens="
                         f"{max_new_tokens} that exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings} (truncate with max_prompt_len)")
