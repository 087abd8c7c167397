"""What one rank of a dry run did: its collectives in issue order and its live device bytes (``Watch``, a
dispatch mode), in a fake world of the full size (``fake_world``)."""

from __future__ import annotations

import time
import traceback
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from rlflow.dryrun import cost
from rlflow.sharding import dist as sdist

META = torch.device("meta")
P2P = ("send", "recv_")  # c10d's point-to-point ops: matched pairwise, not over a group
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object")
BIG = 1 << 26  # bytes: a storage this big is traced to the line that made it (``RankTrace.peak_sites``)


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
    stage_peaks: dict[str, int] = field(default_factory=dict)  # the peak of live device bytes within each stage
    unknown_reads: dict[str, int] = field(default_factory=dict)  # host reads of values no one knows, by call site
    peak_stage: str | None = None  # the stage the peak was in
    peak_sites: dict[str, int] = field(default_factory=dict)  # the bytes live at the peak by the line that made them
    stage_ops: dict[str, Counter] = field(default_factory=dict)  # per stage, how many of each op (``cost.OpCost``)
    op_seconds: dict[str, Counter] = field(default_factory=dict)  # a timed watch's: per stage, each ``OpCost``'s
    # seconds of its calls summed (the op's dispatch and kernel; on an accelerator's queue, its launch alone)
    decode_steps: int = 0  # the generation's decode steps (stage "decode"; its prefill is stage "generate")

    def ledger_gap(self) -> float:
        """The largest |live - ledger| over the plan's steps, as a share of the ledger's peak."""
        return max(abs(a - b) for a, b in zip(self.steps, self.ledger_steps)) / max(self.ledger_peak_bytes, 1)


class Watch(TorchDispatchMode):
    """Records c10d ops, each op's cost per stage (``cost.count``) and the live bytes of the device tensors created
    or handed in (``hold``): those on ``device`` (a device type: the dry run's ``meta``; a real run's ``cpu`` to
    compare with it). ``timed``: each op's seconds too (``RankTrace.op_seconds``)."""

    def __init__(self, trace: RankTrace, device: str = "meta", timed: bool = False):
        super().__init__()
        self.device, self.timed = device, timed
        self.trace, self.live, self.host = trace, {}, set()
        self.total = 0  # the bytes of ``live``: an upper bound of what is alive (frees are found by a sweep)
        self.sites: dict = {}  # storage -> the line that made it (the big ones)
        self.current: str | None = None
        self.quiet = 0  # inside an object collective: its inner collectives are not recorded

    def __enter__(self):
        """Object collectives (pickled, their sizes data) are recorded as one entry each, by name and group,
        and their inner collectives not: the same in a real run and in the fake world's stand-ins."""
        self._objects = {n: getattr(dist, n) for n in OBJECT_COLLECTIVES}
        for n, f in self._objects.items():
            setattr(dist, n, self._noted(n, f))
        return super().__enter__()

    def __exit__(self, *exc):
        for n, f in self._objects.items():
            setattr(dist, n, f)
        return super().__exit__(*exc)

    def _noted(self, name: str, f):
        def run(*args, group=None, **kwargs):
            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            self.trace.collectives.append(Collective(name, ranks, (), ()))
            self.quiet += 1
            try:
                return f(*args, group=group, **kwargs)
            finally:
                self.quiet -= 1
        return run

    def stage(self, name: str) -> None:
        """From here on, live bytes count toward stage ``name``'s peak (it starts at what is live now)."""
        self.current = name
        self.trace.stage_peaks[name] = max(self.trace.stage_peaks.get(name, 0), self.live_bytes())

    def host_copy(self, t: torch.Tensor) -> None:
        """``t`` copied between the device and the host (a swap): its bytes counted in the stage's ops
        (``cost.HOST_COPY``), which on meta tensors no op of the copy shows."""
        c = cost.OpCost(cost.HOST_COPY, str(t.dtype).removeprefix("torch."), 0, t.untyped_storage().nbytes())
        self.trace.stage_ops.setdefault(self.current or "", Counter())[c] += 1

    def hold(self, tensors, host: bool = False) -> None:
        for t in tensors:
            key = StorageWeakRef(t.untyped_storage())
            if host:
                self.host.add(key)
            else:
                self._take(key, t)

    def _take(self, key: StorageWeakRef, t: torch.Tensor) -> bool:
        """``t``'s storage counted as live (True), unless it is already."""
        if key in self.live:
            return False
        self.live[key] = t.untyped_storage().nbytes()
        self.total += self.live[key]
        return True

    def live_bytes(self) -> int:
        """The device bytes alive now (a sweep of the storages seen: exact)."""
        expired = torch.UntypedStorage._expired  # the C call itself: a sweep runs once per allocation near a peak
        for k in [k for k in self.live if expired(k.cdata)]:
            self.total -= self.live.pop(k)
            self.sites.pop(k, None)
        return self.total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t0 = time.perf_counter() if self.timed else 0.0
        out = func(*args, **kwargs)
        dt = time.perf_counter() - t0 if self.timed else 0.0
        c = cost.count(self.trace.stage_ops, self.current or "", func, args, kwargs, out)
        if self.timed and c is not None:
            self.trace.op_seconds.setdefault(self.current or "", Counter())[c] += dt
        if func.namespace == "c10d" and not self.quiet:
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
            if isinstance(t, torch.Tensor) and t.device.type == self.device:
                key = StorageWeakRef(t.untyped_storage())
                if key not in self.host and self._take(key, t):
                    new = True
                    if self.live[key] >= BIG:
                        self.sites[key] = call_site()
        # the peak can only rise when memory is taken, and only past it when the upper bound is: the sweep
        # (linear in the storages alive) runs then only
        top = self.trace.peak_bytes if self.current is None else self.trace.stage_peaks[self.current]
        if new and self.total > top:
            live = self.live_bytes()
            if live > self.trace.peak_bytes:
                self.trace.peak_bytes = live
                self.trace.peak_stage = self.current
                self.trace.peak_sites = self._by_site()
            if self.current is not None:
                self.trace.stage_peaks[self.current] = max(self.trace.stage_peaks[self.current], live)
        return out

    def _by_site(self) -> dict[str, int]:
        """The live bytes by the line that made them (storages of ``BIG`` bytes and more; the rest as one)."""
        out: dict[str, int] = {}
        for k, n in self.live.items():
            site = self.sites.get(k, f"under {BIG >> 20} MiB each")
            out[site] = out.get(site, 0) + n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


