"""The sample flow of one GRPO iteration: how each stage's rows reach the ranks of the next stage.

Two worker groups share the devices (colocated): the rollout group (generation in the rollout layout,
then scoring and advantages on the same ranks) and the train group (old / reference log-probs,
PPO's values and GAE, the update, in the train layout). Rows cross from one group to the other
through a transfer dock (``rlflow.dock``); stages of one group hand their rows over in memory.

- The prompts: every rank reads the same prompt stream, so each computes the same routing plan of the
  step's prompts onto the rollout mesh's data-parallel parts (``rollout_share``, balanced by prompt
  length, ``dock.routing``) and keeps its part; nothing waits on another rank before generation.
- Scoring: the ranks of a rollout tp group hold the same rows; each scores its share of the groups
  (``score_share``), so every rank scores and every row is scored once.
- ``DockFlow.put_rows``: each rank puts its scored rows with every column the train group reads
  (prompt, response, sampling log-probs, rewards, advantages, routes): one put per rank and step.
- ``DockFlow.get``: a routing transition (``dock.routing``) onto the train mesh, planned where the
  metadata is: the first rank to ask takes every row of the step from the train group's controller,
  which routes them onto the mesh's data-parallel parts (balanced by sequence length, GRPO groups whole,
  ``Dock.take_share``); each rank gets its part's indices, warehouses and lengths (metadata) and reads
  the rows straight from the warehouses, its tp and pp peers the same rows. The take waits for the step's
  rows (every rank's put), not for another rank's plan: none is broadcast, and rows never pass through a
  controller, the lead or the driver.

``MemoryFlow`` is the one-process path without a dock: the batch goes from stage to stage in memory (no
copies); the loop's code is the same, and tests check the two flows train identically.

Dock rows are the step's samples, indexed ``prompt * G + k`` from 0 each step (the lead clears the dock
at the end of a step, ``end``); batches carry the run's global sample indices (``index_B``), the dock's
plus ``first prompt * G``. The reference answers travel as dock data (UTF-8 bytes), so a rank of the
train group (or a scorer in another process) reads them with the rows.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from rlflow.batch import PromptBatch, RolloutBatch, TrainBatch, extend
from rlflow.dock.schema import Packed
from rlflow.dock.routing import route
from rlflow.runtime.graph import FIELDS, LOSS_MASK, ROUTES, ROWS, VERSIONS
from rlflow.sharding.mesh import Mesh


def _part(batch, cost: Tensor, mesh: Mesh, part: int, group_size: int = 1):
    """``batch``'s rows of data-parallel part ``part`` of ``mesh`` under the routing plan (``dock.routing``)
    balanced by ``cost`` per row, the same on every rank that computes it from the same rows."""
    zeros = np.zeros(batch.size, dtype=np.int64)
    plan = route(np.arange(batch.size), zeros, cost.cpu().numpy(), zeros, mesh, group_size=group_size)
    return batch.select(torch.from_numpy(plan.positions(part)))


def rollout_share(prompts: PromptBatch, mesh: Mesh, rank: int) -> PromptBatch:
    """``rank``'s prompts of the step: its data-parallel part of ``mesh`` (the rollout mesh) under the routing
    plan every rank computes alike from the prompts' lengths (one row per prompt)."""
    if mesh.data_parallel_size == 1:
        return prompts
    mine = _part(prompts, prompts.prompt_mask_BTp.sum(-1), mesh, mesh.data_parallel_index(rank))
    tp = int(mine.prompt_mask_BTp.sum(-1).max()) if mine.size else 0  # left padding no row of the part needs
    return mine.replace(prompt_ids_BTp=mine.prompt_ids_BTp[:, -tp:], prompt_mask_BTp=mine.prompt_mask_BTp[:, -tp:])


