"""The actor's weights between the train layout and the rollout layout, every step.

Before each rollout, ``to_rollout`` runs the allgather-swap plan (``sharding.plan.allgather_swap``) with
the torch.distributed executor: each rank's rollout shards are built bucket by bucket from the train
shards, and the train state (weights, the AdamW moments and float32 masters) goes to host memory
(pinned on an accelerator; on a CPU it stays where it is, the same tensors). ``to_train`` is the plan's
way back (``swap_back``): the train state comes in again and the rollout weights are freed. Nothing
moves between ranks on the way back: the train state did not change while the rollout ran.

Identical layouts (and one process) need no transition: ``to_rollout`` hands the policy over as it is.
The transition owns the train state while the engine generates: ``to_rollout`` takes it out of the run
state (no caller keeps a reference) and ``to_train`` puts it back.
LoRA: the frozen model does not change, so it is resharded into the rollout layout once, with the first
transition, and kept there; every transition swaps the adapters alone (and their AdamW state). The model is
then resident in both layouts (its train shards stay on the device while the engine generates): one more
copy of the model's rollout shards against every step's move of the whole model.
Every transition's wall time and bytes (sent and received by this rank) are recorded for the metrics,
with the ledger's peak for this rank (``sharding.memory``: the plan's bytes of train weights, optimizer
state, rollout weights and buffers at its worst step) beside the naive transition's (which keeps the
train state on the device), and on an accelerator the allocator's own peak during the transition.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlflow.algos import critic as critics
from rlflow.device import process_device
from rlflow.models import lora
from rlflow.models.config import ModelConfig
from rlflow.models.sharding import RULES, layout
from rlflow.sharding import dist as sdist, geometry as geo
from rlflow.sharding.execute import HostArena, TrainState
from rlflow.sharding.layout import Layout
from rlflow.sharding.memory import StateBytes, ledger
from rlflow.sharding.mesh import Mesh
from rlflow.sharding.plan import DEFAULT_BUCKET_BYTES, allgather_swap, plan, swap_back


def _state_tensors(opt) -> list:
    return [] if opt is None else [*opt.m.values(), *opt.v.values(), *opt.master.values()]


def _critic_tensors(critic) -> list:
    return [] if critic is None else [*critic.params.values(), *_state_tensors(critic.opt_state)]


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
    """Moves one rank's train state train layout -> rollout layout -> train layout (see the module).
    ``train`` None: one process, nothing moves (``to_rollout`` hands the policy over as it is)."""

    def __init__(self, train: Layout | None, rollout: Layout | None, rank: int = 0, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.train, self.rollout, self.rank = train, rollout, rank
        self.identity = train is None or same_layout(train, rollout)
        self.frozen_plan, self.frozen, self.frozen_train = None, None, {}  # LoRA's model: its plan, rollout shards
        self.forward = self.back = None
        self.peak = self.naive_peak = 0
        self.state_bytes = None  # what the ledger counts per train element
        if not self.identity:  # no gradients are kept between steps; AdamW: two float32 moments (+ a master)
            moving, resident = train, 0
            if adapters := [n for n in train.names if lora.is_adapter(n)]:
                base = [n for n in train.names if not lora.is_adapter(n)]
                self.frozen_plan = plan(train.only(base), rollout.only(base), bucket_bytes=bucket_bytes)
                moving, rollout = train.only(adapters), rollout.only(adapters)
                resident = int(self.frozen_plan.src.bytes_per_rank()[rank]
                               + self.frozen_plan.dst.bytes_per_rank()[rank])
            self.forward = allgather_swap(moving, rollout, bucket_bytes=bucket_bytes)
            self.back = swap_back(self.forward)
            self.state_bytes = StateBytes(grad_bytes=0,
                                          optim_bytes=8 + (4 if moving.params[0].dtype != torch.float32 else 0))
            self.peak = resident + int(ledger(self.forward, self.state_bytes).peak[rank])
            self.naive_peak = resident + int(ledger(self.forward, self.state_bytes, naive=True).peak[rank])
        self.device_peak = None
        self.state = TrainState()
        self.out, self.ret = Transition(), Transition()

    def to_rollout(self, run, into: dict | None = None) -> dict:
        """This rank's rollout shards of ``run``'s policy (a ``runtime.state.RunState``). Unless the layouts
        are the same, ``run``'s train state (the policy, its optimizer state, and the critic) is swapped out
        and owned by this object until ``to_train``: ``run.policy`` and ``run.opt_state`` are None meanwhile.
        ``into``: name -> the memory a rollout shard is to be written into (the engine's own parameters,
        ``engines.targets``); not used for a LoRA policy, which reaches the engine merged."""
        if self.identity:
            return run.policy
        dev = next(iter(run.policy.values())).device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        params, run.policy = run.policy, None
        sent, recv = 0, 0
        if self.frozen_plan is not None:  # LoRA: the model stays; its rollout shards are made once
            self.frozen_train = {n: t for n, t in params.items() if not lora.is_adapter(n)}
            params = {n: t for n, t in params.items() if lora.is_adapter(n)}
            if self.frozen is None:
                self.frozen = sdist.execute(self.frozen_plan, self.frozen_train)
                sent, recv = (int(x[self.rank]) for x in (self.frozen_plan.bytes_sent(),
                                                          self.frozen_plan.bytes_received()))
        if dev.type != "cpu":  # one exact-size host buffer for everything swapped out, reused every step
            if self.state.arena is None:
                self.state.arena = HostArena(pin=True)
            self.state.arena.reserve(HostArena.size_of([*params.values(), *_state_tensors(run.opt_state),
                                                        *_critic_tensors(run.critic)]))
        self.state.optim, run.opt_state = run.opt_state, None
        out = sdist.execute(self.forward, params, self.state, into=None if self.frozen_plan else into)
        del params
        if run.critic is not None:  # the critic's train state leaves the device with the policy's
            critics.swap(run.critic, arena=self.state.arena)
        self.out = Transition(time.perf_counter() - t0, sent + int(self.forward.bytes_sent()[self.rank]),
                              recv + int(self.forward.bytes_received()[self.rank]))
        if dev.type == "cuda":
            self.device_peak = int(torch.cuda.max_memory_allocated(dev))
        return out if self.frozen is None else {**self.frozen, **out}

    def to_train(self, run, rollout_params: dict, device) -> None:
        """``run``'s train state back on ``device`` (its policy, optimizer state and critic); ``rollout_params``
        is emptied (freed). Nothing to do for identical layouts."""
        if self.identity:
            return
        t0 = time.perf_counter()
        if self.frozen is not None:  # LoRA: the model's rollout shards stay for the next transition
            rollout_params = {n: t for n, t in rollout_params.items() if lora.is_adapter(n)}
        run.policy = sdist.execute(self.back, rollout_params, self.state)
        if self.frozen_train:  # the train layout's order of the parameters
            both = {**self.frozen_train, **run.policy}
            run.policy, self.frozen_train = {n: both[n] for n in self.train.names if n in both}, {}
        run.opt_state, self.state.optim = self.state.optim, None
        if run.critic is not None:
            critics.swap(run.critic, device)
        if self.state.arena is not None:  # everything in it is back on the device (its copies were queued
            self.state.arena.reset()  # before any later write into it: the next step's swap-out)
        self.ret = Transition(time.perf_counter() - t0, 0, 0)

    def figures(self) -> dict[str, float]:
        """The step's transition figures for the metrics (this rank's; none in one process)."""
        if self.train is None:
            return {}
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
    return sdist.execute(plan(src, full), dict(tensors))


def gather_to_host(shards: dict, src: Layout, root: int = 0) -> dict:
    """The whole tensors of this rank's shards ``shards`` under ``src``, on rank ``root``'s host ({} on the
    other ranks); a collective. Tensor by tensor: each distinct block comes from its first holder (a
    replicated block once) to one receive buffer on ``root``'s device, then to the host, so no rank holds
    more on its device than its own shards and one tensor's blocks (a checkpoint's consolidated export). Not
    the first collective of the process group (NCCL's batched point-to-point on a subset of ranks needs one
    before it)."""
    import torch.distributed as dist
    rank, out = dist.get_rank(), {}
    for p in src.params:
        full = _gather_one(shards, src, p, rank, root)
        if full is not None:
            out[p.name] = full
    return out


def _gather_one(shards: dict, src: Layout, p, rank: int, root: int):
    """``gather_to_host`` of one parameter (a function: its receive buffers are gone when it returns)."""
    import torch.distributed as dist
    bl, view = geo.blocks(*geo.placement(src, p.name)), p.local_view(src.mesh)
    full = torch.empty(p.view, dtype=p.dtype) if rank == root else None
    ops, recvd, seen = [], [], set()
    for row, r in enumerate(bl.ranks.tolist()):
        box = bl.box(row)
        if box in seen:
            continue
        seen.add(box)
        sl = tuple(slice(lo, hi) for lo, hi in box)
        if r == root == rank:
            full[sl] = shards[p.name].reshape(view).cpu()
        elif r == rank:  # in the layout's dtype, which the receive buffer has (a raise here would hang the root)
            ops.append(dist.P2POp(dist.isend, shards[p.name].to(p.dtype).contiguous(), root))
        elif rank == root:
            buf = torch.empty(view, dtype=p.dtype, device=process_device())
            ops.append(dist.P2POp(dist.irecv, buf, r))
            recvd.append((sl, buf))
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    for sl, buf in recvd:
        full[sl] = buf.cpu()
    return None if full is None else full.reshape(p.shape)


def full_weights(cfg: ModelConfig, held: Layout, shards: dict) -> dict:
    """Every rank's copy of the whole policy from its shards ``shards`` of layout ``held`` (a collective)."""
    if not shards:
        return {}
    dt = next(iter(shards.values())).dtype
    mesh = held.mesh  # the whole model on every rank: no pp stages, nothing split
    return gather_full(shards, held, layout(cfg, Mesh(dp=mesh.size), {k: None for k in RULES}, dtype=dt))


__all__ = ["Transition", "Weights", "full_weights", "gather_full", "gather_to_host", "same_layout"]
