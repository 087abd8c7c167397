"""Where the stages of an RL step run: the worker groups' layouts (``Placement``) and one rank's seats in
them (``Seats``).

Colocated (as MindSpeed-RL and TRL do it): the train and rollout layouts span the same ranks and the
stages take turns on every device; the policy's weights move between the two layouts every step
(``runtime/weights.py``). Separate device pools (``runtime/pools.py``) give each pool a world of its own,
whose placement is its one layout as both: the step reads its meshes and contexts from ``Seats`` there
unchanged.

Where a stage runs (``runtime/graph.py``'s ``runs_on``):

- ``rollout``: the rollout layout's ranks, each its data-parallel part;
- ``every``: every rank an equal share of the groups it holds after the rollout;
- ``train``: the train layout's ranks, each its data-parallel part (tp and pp peers the same rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlflow.models.config import ModelConfig
from rlflow.models.execution import LOCAL, Exec
from rlflow.parallel import dp
from rlflow.parallel.context import context
from rlflow.sharding.dist import all_reduce, create_groups
from rlflow.sharding.layout import Layout
from rlflow.sharding.mesh import Mesh

@dataclass(frozen=True)
class Placement:
    """The layouts of a world of more than one rank: the rollout in ``rollout``, the old and reference
    log-probs and the update in ``train``, both over the same ranks (colocated); scoring and advantages
    on every rank. ``critic``: PPO's critic on the train layout's mesh (``models.sharding.layout(...,
    head="value")``); it stays there (values, GAE and its update read the update's rows)."""

    train: Layout
    rollout: Layout
    critic: Layout | None = None

    def __post_init__(self):
        if self.train.mesh.size != self.rollout.mesh.size:
            raise ValueError(f"Placement: the train layout's {self.train.mesh} and the rollout layout's "
                             f"{self.rollout.mesh} must span the same ranks (separate device pools are a world "
                             "each, with a placement of its own: runtime/pools.py)")
        if self.critic is not None and self.critic.mesh != self.train.mesh:
            raise ValueError(f"Placement: the critic's layout ({self.critic.mesh}) must be on the train layout's mesh "
                             f"({self.train.mesh}): it reads the update's rows")
        if self.rollout.mesh.pp > 1:
            raise ValueError(f"Placement: rollout layout {self.rollout.mesh}: generation runs every layer on each "
                             "rank (no pp)")

    @property
    def world(self) -> int:
        return self.train.mesh.size


@dataclass(frozen=True)
class Seats:
    """One rank's place in a placement: its rank, the meshes of the worker groups, the execution contexts
    of the train and rollout layouts, and the sums over the ranks the step's statistics span. One
    process (``placement`` None): every mesh trivial, the plain execution, sums of one."""

    placement: Placement | None
    rank: int
    rollout_ex: Exec
    train_ex: Exec

    @property
    def world(self) -> int:
        return 1 if self.placement is None else self.placement.world

    @property
    def train(self) -> Layout | None:
        return None if self.placement is None else self.placement.train

    def mesh(self, runs_on: str) -> Mesh:
        """The mesh of a stage's worker group (``graph.Stage.runs_on``)."""
        if self.placement is None:
            return Mesh()
        return {"rollout": self.placement.rollout.mesh, "train": self.placement.train.mesh,
                "every": Mesh(dp=self.world)}[runs_on]

    def world_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over every rank."""
        return t if self.placement is None else all_reduce(t)

    def train_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the train layout's data ranks (each holds a share of the update's rows)."""
        return t if self.placement is None else dp.batch_sum(t, self.placement.train)

    def gather(self, obj) -> list:
        """Every rank's ``obj``."""
        if self.placement is None:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def seats(placement: Placement | None, cfg: ModelConfig) -> Seats:
    """This rank's seats (torch.distributed initialised when ``placement`` spans several ranks): the
    process groups of both layouts are made here, in the same order on every rank."""
    if placement is None:
        return Seats(None, 0, LOCAL, LOCAL)
    create_groups([placement.train.mesh, placement.rollout.mesh])
    train_ex = context(placement.train, cfg)
    return Seats(placement, dist.get_rank(), rollout_ex=context(placement.rollout, cfg), train_ex=train_ex)


__all__ = ["Placement", "Seats", "seats"]
