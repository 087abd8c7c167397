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
import sys
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


class ProcTransport:
    """Calls become proxy calls to the dock processes (controller calls go through the hub; several in one
    ``call_many`` are one round trip); ``close`` (in the process that started them) stops them."""

    nodes: tuple = ()

    def __init__(self, servers: list, hub):
        self._servers, self.hub = servers, hub

    def __getstate__(self):
        return {"_servers": [], "hub": self.hub}  # a copy in another process does not own the servers

    def call(self, target, method: str, *args):
        if isinstance(target, _Ctrl):
            return self.hub.call(target.consumer, method, args)
        return getattr(target, method)(*args)

    def call_many(self, calls) -> list:
        calls = list(calls)
        out: list = [None] * len(calls)
        ctrl = [i for i, (t, _, _) in enumerate(calls) if isinstance(t, _Ctrl)]
        if ctrl:
            for i, r in zip(ctrl, self.hub.each([(calls[i][0].consumer, calls[i][1], calls[i][2]) for i in ctrl])):
                out[i] = r
        rest = sorted(set(range(len(calls))) - set(ctrl))
        for i, r in zip(rest, LocalTransport().call_many([calls[i] for i in rest])):
            out[i] = r
        return out

    def here(self):
        return None

    def close(self, targets) -> None:
        for s in self._servers:
            s.shutdown()
        self._servers = []


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
            s = _Server(ctx=ctx)
            s.start()
            servers.append(s)
        var = [c.name for c in schema if c.kind == "var"]
        whs = [servers[i].Warehouse(f"w{i}", schema.wire_spec()) for i in range(warehouses)]
        hub = servers[-1].ControllerHub(list(consumers), capacity, schema.names, var, group_size)
    except BaseException:
        for s in servers:
            s.shutdown()
        raise
    return Dock(schema, consumers, capacity, group_size, ProcTransport(servers, hub), whs,
                {c: _Ctrl(c) for c in consumers})


__all__ = ["ControllerHub", "ProcTransport", "proc_dock"]
