"""The one owner of processes: run ``fn(rank, world, *args)`` on every rank of a torch.distributed world.

Three ways in, one function body:

- ``spawn(fn, world, *args)``: local processes on this machine (``torch.multiprocessing``, spawn start
  method); the default.
- ``from_env(fn, *args)``: this process is already one rank of a world that ``torchrun`` or Slurm
  started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; Slurm's
  ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` when those are absent).
- ``ray_spawn(fn, world, *args, address=...)``: one Ray actor per rank, placed by a placement group
  (one bundle per rank: a GPU each when the cluster has them, else a CPU); rank 0's node is the
  rendezvous. Ray schedules and places; torch.distributed carries the collectives.

The collective backend is ``rlflow.device.backend_for(world)`` (gloo on CPU, nccl on CUDA, hccl on
NPU) unless given; each process runs with one intra-op thread (one thread per rank, as on a device).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import tempfile
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlflow import device as rd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, local_rank: int, addr: str, port: int, backend: str,
          timeout_s: float | None = None) -> None:
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(local_rank))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    elif backend == "hccl":  # NOT RUN HERE (no Ascend NPU)
        torch.npu.set_device(local_rank % torch.npu.device_count())
    # timeout_s: how long a collective waits for a peer before it raises (None: torch's default)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world, timeout=timeout)


def _finish() -> None:
    from rlflow.sharding.dist import clear_groups
    clear_groups()
    dist.destroy_process_group()


def _entry(rank, fn, world, port, backend, timeout_s, outdir, args):
    _init(rank, world, rank, "127.0.0.1", port, backend, timeout_s)
    try:
        res = fn(rank, world, *args)
        torch.save(res, os.path.join(outdir, f"{rank}.pt"))
    finally:
        _finish()


def spawn(fn, world: int, *args, backend: str | None = None, timeout_s: float | None = None) -> list:
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
    signal)``."""
    backend = backend or rd.backend_for(world)
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_entry, args=(fn, world, free_port(), backend, timeout_s, d, args), nprocs=world,
                                 join=False, start_method="spawn")
        got: list[int] = []

        def forward(sig, _frame):
            got.append(sig)
            for p in ctx.processes:
                if p.is_alive():
                    os.kill(p.pid, sig)
        old = {}
        if threading.current_thread() is threading.main_thread():
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
                    if e.signal_name:  # killed (the OOM killer, a lost node): no rank said why
                        raise SystemExit(f"error: rank {e.error_index} was killed by signal {e.signal_name}; "
                                         "the other ranks were stopped") from None
                    raise SystemExit(e.exit_code) from None  # it exited with a code and said why
            if got:
                for p in ctx.processes:
                    p.join()
                codes = {p.exitcode for p in ctx.processes}
                if codes <= {0, 128 + got[0]}:
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


class _RankActor:
    """One rank of a Ray-launched world."""

    def node_address(self) -> tuple[str, int]:
        import ray
        return ray.util.get_node_ip_address(), free_port()

    def run(self, fn, rank: int, world: int, addr: str, port: int, backend: str, timeout_s, args):
        import ray
        gpus = ray.get_gpu_ids()
        _init(rank, world, 0 if gpus else rank, addr, port, backend, timeout_s)
        try:
            return fn(rank, world, *args)
        finally:
            _finish()


def ray_spawn(fn, world: int, *args, address: str | None = None, backend: str | None = None,
              timeout_s: float | None = None) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` Ray actors (one per bundle of a placement group); returns
    the results in rank order. Each actor gets one GPU when the cluster has ``world`` of them (nccl), else
    one CPU (gloo)."""
    ray = ray_init(address)
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpu = ray.cluster_resources().get("GPU", 0) >= world
    bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
    backend = backend or ("nccl" if gpu else "gloo")
    pg = placement_group([bundle] * world, strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    actor = ray.remote(_RankActor)
    try:
        workers = [actor.options(num_cpus=1, num_gpus=1 if gpu else 0, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=r)).remote() for r in range(world)]
        addr, port = ray.get(workers[0].node_address.remote())
        return ray.get([w.run.remote(fn, r, world, addr, port, backend, timeout_s, args)
                        for r, w in enumerate(workers)])
    finally:
        remove_placement_group(pg)


__all__ = ["env_world", "free_port", "from_env", "ray_init", "ray_spawn", "spawn"]
