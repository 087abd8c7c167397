"""A step's figures as values, and the one rule that combines them over ranks.

``Figures``: counts (summed over the ranks) and times (the slowest rank's). Every figure of a step is one
or the other, and every combination of ranks' figures (the loop's reduction over a world, the train lead's
over the rollout ranks of separate pools) is ``combine``.

``RolloutReport``: what the rollout side of a step reports of it. The colocated step hands it to its train
side in memory; a rollout rank of separate pools sends it to the train lead through the link's store
(``runtime/pools.py``), as bytes (``to_bytes``) that carry their own names.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Sequence


@dataclass
class Figures:
    counts: dict[str, float] = field(default_factory=dict)  # summed over the ranks
    times: dict[str, float] = field(default_factory=dict)  # the slowest rank's

    def __add__(self, other: "Figures") -> "Figures":
        """One rank's figures from two sources (disjoint names)."""
        return Figures({**self.counts, **other.counts}, {**self.times, **other.times})


def combine(ranks: Sequence[Figures]) -> Figures:
    """The figures of several ranks as one: counts summed, times the slowest rank's. A name some ranks do not
    report (a train rank of separate pools holds no rollout figures; the lead does) counts only where it is;
    names keep the order in which the ranks first give them."""
    counts: dict[str, float] = {}
    times: dict[str, float] = {}
    for f in ranks:
        for n, v in f.counts.items():
            counts[n] = counts.get(n, 0.0) + v
        for n, v in f.times.items():
            times[n] = max(times.get(n, v), v)
    return Figures(counts, times)


@dataclass
class RolloutReport:
    """The rollout side's figures of step ``step``: counts of its scored rows (``row_counts``) and the rollout's
    own (multi-turn: ``env/*``), times of the rollout and the scoring, the rollout's own and the engine's weight
    loads. ``bad_rewards``: the non-finite rewards among them; ``rows``: the rows put into the dock. Separate
    pools: ``version``, the policy version that sampled the step (the oldest token's)."""

    step: int
    figures: Figures
    bad_rewards: int = 0
    rows: int = 0
    version: int | None = None

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def from_bytes(b: bytes) -> "RolloutReport":
        d = json.loads(bytes(b))
        return RolloutReport(**{**d, "figures": Figures(**d["figures"])})


def combine_reports(reports: Sequence[RolloutReport]) -> RolloutReport:
    """Several rollout ranks' reports of one step as one (``combine``; the oldest version: the staleness bound's)."""
    steps = {r.step for r in reports}
    if len(steps) != 1:
        raise ValueError(f"combine_reports: reports of steps {sorted(steps)}, not one step")
    versions = [r.version for r in reports if r.version is not None]
    return RolloutReport(step=steps.pop(), figures=combine([r.figures for r in reports]),
                         bad_rewards=sum(r.bad_rewards for r in reports), rows=sum(r.rows for r in reports),
                         version=min(versions) if versions else None)


def row_counts(rows, rewards, scored) -> dict[str, float]:
    """The counts of a rank's scored rows (``RolloutBatch``; their rewards, which were scored)."""
    return {"prompt_tokens": float(rows.prompt_mask_BTp.sum()),
            "response_tokens": float(rows.response_mask_BTr.sum()), "reward_sum": float(rewards.sum()),
            "reward_sq": float((rewards ** 2).sum()), "scored": float(scored.sum())}


__all__ = ["Figures", "RolloutReport", "combine", "combine_reports", "row_counts"]