class MetaHost:
    """The dry run's host memory: swapped-out tensors land here (meta, and not counted as device bytes)."""

    def __init__(self, watch: Watch):
        self.watch = watch

    def take(self, t: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():  # made unseen: host memory, not the device's
            h = torch.empty(t.shape, dtype=t.dtype, device=META)
        self.watch.hold([h], host=True)
        self.watch.host_copy(t)
        return h

    def reserve(self, nbytes: int) -> None:  # ``HostArena``'s: nothing to make ready
        pass

    def reset(self) -> None:
        pass


@contextmanager
def fake_world(rank: int, world: int, device: str = "meta"):
    """torch.distributed's ``fake`` backend as rank ``rank`` of ``world`` for the block (no peers, no memory), for
    tensors on the CPU, meta and ``device`` (a fake accelerator's type)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("fake_world: torch.distributed is initialised already in this process")
    devices = dict.fromkeys(("cpu", "meta", device))
    dist.init_process_group(",".join(f"{d}:fake" for d in devices), store=FakeStore(), rank=rank, world_size=world)
    sdist.clear_groups()
    real = {n: getattr(dist, n) for n in _OBJECTS}
    for n in _OBJECTS:
        setattr(dist, n, _OBJECTS[n])
    try:
        yield
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
        sdist.clear_groups()
        dist.destroy_process_group()


def call_site() -> str:
    """The innermost rlflow line outside the dry run on the stack."""
    for f in reversed(traceback.extract_stack()):
        if "/rlflow/" in f.filename and "/dryrun/" not in f.filename:
            return f"{f.filename.rsplit('/rlflow/', 1)[1]}:{f.lineno}"
    return "?"


def _broadcast_object_list(objects, src=None, group=None, device=None, group_src=None):
    """Every peer alike: what a rank receives is what it holds (the fake world sends no bytes, and the
    sizes it would receive first are garbage)."""


def _all_gather_object(out, obj, group=None):
    out[:] = [obj] * len(out)


_OBJECTS = {"broadcast_object_list": _broadcast_object_list, "all_gather_object": _all_gather_object}


__all__ = ["BIG", "Collective", "META", "MetaHost", "P2P", "RankTrace", "Watch", "call_site", "fake_world"]
