"""Where the stages of an RL step run: a ``Placement``, one value of two kinds, and one rank's seats in it
(``Seats``).

- ``Colocated(train, rollout, critic)`` (as MindSpeed-RL and TRL do it): the train and rollout layouts span
  the same ranks and the stages take turns on every device; the policy's weights move between the two
  layouts every step (``runtime/weights.py``).
- ``Disaggregated(rollout, train, critic)``: separate device pools (``runtime/pools.py``), the rollout pool
  the rollout layout's ranks, the train pool the train layout's, each a world of its own; each pool's
  steps run in its ``own`` placement, its one layout as both, so the step reads its meshes and contexts
  from ``Seats`` there unchanged. Launched with ``launch.spawn(..., pools=placement.pools)``; the
  staleness bound and partial rollout are the loop's settings (``LoopConfig``).

The placement is one value built once (by a library user's code; by the recipe on each rank from the same
flags) and handed to ``step.context``; the launcher reads its ``pools``.

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
from rlflow.runtime.pools import Pools
from rlflow.sharding.dist import all_reduce, create_groups
from rlflow.sharding.layout import Layout
from rlflow.sharding.mesh import Mesh
from rlflow.sharding.plan import PushPlan, push_plan

@dataclass(frozen=True)
class Colocated:
    """The layouts of a world of more than one rank: the rollout in ``rollout``, the old and reference
    log-probs and the update in ``train``, both over the same ranks (colocated); scoring and advantages
    on every rank. ``critic``: PPO's critic on the train layout's mesh (``models.sharding.layout(...,
    head="value")``); it stays there (values, GAE and its update read the update's rows)."""

    train: Layout
    rollout: Layout
    critic: Layout | None = None

    def __post_init__(self):
        if self.train.mesh.size != self.rollout.mesh.size:
            raise ValueError(f"Colocated: the train layout's {self.train.mesh} and the rollout layout's "
                             f"{self.rollout.mesh} must span the same ranks (separate device pools: Disaggregated)")
        _check(self)

    @property
    def world(self) -> int:
        return self.train.mesh.size


@dataclass(frozen=True, kw_only=True)
class Disaggregated:
    """Separate device pools: global ranks 0..R-1 (R: the rollout layout's ranks) generate and score in
    ``rollout``; the next N (the train layout's) compute the log-probs and the updates in ``train``, with
    PPO's ``critic`` on the train layout's mesh. Rows cross through the dock, weights through the push
    (``push_plan``)."""

    rollout: Layout
    train: Layout
    critic: Layout | None = None

    def __post_init__(self):
        _check(self)

    @property
    def world(self) -> int:
        return self.rollout.mesh.size + self.train.mesh.size

    @property
    def pools(self) -> Pools:
        """The split of the world the launcher makes (``runtime.pools.Pools``)."""
        return Pools(self.rollout.mesh.size, self.world)

    def own(self, pool: str) -> Colocated | None:
        """The placement the ranks of ``pool`` ("rollout" or "train") run their steps in, in the pool's world:
        its layout as both (None: a pool of one rank, one process). Only the train pool's carries the critic."""
        layout = {"rollout": self.rollout, "train": self.train}[pool]
        if layout.mesh.size == 1:
            return None
        return Colocated(layout, layout, critic=self.critic if pool == "train" else None)

    def push_plan(self) -> PushPlan:
        """The plan of the weight push, the train layout's shards into the rollout layout's."""
        return push_plan(self.train, self.rollout)


Placement = Colocated | Disaggregated


def _check(p: Colocated | Disaggregated) -> None:
    name = type(p).__name__
    if p.critic is not None and p.critic.mesh != p.train.mesh:
        raise ValueError(f"{name}: the critic's layout ({p.critic.mesh}) must be on the train layout's mesh "
                         f"({p.train.mesh}): it reads the update's rows")
    # a pool's own placement (its one layout as both) runs one side only: the train pool's never generates
    if p.rollout is not p.train and (why := rollout_problem(p.rollout.mesh)) is not None:
        raise ValueError(f"{name}: rollout layout {why}")


def rollout_problem(mesh: Mesh) -> str | None:
    """Why a rollout layout's mesh cannot generate (None: it can)."""
    return f"{mesh}: generation runs every layer on each rank (no pp); use tp, ep or dp" if mesh.pp > 1 else None


@dataclass(frozen=True)
class Seats:
    """One rank's place in a colocated placement (separate pools: its pool's own): its rank, the meshes of the
    worker groups, the execution contexts of the train and rollout layouts, and the sums over the ranks the
    step's statistics span. One process (``placement`` None): every mesh trivial, the plain execution, sums
    of one."""

    placement: Colocated | None
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


def seats(placement: Colocated | None, cfg: ModelConfig) -> Seats:
    """This rank's seats (torch.distributed initialised when ``placement`` spans several ranks): the
    process groups of both layouts are made here, in the same order on every rank."""
    if placement is None:
        return Seats(None, 0, LOCAL, LOCAL)
    create_groups([placement.train.mesh, placement.rollout.mesh])
    train_ex = context(placement.train, cfg)
    return Seats(placement, dist.get_rank(), rollout_ex=context(placement.rollout, cfg), train_ex=train_ex)


__all__ = ["Colocated", "Disaggregated", "Placement", "Seats", "rollout_problem", "seats"]
