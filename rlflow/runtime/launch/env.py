"""A world that torchrun or Slurm started: this process is one of its ranks (``from_env``), and separate pools
made inside it (``split_world``)."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from rlflow import device as rd
from rlflow.runtime.launch.world import _finish, _init


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
