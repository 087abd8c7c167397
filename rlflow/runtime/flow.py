"""The sample flow of one GRPO iteration: how each stage's outputs reach the next stage.

``MemoryFlow`` hands the batch from stage to stage in this process (no copies; the one-process fast
path). ``DockFlow`` routes every stage through a transfer dock (``rlflow.dock``), as separate worker
groups would: a stage ``put``s the columns it produced for its rows, and the next stage's consumer
``get``s the rows that are ready in the columns it reads. Both give the loop the same typed batches, so
the stage code is written once (``runtime/loop.py``); tests check the two flows train identically.

Dock rows are the step's samples, indexed ``prompt * G + k`` from 0 each iteration (``clear()``
between iterations). Answers (strings) are prompt metadata held by the driver, keyed by group id.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlflow.batch import PromptBatch, RolloutBatch, TrainBatch, extend, unpad

# dock column -> batch field (var columns come back padded with their masks)
_FIELDS = {"prompt_ids": "prompt_ids_BTp", "response_ids": "response_ids_BTr",
           "sample_logprobs": "sample_logprobs_BTr", "old_logprobs": "old_logprobs_BTr",
           "ref_logprobs": "ref_logprobs_BTr", "rewards": "rewards_B", "advantages": "advantages_B"}


class MemoryFlow:
    """Stages share one batch in memory; ``put`` adds columns to it, ``get`` returns it."""

    def begin(self, prompts: PromptBatch, group_size: int) -> PromptBatch:
        self._cols: dict[str, Tensor] = {}
        return prompts

    def put_rollout(self, rollout: RolloutBatch) -> None:
        self._batch = rollout

    def put(self, rows: RolloutBatch, **cols: Tensor) -> None:
        self._cols.update(cols)

    def get(self, consumer: str, columns: list[str]) -> tuple[RolloutBatch, dict[str, Tensor]]:
        return self._batch, {c: self._cols[c] for c in columns}


class DockFlow:
    """Stages exchange rows through ``dock`` (in-process or Ray); each ``get`` takes whole groups."""

    def __init__(self, dock):
        self.dock = dock

    def begin(self, prompts: PromptBatch, group_size: int) -> PromptBatch:
        self.G = group_size
        local = prompts.replace(index_B=torch.arange(prompts.size, device=prompts.index_B.device),
                                group_B=torch.arange(prompts.size, device=prompts.group_B.device))
        self.answers = local.answers
        rows = local.repeat(group_size)
        self.dock.clear()
        self.dock.put(rows.index_B.cpu(), {"prompt_ids": unpad(rows.prompt_ids_BTp.cpu(), rows.prompt_mask_BTp.cpu()),
                                           "group": rows.group_B.cpu()})
        b = self.dock.get("rollout", ["prompt_ids", "group"], rows.size, groups=True)
        first = (b.index_B % group_size == 0).nonzero()[:, 0]  # the rollout stage reads one row per prompt
        g = b["group"][first]
        self.device = prompts.prompt_ids_BTp.device
        return PromptBatch(prompt_ids_BTp=b["prompt_ids"][first], prompt_mask_BTp=b.mask["prompt_ids"][first],
                           index_B=b.index_B[first] // group_size, group_B=g,
                           answers=tuple(self.answers[i] for i in g.tolist())).to(self.device)

    def put_rollout(self, rollout: RolloutBatch) -> None:
        self.put(rollout, response_ids=rollout.response_ids_BTr, sample_logprobs=rollout.sample_logprobs_BTr)

    def put(self, rows: RolloutBatch, **cols: Tensor) -> None:
        m = rows.response_mask_BTr.cpu()
        self.dock.put(rows.index_B.cpu(), {c: (unpad(v.cpu(), m) if v.dim() == 2 else v.cpu()) for c, v in cols.items()})

    def get(self, consumer: str, columns: list[str]) -> tuple[RolloutBatch, dict[str, Tensor]]:
        base = ["prompt_ids", "response_ids", "sample_logprobs", "group"]
        b = self.dock.get(consumer, base + [c for c in columns if c not in base], self.G * len(self.answers),
                          groups=True)
        g = b["group"]
        rollout = RolloutBatch(prompt_ids_BTp=b["prompt_ids"], prompt_mask_BTp=b.mask["prompt_ids"],
                               index_B=b.index_B, group_B=g, answers=tuple(self.answers[i] for i in g.tolist()),
                               response_ids_BTr=b["response_ids"], response_mask_BTr=b.mask["response_ids"],
                               sample_logprobs_BTr=b["sample_logprobs"])
        return rollout.to(self.device), {c: b[c].to(self.device) for c in columns}


def train_batch(rollout: RolloutBatch, cols: dict[str, Tensor]) -> TrainBatch:
    """The update's TrainBatch from the rollout rows and the dock columns (``old_logprobs`` defaults to
    the sampling log-probs: with one optimizer step per batch the update uses the current ones)."""
    fields = {_FIELDS[c]: v for c, v in cols.items()}
    fields.setdefault("old_logprobs_BTr", rollout.sample_logprobs_BTr)
    return extend(rollout, TrainBatch, **fields)
