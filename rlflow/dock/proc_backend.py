"""Local-process backend: each warehouse in a server process of its own, the controllers in one more.

The dock processes are ``multiprocessing.managers`` servers started by the process that makes the dock
(the driver); the ``Dock`` it returns holds proxies and pickles, so the ranks of a run (spawned
processes) are handed the same dock and call the servers directly: rows go from the producing rank to a
warehouse process and from there to the consuming rank, never through the driver. A server runs each
client connection in a thread of its own, so a take blocked in a controller waiting for rows does not
stop the puts that will make them ready (the controllers and warehouses lock internally). The
controllers sit on one hub object, so a put's readiness flips for every consumer are one round trip. An error
raised in a dock process is raised again, unchanged, in the caller.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.managers import BaseManager
from dataclasses import dataclass
from typing import Sequence

from rlflow.dock.client import Dock, LocalTransport
from rlflow.dock.controller import Controller
from rlflow.dock.schema import Schema
from rlflow.dock.warehouse import Warehouse


class ControllerHub:
    """Every consumer's controller, in one dock process: a put's readiness flips for all consumers are one
    round trip (``each``), not one per consumer."""

    def __init__(self, consumers, capacity: int, columns, var_columns, group_size: int):
        self._c = {c: Controller(c, capacity, columns, var_columns, group_size) for c in consumers}

    def call(self, consumer: str, method: str, args: tuple):
        return getattr(self._c[consumer], method)(*args)

    def each(self, calls: list) -> list:
        """``[(consumer, method, args)]`` -> results, a failed call's exception in its place."""
        return LocalTransport().call_many([(self._c[c], method, args) for c, method, args in calls])


@dataclass(frozen=True)
class _Ctrl:
    """A consumer's controller on the hub (what the ``Dock`` holds as its controller target)."""
    consumer: str


class _Server(BaseManager):
    pass


_Server.register("Warehouse", Warehouse)
_Server.register("ControllerHub", ControllerHub)


class DockLost(RuntimeError):
    """A dock process (a warehouse's or the controllers') is gone: its rows with it."""


class ProcTransport:
    """Calls become proxy calls to the dock processes (controller calls go through the hub; several in one
    ``call_many`` are one round trip). ``call_many`` runs its calls to different processes at once, from a
    pool of threads (a proxy keeps one connection per thread), so a put or read spanning S warehouses
    waits for the slowest, not for the sum. ``close`` (in the process that started them) stops them."""

    def __init__(self, servers: list, hub, nodes: tuple = (), here=None):
        self._servers, self.hub, self._pool = servers, hub, None
        self.nodes, self._here = tuple(nodes), here  # each warehouse's node, and this process's

    def __getstate__(self):  # a copy in another process does not own the servers, nor this one's threads
        return {"_servers": [], "hub": self.hub, "_pool": None, "nodes": self.nodes, "_here": self._here}

    def call(self, target, method: str, *args):
        try:
            if isinstance(target, _Ctrl):
                return self.hub.call(target.consumer, method, args)
            return getattr(target, method)(*args)
        except (EOFError, ConnectionError) as e:
            raise self._lost(target, e) from e

    def _lost(self, target, e: BaseException) -> "DockLost":
        """The error of a round trip to a dock process that is gone, naming it (the same words whichever way a
        rank noticed, ``e``: EOFError, a broken pipe or a reset, so that the ranks' verdicts are one)."""
        proxy = self.hub if isinstance(target, _Ctrl) else target
        address = getattr(getattr(proxy, "_token", None), "address", None)
        server = next((s for s in self._servers if s.address == address), None)
        pid = getattr(getattr(server, "_process", None), "pid", None)
        what = "the controllers' hub" if isinstance(target, _Ctrl) else "a warehouse"
        return DockLost(f"the transfer dock's process serving {what} at {address}"
                        f"{f' (pid {pid})' if pid else ''} is gone (its connection closed); the step's rows were "
                        "there, so the run cannot go on: continue it from its last checkpoint (--resume auto)")

    def call_many(self, calls) -> list:
        calls = list(calls)
        ctrl = [i for i, (t, _, _) in enumerate(calls) if isinstance(t, _Ctrl)]
        jobs = [([i], (lambda i=i: LocalTransport().call_many([calls[i]])))
                for i in range(len(calls)) if i not in set(ctrl)]
        if ctrl:
            jobs.append((ctrl, lambda: self.hub.each([(calls[i][0].consumer, calls[i][1], calls[i][2]) for i in ctrl])))
        if len(jobs) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dock")
            futures = [(where, self._pool.submit(job)) for where, job in jobs]
            jobs = [(where, f.result) for where, f in futures]
        out: list = [None] * len(calls)
        for where, job in jobs:
            try:
                got = job()
            except (EOFError, ConnectionError) as e:  # the process is gone
                got = [self._lost(calls[where[0]][0], e)] * len(where)
            except Exception as e:  # noqa: BLE001 - a failed round trip: every call in it failed
                got = [e] * len(where)
            for i, r in zip(where, got):
                out[i] = self._lost(calls[i][0], r) if isinstance(r, (EOFError, ConnectionError)) else r
        return out

    def here(self):
        return self._here

    def close(self, targets) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        for s in self._servers:
            s.shutdown()
        self._servers = []


