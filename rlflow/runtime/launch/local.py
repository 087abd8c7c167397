"""Local processes on this machine (``spawn``): the ranks in process groups of their own, the signals a terminal
or a scheduler sends forwarded to them, and a failed rank's verdict said once."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlflow import device as rd
from rlflow.runtime.launch.world import _finish, _init, free_port, loopback_interface
from rlflow.startup import stop_at_once


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
