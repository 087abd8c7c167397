"""Per-rank memory ledger of a plan: bytes of train weights, grads, optimizer state, rollout weights
and temporary buffers after every step, and the peak.

Train state per weight element (``StateBytes``; Megatron mixed precision defaults): the weight in the
layout's dtype, an fp32 gradient (4 bytes) and Adam's fp32 master copy + two moments (12 bytes). KV
cache is not counted: it is what the freed memory is for.

The *naive* transition keeps the whole train state on the device and builds the rollout copy beside
it, through the same collectives: its peak is ``train + grads + optim + rollout + one bucket``.
Allgather-swap swaps grads and optimizer state out first and each bucket's train shards as soon as the
bucket is sliced, so its peak is at most ``train + rollout + one bucket`` and usually about
``max(train, rollout) + one bucket``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlflow.sharding.layout import Layout, fmt_bytes
from rlflow.sharding.plan import COLLECTIVES, Plan

CATEGORIES = ("train_weights", "grads", "optim", "rollout_weights", "tmp")
TRAIN, GRADS, OPTIM, ROLLOUT, TMP = range(5)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per train weight element of the gradient and of the optimizer state."""

    grad_bytes: int = 4
    optim_bytes: int = 12


def elements_per_rank(layout: Layout) -> np.ndarray:
    per_stage = np.zeros(layout.mesh.pp, dtype=np.int64)
    for p in layout.params:
        per_stage[p.stage] += int(np.prod(p.local_view(layout.mesh), dtype=np.int64))
    return per_stage[layout.mesh.coord_array[:, 0]]


@dataclass(frozen=True, eq=False)
class Ledger:
    labels: tuple[str, ...]  # "start", then one per step
    bytes: np.ndarray  # [len(labels), len(CATEGORIES), world]

    @property
    def total(self) -> np.ndarray:
        return self.bytes.sum(axis=1)

    @property
    def peak(self) -> np.ndarray:
        """``[world]`` the largest total over the steps."""
        return self.total.max(axis=0)

    @property
    def peak_step(self) -> np.ndarray:
        return self.total.argmax(axis=0)

    def at_peak(self, rank: int) -> dict[str, int]:
        row = self.bytes[self.peak_step[rank], :, rank]
        return {c: int(v) for c, v in zip(CATEGORIES, row)}

    def table(self, rank: int, every: int = 1) -> str:
        head = f"{'step':>5} {'op':<28}" + "".join(f"{c:>16}" for c in CATEGORIES) + f"{'total':>16}"
        rows = [head]
        for i in range(0, len(self.labels), every):
            b = self.bytes[i, :, rank]
            rows.append(f"{i:>5} {self.labels[i][:28]:<28}" + "".join(f"{fmt_bytes(v):>16}" for v in b)
                        + f"{fmt_bytes(b.sum()):>16}")
        return "\n".join(rows)


def ledger(plan: Plan, state: StateBytes = StateBytes(), *, naive: bool = False) -> Ledger:
    """Bytes per rank and category after each step of ``plan``. ``naive=True``: the same plan with
    every swap left out (the train state stays on the device)."""
    world = plan.world
    start = np.zeros((len(CATEGORIES), world), dtype=np.int64)
    if plan.kind == "swap_back":
        start[ROLLOUT] = plan.src.bytes_per_rank()
        train_layout = plan.dst
    else:
        train_layout = plan.src
        start[TRAIN] = plan.src.bytes_per_rank()
    el = elements_per_rank(train_layout)
    full = {"train": train_layout.bytes_per_rank(), "grads": el * state.grad_bytes,
            "optim": el * state.optim_bytes}
    if plan.kind != "swap_back":
        start[GRADS], start[OPTIM] = full["grads"], full["optim"]
    cat = {"train": TRAIN, "grads": GRADS, "optim": OPTIM, "rollout": ROLLOUT, "tmp": TMP}
    labels, deltas = ["start"], []
    for s in plan.steps:
        if naive and s.op in ("swap_out", "swap_in"):
            continue
        d = np.zeros((len(CATEGORIES), world), dtype=np.int64)
        b = plan.buckets[s.bucket] if s.bucket is not None else None
        if s.op in COLLECTIVES:
            d[TMP] = b.tmp
        elif s.op == "slice":  # the collective has returned: only what it keeps is still there
            d[ROLLOUT] = b.dst_bytes
            d[TMP] = -(b.tmp - b.keep) if b.kind != "slice" else 0
        elif s.op == "free" and s.what == "tmp":
            d[TMP] = -b.keep
        elif s.op == "free" and s.what == "rollout":
            d[ROLLOUT] = -start[ROLLOUT]
        elif s.op == "swap_out":
            d[cat[s.what]] = -(b.src_bytes if b is not None else full[s.what])
        elif s.op == "swap_in":
            d[cat[s.what]] = full[s.what]
        else:
            raise ValueError(f"ledger: unknown step {s}")
        target = f"b{s.bucket}" if s.bucket is not None else "all"
        labels.append(" ".join(filter(None, (s.op, s.what, target))))
        deltas.append(d)
    deltas = np.asarray(deltas, dtype=np.int64).reshape(-1, len(CATEGORIES), world)
    seq = np.concatenate([start[None], deltas])
    return Ledger(labels=tuple(labels), bytes=np.cumsum(seq, axis=0))


def report(plan: Plan, state: StateBytes = StateBytes()) -> dict:
    """Peaks per rank of ``plan`` (allgather-swap) and of the naive transition, and bytes moved."""
    swap, naive = ledger(plan, state), ledger(plan, state, naive=True)
    return {"peak_bytes_per_rank": swap.peak.tolist(), "naive_peak_bytes_per_rank": naive.peak.tolist(),
            "bytes_moved_per_rank": plan.bytes_received().tolist(),
            "bytes_sent_per_rank": plan.bytes_sent().tolist()}