def _stop(servers: list) -> None:
    """Shut ``servers`` down, one whose start was interrupted too (its process forked, its address not yet read:
    no ``shutdown`` of its own, and the interpreter's exit would wait for it forever)."""
    for s in servers:
        if hasattr(s, "shutdown"):
            s.shutdown()
        elif getattr(s, "_process", None) is not None:
            s._process.kill()
            s._process.join()


def _hub(server, schema: Schema, consumers: Sequence[str], capacity: int, group_size: int):
    var = [c.name for c in schema if c.kind == "var"]
    return server.ControllerHub(list(consumers), capacity, schema.names, var, group_size)


def _dock(schema, consumers, capacity, group_size, transport, warehouses) -> Dock:
    return Dock(schema, consumers, capacity, group_size, transport, warehouses, {c: _Ctrl(c) for c in consumers})


def proc_dock(schema: Schema, consumers: Sequence[str], *, capacity: int,
              warehouses: int = 1, group_size: int = 1) -> Dock:
    """A dock whose ``warehouses`` warehouses run in processes of their own and whose controllers share one
    more; ``close()`` stops them."""
    if warehouses < 1:
        raise ValueError(f"proc_dock: warehouses must be >= 1, got {warehouses}")
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    servers = []
    try:
        for _ in range(warehouses + 1):
            servers.append(_Server(ctx=ctx))
            servers[-1].start()
        whs = [servers[i].Warehouse(f"w{i}", schema.wire_spec()) for i in range(warehouses)]
        hub = _hub(servers[-1], schema, consumers, capacity, group_size)
    except BaseException:
        _stop(servers)
        raise
    return _dock(schema, consumers, capacity, group_size, ProcTransport(servers, hub), whs)


def node_id() -> str:
    """This process's node: its host name and, where the launcher numbers nodes (torchrun's ``GROUP_RANK``,
    Slurm's ``SLURM_NODEID``), that number, so two launches on one host count as two nodes."""
    return f"{socket.gethostname()}:{os.environ.get('GROUP_RANK', os.environ.get('SLURM_NODEID', ''))}"


DOCK_HOST = "RLFLOW_DOCK_HOST"  # the address this node's dock servers listen on (default: reachable_host)


