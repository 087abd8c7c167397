"""The one owner of processes: run ``fn(rank, world, *args)`` on every rank of a torch.distributed world.

Three ways in, one function body:

- ``spawn(fn, world, *args)``: local processes on this machine (``torch.multiprocessing``, spawn start
  method); the default.
- ``from_env(fn, *args)``: this process is already one rank of a world that ``torchrun`` or Slurm
  started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; Slurm's
  ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` when those are absent).
- ``ray_spawn(fn, world, *args, address=...)``: one Ray actor per rank, placed by a placement group
  (one bundle per rank: a GPU each when the cluster has them, else a CPU); rank 0's node is the
  rendezvous. Ray schedules and places; torch.distributed carries the collectives. A rank lost (its
  actor died, or it stopped answering) raises ``RankLost`` naming it, after the other ranks are stopped.

The collective backend is ``rlflow.device.backend_for(world)`` (gloo on CPU, nccl on CUDA, hccl on
NPU) unless given; a CPU rank runs with one intra-op thread (one thread per rank, as on a device), an
accelerator's rank with its share of the node's cores.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlflow import device as rd
from rlflow.startup import stop_at_once


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _node_devices(backend: str) -> int:
    return torch.cuda.device_count() if backend == "nccl" else torch.npu.device_count()


def _init(rank: int, world: int, local_rank: int, addr: str, port: int, backend: str,
          timeout_s: float | None = None, store: str | None = None) -> None:
    """torch.distributed for this rank: the store at ``addr:port`` (rank 0's TCP store), or ``store``, a file
    store's path (one host: nothing listens on the network)."""
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(local_rank))
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    elif backend == "hccl":  # NOT RUN HERE (no Ascend NPU)
        import torch_npu  # noqa: F401  (torch.npu exists once it is imported)
        torch.npu.set_device(local_rank % torch.npu.device_count())
    # a CPU rank computes on one core (the ranks share them); an accelerator's rank keeps its share of the
    # node's cores for its host-side work (tokenizing, rewards, the dock)
    if backend == "gloo":
        torch.set_num_threads(1)
    else:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE") or _node_devices(backend))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // max(1, ranks_here)))
    # timeout_s: how long a collective waits for a peer before it raises (None: torch's default)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    if backend == "gloo" and store is None and "GLOO_SOCKET_IFNAME" not in os.environ:
        if (ifname := gloo_interface(addr)) is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    where = f"file://{store}" if store else f"tcp://{addr}:{port}"
    dist.init_process_group(backend, init_method=where, rank=rank, world_size=world, timeout=timeout)


def _finish() -> None:
    from rlflow.runtime.pools import leave
    from rlflow.sharding.dist import clear_groups
    clear_groups()
    leave()
    dist.destroy_process_group()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]).is_loopback
    except (OSError, ValueError):
        return False


def _ipv4_of(interface: str) -> str | None:
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # SIOCGIFADDR
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface[:15].encode()))[20:24])
        except OSError:
            return None


def several_hosts() -> bool:
    """Whether this rank's world spans several hosts, as torchrun or Slurm describe it."""
    e = os.environ
    if e.get("WORLD_SIZE") and e.get("LOCAL_WORLD_SIZE") and int(e["WORLD_SIZE"]) > int(e["LOCAL_WORLD_SIZE"]):
        return True
    return int(e.get("GROUP_WORLD_SIZE") or 1) > 1 or int(e.get("SLURM_NNODES") or 1) > 1


def gloo_interface(master: str) -> str | None:
    """The ``GLOO_SOCKET_IFNAME`` a gloo rank needs to reach ranks on other hosts, or None where gloo's own
    choice works. gloo binds the address this host's name resolves to; where that is a loopback address (as
    Debian's /etc/hosts often has it) the other hosts cannot connect and the run dies after its timeout
    ("connectFullMesh failed"). Then: the interface the route to ``master`` (MASTER_ADDR) leaves by, or on
    the master's own host (its name resolves to a loopback address there too) the default route's. Where no
    interface can be told, a warning says what to set, and gloo chooses as before."""
    host = socket.gethostname()
    if not _is_loopback(host) or (_is_loopback(master) and not several_hosts()):
        return None
    from rlflow.dock.proc_backend import reachable_host
    try:
        local = reachable_host("192.0.2.1" if _is_loopback(master) else master)  # TEST-NET-1: the default route
        found = next((name for _, name in socket.if_nameindex() if _ipv4_of(name) == local), None)
        why = f"no interface's address is {local}"
    except OSError as e:
        found, why = None, str(e)
    if found is None:
        warnings.warn(f"gloo: this host's name {host} resolves to a loopback address and {why} (the route to "
                      f"MASTER_ADDR={master}): ranks on other hosts may not reach this one; set GLOO_SOCKET_IFNAME "
                      "to the interface they reach it by", RuntimeWarning, stacklevel=2)
    return found


