"""Ray backend: warehouses and controllers (or the centralized store) as Ray actors.

- Warehouses are pinned to nodes (``NodeAffinitySchedulingStrategy``), ``i % len(nodes)``: one or
  more per node. A put from a process on a node prefers that node's warehouses.
- Controllers are light actors (no CPU reserved) placed by Ray.
- Actors are threaded (``max_concurrency``), so a get blocked in a controller waiting for rows does
  not stop the puts that will make them ready.
- Bytes: a put's numpy arrays travel as task arguments (Ray puts large ones in the object store);
  a warehouse's reply is a plain numpy payload that lands in the object store and is read by a client
  on the same node zero-copy (read-only views; the client's assembly makes the one copy it needs).

The returned ``Dock`` / ``CentralizedBuffer`` pickles (it holds actor handles), so Ray workers can be
handed the same client. ``close()`` kills the actors.
"""

from __future__ import annotations

from typing import Sequence

import ray
from ray.exceptions import RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlflow.dock.centralized import CentralizedBuffer, CentralStore
from rlflow.dock.client import Dock, _Client
from rlflow.dock.controller import Controller
from rlflow.dock.schema import Schema
from rlflow.dock.warehouse import Warehouse


def _cause(e: RayTaskError) -> BaseException:
    c = getattr(e, "cause", None)
    return c if isinstance(c, BaseException) else e


class RayTransport:
    """Calls become actor method calls; ``call_many`` launches all, then waits."""

    def __init__(self, nodes: Sequence[str | None] = ()):
        self.nodes = tuple(nodes)  # node id of each warehouse

    def call(self, target, method: str, *args):
        try:
            return ray.get(getattr(target, method).remote(*args))
        except RayTaskError as e:
            raise _cause(e) from None

    def call_many(self, calls) -> list:
        refs = [getattr(t, m).remote(*a) for t, m, a in calls]
        out = []
        for r in refs:
            try:
                out.append(ray.get(r))
            except RayTaskError as e:
                out.append(_cause(e))
        return out

    def here(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def close(self, targets) -> None:
        for t in targets:
            ray.kill(t)


def alive_nodes() -> list[str]:
    """Ids of the live nodes of the Ray cluster, sorted."""
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def ray_dock(schema: Schema, consumers: Sequence[str], *, capacity: int,
             warehouses: int = 1, group_size: int = 1, nodes: Sequence[str] | None = None,
             max_concurrency: int = 64) -> Dock:
    """A dock whose ``warehouses`` warehouses are spread round-robin over ``nodes`` (default: all live
    nodes) and whose controllers (one per consumer) are actors too."""
    _Client(schema, consumers, capacity, group_size)  # validate before starting actors
    if warehouses < 1:
        raise ValueError(f"ray_dock: warehouses must be >= 1, got {warehouses}")
    nodes = list(nodes or alive_nodes())
    placed = [nodes[i % len(nodes)] for i in range(warehouses)]
    wh_cls = ray.remote(Warehouse)
    whs = [wh_cls.options(num_cpus=0, max_concurrency=max_concurrency, name=None,
                          scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
           .remote(f"w{i}", schema.wire_spec()) for i, node in enumerate(placed)]
    var = [c.name for c in schema if c.kind == "var"]
    ct_cls = ray.remote(Controller)
    ctrls = {c: ct_cls.options(num_cpus=0, max_concurrency=max_concurrency)
             .remote(c, capacity, schema.names, var, group_size) for c in consumers}
    ray.get([a.traffic.remote() for a in [*whs, *ctrls.values()]])  # wait until all are up
    return Dock(schema, consumers, capacity, group_size, RayTransport(placed), whs, ctrls)


def ray_centralized(schema: Schema, consumers: Sequence[str], *, capacity: int,
                    group_size: int = 1, node: str | None = None, max_concurrency: int = 64) -> CentralizedBuffer:
    """The centralized replay buffer as one Ray actor (on ``node``, default: the first live node)."""
    _Client(schema, consumers, capacity, group_size)
    node = node or alive_nodes()[0]
    store = (ray.remote(CentralStore)
             .options(num_cpus=0, max_concurrency=max_concurrency,
                      scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
             .remote(*CentralizedBuffer.make_store(schema, consumers, capacity, group_size)))
    ray.get(store.traffic.remote())
    return CentralizedBuffer(schema, consumers, capacity, group_size, RayTransport((node,)), store)
