"""One Ray actor per rank (``ray_spawn``): placed by a placement group, a lost rank told from a failing one."""

from __future__ import annotations

import os
import re
import time

import torch.distributed as dist

from rlflow.runtime.launch.env import split_world
from rlflow.runtime.launch.world import _finish, _init, free_port


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
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
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
