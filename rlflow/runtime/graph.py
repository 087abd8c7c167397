"""The RL iteration as data: each stage declared once, with the dock columns it reads and writes and
where it runs; each column once, with its dtype and the batch field it fills. Two iterations: ``GRPO``
(the outcome estimators) and ``PPO`` (a critic and GAE); ``graph_for`` picks one. Each stage carries its
function (``runtime/work.py``); the step (``runtime/step.py``) runs them in this order, each on its group.

Everything that names stages or columns reads this declaration: the dock's schema and consumers
(``GRPO.schema``, ``GRPO.consumers``), the sample flow's column <-> batch-field mapping (``FIELDS``,
``runtime/flow.py``), the dock cost model's flow (``GRPO.flow``, ``dock/cost.py``), and the step (the
mesh each stage's worker group runs on, ``placement.Seats.mesh``, and the columns the train group takes
from the dock: what its stages read that the rollout group's stages wrote). Where a stage runs:

- ``rollout``: the rollout layout's ranks, each its data-parallel part;
- ``every``: every rank an equal share of the groups (scoring on the CPU: each rank the share of its
  rollout rows its tp index takes);
- ``train``: the train layout's ranks, each its data-parallel part (tp and pp peers the same rows).

How a stage's rows reach it (``via``): ``"memory"``, handed over by the stage before it on the same
ranks and rows (prompts -> rollout -> score -> advantage, one worker group); ``"dock"``, its worker
group's one take of the step from the transfer dock (the train group: the rows cross from the rollout
layout to the train layout there, ``runtime/flow.py``), which the group's later stages share. The dock
has one consumer per worker group that takes (``consumers``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from rlflow.dock.cost import Stage as FlowStage
from rlflow.dock.schema import Column, Schema
from rlflow.runtime import work

RUNS_ON = ("rollout", "every", "train")
VIA = ("memory", "dock")


@dataclass(frozen=True)
class Stage:
    """A stage: the columns it reads and writes, the worker group it runs on and how its rows reach it, and its
    function (``runtime/work.py``: ``fn(work)``; None for the stages the schedule itself runs: the prompts and the
    rollout, whose weights and engine depend on the placement)."""
    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    runs_on: str
    via: str = "memory"
    fn: Callable[[work.Work], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.runs_on not in RUNS_ON:
            raise ValueError(f"Stage {self.name!r}: runs_on must be one of {RUNS_ON}, got {self.runs_on!r}")
        if self.via not in VIA:
            raise ValueError(f"Stage {self.name!r}: via must be one of {VIA}, got {self.via!r}")
        if (self.fn is None) != (self.runs_on == "rollout"):  # the schedule runs the rollout group's stages
            raise ValueError(f"Stage {self.name!r} on {self.runs_on!r}: " + (
                "the rollout group's stages are the schedule's (the engine generates): put a function on 'every' "
                "or 'train'" if self.fn is not None else "needs its function (fn=, runtime/work.py)"))


@dataclass(frozen=True)
class Graph:
    columns: tuple[tuple[Column, str], ...]  # (dock column, the batch field it fills)
    stages: tuple[Stage, ...]

    def __post_init__(self):
        names = {c.name for c, _ in self.columns}
        for s in self.stages:
            unknown = sorted(set(s.reads + s.writes) - names)
            if unknown:
                raise ValueError(f"Stage {s.name!r} names columns {unknown} the graph does not declare")

    @property
    def schema(self) -> Schema:
        return Schema(*(c for c, _ in self.columns))

    @property
    def consumers(self) -> tuple[str, ...]:
        """The worker groups that take their rows from the dock (one controller each), by where they run."""
        return tuple(dict.fromkeys(s.runs_on for s in self.stages if s.via == "dock"))

    @property
    def flow(self) -> tuple[FlowStage, ...]:
        """Every stage with what it reads and writes, as the dock cost model counts a disaggregated
        deployment (each stage its own workers, every read and write through the dock; the first stage: the
        producer's put of the prompts). rlflow's colocated runtime moves a subset: ``consumers``."""
        return tuple(FlowStage(s.name, s.reads, s.writes) for s in self.stages)

    @property
    def flow_consumers(self) -> tuple[str, ...]:
        """The consumers of that disaggregated ``flow``: every stage that reads (a controller each)."""
        return tuple(s.name for s in self.stages if s.reads)

    def __getitem__(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage {name!r}; stages: {[s.name for s in self.stages]}")


PROMPT = ("prompt_ids", "group", "answer")
ROWS = PROMPT + ("response_ids", "sample_logprobs")  # a sample after the rollout
# An MoE rollout's expert choices: with routing replay (``LoopConfig.routing_replay``) the rollout writes
# them too and the old-log-prob and update stages read them; the loop adds them to those stages' columns.
ROUTES = ("prompt_routes", "response_routes")
LOSS_MASK = "loss_mask"  # multi-turn rows' (``LoopConfig.multiturn``): the loop adds it to the train group's columns
VERSIONS = "versions"  # separate pools' rows: the policy version of each token; the loop adds it there too

# Every column any graph declares, with the batch field it fills (one table: ``FIELDS``).
COLUMNS = (
    (Column("prompt_ids", torch.int64, "var", length_group="prompt", pad_left=True), "prompt_ids_BTp"),
    (Column("response_ids", torch.int64, "var", length_group="response"), "response_ids_BTr"),
    (Column("sample_logprobs", torch.float32, "var", length_group="response"), "sample_logprobs_BTr"),
    (Column("old_logprobs", torch.float32, "var", length_group="response"), "old_logprobs_BTr"),
    (Column("ref_logprobs", torch.float32, "var", length_group="response"), "ref_logprobs_BTr"),
    (Column("rewards", torch.float32, "scalar"), "rewards_B"),
    (Column("advantages", torch.float32, "scalar"), "advantages_B"),
    (Column("group", torch.int64, "scalar"), "group_B"),
    (Column("answer", torch.uint8, "var", length_group="answer"), "answers"),  # the reference answer (UTF-8), read by the scorers
    # per token, its experts in every MoE layer (M x K values, -1: none), flattened
    (Column("prompt_routes", torch.int16, "var", length_group="prompt_routes", pad_left=True, pad_value=-1),
     "prompt_routes_BTpMK"),
    (Column("response_routes", torch.int16, "var", length_group="response_routes", pad_value=-1),
     "response_routes_BTrMK"),
    # PPO with a critic: which rows a reward scored (1) or left unscored (0), the critic's values before the
    # update, GAE's per-token advantages and the returns
    (Column("scored", torch.uint8, "scalar"), "scored_B"),
    (Column("values", torch.float32, "var", length_group="response"), "values_BTr"),
    (Column("token_advantages", torch.float32, "var", length_group="response"), "token_advantages_BTr"),
    (Column("returns", torch.float32, "var", length_group="response"), "returns_BTr"),
    # a multi-turn row's sampled tokens (1) among its response tokens (0: the environment's observations); the
    # rollout writes it with the rows and every stage that reads the log-probs or the losses reads it too
    (Column("loss_mask", torch.uint8, "var", length_group="response"), "loss_mask_BTr"),
    # separate pools: the policy version (updates seen) that sampled each response token; a partial rollout's
    # row may span several
    (Column("versions", torch.int64, "var", length_group="response"), "versions_BTr"),
)
FIELDS = {c.name: f for c, f in COLUMNS}  # dock column -> batch field, of every graph
_CRITIC = ("scored", "values", "token_advantages", "returns")  # PPO's

_HEAD = (  # the stages every iteration starts with (every rank reads the same prompt stream)
    Stage("prompts", (), PROMPT, "rollout"),
    Stage("rollout", PROMPT, ("response_ids", "sample_logprobs"), "rollout"),
)
_LOGPROBS = (
    Stage("ref_logprob", ROWS, ("ref_logprobs",), "train", via="dock", fn=work.ref_logprob),
    Stage("old_logprob", ROWS, ("old_logprobs",), "train", via="dock", fn=work.old_logprob),
)

# GRPO and the other outcome estimators (RLOO, REINFORCE++): one advantage per sample, from the rewards
GRPO = Graph(
    columns=tuple(c for c in COLUMNS if c[0].name not in _CRITIC),
    stages=_HEAD + (Stage("score", ROWS, ("rewards",), "every", fn=work.score),
                    Stage("advantage", ("rewards", "group"), ("advantages",), "every", fn=work.advantage),)
    + _LOGPROBS + (Stage("update", ROWS + ("rewards", "advantages", "old_logprobs", "ref_logprobs"), (), "train",
                         via="dock", fn=work.update),),
)

# PPO with a critic: the critic's values in the train layout, GAE there (it needs them), then the policy's
# and the critic's updates
PPO = Graph(
    columns=tuple(c for c in COLUMNS if c[0].name != "advantages"),
    stages=_HEAD + (Stage("score", ROWS, ("rewards", "scored"), "every", fn=work.score),) + _LOGPROBS + (
        Stage("values", ROWS, ("values",), "train", via="dock", fn=work.values),
        Stage("gae", ("rewards", "scored", "values"), ("token_advantages", "returns"), "train", via="dock",
              fn=work.gae),
        Stage("update", ROWS + ("rewards", "token_advantages", "old_logprobs", "ref_logprobs"), (), "train",
              via="dock", fn=work.update),
        Stage("critic_update", ROWS + ("scored", "values", "returns"), (), "train", via="dock",
              fn=work.critic_update),
    ),
)


def graph_for(adv_estimator: str) -> Graph:
    """The iteration an advantage estimator runs: ``PPO`` for "gae" (a critic), else ``GRPO``."""
    return PPO if adv_estimator == "gae" else GRPO


__all__ = ["COLUMNS", "FIELDS", "GRPO", "Graph", "LOSS_MASK", "PPO", "PROMPT", "ROUTES", "ROWS", "RUNS_ON", "Stage",
           "VERSIONS", "VIA", "graph_for"]
