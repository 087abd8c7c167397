"""Separate device pools: the first K ranks of a world generate and score (the rollout pool), the other N
train (the train pool); rows cross through the transfer dock, weights through the push (``plan.push_plan``).

Each pool is a torch.distributed world of its own (its default group: everything written for one world,
the layouts' groups, the collectives of the step, checkpoints, runs in a pool unchanged); a *link* over all
K + N ranks carries what crosses between them:

- the push (train -> rollout, a process group over every rank): after each update the train ranks send the
  new policy, version v = the steps trained, as the plan's point-to-point pieces; the train lead first sends
  a header [v, stop].
- the reports (rollout -> train lead, keys in the store every rank reaches): after each step it produced,
  each rollout rank sets that step's ``report.RolloutReport`` (its counts and times, the version that sampled
  it, the seconds it waited for weights). A store key, not a message: a point-to-point send waits for its
  receive, which the train lead posts only after it trained the step, and the rollout pool would wait with it.

The rollout side receives on a thread of its own into a spare copy of its shards while the engine uses
the current one (two copies; a newer version waits for the spare, so at most one is pending), and swaps
it in between steps (with partial rollout, also between decode steps: ``newer``). The train side keeps at
most one push in flight: its pieces are copies, so the next update may change the weights while they
travel. The push group is used by one thread of each process.

LoRA: the frozen model moves once, with the first version, into one copy both spare copies share; every later
version is the adapters alone (``adapters_plan``).
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlflow.models import lora
from rlflow.runtime.report import RolloutReport, combine_reports
from rlflow.sharding.push import push_pieces, push_place, push_slots
from rlflow.sharding.plan import PushPlan, push_plan

_FINAL = b"final"  # a rollout rank's last report
_HEADER, _PIECE = 0, 1  # tags on the push group


def split_problem(rollout: int, world: int) -> str | None:
    """Why ``rollout`` rollout ranks do not split a world of ``world`` into two pools (None: they do)."""
    if rollout < 1:
        return "must be >= 1 (each pool needs a rank at least)"
    return f"leaves no rank of a world of {world} to train" if rollout >= world else None


@dataclass(frozen=True)
class Pools:
    """``rollout`` ranks generate (global ranks 0..rollout-1), the rest of ``world`` train."""
    rollout: int
    world: int

    def __post_init__(self):
        if (why := split_problem(self.rollout, self.world)) is not None:
            raise ValueError(f"Pools: rollout={self.rollout}: {why}")

    @property
    def train(self) -> int:
        return self.world - self.rollout

    def pool(self, rank: int) -> str:
        return "rollout" if rank < self.rollout else "train"

    def local(self, rank: int) -> tuple[int, int]:
        """(rank in its pool, the pool's size) of global rank ``rank``."""
        return (rank, self.rollout) if rank < self.rollout else (rank - self.rollout, self.train)

    @property
    def train_lead(self) -> int:
        return self.rollout  # the global rank of the train pool's rank 0


@dataclass
class Link:
    pools: Pools
    rank: int  # global
    push: object  # a ProcessGroup over every rank (train -> rollout)
    reports: object  # a store every rank reaches (rollout -> train lead)
    device: torch.device = torch.device("cpu")  # where the push group's tensors live (nccl's: the rank's GPU)


_JOINED: list[Link | None] = [None]


def join(pools: Pools, rank: int, store, backend: str, timeout_s: float | None) -> Link:
    """This rank's link (``store``: a store every rank of the world reaches); called by ``launch`` once the
    rank's pool world is up."""
    timeout = datetime.timedelta(seconds=1800 if timeout_s is None else timeout_s)

    def group(name: str):
        prefixed = dist.PrefixStore(f"link/{name}", store)
        if backend == "gloo":
            return dist.ProcessGroupGloo(prefixed, rank, pools.world, timeout)
        if backend == "nccl":  # NOT RUN HERE (no GPU): the weights cross device to device
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(prefixed, rank, pools.world, opts)
        raise NotImplementedError(f"separate device pools: no link for backend {backend!r} yet (gloo on CPU, "
                                  "nccl on CUDA)")
    reports = dist.PrefixStore("link/reports", store)
    reports.set_timeout(timeout)
    # NOT RUN HERE (no GPU): nccl sends device tensors only, the headers included
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    _JOINED[0] = Link(pools, rank, group("push"), reports, device)
    return _JOINED[0]


def joined() -> Link | None:
    """This process's link, when it is a rank of a world of separate pools."""
    return _JOINED[0]


def leave() -> None:
    _JOINED[0] = None


def barrier(link: Link) -> None:
    """Every rank of both pools here (over the link's group: no thread of this process may use it meanwhile)."""
    link.push.barrier().wait()


def _wait(works) -> None:
    for w in works:
        w.wait()


def adapters_plan(plan: PushPlan) -> PushPlan | None:
    """The push of LoRA's adapters alone (the versions after the first), or None: every weight trains."""
    names = [n for n in plan.src.names if lora.is_adapter(n)]
    return push_plan(plan.src.only(names), plan.dst.only(names)) if names else None


class TrainSide:
    """The train pool's end of the link (rank ``rank`` of the train pool): ``push`` each new version,
    ``figures`` of each step from the rollout ranks (the lead), ``stop`` at the end."""

    def __init__(self, link: Link, rank: int, plan: PushPlan):
        self.link, self.rank, self.plan = link, rank, plan
        self.lead = rank == 0
        self.version: int | None = None  # the last version pushed
        self._flight: tuple[list, list] = ([], [])  # the works of the push in flight, and its pieces
        self.dropped = 0  # rows the rollout ranks reported past the last trained step
        self.stopped = False
        self._next: dict[int, int] = {}  # the number of the last report read from each rollout rank

    @functools.cached_property
    def later(self) -> PushPlan:
        """The push of every version after the first (LoRA: the adapters alone)."""
        return adapters_plan(self.plan) or self.plan

    def push(self, policy: dict, version: int) -> None:
        """``policy`` (this rank's train shards) as version ``version``; returns once it is posted."""
        if self.version is None and (off := self.plan.src.mismatched_dtypes(policy)):
            raise ValueError(f"separate pools: the train shards' {off[0]} is {policy[off[0]].dtype}, the train "
                             f"layout's {self.plan.src[off[0]].dtype}: make the layouts with the weights' dtype")
        _wait(self._flight[0])  # at most one push in flight
        pg, k = self.link.push, self.link.pools.rollout
        works = []
        if self.lead:
            header = torch.tensor([version, 0], dtype=torch.int64, device=self.link.device)
            works += [pg.send([header], d, _HEADER) for d in range(k)]
        pieces = push_pieces(self.plan if self.version is None else self.later, self.rank, policy)
        works += [pg.send([t], d, _PIECE) for d, t in pieces]
        self._flight, self.version = (works, pieces), version

    def figures(self, step: int) -> RolloutReport | None:
        """The rollout ranks' reports of step ``step`` as one (the lead; None elsewhere): ``report.combine_reports``
        (the version the oldest: each rank's own with partial rollout)."""
        if not self.lead:
            return None
        got = [self._receive(r) for r in range(self.link.pools.rollout)]
        for r, f in enumerate(got):
            if f is None or f.step != step:
                raise RuntimeError(f"separate pools: rollout rank {r} reported "
                                   f"{'its final message' if f is None else f'step {f.step}'} where the train pool "
                                   f"trained step {step}")
        return combine_reports(got)

    def _receive(self, src: int) -> RolloutReport | None:
        """Rollout rank ``src``'s next report (waited for; None: its final message), its key deleted."""
        self._next[src] = n = self._next.get(src, 0) + 1
        key = f"{src}/{n}"
        got = self.link.reports.get(key)
        self.link.reports.delete_key(key)
        return None if bytes(got) == _FINAL else RolloutReport.from_bytes(got)

    def stop(self) -> int:
        """The end of the run: the rollout ranks are told to stop, and the lead takes their reports up to each
        one's final message (none is left pending). Returns the rows produced but never trained (the lead's
        count; 0 elsewhere)."""
        if self.stopped:
            return self.dropped
        self.stopped = True
        _wait(self._flight[0])
        self._flight = ([], [])
        if not self.lead:
            return 0
        pg, k = self.link.push, self.link.pools.rollout
        header = torch.tensor([-1, 1], dtype=torch.int64, device=self.link.device)  # [no version, stop]
        _wait([pg.send([header], d, _HEADER) for d in range(k)])
        for r in range(k):
            while (f := self._receive(r)) is not None:
                self.dropped += f.rows
        return self.dropped


class RolloutSide:
    """The rollout pool's end of the link (rank ``rank`` of the rollout pool, ``pool``: its size): the
    versions arrive on a receiver thread into two copies of this rank's rollout shards on ``device`` (the
    engine's and the one the next version fills), allocated here: every version arrives whole."""

    def __init__(self, link: Link, rank: int, pool: int, plan: PushPlan, *, device: torch.device | str = "cpu",
                 partial: bool = False):
        self.link, self.rank, self.pool, self.plan = link, rank, pool, plan
        self.partial = partial  # partial rollout: each rank swaps a newer version in as it lands (``newer``)
        self._cond = threading.Condition()
        self._reports = 0
        self.later, self.first = adapters_plan(plan) or plan, True
        lay = plan.dst
        held = [n for n in lay.names if lay.holds(n, rank)]

        def empty(n):
            return torch.empty(lay[n].local_shape(lay.mesh), dtype=lay[n].dtype, device=device)
        frozen = {n: empty(n) for n in held if n not in self.later.dst.names}  # LoRA's model: one copy, filled once
        self._free = [{n: frozen[n] if n in frozen else empty(n) for n in held}
                      for _ in range(2)]  # copies the receiver may fill
        self.pending: tuple[int, dict] | None = None  # a version received, not yet in use
        self.current: tuple[int, dict] | None = None  # the version the engine generates with
        self.stopped, self.error = False, None
        self._thread = threading.Thread(target=self._receive, name="rlflow-push-receiver", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        pg, lead = self.link.push, self.link.pools.train_lead
        try:
            while True:
                header = torch.empty(2, dtype=torch.int64, device=self.link.device)
                pg.recv([header], lead, _HEADER).wait()
                version, stop = header.tolist()
                if stop:
                    with self._cond:
                        self.stopped = True
                        self._cond.notify_all()
                    return
                with self._cond:
                    self._cond.wait_for(lambda: self._free)
                    buf = self._free.pop()
                slots = push_slots(self.plan if self.first else self.later, self.rank, buf)
                self.first = False
                _wait([pg.recv([b], self.link.pools.rollout + s, _PIECE) for s, b, _ in slots])
                push_place(slots)
                with self._cond:
                    self.pending = (version, buf)
                    self._cond.notify_all()
        except Exception as e:  # noqa: BLE001 -- raised where the producer waits
            with self._cond:
                self.error = e
                self._cond.notify_all()

    def _agree(self, have: int, stop: bool) -> tuple[int, bool]:
        """The rollout ranks' common view: the oldest pending version among them, and whether any was told to stop."""
        if self.pool == 1:
            return have, stop
        from rlflow.sharding.dist import all_reduce
        have = int(all_reduce(torch.tensor([have], dtype=torch.int64), dist.ReduceOp.MIN).item())
        stop = bool(all_reduce(torch.tensor([int(stop)], dtype=torch.int64), dist.ReduceOp.MAX).item())
        return have, stop

    def _swap_in(self) -> None:
        """The pending version becomes the current one; the old copy is the receiver's next buffer (under _cond)."""
        if self.current is not None:
            self._free.append(self.current[1])
        self.current, self.pending = self.pending, None
        self._cond.notify_all()

    def newer(self) -> tuple[int, dict] | None:
        """Partial rollout: the version received since the last swap, swapped in now, or None. This rank alone:
        its rows are its own (a rollout layout without tp or ep), so the ranks need not swap together."""
        with self._cond:
            if self.error is not None:
                raise RuntimeError(f"separate pools: the weight push to rollout rank {self.rank} failed: "
                                   f"{self.error}") from self.error
            if self.pending is None:
                return None
            self._swap_in()
            return self.current

    def weights_for(self, step: int, staleness: int) -> tuple[int, dict, float] | None:
        """(version, this rank's rollout shards, seconds waited) to generate step ``step`` with: the newest
        version every rollout rank has (with ``partial``: the newest this rank has), and at least
        ``step - staleness`` on every rank (waited for); None once the train pool said stop."""
        if self.partial:
            return self._newest_for(step, staleness)
        t0 = time.perf_counter()
        while True:
            with self._cond:
                if self.error is not None:
                    raise RuntimeError(f"separate pools: the weight push to rollout rank {self.rank} failed: "
                                       f"{self.error}") from self.error
                have = -1 if self.pending is None else self.pending[0]
                stop = self.stopped  # what is produced after the stop would not be trained
            have, stop = self._agree(have, stop)
            if stop:
                return None
            if have >= 0:  # every rank has it: swap it in
                with self._cond:
                    self._swap_in()
            if self.current is not None and self.current[0] >= step - staleness:
                return self.current[0], self.current[1], time.perf_counter() - t0
            with self._cond:
                self._cond.wait_for(lambda: self.pending is not None or self.stopped or self.error is not None)

    def _newest_for(self, step: int, staleness: int) -> tuple[int, dict, float] | None:
        """``weights_for`` of partial rollout: each rank swaps in what it has; the ranks agree only on whether
        every one's version is new enough (a rank that is waits with the others, in the agreement)."""
        t0, need = time.perf_counter(), step - staleness
        while True:
            self.newer()
            with self._cond:
                ok = self.current is not None and self.current[0] >= need
                stop = self.stopped
            lacking, stop = self._agree(0 if ok else -1, stop)
            if stop:
                return None
            if lacking == 0:  # every rank's version is new enough
                return self.current[0], self.current[1], time.perf_counter() - t0
            if not ok:
                with self._cond:
                    self._cond.wait_for(lambda: self.pending is not None or self.stopped or self.error is not None)

    def first_version(self) -> int | None:
        """The first version's number (the train pool's steps done when it started), waited for; None when
        the train pool stopped before pushing any."""
        with self._cond:
            self._cond.wait_for(lambda: self.pending is not None or self.stopped or self.error is not None)
        got = self.weights_for(-1, 0)
        return None if got is None else got[0]

    def report(self, report: RolloutReport) -> None:
        """One step's ``report`` to the train lead."""
        self._set(report.to_bytes())

    def _set(self, value: bytes) -> None:
        self._reports += 1
        self.link.reports.set(f"{self.rank}/{self._reports}", value)

    def finish(self) -> None:
        """The final report, once the train pool said stop (waited for). Versions that arrive meanwhile are
        dropped, so the receiver always has a buffer for the next (the train pool waits for its push to land
        before it says stop)."""
        with self._cond:
            while True:
                self._cond.wait_for(lambda: self.stopped or self.error is not None or self.pending is not None)
                if self.pending is not None:
                    self._free.append(self.pending[1])
                    self.pending = None
                    self._cond.notify_all()
                    continue
                break
        if not self.stopped:  # the link broke before the train pool said stop (it ended without TrainSide.stop)
            raise RuntimeError(f"separate pools: the train pool ended without telling rollout rank {self.rank} to "
                               f"stop (TrainSide.stop): {self.error}") from self.error
        self._set(_FINAL)
        self._thread.join(timeout=60)


__all__ = ["Link", "Pools", "RolloutSide", "TrainSide", "barrier", "join", "joined", "leave"]
