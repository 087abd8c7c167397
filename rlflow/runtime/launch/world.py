"""A rank's torch.distributed world, whichever launcher started it: its initialisation (the backend's device, the
threads, the store), its end, and the interface gloo binds."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import warnings

import torch
import torch.distributed as dist


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
