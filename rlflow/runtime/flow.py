"""The sample flow of one GRPO iteration: how each stage's rows reach the ranks of the next stage.

``DockFlow`` routes every stage through a transfer dock (``rlflow.dock``): a stage ``put``s the columns
it produced for its rows, and the ranks of the next stage ``get`` theirs. A get is a routing
transition (``dock.routing``): the lead rank takes every row of the step that is ready for the
consumer (metadata: indices, warehouses, lengths), plans which data-parallel part of the stage's mesh
reads which rows (balanced by sequence length, GRPO groups whole), and hands the plan to every rank
(metadata again); each rank then reads its part straight from the warehouses, its tp and pp peers
the same rows. Rows never pass through the lead or the driver. With one process the same calls run
on a world of one.

``MemoryFlow`` is the one-process path without a dock: the batch goes from stage to stage in memory
(no copies); the loop's code is the same, and tests check the two flows train identically.

Dock rows are the step's samples, indexed ``prompt * G + k`` from 0 each step (``clear()`` at the start
of a step); batches carry the run's global sample indices (``index_B``), the dock's plus
``first prompt * G``. The reference answers travel as dock data (UTF-8 bytes), so a scoring rank in
another process reads them with the rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from rlflow.batch import PromptBatch, RolloutBatch, TrainBatch, extend, unpad
from rlflow.dock.client import Ticket
from rlflow.dock.routing import RowPlan, route
from rlflow.runtime.graph import FIELDS, PROMPT, ROUTES, ROWS
from rlflow.sharding.mesh import Mesh



class MemoryFlow:
    """One process: stages share one batch in memory; ``put`` adds columns to it, ``get`` returns it."""

    def begin(self, prompts: PromptBatch, group_size: int) -> None:
        self._prompts, self._cols = prompts, {}

    def rollout_prompts(self, mesh: Mesh, rank: int) -> PromptBatch:
        _one(mesh)
        return self._prompts

    def put_rollout(self, rollout: RolloutBatch) -> None:
        self._batch = rollout

    def put(self, rows: RolloutBatch, **cols: Tensor) -> None:
        self._cols.update(cols)

    def get(self, consumer: str, columns: list[str], mesh: Mesh, rank: int) -> tuple[RolloutBatch, dict[str, Tensor]]:
        _one(mesh)  # the rollout batch carries its routes, when recorded
        return self._batch, {c: self._cols[c] for c in columns if c not in ROUTES}


def _one(mesh: Mesh) -> None:
    if mesh.size != 1:
        raise ValueError(f"MemoryFlow is the one-process flow; {mesh} has {mesh.size} ranks (use a dock)")


class DockFlow:
    """Stages exchange rows through ``dock`` (in-process, local processes or Ray); rank ``rank`` of
    ``world`` (rank 0 leads: it clears the dock, puts the prompts and plans every get). Only the lead
    takes, so no rank waits for another before a get: the others read what the lead's plan hands them,
    and the lead clears the dock for step s + 1 only after the update of step s, which every rank's
    last read of step s precedes."""

    def __init__(self, dock, rank: int = 0, world: int = 1, route_dims: tuple[int, int] | None = None):
        self.dock, self.rank, self.world = dock, rank, world
        self.route_dims = route_dims  # (MoE layers, top-k) of the route columns, with routing replay
        self._seen: dict[str, int] = {}  # dock traffic at the last busiest_bytes()

    def begin(self, prompts: PromptBatch, group_size: int) -> None:
        """The step's prompts (the same on every rank) become dock rows; only the lead writes them."""
        self.G, self.P = group_size, prompts.size
        self.base = int(prompts.index_B[0]) * group_size  # global sample index of dock row 0
        self.device = prompts.prompt_ids_BTp.device
        if self.rank == 0:
            rows = prompts.repeat(group_size)
            self.dock.clear()
            self.dock.put(rows.index_B.cpu() - self.base, {
                "prompt_ids": unpad(rows.prompt_ids_BTp.cpu(), rows.prompt_mask_BTp.cpu()),
                "group": rows.group_B.cpu(),
                "answer": [torch.tensor(list(a.encode()), dtype=torch.uint8) for a in rows.answers]})

    def _take(self, consumer: str, columns: list[str], mesh: Mesh) -> tuple[Ticket, RowPlan]:
        """The lead's take of every row of the step and its routing onto ``mesh``; every rank gets both."""
        msg = [None]
        if self.rank == 0:
            (t,) = self.dock.take(consumer, columns, self.P * self.G, groups=True)
            cost = sum(t.lengths.get(c, 0) for c in ("prompt_ids", "response_ids"))
            sizes = {c: self.dock.schema[c].dtype.itemsize for c in columns}
            row_bytes = sum(t.lengths[c] * sizes[c] if c in t.lengths else sizes[c] for c in columns)
            msg = [(t, route(t.index, t.warehouse, cost, row_bytes, mesh, group_size=self.G))]
        if self.world > 1:
            dist.broadcast_object_list(msg, src=0)
        return msg[0]

    def _read(self, consumer: str, columns: list[str], mesh: Mesh, rank: int):
        t, plan = self._take(consumer, columns, mesh)
        pos = plan.positions(mesh.data_parallel_index(rank))
        return self.dock.read(Ticket(consumer, t.columns, t.index[pos], t.warehouse[pos],
                                     {c: v[pos] for c, v in t.lengths.items()}))

    def _answers(self, b) -> tuple[str, ...]:
        return tuple(bytes(r.tolist()).decode() for r in b.rows("answer"))

    def rollout_prompts(self, mesh: Mesh, rank: int) -> PromptBatch:
        """This rank's prompts of the step: its data-parallel part of the rollout mesh (one row per prompt)."""
        b = self._read("rollout", list(PROMPT), mesh, rank)
        first = (b.index_B % self.G == 0).nonzero()[:, 0]
        ans = self._answers(b)
        return PromptBatch(prompt_ids_BTp=b["prompt_ids"][first], prompt_mask_BTp=b.mask["prompt_ids"][first],
                           index_B=(b.index_B[first] + self.base) // self.G, group_B=b["group"][first],
                           answers=tuple(ans[i] for i in first.tolist())).to(self.device)

    def put_rollout(self, rollout: RolloutBatch) -> None:
        self.put(rollout, response_ids=rollout.response_ids_BTr, sample_logprobs=rollout.sample_logprobs_BTr)
        if rollout.response_routes_BTrMK is not None:  # each row's routes flattened over its tokens
            flat = {c: [t.reshape(-1) for t in unpad(v.cpu(), m.cpu())] for c, v, m in (
                ("prompt_routes", rollout.prompt_routes_BTpMK, rollout.prompt_mask_BTp),
                ("response_routes", rollout.response_routes_BTrMK, rollout.response_mask_BTr))}
            self.dock.put(rollout.index_B.cpu() - self.base, flat)

    def put(self, rows: RolloutBatch, **cols: Tensor) -> None:
        m = rows.response_mask_BTr.cpu()
        self.dock.put(rows.index_B.cpu() - self.base,
                      {c: (unpad(v.cpu(), m) if v.dim() == 2 else v.cpu()) for c, v in cols.items()})

    def get(self, consumer: str, columns: list[str], mesh: Mesh, rank: int) -> tuple[RolloutBatch, dict[str, Tensor]]:
        """This rank's rows for ``consumer``: its data-parallel part of ``mesh`` (``rank``: its rank there)."""
        b = self._read(consumer, list(ROWS) + [c for c in columns if c not in ROWS], mesh, rank)
        routes = {}
        if "response_routes" in columns:  # [B, T * M * K] padded with -1 -> [B, T, M, K]
            mk = self.route_dims
            routes = {FIELDS[c]: b[c].view(b[c].shape[0], -1, *mk) for c in ROUTES}
        rollout = RolloutBatch(prompt_ids_BTp=b["prompt_ids"], prompt_mask_BTp=b.mask["prompt_ids"],
                               index_B=b.index_B + self.base, group_B=b["group"], answers=self._answers(b),
                               response_ids_BTr=b["response_ids"], response_mask_BTr=b.mask["response_ids"],
                               sample_logprobs_BTr=b["sample_logprobs"], **routes)
        return rollout.to(self.device), {c: b[c].to(self.device) for c in columns if c not in ROUTES}

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


__all__ = ["DockFlow", "MemoryFlow", "train_batch"]
