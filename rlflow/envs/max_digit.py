"""``max_digit_feedback``: the built-in task ``max_digit`` with a second chance. The prompt is ``max:381920=``;
a wrong answer is told whether the largest digit is higher (``+=``) or lower (``-=``) than the one given (``?=``
when the turn is not one digit), and the model answers again. Reward 1 for the right digit by the last turn
(the run's ``--max-turns``), 0 otherwise: a model that reads the hint beats one that answers once."""

from __future__ import annotations

from rlflow.envs.base import Feedback


class MaxDigitFeedback:
    def __init__(self, example):
        self.answer = example.answer

    def step(self, turn: str):
        if turn == self.answer:
            return Feedback(reward=1.0, done=True)
        hint = "?=" if not (len(turn) == 1 and turn.isdigit()) else "+=" if self.answer > turn else "-="
        return Feedback(observation=hint, reward=0.0)
