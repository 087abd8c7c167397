"""Reward functions: a registry of rule-based verifiers ``fn(response: str, answer: str) -> float in [0, 1]``,
and the user's own, loaded from a file or a module (``load_reward``) and called batched as TRL calls them::

    fn(prompts: list[str], completions: list[str], answers: list[str], **extra_columns) -> list[float | None]

``CombinedReward`` sums several of either kind with weights.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import traceback
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Callable

RewardFn = Callable[[str, str], float]
REGISTRY: dict[str, RewardFn] = {}


def register(name: str):
    def deco(fn: RewardFn) -> RewardFn:
        if name in REGISTRY:
            raise ValueError(f"reward {name!r} is already registered")
        REGISTRY[name] = fn
        return fn
    return deco


def get(name: str) -> RewardFn:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(REGISTRY)}") from None


@register("exact")
def exact_match(response: str, answer: str) -> float:
    """1 if the response, stripped, equals the answer (the built-in tasks' verifier)."""
    return float(response.strip() == answer.strip())


_NUM = r"-?[\d,]*\.?\d+(?:/\d+)?"


def _to_number(s: str) -> Fraction | None:
    s = s.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_final_answer(text: str) -> str | None:
    """The final answer of a math solution: the last ``\\boxed{...}``, else what follows the last ``####``,
    else the last number in the text."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    nums = re.findall(_NUM, text)
    return nums[-1] if nums else None


def _last_boxed(text: str) -> str | None:
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    j, depth = i + len("\\boxed{"), 1
    start = j
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[start:j - 1] if depth == 0 else None


@register("math")
def math_final_answer(response: str, answer: str) -> float:
    """1 if the response's final answer equals the reference numerically (GSM8K ``#### 42`` and
    ``\\boxed{42}`` forms; ``1,000`` == ``1000`` == ``1000.0``; fractions compare exactly), else
    string equality of the stripped answers."""
    got = extract_final_answer(response)
    ref = extract_final_answer(answer) if ("####" in answer or "\\boxed" in answer) else answer
    if got is None or ref is None:
        return 0.0
    a, b = _to_number(got), _to_number(ref)
    if a is not None and b is not None:
        return float(a == b)
    return float(got.strip() == ref.strip())


def per_sample(fn: RewardFn) -> Callable[[list[str], list[str]], list[float]]:
    """The loop's batched reward form, ``(completions, answers) -> one float per completion``
    (``algos.stages.score``), of a per-sample ``fn(response, answer)``."""
    def batched(completions: list[str], answers: list[str]) -> list[float]:
        return [float(fn(c, a)) for c, a in zip(completions, answers)]
    return batched


class RewardError(RuntimeError):
    """A reward function raised, or returned something that is not a list of numbers or None, one per sample."""


def _at(e: BaseException) -> str:
    """Where ``e`` was raised (the innermost frame: the reward function's own line, or what it called)."""
    frames = traceback.extract_tb(e.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""


@dataclass(frozen=True)
class Reward:
    """One reward function, called batched. ``per_sample``: a registry verifier ``fn(response, answer)``, called
    once per sample; otherwise the user's ``fn(prompts=, completions=, answers=, **extra_columns)`` (keywords,
    as TRL calls it; ``async def`` functions run to completion with ``asyncio.run``)."""

    name: str
    fn: Callable
    per_sample: bool = False

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str],
                 **extra: list) -> list[float | None]:
        n = len(completions)
        if self.per_sample:
            out = []
            for i, (c, a) in enumerate(zip(completions, answers)):
                try:
                    out.append(self.fn(c, a))
                except Exception as e:
                    raise RewardError(f"reward {self.name} raised {type(e).__name__}: {e}{_at(e)} on sample {i} "
                                      f"(prompt {prompts[i]!r:.200})") from e
            return self._checked(out, n, prompts)
        try:
            got = self.fn(prompts=prompts, completions=completions, answers=answers, **extra)
            if inspect.iscoroutine(got):
                got = asyncio.run(got)
        except Exception as e:
            raise RewardError(f"reward {self.name} raised {type(e).__name__}: {e}{_at(e)} on a batch of {n} samples "
                              f"(first prompt {(prompts[0] if prompts else '')!r:.200})") from e
        return self._checked(got, n, prompts)

    def _checked(self, got, n: int, prompts: list[str]) -> list[float | None]:
        if not isinstance(got, (list, tuple)) or len(got) != n:
            what = f"{len(got)} values" if isinstance(got, (list, tuple)) else f"a {type(got).__name__}"
            raise RewardError(f"reward {self.name} returned {what} for {n} samples; it must return a list of "
                              "one float (or None: no score) per completion")
        out = []
        for i, v in enumerate(got):
            if v is not None and not hasattr(v, "__float__"):  # numbers, numpy and 0-d torch scalars; not text
                raise RewardError(f"reward {self.name} returned {v!r} for sample {i} (prompt {prompts[i]!r:.200}); "
                                  "expected a float or None")
            out.append(None if v is None else float(v))
        return out

    def check_columns(self, columns: list[str]) -> None:
        """ValueError unless the function takes the call's keywords with these extra columns (a user function
        that lists its parameters must name them all, or take ``**kwargs``)."""
        if self.per_sample:
            return
        try:
            inspect.signature(self.fn).bind(prompts=[], completions=[], answers=[], **{c: [] for c in columns})
        except TypeError as e:
            cols = "".join(f", {c}=" for c in columns)
            raise ValueError(f"reward {self.name} cannot be called as fn(prompts=, completions=, answers={cols}) "
                             f"({e}); add **kwargs to take the columns it does not use") from None