def loopback_interface() -> str | None:
    """The name of this host's loopback interface (``lo`` on Linux), or None."""
    names = [n for _, n in socket.if_nameindex()]
    return next((n for n in names if n == "lo"), next((n for n in names if n.startswith("lo")), None))


def _own_group(launcher: int) -> None:
    """This rank in a process group of its own, dying with the launcher (pid ``launcher``): a terminal's Ctrl-C
    (sent to the foreground group) then reaches the launcher only, which forwards it once (twice, a rank
    stopped at once without its checkpoint); a launcher killed outright takes its ranks with it. Out of the
    terminal's foreground group, a write to it or a read from it would stop the rank (SIGTTOU, SIGTTIN)."""
    os.setpgid(0, 0)
    for s in (signal.SIGTTOU, signal.SIGTTIN):
        signal.signal(s, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # the launcher ended before the line above
            os._exit(1)


def split_world(split, rank: int, timeout_s: float | None = None) -> None:
    """Separate device pools in a world started elsewhere (torchrun, Slurm: one default group over every rank,
    whose collectives made what spans the pools, such as the dock): this rank leaves that group for its pool's
    world and joins the link (``runtime.pools``), both over the world's store. Called by every rank."""
    from rlflow.runtime import pools
    # the store the world met through (torchrun's or rank 0's TCP store) outlives its group: the pools meet there
    backend, store = dist.get_backend(), dist.distributed_c10d._get_default_store()
    dist.barrier()  # every rank is done with the whole world's group before any leaves it
    dist.destroy_process_group()
    local, size = split.local(rank)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=dist.PrefixStore(f"pool-{split.pool(rank)}", store), rank=local,
                            world_size=size, timeout=timeout)
    pools.join(split, rank, dist.PrefixStore("pools", store), backend, timeout_s)


STARTING = "interrupted while the ranks started: nothing was saved"


