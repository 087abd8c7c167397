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

from rlflow.runtime.launch.env import env_world, from_env, split_world
from rlflow.runtime.launch.local import PEER_GONE, STARTING, peer_gone, spawn
from rlflow.runtime.launch.on_ray import RAY_GPU_ENV, RankLost, gpu_index, ray_init, ray_spawn
from rlflow.runtime.launch.world import free_port, gloo_interface, loopback_interface, several_hosts

__all__ = ["PEER_GONE", "RAY_GPU_ENV", "RankLost", "STARTING", "env_world", "free_port", "from_env", "gloo_interface",
           "gpu_index", "loopback_interface", "peer_gone", "ray_init", "ray_spawn", "several_hosts", "spawn",
           "split_world"]