def score_share(rows: RolloutBatch, mesh: Mesh, rank: int, group_size: int) -> RolloutBatch:
    """The rows ``rank`` scores of those its rollout tp group holds (``mesh``: the rollout mesh): its tp
    index's share of the groups, balanced by sequence length (with tp 1: all of them)."""
    if mesh.tp == 1:
        return rows
    cost = rows.prompt_mask_BTp.sum(-1) + rows.response_mask_BTr.sum(-1)
    return _part(rows, cost, Mesh(dp=mesh.tp), mesh.coords(rank)["tp"], group_size)


# per-token columns that travel as fields of the rows (not as stage columns), in the dock's dtype
_ON_THE_ROWS = (LOSS_MASK, VERSIONS)
_COLUMN_DTYPE = {LOSS_MASK: torch.uint8, VERSIONS: torch.int64}


class MemoryFlow:
    """One process: stages share one batch in memory; ``put_rows`` hands it over, ``get`` returns it."""

    def begin(self, prompts: PromptBatch, group_size: int) -> None:
        self._batch, self._cols = None, {}

    def put_rows(self, rows: RolloutBatch, **cols: Tensor) -> None:
        self._batch, self._cols = rows, cols

    def get(self, consumer: str, columns: list[str], mesh: Mesh, rank: int) -> tuple[RolloutBatch, dict[str, Tensor]]:
        if mesh.size != 1:
            raise ValueError(f"MemoryFlow is the one-process flow; {mesh} has {mesh.size} ranks (use a dock)")
        # the batch carries its routes, loss mask and versions
        return self._batch, {c: self._cols[c] for c in columns if c not in ROUTES + _ON_THE_ROWS}

    def end(self) -> None:
        self._batch, self._cols = None, {}


