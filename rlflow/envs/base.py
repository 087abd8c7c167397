"""What an environment's ``step`` returns (``rlflow.envs``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Feedback:
    """The environment's answer to one turn: the ``observation`` the model reads next (text, or token ids),
    the ``reward`` it adds to the episode's (None: none), and whether the episode is ``done``."""
    observation: str | list[int] | None = None
    reward: float | None = None
    done: bool = False


__all__ = ["Feedback"]
