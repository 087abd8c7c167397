"""Environments of multi-turn rollouts (``rlflow/multiturn.py``): what answers the model between its turns.

An environment is a class, the user's in a file (``--env path/to/file.py:Class`` or ``module:Class``, as
``--reward``) or a built-in one (``ENVS``). One instance is one episode:

    class MyEnv:
        def __init__(self, example):         # the episode of one prompt: a ``rlflow.data.Example`` (the prompt
            ...                              # text, the reference answer, the dataset's other columns)
        def step(self, turn: str) -> Feedback:   # the model's turn (its text) -> the environment's answer
            ...                              # (or ``async def step``)

``Feedback(observation=None, reward=None, done=False)``: ``observation`` is what the model reads before its
next turn, text (made into tokens once, by the run's template) or token ids (appended as they are);
``reward`` adds to the episode's reward; ``done`` ends the episode. An episode in which the environment gave
no reward is scored by the run's ``--reward`` on the model's last turn. Whatever an environment does wrong
(raises, outlasts its timeout, returns something else than a ``Feedback``) ends that episode unscored and is
counted in the metrics; the run goes on.
"""

from __future__ import annotations

from typing import Callable

from rlflow.envs.base import Feedback
from rlflow.envs.max_digit import MaxDigitFeedback
from rlflow.envs.tools import ToolEnv

ENVS: dict[str, Callable] = {"max_digit_feedback": MaxDigitFeedback, "tools": ToolEnv}


def load_env(spec: str) -> Callable:
    """The environment class of a built-in name or ``path/to/file.py:Class`` / ``module:Class``; ValueError
    naming the spec and what is wrong."""
    if spec in ENVS:
        return ENVS[spec]
    from rlflow.rewards import load_object

    return load_object(spec, "env", sorted(ENVS))


__all__ = ["ENVS", "Feedback", "load_env"]
