"""Reward functions: a registry of rule-based verifiers ``fn(response: str, answer: str) -> float in [0, 1]``."""

from __future__ import annotations

import re
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