class DockFlow:
    """The rollout group's rows reach the train group through ``dock`` (in-process, local processes or Ray);
    rank ``rank`` of ``world``. Rank 0 leads: it clears the dock at the end of step s (``end``), after its
    update, which every rank's reads of step s precede (the update's collectives join every rank), and
    before the step's closing collective, which every rank's first put of step s + 1 follows."""

    def __init__(self, dock, rank: int = 0, world: int = 1, route_dims: tuple[int, int] | None = None,
                 timeout: float | None = None, clears: bool = True):
        self.dock, self.rank, self.world = dock, rank, world
        self.timeout = timeout  # seconds a get waits for the step's rows (None: no limit), then DockTimeout
        self.route_dims = route_dims  # (MoE layers, top-k) of the route columns, with routing replay
        self._seen: dict[str, int] = {}  # dock traffic at the last busiest_bytes()
        self._gets = 0  # the key of each take, the same on every rank
        self.slot: int | None = None
        if rank == 0 and clears:  # a dock handed over with an earlier run's rows starts empty
            dock.clear()
        if world > 1:
            dist.barrier()

    def begin(self, prompts: PromptBatch, group_size: int, slot: int | None = None) -> None:
        """The step of ``prompts``; ``slot``: its rows are dock rows ``slot * P * G ..`` (separate pools, where
        the dock holds several steps' rows), else from 0."""
        self.G, self.P, self.slot = group_size, prompts.size, slot
        # global sample index of dock row 0
        self.base = (int(prompts.index_B[0]) - (slot or 0) * prompts.size) * group_size
        self.device = prompts.prompt_ids_BTp.device

    def _within(self) -> tuple[int, int] | None:
        n = self.P * self.G
        return None if self.slot is None else (self.slot * n, (self.slot + 1) * n)

    def put_rows(self, rows: RolloutBatch, **cols: Tensor) -> None:
        """``rows`` (this rank's scored rows) with every column the train group reads: the prompt, the
        response, its sampling log-probs, the expert routes when recorded, and ``cols`` (one per row, or
        [B, Tr] per response token); one put."""
        rows = rows.to("cpu")
        pm, rm = rows.prompt_mask_BTp, rows.response_mask_BTr
        answers = [a.encode() for a in rows.answers]
        put = {"prompt_ids": Packed.from_padded(rows.prompt_ids_BTp, pm), "group": rows.group_B,
               "answer": Packed(torch.from_numpy(np.frombuffer(b"".join(answers), dtype=np.uint8).copy()),
                                torch.tensor([len(a) for a in answers], dtype=torch.int64)),
               "response_ids": Packed.from_padded(rows.response_ids_BTr, rm),
               "sample_logprobs": Packed.from_padded(rows.sample_logprobs_BTr, rm),
               **{c: (Packed.from_padded(v.cpu(), rm) if v.dim() == 2 else v.cpu()) for c, v in cols.items()}}
        for c in _ON_THE_ROWS:
            if (v := getattr(rows, FIELDS[c])) is not None:
                put[c] = Packed.from_padded(v.to(_COLUMN_DTYPE[c]), rm)
        if rows.response_routes_BTrMK is not None:  # each row's routes, flattened over its tokens
            put["prompt_routes"] = Packed.from_padded(rows.prompt_routes_BTpMK, pm)
            put["response_routes"] = Packed.from_padded(rows.response_routes_BTrMK, rm)
        self.dock.put(rows.index_B - self.base, put)

    def get(self, consumer: str, columns: list[str], mesh: Mesh, rank: int) -> tuple[RolloutBatch, dict[str, Tensor]]:
        """This rank's rows for ``consumer``: its data-parallel part of ``mesh`` (``rank``: its rank there) of the
        step's one take, routed by the controller (``Dock.take_share``), read straight from the warehouses."""
        columns = list(ROWS) + [c for c in columns if c not in ROWS]
        self._gets += 1
        t = self.dock.take_share(consumer, columns, self.P * self.G, key=self._gets, parts=mesh.data_parallel_size,
                                 part=mesh.data_parallel_index(rank), cost=("prompt_ids", "response_ids"), groups=True,
                                 timeout=self.timeout, within=self._within())
        b = self.dock.read(t)
        fields = {}
        if "response_routes" in columns:  # [B, T * M * K] padded with -1 -> [B, T, M, K]
            mk = self.route_dims
            fields = {FIELDS[c]: b[c].view(b[c].shape[0], -1, *mk) for c in ROUTES}
        if LOSS_MASK in columns:
            fields[FIELDS[LOSS_MASK]] = b[LOSS_MASK].bool() & b.mask["response_ids"]
        if VERSIONS in columns:
            fields[FIELDS[VERSIONS]] = b[VERSIONS]
        answers = tuple(bytes(r.tolist()).decode() for r in b.rows("answer"))
        rollout = RolloutBatch(prompt_ids_BTp=b["prompt_ids"], prompt_mask_BTp=b.mask["prompt_ids"],
                               index_B=b.index_B + self.base, group_B=b["group"], answers=answers,
                               response_ids_BTr=b["response_ids"], response_mask_BTr=b.mask["response_ids"],
                               sample_logprobs_BTr=b["sample_logprobs"], **fields)
        return rollout.to(self.device), {c: b[c].to(self.device) for c in columns
                                         if c not in ROWS + ROUTES + _ON_THE_ROWS}

    def end(self) -> None:
        """The step's last use of the dock: the lead clears it for the next step (its slot only, with slots)."""
        if self.rank == 0:
            if self.slot is None:
                self.dock.clear()
            else:
                self.dock.release(*self._within())

    def busiest_bytes(self) -> float:
        """Bytes in + out of the dock process that moved the most since the last call."""
        now = {k: v["bytes_in"] + v["bytes_out"] for k, v in self.dock.traffic().items()}
        before, self._seen = self._seen, now
        return float(max(n - before.get(k, 0) for k, n in now.items()))


def train_batch(rollout: RolloutBatch, cols: dict[str, Tensor]) -> TrainBatch:
    """The update's TrainBatch from the rollout rows and the dock columns (``old_logprobs`` defaults to
    the sampling log-probs: with one optimizer step per batch the update uses the current ones)."""
    fields = {FIELDS[c]: v for c, v in cols.items()}
    fields.setdefault("old_logprobs_BTr", rollout.sample_logprobs_BTr)
    return extend(rollout, TrainBatch, **fields)


__all__ = ["DockFlow", "MemoryFlow", "rollout_share", "score_share", "train_batch"]
