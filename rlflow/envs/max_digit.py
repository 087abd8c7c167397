"""``max_digit_feedback``: the built-in task ``max_digit`` with a hint after a wrong answer. The prompt is
``max:381920=``; a wrong answer is shown the half of the digits that holds the largest one (``+920=``), and the
model answers again, up to the run's ``--max-turns``. Reward 1 for the right digit by the last turn, 0
otherwise: the hint makes the second answer easier than the first (the largest of three digits, not six), so a
model that reads it gains over one that answers once."""

from __future__ import annotations

from rlflow.envs.base import Feedback


class MaxDigitFeedback:
    def __init__(self, example):
        digits = example.prompt.removeprefix("max:").removesuffix("=")
        if not (example.prompt.startswith("max:") and digits.isdigit() and max(digits) == example.answer):
            raise ValueError(f"max_digit_feedback: the prompt {example.prompt!r} with answer {example.answer!r} is "
                             "not the built-in task max_digit's")
        half = len(digits) // 2
        self.answer = example.answer
        self.hint = digits[:half] if max(digits[:half]) == example.answer else digits[half:]

    def step(self, turn: str):
        if turn == self.answer:
            return Feedback(reward=1.0, done=True)
        return Feedback(observation=f"+{self.hint}=", reward=0.0)
