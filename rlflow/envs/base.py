"""What an environment's ``step`` returns (``rlflow.envs``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Feedback:
    """The environment's answer to one turn: the ``observation`` the model reads next, the ``reward`` it adds
    to the episode's (None: none), whether the episode is ``done``, and ``counts`` to add to the run's metrics
    (``env/<name>``; the names the class declares in ``COUNTS``).

    An observation is text (a user message), a message or a list of messages ({"role": "user" or "tool",
    "content": text}), rendered into tokens once by the run's chat template as what follows the model's turn (the
    template's incremental form; without a template, the messages' text as it is), or token ids appended as they
    are."""
    observation: str | dict | list | None = None
    reward: float | None = None
    done: bool = False
    counts: dict[str, float] | None = None


__all__ = ["Feedback"]
