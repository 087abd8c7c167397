"""Dry runs: rlflow's own code executed for one rank of a full-size world, on tensors without memory.

Tensors live on the ``meta`` device (shapes and dtypes, no storage to fill) and torch.distributed runs its
``fake`` backend over a world of the full size (every collective returns at once; torchtitan and PyTorch's own
tests trace distributed programs the same way), so one process executes what a rank of 16 or 384 devices
would: the same plans, buckets, packing, collectives and swaps. A dispatch mode watches every op:

- **collectives**: each c10d op in issue order, with its group's ranks and its tensors' shapes and dtypes.
  ``mismatched`` checks a world's traces: every member of a group must issue that group's collectives in the
  same order with the same shapes (else the real run hangs or corrupts);
- **memory**: the live bytes of device tensors after every op (storages the run created or was handed, less
  those freed; host copies left out), and their peak, beside the plan's ledger for the rank.

Built so far: the transition (``transition``: the allgather-swap into the rollout layout, with the train
state swapped out). Not yet: the engine's prefill and decode, the swap back and the update (the model's
forward has data-dependent ops, ``nonzero`` and ``item``, which meta tensors cannot run; docs/dryrun.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from rlflow.optim import AdamWState
from rlflow.sharding import dist as sdist
from rlflow.sharding.execute import TrainState
from rlflow.sharding.memory import StateBytes, ledger
from rlflow.sharding.plan import allgather_swap

META = torch.device("meta")
P2P = ("send", "recv_")  # c10d's point-to-point ops: matched pairwise, not over a group


@dataclass(frozen=True)
class Collective:
    """One collective as a rank issued it."""
    op: str
    group: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    splits: tuple[tuple[int, ...], ...] = ()  # an all-to-all's (output, input) split sizes, one per group member
    peer: int | None = None  # a send's destination, a receive's source (global rank)


@dataclass
class RankTrace:
    """What one rank did: its collectives in issue order, its live device bytes' peak and after each step of the
    plan, and the ledger's for the same."""
    rank: int
    collectives: list[Collective] = field(default_factory=list)
    peak_bytes: int = 0
    ledger_peak_bytes: int = 0
    steps: list[int] = field(default_factory=list)  # live device bytes after each plan step
    ledger_steps: list[int] = field(default_factory=list)

    def ledger_gap(self) -> float:
        """The largest |live - ledger| over the plan's steps, as a share of the ledger's peak."""
        return max(abs(a - b) for a, b in zip(self.steps, self.ledger_steps)) / max(self.ledger_peak_bytes, 1)


class _Watch(TorchDispatchMode):
    """Records c10d ops and the live bytes of the device tensors created or handed in (``hold``)."""

    def __init__(self, trace: RankTrace):
        super().__init__()
        self.trace, self.live, self.host = trace, {}, set()

    def hold(self, tensors, host: bool = False) -> None:
        for t in tensors:
            key = StorageWeakRef(t.untyped_storage())
            (self.host.add(key) if host else self.live.setdefault(key, t.untyped_storage().nbytes()))

    def live_bytes(self) -> int:
        self.live = {k: n for k, n in self.live.items() if not k.expired()}
        return sum(self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "c10d":
            tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]
            pg = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.ScriptObject)), None)
            group = tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(pg))) if pg is not None else ()
            splits = tuple(tuple(a) for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], int))
            op = func.__name__.split(".")[0]
            peer = None
            if op in P2P:  # (tensors, group, peer's rank in the group, tag)
                peer = group[args[2]] if group else args[2]
            self.trace.collectives.append(Collective(op, group, tuple(tuple(t.shape) for t in tensors),
                                                     tuple(str(t.dtype) for t in tensors), splits, peer))
        new = False
        for t in (out if isinstance(out, (list, tuple)) else [out]):
            if isinstance(t, torch.Tensor) and t.device == META:
                key = StorageWeakRef(t.untyped_storage())
                if key not in self.host and key not in self.live:
                    self.live[key], new = t.untyped_storage().nbytes(), True
        if new:  # the peak can only rise when memory is taken
            self.trace.peak_bytes = max(self.trace.peak_bytes, self.live_bytes())
        return out