def _entry(rank, fn, world, port, backend, timeout_s, outdir, launcher, args, split=None):
    _own_group(launcher)
    # started with SIGINT and SIGTERM ignored (a terminal's Ctrl-C reached the ranks while they imported, each
    # with its traceback): until the run installs its own handlers they end the rank at once, and the launcher
    # forwards a signal only once the rank says it can take it
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, functools.partial(stop_at_once, say=STARTING if rank == 0 else None))
    open(os.path.join(outdir, f"ready-{rank}"), "w").close()
    # one host: the store is a file (torch's TCP store listens on every interface, unauthenticated) and gloo's
    # connections stay on the loopback
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and (lo := loopback_interface()):
        os.environ["GLOO_SOCKET_IFNAME"] = lo
    if split is None:
        _init(rank, world, rank, "127.0.0.1", port, backend, timeout_s, store=os.path.join(outdir, "store"))
    else:  # separate pools: a world per pool, and the link over every rank (``runtime.pools``)
        from rlflow.runtime import pools
        local, size = split.local(rank)
        _init(local, size, rank, "127.0.0.1", port, backend, timeout_s,
              store=os.path.join(outdir, f"store-{split.pool(rank)}"))
        pools.join(split, rank, dist.FileStore(os.path.join(outdir, "store-link"), world), backend, timeout_s)
    try:
        res = fn(rank, world, *args)
        torch.save(res, os.path.join(outdir, f"{rank}.pt"))
        # no rank tears its gloo pairs down while a peer's last operations may still use them (a peer then
        # aborts: "terminate called without an active exception")
        dist.barrier()
    except SystemExit as e:  # the rank's verdict: handed to the launcher, which says each verdict once (several
        if e.code in (None, 0) or e.code == 128 + signal.SIGINT or e.code == 128 + signal.SIGTERM:
            raise  # ranks reach the same one), and the rank ends now (its peers are stopped soon after: a message
        if isinstance(e.code, str):  # left to the exit could be lost; tearing gloo down under a peer aborts)
            with open(os.path.join(outdir, f"said-{rank}"), "w") as f:
                f.write(e.code)
        _exit_now(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:
        if peer_gone(e):  # a consequence of another rank's end, or the dock's: that one says why
            _exit_now(PEER_GONE)
        raise
    finally:
        _finish()


PEER_GONE = 75  # a rank's exit code when its connection to another process of the run closed under it


def peer_gone(e: BaseException) -> bool:
    """``e`` (or what it was raised from) says a connection of gloo to another rank closed: that rank ended."""
    seen = 0
    while e is not None and seen < 8:
        text = str(e)
        if ("gloo" in text or "pair.cc" in text) and ("closed by peer" in text or "reset by peer" in text):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _exit_now(code: int) -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _failure(procs, e, outdir: str) -> str | int:
    """What ends a run one of whose ranks failed (``e``: torch's ProcessExitedException of the first one it saw;
    the others were stopped by then): the exit code of a rank that said why (each different verdict the ranks
    left in ``outdir`` is said once here), or a line naming a rank killed by a signal. A rank that lost its
    connection to another (``PEER_GONE``) points at the others."""
    _say_verdicts(outdir, len(procs))
    if e.exit_code != PEER_GONE:
        first = (e.error_index, e.exit_code if not e.signal_name else -signal.Signals[e.signal_name])
    else:
        stopped = {0, None, PEER_GONE, -signal.SIGTERM, -signal.SIGKILL}  # the launcher stopped these
        first = next(((i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in stopped), None)
        if first is None:
            return (f"error: rank {e.error_index} lost its connection to another rank, and no rank said why; the "
                    f"other ranks were stopped")
    i, code = first
    if code < 0:  # killed (the OOM killer, a lost node): no rank said why
        return f"error: rank {i} was killed by signal {signal.Signals(-code).name}; the other ranks were stopped"
    return code  # it exited with a code and said why


def _say_verdicts(outdir: str, world: int) -> None:
    """The one-line verdicts the ranks left (``_entry``), each different one once, in the ranks' order."""
    said = []
    for r in range(world):
        try:
            with open(os.path.join(outdir, f"said-{r}")) as f:
                said.append(f.read())
        except OSError:
            pass
    for line in dict.fromkeys(said):
        print(line, file=sys.stderr)


def _wait_stopping(procs, fine: set[int], grace_s: float = 3.0, tick=lambda: None) -> None:
    """Wait for ranks asked to stop (they finish their step and write the checkpoint, however long that takes);
    once one ends otherwise than ``fine``, the others get ``grace_s`` and are then killed: they may wait on it
    in a collective for as long as its timeout. ``tick()`` runs every round (signals still to deliver)."""
    failed_at = None
    while any(p.is_alive() for p in procs):
        tick()
        for p in procs:
            p.join(0.1)
        if failed_at is None and any(p.exitcode is not None and p.exitcode not in fine for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            for p in procs:
                if p.is_alive():
                    _kill_group(p.pid)
            for p in procs:
                p.join()


def _kill_group(pid: int) -> None:
    """SIGKILL to a rank and what it started (it leads its own process group)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def spawn(fn, world: int, *args, backend: str | None = None, timeout_s: float | None = None, pools=None) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` local processes (torch.distributed initialised; a
    process's device is ``rlflow.device.process_device()``); returns the results in rank order. ``fn``
    must be importable (module level). A process that fails makes the call raise at once and the others
    are stopped (none is left waiting in a collective): ``torch.multiprocessing.ProcessRaisedException``
    with its traceback, ``SystemExit`` with the exit code of a rank that exited, or ``SystemExit`` naming
    the rank and the signal that killed it. ``timeout_s``: a collective that waits longer than this for a
    peer (a hung rank) raises on the ranks waiting, and the run fails (None: torch's default, 30 min on
    gloo, 10 min on nccl).

    SIGINT and SIGTERM (Ctrl-C, a scheduler's preemption) sent to this process are forwarded to every
    rank, and the ranks are then waited for (they agree to stop after the same step and may still be
    writing a checkpoint); when they all end with 0 or ``128 + signal`` this raises ``SystemExit(128 +
    signal)``.

    ``pools`` (a ``runtime.pools.Pools``): separate device pools, each rank in its pool's world (its rank and
    size there are ``pools.local(rank)``; ``fn`` still gets the global ones) and linked to every rank
    (``pools.joined()``)."""
    backend = backend or rd.backend_for(world)
    main = threading.current_thread() is threading.main_thread()
    # torch logs each rank it stops after a failure ("Terminating process ... via signal SIGTERM", "Unable to
    # shutdown ..."): the failure's own line (``_failure``) says what happened
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as d:
        # the ranks start with SIGINT and SIGTERM ignored (inherited), until ``_entry`` installs its handlers
        ignored = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            ctx = mp.start_processes(_entry, args=(fn, world, free_port(), backend, timeout_s, d, os.getpid(), args,
                                                   pools),
                                     nprocs=world,
                                     join=False, start_method="spawn")
        finally:
            for s, h in ignored.items():
                signal.signal(s, h)
        got: list[int] = []
        pending: dict[int, int] = {}  # rank -> a signal for it once it can take one

        def deliver():
            for r, sig in list(pending.items()):
                p = ctx.processes[r]
                if not p.is_alive():
                    del pending[r]
                elif os.path.exists(os.path.join(d, f"ready-{r}")):
                    del pending[r]
                    os.kill(p.pid, sig)

        def forward(sig, _frame):
            got.append(sig)
            pending.update({r: sig for r in range(len(ctx.processes))})
            deliver()
        old = {}
        if main:
            old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not got:
                try:
                    # after a failure the others get 3 s, SIGTERM, 3 s, SIGKILL (one whose peer died is stuck
                    # in a collective and cannot act on SIGTERM)
                    if ctx.join(timeout=0.2, grace_period=3):
                        break
                except mp.ProcessExitedException as e:  # the other ranks were stopped by now
                    if got:
                        continue
                    raise SystemExit(_failure(ctx.processes, e, d)) from None
            if got:
                # a rank may have heard another signal first (a scheduler's SIGTERM beside the terminal's SIGINT)
                # a rank ends with 128 + the signal (its handler), or by the signal itself: one that arrives while
                # the rank is inside a blocking call of its start-up (gloo's connect) may find no handler to run;
                # a rank whose peer stopped first may see their connection close (``PEER_GONE``)
                sigs = {*got, signal.SIGINT, signal.SIGTERM}
                fine = {0, PEER_GONE, *(128 + g for g in sigs), *(-g for g in sigs)}
                _wait_stopping(ctx.processes, fine, tick=deliver)
                _say_verdicts(d, world)
                codes = {p.exitcode for p in ctx.processes}
                if codes <= fine:
                    if ctx.processes[0].exitcode not in (0, *(128 + g for g in sigs)):  # rank 0 did not say it: it
                        print(STARTING, file=sys.stderr)  # had no handler yet, or a peer stopped first (PEER_GONE)
                    raise SystemExit(128 + got[0])
                raise RuntimeError(f"ranks ended with exit codes {sorted(codes)} after signal {got[0]}")
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)]


def env_world() -> tuple[int, int, int] | None:
    """(rank, world, local rank) when this process was started as one rank of a world (torchrun, Slurm)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"]))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return None


def from_env(fn, *args, backend: str | None = None, timeout_s: float | None = None):
    """Run ``fn(rank, world, *args)`` as the rank this process was started as (see ``env_world``); returns
    what it returned. ``MASTER_ADDR`` / ``MASTER_PORT`` come from the environment (torchrun sets them; under
    Slurm set them to the first node and a free port)."""
    where = env_world()
    if where is None:
        raise RuntimeError("from_env: RANK and WORLD_SIZE (torchrun) or SLURM_PROCID and SLURM_NTASKS are not set")
    rank, world, local = where
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise RuntimeError("from_env: MASTER_ADDR and MASTER_PORT must be set (torchrun sets them)")
    _init(rank, world, local, addr, int(port), backend or rd.backend(), timeout_s)  # torchrun: a device per rank
    try:
        return fn(rank, world, *args)
    finally:
        _finish()


# ---- Ray ----
def _ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("the Ray launcher needs Ray: pip install 'rlflow[ray]'") from None
    return ray


def ray_init(address: str | None = None):
    """Join the Ray cluster at ``address`` (``auto``: the one ``ray start --head`` runs on this machine), or
    start a local one when None. Idempotent."""
    ray = _ray()
    if not ray.is_initialized():
        # the workers import rlflow from this checkout (a cluster's nodes share the working directory)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}}
        ray.init(address=address, include_dashboard=False, log_to_driver=True, runtime_env=env,
                 **({} if address else {"num_cpus": os.cpu_count()}))
    return ray


class RankLost(RuntimeError):
    """Ranks of a Ray-launched world were lost: an actor died (its process was killed or crashed, its node
    was lost) or stopped answering (the others' collectives timed out waiting for it), or the ranks' links
    or the dock's actors failed under them. The other ranks were stopped. ``ranks``: the lost ones. A
    failure that would repeat on a rerun (an exception in the ranks' code, a rank's ``SystemExit``) is
    raised as itself instead."""

    def __init__(self, ranks, why: str):
        self.ranks, self.why = tuple(ranks), why
        if not self.ranks:  # the dock's actors, not a rank
            super().__init__(f"{why}; the ranks were stopped")
            return
        who = f"rank {self.ranks[0]} was" if len(self.ranks) == 1 else f"ranks {list(self.ranks)} were"
        super().__init__(f"{who} lost: {why}; the other ranks were stopped")


class _RankExit(Exception):
    """A rank's ``SystemExit`` carried to the driver as a task error (Ray turns a ``SystemExit`` that leaves an
    actor method into the actor's death, which would read as a lost rank)."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


# Ray would set each GPU actor's CUDA_VISIBLE_DEVICES to its one GPU: NCCL then cannot see its same-node peers'
# devices (no P2P / NVLink path; NeMo-RL traced hangs and slow first collectives on NVSwitch nodes to this).
# The actors see the node's GPUs and each picks its own by the id Ray gave it.
RAY_GPU_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def gpu_index(gpu_ids: list, visible: str | None) -> int:
    """The device index of the first of a Ray actor's ``gpu_ids`` among the devices this process sees
    (``visible``: the node's CUDA_VISIBLE_DEVICES, None or empty when it sees them all)."""
    first = str(gpu_ids[0])
    if not visible:
        return int(first)
    order = [v.strip() for v in visible.split(",")]
    if first not in order:
        raise RuntimeError(f"Ray gave this actor GPU {first}, which CUDA_VISIBLE_DEVICES={visible} does not list")
    return order.index(first)


class _RankActor:
    """One rank of a Ray-launched world."""

    def node_address(self) -> tuple[str, int]:
        import ray
        return ray.util.get_node_ip_address(), free_port()

    def run(self, fn, rank: int, world: int, addr: str, port: int, backend: str, timeout_s, args, split=None):
        import ray
        gpus = ray.get_gpu_ids()
        local = gpu_index(gpus, os.environ.get("CUDA_VISIBLE_DEVICES")) if gpus else rank
        _init(rank, world, local, addr, port, backend, timeout_s)
        try:
            if split is None:
                return fn(rank, world, *args)
            split_world(split, rank, timeout_s)  # separate pools: from the whole world to the rank's pool and the link
            out = fn(rank, world, *args)
            from rlflow.runtime import pools
            pools.barrier(pools.joined())  # rank 0 hosts the store: no rank leaves while another reads a report
            return out
        except SystemExit as e:
            raise _RankExit(e.code) from None
        finally:
            _finish()


# a collective or link that failed because a peer went away or stopped answering (gloo's and nccl's words)
_PEER_LOST = re.compile(r"timed out|connection (closed|reset) by peer|broken pipe|remote process exited", re.I)


def _peer_lost(e: BaseException) -> bool:
    """``e`` (raised in a rank) says a peer or a dock actor went away or stopped answering, not that the rank's own
    code failed: a dead dock actor, a timed-out dock get, a torch.distributed error, or gloo's plain RuntimeError
    saying so (a subclass, e.g. a reward function's RewardError, is the code's own; so is any other
    ``TimeoutError``, e.g. a verifier's)."""
    from ray.exceptions import RayActorError

    from rlflow.dock.controller import DockTimeout
    return (isinstance(e, (RayActorError, DockTimeout, dist.DistError))
            or type(e) is RuntimeError and _PEER_LOST.search(str(e)) is not None)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _ray_failure(failed: dict, silent: list[int]) -> BaseException:
    """The one error of a Ray world in which ranks ``failed`` ({rank: what ray.get raised}) and ranks ``silent``
    had not ended a few seconds later: ``RankLost`` when ranks were lost (an actor died, or a rank stopped
    answering while the others' collectives or dock calls failed waiting for it), ``SystemExit`` for a rank's
    exit, else the first failed rank's own exception (it would fail a rerun the same way)."""
    from ray.exceptions import RayActorError, RayTaskError
    dead = {r: e for r, e in failed.items() if isinstance(e, RayActorError) and not isinstance(e, RayTaskError)}
    if dead:  # the rank's actor itself died (a RayTaskError is the rank's code raising)
        pids = ", ".join(m.group(1) for e in dead.values() if (m := re.search(r"pid: (\d+)", str(e))))
        return RankLost(sorted(dead), f"its Ray actor died{f' (pid {pids})' if pids else ''}: the process was "
                                      "killed or crashed, or its node was lost")
    cause = {r: e.cause if isinstance(e, RayTaskError) and isinstance(getattr(e, "cause", None), BaseException)
             else e for r, e in failed.items()}
    exits = {r: c.code for r, c in cause.items() if isinstance(c, _RankExit)}
    if exits:
        return SystemExit(exits[min(exits)])
    own = [r for r, c in cause.items() if not _peer_lost(c)]
    if own:
        e = failed[min(own)]
        e.add_note(f"(raised on rank {min(own)} of the Ray world; the other ranks were stopped)")
        return e
    docks = [r for r, c in cause.items() if isinstance(c, RayActorError)]
    if docks:
        return RankLost([], f"a dock actor died under rank {min(docks)} ({_first_line(cause[min(docks)])})")
    r = min(cause)
    if silent:
        return RankLost(silent, f"it stopped answering (rank {r}: {_first_line(cause[r])})")
    return RankLost(sorted(cause), f"their links failed (rank {r}: {_first_line(cause[r])})")


def _ray_results(refs: list, grace_s: float = 5.0) -> list:
    """The ranks' results in rank order. At the first failure the others get ``grace_s`` to end (a rank whose
    peer died fails its collective within moments; the dead actor's death is reported in about a second),
    and ``_ray_failure`` of what they ended with is raised."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError
    rank_of = {ref: r for r, ref in enumerate(refs)}
    pending, failed, deadline = list(refs), {}, None
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            break  # the grace is over: the pending ranks stopped answering
        try:
            ray.get(done[0])
        except Exception as e:  # noqa: BLE001 -- sorted out by _ray_failure
            failed[rank_of[done[0]]] = e
            died = isinstance(e, RayActorError) and not isinstance(e, RayTaskError)
            soon = time.monotonic() + (1.0 if died else grace_s)  # a death names the lost rank: wait less
            deadline = soon if deadline is None else min(deadline, soon)
    if failed:
        raise _ray_failure(failed, sorted(rank_of[p] for p in pending))
    return ray.get(refs)


def ray_spawn(fn, world: int, *args, address: str | None = None, backend: str | None = None,
              timeout_s: float | None = None, pools=None) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` Ray actors (one per bundle of a placement group); returns
    the results in rank order. ``pools``: separate device pools, as ``spawn``'s (each actor joins the whole
    world, then ``split_world``). Each actor gets one GPU when the cluster has ``world`` of them (nccl), else
    one CPU (gloo). When a rank fails, the actors are killed (none is left waiting in a collective) and the
    placement group removed, then this raises: ``RankLost`` naming the ranks lost (an actor that died: a
    killed or crashed process, a lost node; a rank that stopped answering while the others' collectives
    timed out, ``timeout_s``), ``SystemExit`` with a rank's exit code, or the rank's own exception."""
    ray = ray_init(address)
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpu = ray.cluster_resources().get("GPU", 0) >= world
    bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
    backend = backend or ("nccl" if gpu else "gloo")
    pg = placement_group([bundle] * world, strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    actor = ray.remote(_RankActor)
    workers = []
    try:
        env = {"runtime_env": {"env_vars": RAY_GPU_ENV}} if gpu else {}
        workers = [actor.options(num_cpus=1, num_gpus=1 if gpu else 0, **env,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(
                                     placement_group=pg, placement_group_bundle_index=r)).remote()
                   for r in range(world)]
        addr, port = ray.get(workers[0].node_address.remote())
        return _ray_results([w.run.remote(fn, r, world, addr, port, backend, timeout_s, args, pools)
                             for r, w in enumerate(workers)])
    finally:
        for w in workers:  # a rank still in a collective with a lost peer, or hung
            ray.kill(w, no_restart=True)
        remove_placement_group(pg)


__all__ = ["RankLost", "env_world", "free_port", "from_env", "ray_init", "ray_spawn", "spawn"]