def reachable_host(peer: str) -> str:
    """The IPv4 address of this node's interface towards ``peer`` (the address ranks on other nodes reach
    this one by; no packet is sent). ``RLFLOW_DOCK_HOST`` overrides it."""
    if os.environ.get(DOCK_HOST):
        return os.environ[DOCK_HOST]
    try:
        addr = socket.getaddrinfo(peer, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return s.getsockname()[0]
    except OSError as e:
        raise OSError(f"MASTER_ADDR={peer}: no IPv4 route to it ({e}); the dock's servers need one, or "
                      f"{DOCK_HOST}=<this node's IPv4 address>") from None


def _all_ok(what: str, err: str | None) -> None:
    """Every rank says whether its part of ``what`` failed; each raises the first failure, naming its rank
    (so no rank goes on with a dock another could not build)."""
    import torch.distributed as dist
    errs: list = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    failed = [(r, e) for r, e in enumerate(errs) if e]
    if failed:
        raise RuntimeError(f"node_dock: rank {failed[0][0]} could not {what}: {failed[0][1]}")


def node_dock(schema: Schema, consumers: Sequence[str], *, capacity: int, warehouses: int, local_rank: int,
              group_size: int = 1) -> Dock:
    """The process dock of a world that was started elsewhere (torchrun, Slurm), where no driver exists to
    start it: a collective of the default torch.distributed group, called by every rank.

    Warehouse ``i`` runs on node ``i % nodes`` (nodes in the order of their first rank), started by that
    node's local rank 0; the controllers' hub by rank 0. The servers listen on TCP at the node's address
    towards ``MASTER_ADDR`` (``reachable_host``) and admit only this world's ranks: rank 0 draws the key and
    broadcasts it over the process group. The ranks exchange the servers' proxies, so every rank calls every
    warehouse directly and puts to its own node's. A rank that cannot start its servers, or reach another's,
    makes every rank raise, naming it; a world over several hosts whose servers would listen on a loopback
    address is refused. ``close()`` on a rank stops the servers it started: call it once no rank uses the
    dock."""
    import pickle

    import torch.distributed as dist
    if warehouses < 1:
        raise ValueError(f"node_dock: warehouses must be >= 1, got {warehouses}")
    rank, world = dist.get_rank(), dist.get_world_size()
    key = [os.urandom(32) if rank == 0 else None]
    dist.broadcast_object_list(key, src=0)
    # this process's multiprocessing key: the proxies it unpickles (no driver handed them over) authenticate
    # with it; a rank runs no other manager
    mp.current_process().authkey = key[0]
    me, host, err = node_id(), None, None
    try:
        host = reachable_host(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    except OSError as e:
        err = str(e)
    _all_ok("find its address", err)
    who: list = [None] * world
    dist.all_gather_object(who, (me, local_rank, host))
    nodes = list(dict.fromkeys(w[0] for w in who))
    firsts = [w[0] for w in who if w[1] == 0]
    bad = [n for n in nodes if firsts.count(n) != 1]
    if bad:
        raise RuntimeError(f"node_dock: node {bad[0]} has {firsts.count(bad[0])} ranks with local rank 0 "
                           "(expected one per node: LOCAL_RANK or SLURM_LOCALID)")
    hosts = sorted({w[0].rsplit(":", 1)[0] for w in who})
    loop = [(r, w[2]) for r, w in enumerate(who) if w[1] == 0 and w[2].startswith("127.")]
    if len(hosts) > 1 and loop:
        raise RuntimeError(f"node_dock: the world spans hosts {', '.join(hosts[:4])}, but rank {loop[0][0]}'s dock "
                           f"servers would listen on {loop[0][1]} (MASTER_ADDR={os.environ.get('MASTER_ADDR')} "
                           f"resolves to a loopback address there): set MASTER_ADDR to an address every host "
                           f"reaches, or {DOCK_HOST}")
    mine = [i for i in range(warehouses) if nodes[i % len(nodes)] == me] if local_rank == 0 else []
    servers, made, hub = [], {}, None
    try:
        try:
            if mine or rank == 0:
                ctx = mp.get_context("forkserver")  # this process runs gloo/NCCL threads: no plain fork
                ctx.set_forkserver_preload([__name__])

                def start():
                    servers.append(_Server(address=(host, 0), authkey=key[0], ctx=ctx))
                    servers[-1].start()
                    return servers[-1]
                for i in mine:
                    made[i] = start().Warehouse(f"w{i}", schema.wire_spec())
                if rank == 0:
                    hub = _hub(start(), schema, consumers, capacity, group_size)
            err = None
        except Exception as e:  # noqa: BLE001 - every rank must reach the exchange, then all raise
            err = f"at {host}: {type(e).__name__}: {e}"
        _all_ok("start its dock servers", err)
        got: list = [None] * world  # pickled here, unpickled below: unpickling a proxy connects to its server
        dist.all_gather_object(got, ([s.address for s in servers], pickle.dumps((made, hub))))
        whs, err = {}, None
        for r, (addrs, blob) in enumerate(got):
            try:
                m, h = pickle.loads(blob)
            except Exception as e:  # noqa: BLE001 - every rank must reach the exchange, then all raise
                err = f"rank {r}'s, at {addrs}: {type(e).__name__}: {e}"
                break
            whs.update(m)
            hub = h if r == 0 else hub
        _all_ok("reach the dock's servers", err)
    except BaseException:
        _stop(servers)
        raise
    transport = ProcTransport(servers, hub, nodes=tuple(nodes[i % len(nodes)] for i in range(warehouses)),
                              here=me)
    return _dock(schema, consumers, capacity, group_size, transport, [whs[i] for i in range(warehouses)])


__all__ = ["ControllerHub", "ProcTransport", "node_dock", "node_id", "proc_dock", "reachable_host"]
