"""Sample routing as a layout transition: which ranks of a stage's mesh read which rows of the dock.

A stage's rows are sharded over the data axes ``("dp", "ep")`` of the mesh it runs on (the rollout mesh,
the train mesh, or a flat mesh of every rank for scoring) and replicated over the others: the tp ranks
and pp stages of a data-parallel group read the same rows. ``route(ticket, mesh, ...)`` turns the rows
a consumer took (a ``Ticket``: indices, warehouses, lengths) into a ``RowPlan``: each row's data-parallel
part (equal row counts, total sequence length balanced, GRPO groups kept whole where asked), the ranks
that read it, and the bytes each rank and each warehouse moves. The plan is metadata only; the dock
executes it (each rank reads its part straight from the warehouses), and its bytes are the dock cost
model's input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlflow.dock.samplers import balance
from rlflow.sharding.layout import fmt_bytes
from rlflow.sharding.mesh import Mesh


@dataclass(frozen=True, eq=False)
class RowPlan:
    mesh: Mesh  # the consuming stage's mesh
    index: np.ndarray  # int64 [k] rows, ascending
    warehouse: np.ndarray  # int32 [k] where each row is stored
    part: np.ndarray  # int64 [k] the data-parallel index that reads each row
    row_bytes: np.ndarray  # int64 [k] bytes of each row's columns

    def positions(self, part: int) -> np.ndarray:
        """Positions (into ``index``) of the rows of data-parallel part ``part``."""
        return np.flatnonzero(self.part == part)

    def ranks(self, part: int) -> tuple[int, ...]:
        """The ranks that read part ``part``: its tp and pp peers included."""
        return tuple(r for r in range(self.mesh.size) if self.mesh.data_parallel_index(r) == part)

    def rows_of_rank(self, rank: int) -> np.ndarray:
        return self.index[self.positions(self.mesh.data_parallel_index(rank))]

    def bytes_per_rank(self) -> np.ndarray:
        """[world] bytes each rank reads."""
        per_part = np.bincount(self.part, weights=self.row_bytes, minlength=self.mesh.data_parallel_size)
        return np.array([per_part[self.mesh.data_parallel_index(r)] for r in range(self.mesh.size)], dtype=np.int64)

    def bytes_per_warehouse(self, warehouses: int) -> np.ndarray:
        """[warehouses] bytes each warehouse sends (a row once per rank that reads it)."""
        readers = self.mesh.size // self.mesh.data_parallel_size
        return (np.bincount(self.warehouse, weights=self.row_bytes, minlength=warehouses) * readers).astype(np.int64)

    def __str__(self) -> str:
        lines = [f"row plan: {len(self.index)} rows -> {self.mesh} ({self.mesh.data_parallel_size} data-parallel "
                 f"parts, {self.mesh.size // self.mesh.data_parallel_size} readers each)"]
        per = self.bytes_per_rank()
        for p in range(self.mesh.data_parallel_size):
            pos = self.positions(p)
            lines.append(f"  part {p}: {len(pos)} rows, {fmt_bytes(self.row_bytes[pos].sum())} -> ranks "
                         f"{list(self.ranks(p))} ({fmt_bytes(per[self.ranks(p)[0]])} each)")
        wh = self.bytes_per_warehouse(int(self.warehouse.max(initial=-1)) + 1)
        lines.append("  warehouses send: " + ", ".join(f"w{i} {fmt_bytes(b)}" for i, b in enumerate(wh)))
        return "\n".join(lines)


def route(index: np.ndarray, warehouse: np.ndarray, cost: np.ndarray, row_bytes: np.ndarray, mesh: Mesh, *,
          group_size: int = 1) -> RowPlan:
    """The row plan for rows ``index`` (ascending; whole groups of ``group_size`` consecutive rows when
    ``group_size > 1``) onto ``mesh``'s data-parallel parts, balanced by ``cost`` (sequence length). Parts
    differ by at most one group; with fewer groups than parts some parts are empty."""
    index = np.asarray(index, dtype=np.int64)
    k, parts, G = len(index), mesh.data_parallel_size, group_size
    if k % G:
        raise ValueError(f"route: {k} rows are not whole groups of {G}")
    part = np.zeros(k, dtype=np.int64)
    for p, units in enumerate(balance(np.asarray(cost, dtype=np.float64).reshape(-1, G).sum(axis=1), parts)):
        part[(units[:, None] * G + np.arange(G)).reshape(-1)] = p
    return RowPlan(mesh=mesh, index=index, warehouse=np.asarray(warehouse, dtype=np.int32), part=part,
                   row_bytes=np.asarray(row_bytes, dtype=np.int64))


__all__ = ["RowPlan", "route"]