class _MetaHost:
    """The dry run's host memory: swapped-out tensors land here (meta, and not counted as device bytes)."""

    def __init__(self, watch: _Watch):
        self.watch = watch

    def take(self, t: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():  # made unseen: host memory, not the device's
            h = torch.empty(t.shape, dtype=t.dtype, device=META)
        self.watch.hold([h], host=True)
        return h


@contextmanager
def fake_world(rank: int, world: int):
    """torch.distributed's ``fake`` backend as rank ``rank`` of ``world`` for the block (no peers, no memory)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("fake_world: torch.distributed is initialised already in this process")
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
    sdist.clear_groups()
    try:
        yield
    finally:
        sdist.clear_groups()
        dist.destroy_process_group()


def transition(train, rollout, rank: int, *, state: StateBytes = StateBytes(grad_bytes=0, optim_bytes=12)
               ) -> RankTrace:
    """Rank ``rank``'s allgather-swap from layout ``train`` to ``rollout`` (``runtime.weights``' forward way) on
    meta tensors in a fake world of the layouts' size: its train shards and AdamW state (``state``'s bytes per
    element: 12 is float32 moments and a master) swapped out, its rollout shards built. The ledger's peak for
    the rank is computed from the same plan and ``state``."""
    plan = allgather_swap(train, rollout)
    led = ledger(plan, state)
    trace = RankTrace(rank, ledger_peak_bytes=int(led.peak[rank]), ledger_steps=led.total[1:, rank].tolist())
    stage = train.mesh.coords(rank)["pp"]
    with fake_world(rank, train.mesh.size), _Watch(trace) as watch:
        shards = {p.name: torch.empty(p.local_shape(train.mesh), dtype=p.dtype, device=META)
                  for p in train.params if p.stage == stage}
        optim = None
        if state.optim_bytes:
            f32 = lambda: {n: torch.empty(t.shape, dtype=torch.float32, device=META)  # noqa: E731
                           for n, t in shards.items()}
            optim = AdamWState(step=1, m=f32(), v=f32(), master=f32() if state.optim_bytes > 8 else {})
        held = list(shards.values()) + ([] if optim is None else [*optim.m.values(), *optim.v.values(),
                                                                   *optim.master.values()])
        watch.hold(held)
        del held
        st = TrainState(optim=optim)
        st.arena = _MetaHost(watch)
        del optim
        out = sdist.execute(plan, shards, st, device=META, on_step=lambda i: trace.steps.append(watch.live_bytes()))
        trace.peak_bytes = max(trace.peak_bytes, watch.live_bytes())
        del out
    return trace


def _signature(c: Collective) -> tuple:
    """What every member of the group must issue alike: the op and dtypes, and the shapes except for an
    all-to-all, whose members' sizes differ by design (``_splits_agree`` checks those)."""
    return (c.op, c.dtypes) if c.splits else (c.op, c.shapes, c.dtypes)


def _splits_agree(group: tuple[int, ...], calls: dict[int, Collective]) -> bool:
    """An all-to-all's sizes fit together: what member i sends to member j is what j receives from i."""
    for i, a in enumerate(group):
        for j, b in enumerate(group):
            if calls[a].splits[1][j] != calls[b].splits[0][i]:
                return False
    return True


def _unpaired(by_rank: dict[int, RankTrace]) -> list[str]:
    """Point-to-point: what rank a sends to rank b, in order, must be what b receives from a (shapes, dtypes)."""
    sent, got = {}, {}
    for r, t in by_rank.items():
        for c in t.collectives:
            if c.op == "send":
                sent.setdefault((r, c.peer), []).append((c.shapes, c.dtypes))
            elif c.op == "recv_":
                got.setdefault((c.peer, r), []).append((c.shapes, c.dtypes))
    return [f"ranks {a} -> {b}: {len(sent.get((a, b), []))} sends, {len(got.get((a, b), []))} receives, or their "
            "sizes differ" for a, b in sorted(set(sent) | set(got))
            if a in by_rank and b in by_rank and sent.get((a, b)) != got.get((a, b))]


def mismatched(traces: list[RankTrace]) -> list[str]:
    """Where a world's traces disagree: for every group, each member's sequence of that group's collectives
    (op, shapes, dtypes) must be the group's first member's, and each all-to-all's split sizes must fit
    together over its members. Empty: they agree."""
    by_rank = {t.rank: t for t in traces}
    groups = {c.group for t in traces for c in t.collectives if len(c.group) > 1 and c.op not in P2P}
    out = _unpaired(by_rank)
    for g in sorted(groups):
        calls = {r: [c for c in by_rank[r].collectives if c.group == g and c.op not in P2P] for r in g if r in by_rank}
        seqs = {r: [_signature(c) for c in cs] for r, cs in calls.items()}
        first = next(iter(seqs))
        for r, s in seqs.items():
            if s != seqs[first]:
                i = next((k for k, (a, b) in enumerate(zip(s, seqs[first])) if a != b), min(len(s), len(seqs[first])))
                out.append(f"group {g}: rank {r}'s collective {i} {s[i] if i < len(s) else 'missing'} against rank "
                           f"{first}'s {seqs[first][i] if i < len(seqs[first]) else 'missing'}")
        if not out and len(calls) == len(g):
            for i, c in enumerate(calls[first]):
                if c.splits and not _splits_agree(g, {r: cs[i] for r, cs in calls.items()}):
                    out.append(f"group {g}: all-to-all {i}: what a member sends is not what its peer receives")
    return out


__all__ = ["Collective", "RankTrace", "fake_world", "mismatched", "transition"]