def load_reward(spec: str) -> Reward:
    """A registry name ("exact", "math"), ``path/to/file.py:function`` or ``module:function`` (imported from
    ``sys.path``). ValueError naming the spec and what is wrong."""
    if spec in REGISTRY:
        return Reward(spec, REGISTRY[spec], per_sample=True)
    return Reward(spec, load_object(spec, "reward", sorted(REGISTRY)))


def import_file(where: str, kind: str, spec: str | None = None):
    """The module of the Python file ``where``, imported once per process; ValueError naming the ``kind`` and
    the ``spec`` it was given by (default: the file)."""
    spec = spec or where
    if not os.path.isfile(where):
        raise ValueError(f"{kind} {spec}: no file {where}")
    mod_name = f"rlflow_{kind}_" + re.sub(r"\W", "_", os.path.abspath(where))
    mod = sys.modules.get(mod_name)
    if mod is None:
        mod_spec = importlib.util.spec_from_file_location(mod_name, where)
        mod = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_name] = mod  # dataclasses and pickling look the module up
        try:
            mod_spec.loader.exec_module(mod)
        except Exception as e:
            del sys.modules[mod_name]
            raise ValueError(f"{kind} {spec}: importing {where} raised {type(e).__name__}: {e}") from None
    return mod


def load_object(spec: str, kind: str, registered: list[str]) -> Callable:
    """The callable ``path/to/file.py:name`` or ``module:name`` names (a function, a class), imported once per
    process; ValueError naming the ``kind`` ("reward", "env"), the spec and what is wrong (``registered``: the
    built-in names, for the message)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"unknown {kind} {spec!r}: not registered ({registered}), and not "
                         "path/to/file.py:name or module:name")
    if where.endswith(".py") or os.sep in where or "/" in where:
        mod = import_file(where, kind, spec)
    else:
        try:
            mod = importlib.import_module(where)
        except ImportError as e:
            raise ValueError(f"{kind} {spec}: cannot import module {where!r} ({e})") from None
        except Exception as e:
            raise ValueError(f"{kind} {spec}: importing {where} raised {type(e).__name__}: {e}") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(mod).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == mod.__name__)
        thing = {"reward": "function", "env": "class"}.get(kind, "callable")
        raise ValueError(f"{kind} {spec}: {where} has no {thing} {name!r}"
                         + (f" (it defines {found})" if found else ""))
    return fn


def unpack(carried: str) -> tuple[str, str, dict]:
    """(prompt, answer, extra columns) of an answer ``CombinedReward.carry`` packed."""
    row = json.loads(carried)
    return row["prompt"], row["answer"], row["extra"]


class CombinedReward:
    """Reward functions summed with weights (TRL's ``reward_weights``): a sample's reward is the weighted sum
    of the functions that scored it (None from a function: it does not apply to that sample), and None when
    none did."""

    def __init__(self, rewards: list[Reward], weights: list[float] | None = None, *, context: bool = False):
        if not rewards:
            raise ValueError("CombinedReward: no reward functions")
        weights = [1.0] * len(rewards) if weights is None else [float(w) for w in weights]
        if len(weights) != len(rewards):
            raise ValueError(f"CombinedReward: {len(weights)} weights for {len(rewards)} reward functions")
        bad = [w for w in weights if not math.isfinite(w)]
        if bad:
            raise ValueError(f"CombinedReward: weights must be finite, got {bad}")
        self.rewards, self.weights = list(rewards), weights
        self.context = context  # carry every example's prompt and extra columns (a multi-turn environment reads them)

    @classmethod
    def load(cls, specs: list[str], weights: list[float] | None = None, *, context: bool = False) -> CombinedReward:
        return cls([load_reward(s) for s in specs], weights, context=context)

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str],
                 **extra: list) -> list[float | None]:
        total: list[float | None] = [None] * len(completions)
        for reward, w in zip(self.rewards, self.weights):
            for i, v in enumerate(reward(prompts, completions, answers, **extra)):
                if v is not None:
                    total[i] = (total[i] or 0.0) + w * v
        return total

    def check_columns(self, columns: list[str]) -> None:
        for r in self.rewards:
            r.check_columns(columns)

    @property
    def needs_context(self) -> bool:
        """A user function is among them (it is called with the prompts and the extra dataset columns too), or
        the examples are to carry them anyway (``context``)."""
        return self.context or any(not r.per_sample for r in self.rewards)

    def carry(self, examples: list) -> list:
        """``examples`` (``rlflow.data.Example``) ready for ``score``. When a user function needs the prompt and
        the extra columns, the answer becomes the JSON of prompt, answer and extra columns: the answer is the
        one per-row text that travels with a sample (through the transfer dock too) to the scorer. Registry
        verifiers need the answer only: the examples are returned as they are."""
        if not self.needs_context:
            return examples
        out = []
        for ex in examples:
            try:
                packed = json.dumps({"prompt": ex.prompt, "answer": ex.answer, "extra": ex.extra}, ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"the example with prompt {ex.prompt!r:.200}: its extra columns {sorted(ex.extra)} "
                                 f"reach the reward functions as JSON, and one is not a JSON value ({e})") from None
            out.append(replace(ex, answer=packed))
        return out

    def score(self, completions: list[str], answers: list[str]) -> list[float | None]:
        """The rewards of a scorer's rows, each function called once for all of them: the loop's reward
        (``stages.score_rows``), the answers made by ``carry``. None: no function scored the sample; the loop
        leaves it out of the advantages."""
        if self.needs_context:
            rows = [unpack(a) for a in answers]
            keys = sorted({k for _, _, extra in rows for k in extra})
            return self([p for p, _, _ in rows], completions, [a for _, a, _ in rows],
                        **{k: [extra.get(k) for _, _, extra in rows] for k in keys})
        return self([""] * len(answers), completions, answers)
