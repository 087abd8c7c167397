"""The actor's weights between the train layout and the rollout layout, every step.

Before each rollout, ``to_rollout`` runs the allgather-swap plan (``sharding.plan.allgather_swap``) with
the torch.distributed executor: each rank's rollout shards are built bucket by bucket from the train
shards, and the train state (weights, the AdamW moments and float32 masters) goes to host memory
(pinned on an accelerator; on a CPU it stays where it is, the same tensors). ``to_train`` is the plan's
way back (``swap_back``): the train state comes in again and the rollout weights are freed. Nothing
moves between ranks on the way back: the train state did not change while the rollout ran.

Identical layouts need no transition: ``to_rollout`` hands the train weights to the rollout as they are.
Every transition's wall time and bytes (sent and received by this rank) are recorded for the metrics,
with the ledger's peak for this rank (``sharding.memory``: the plan's bytes of train weights, optimizer
state, rollout weights and buffers at its worst step) beside the naive transition's (which keeps the
train state on the device), and on an accelerator the allocator's own peak during the transition.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlflow import optim
from rlflow.sharding import dist as sdist
from rlflow.sharding.execute import TrainState
from rlflow.sharding.layout import Layout
from rlflow.sharding.memory import StateBytes, ledger
from rlflow.sharding.plan import DEFAULT_BUCKET_BYTES, allgather_swap, swap_back


def same_layout(a: Layout, b: Layout) -> bool:
    return a.mesh == b.mesh and a.names == b.names and all(a[n].spec == b[n].spec and a[n].stage == b[n].stage
                                                           for n in a.names)


@dataclass
class Transition:
    """The last transition's figures on this rank."""
    seconds: float = 0.0
    sent: int = 0
    recv: int = 0


class Weights:
    """Moves one rank's actor weights train layout -> rollout layout -> train layout (see the module)."""

    def __init__(self, train: Layout, rollout: Layout, rank: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.train, self.rollout, self.rank = train, rollout, rank
        self.identity = same_layout(train, rollout)
        self.forward = None if self.identity else allgather_swap(train, rollout, bucket_bytes=bucket_bytes)
        self.back = None if self.identity else swap_back(self.forward)
        self.peak = self.naive_peak = 0
        if not self.identity:  # no gradients are kept between steps; AdamW: two float32 moments (+ a master)
            state = StateBytes(grad_bytes=0, optim_bytes=8 + (4 if train.params[0].dtype != torch.float32 else 0))
            self.peak = int(ledger(self.forward, state).peak[rank])
            self.naive_peak = int(ledger(self.forward, state, naive=True).peak[rank])
        self.device_peak = None
        self.state = TrainState()
        self.out, self.ret = Transition(), Transition()

    def to_rollout(self, params: dict, opt_state: optim.AdamWState) -> dict:
        """This rank's rollout shards. The train weights and ``opt_state`` are swapped out (owned by this
        object until ``to_train``)."""
        if self.identity:
            return params
        dev = next(iter(params.values())).device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        self.state.optim = opt_state
        out = sdist.execute(self.forward, dict(params), self.state)
        self.out = Transition(time.perf_counter() - t0, int(self.forward.bytes_sent()[self.rank]),
                              int(self.forward.bytes_received()[self.rank]))
        if dev.type == "cuda":
            self.device_peak = int(torch.cuda.max_memory_allocated(dev))
        return out

    def to_train(self, rollout_params: dict) -> tuple[dict, optim.AdamWState]:
        """The train weights and optimizer state back; ``rollout_params`` is emptied (freed)."""
        if self.identity:
            raise RuntimeError("to_train: identical layouts keep the train weights in place (nothing to bring back)")
        t0 = time.perf_counter()
        params = sdist.execute(self.back, rollout_params, self.state)
        opt, self.state.optim = self.state.optim, None
        self.ret = Transition(time.perf_counter() - t0, 0, 0)
        return params, opt

    def figures(self) -> dict[str, float]:
        """The step's transition figures for the metrics (this rank's)."""
        out = {"transition_out_s": self.out.seconds, "transition_back_s": self.ret.seconds,
               "transition_sent_bytes": float(self.out.sent), "transition_recv_bytes": float(self.out.recv),
               "transition_peak_bytes": float(self.peak), "transition_naive_peak_bytes": float(self.naive_peak)}
        if self.device_peak is not None:
            out["transition_device_peak_bytes"] = float(self.device_peak)
        return out




def gather_full(tensors: dict, src: Layout, full: Layout) -> dict:
    """Every rank's copy of the whole tensors from its shards ``tensors`` under ``src`` (``full``: the same
    parameters replicated on the same mesh); a collective: every rank calls it (checkpoints)."""
    if same_layout(src, full):
        return dict(tensors)
    from rlflow.sharding.plan import plan
    return sdist.execute(plan(src, full), dict(tensors))


__all__ = ["Transition", "Weights", "gather_full", "same_layout"]
