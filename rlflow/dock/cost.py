"""Communication-volume model of the sample flow: centralized replay buffer vs transfer dock.

This follows the accounting of MindSpeed RL (arXiv 2507.19017): Eq. (1) the bytes a stage moves,
Eq. (2) the bytes through the centralized replay buffer, Eq. (4) the bytes through the busiest process
of the transfer dock with S warehouses and C controllers. The paper's own text was not available
offline when this was written; the formulas below are the same accounting written out term by term
for rlflow's columns, and each states exactly what it counts. They count payload bytes (the tensors
and the metadata scalars), not message headers; ``bench/dock.py`` measures the real serialized bytes
and reports the gap as ``model_error``.

Symbols
    G   prompts per step; n samples per prompt (GRPO group size). Rows per iteration: R = G*n.
    PL  mean prompt length, SL mean response length (tokens).
    b_c bytes per token of column c (its dtype's itemsize; the paper takes B = 4 for every column,
        pass ``bytes_per_token=4`` to reproduce that). A variable-length cell also carries its length
        (one int64, 8 bytes) on the wire.
    w_c bytes of one cell: PL*b_c + 8 (prompt-length columns), SL*b_c + 8 (response-length columns),
        b_c (scalars), L*b_c (fixed length L).
    N   workers of a stage (DP ranks); S warehouses; C controllers (one per consumer stage).
    m   metadata bytes per row and message: index (int64, 8) + warehouse id (int32, 4) + 8 per length.

Eq. (1)  V_k = R * (sum_{c in reads_k} w_c + sum_{c in writes_k} w_c)
         bytes stage k reads plus writes in one iteration (the producer's first put is a stage that
         only writes).
Eq. (2)  V_rb = sum_k V_k
         bytes through the centralized replay buffer: every write goes into it and every read comes out
         of it, so its process carries all of the flow whatever N is; each of the N workers of a
         stage carries V_k / N.
Eq. (4)  V_td = max(V_rb / S, M_lead)
         bytes through the busiest process of the transfer dock. Rows are spread evenly over S
         warehouses (placement round-robin over groups), each carries V_rb / S. A controller carries
         metadata only: M = R * (sum_k [puts] (8 + 4 + 8 * var columns written by k)
                                  + (8 + 4 + 8 * var columns its consumer reads))
         and the lead controller (which assigns warehouses) also R * (8 + 4 + 4 + 4 + 1) per put for
         ``place`` (index, preferred id, column-list aside, returned id, new flag). C enters the
         dock's *total* volume (C * M) but not the busiest process.

Separate pools (the streaming case, ``streaming``): per step the rollout pool puts the step's rows once and the
train pool takes them once (a two-stage flow, ``pools_flow``; each of the P = tp x pp ranks of a data-parallel
part reads its part's rows), and the step's slot is released (its R row indices, 8 bytes each, to every
warehouse): V_step = (V_put + P * V_take) / S + R * 8 at each warehouse, S the warehouses the rows are put in
(a row goes to its producer's node: the rollout pool's), assuming S divides the step's groups. The
staleness k changes not the bytes per step but the rows held: at most k + 1 steps' (the slots the back-pressure
bounds), H = (k + 1) * R * sum_{c put} s_c / S per warehouse, s_c the stored bytes of a cell (w_c without its
length on the wire).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.dock.schema import Schema

LENGTH_BYTES = 8  # int64 length per var cell on the wire
INDEX_BYTES, WH_BYTES = 8, 4


@dataclass(frozen=True, slots=True)
class Stage:
    """One stage of the flow: the columns it reads (as a consumer) and writes (puts). The GRPO flow is
    ``rlflow.runtime.graph.GRPO.flow``."""

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]



@dataclass(frozen=True, slots=True)
class Shape:
    """Sizes of one iteration's sample flow."""

    prompts: int  # G
    group_size: int  # n
    prompt_len: float  # PL, mean tokens
    response_len: float  # SL, mean tokens
    bytes_per_token: int | None = None  # None: each column's dtype itemsize; 4: the paper's B
    answer_len: float = 8  # mean bytes of a reference answer (UTF-8; the scorers read it with the rows)

    @property
    def rows(self) -> int:
        return self.prompts * self.group_size


def cell_bytes(shape: Shape, column: str, schema: Schema) -> float:
    """w_c: payload bytes of one cell of ``column``."""
    col = schema[column]
    b = shape.bytes_per_token or col.dtype.itemsize
    if col.kind == "scalar":
        return b
    if col.kind == "fixed":
        return col.length * b
    tokens = {"prompt": shape.prompt_len, "response": shape.response_len, "answer": shape.answer_len}.get(col.length_group)
    if tokens is None:
        raise ValueError(f"cell_bytes: var column {column!r} has length group {col.length_group!r}; "
                         f"the model knows 'prompt', 'response' and 'answer'")
    return tokens * b + LENGTH_BYTES


def stage_bytes(shape: Shape, stage: Stage, schema: Schema) -> float:
    """Eq. (1): bytes stage ``stage`` reads plus writes in one iteration."""
    return shape.rows * sum(cell_bytes(shape, c, schema) for c in (*stage.reads, *stage.writes))


def centralized_bytes(shape: Shape, flow, schema: Schema) -> float:
    """Eq. (2): bytes through the centralized buffer's one process per iteration (= the whole flow)."""
    return sum(stage_bytes(shape, s, schema) for s in flow)


def worker_bytes(shape: Shape, stage: Stage, workers: int, schema: Schema) -> float:
    """Bytes one of ``workers`` DP ranks of ``stage`` moves (the same in both designs)."""
    return stage_bytes(shape, stage, schema) / workers


def controller_bytes(shape: Shape, consumer: str, flow, schema: Schema,
                     lead: bool = False) -> float:
    """Metadata bytes through ``consumer``'s controller per iteration (see Eq. (4))."""
    var = {c.name for c in schema if c.kind == "var"}
    per_row = 0.0
    for s in flow:
        if s.writes:
            per_row += INDEX_BYTES + WH_BYTES + LENGTH_BYTES * len(var & set(s.writes))
            if lead:
                per_row += INDEX_BYTES + 4 + WH_BYTES + 1  # place: index, preferred, returned id, new flag
        if s.name == consumer:
            per_row += INDEX_BYTES + WH_BYTES + LENGTH_BYTES * len(var & set(s.reads))
    return shape.rows * per_row


def dock_bytes(shape: Shape, warehouses: int, flow, schema: Schema) -> dict[str, float]:
    """Eq. (4): bytes through the busiest warehouse, the busiest controller and the busiest dock process;
    ``total`` is every dock process together (C controllers)."""
    consumers = [s.name for s in flow if s.reads]
    wh = centralized_bytes(shape, flow, schema) / warehouses
    ctl = [controller_bytes(shape, c, flow, schema, lead=(i == 0)) for i, c in enumerate(consumers)]
    return {"warehouse": wh, "controller": max(ctl), "busiest": max(wh, max(ctl)),
            "total": wh * warehouses + sum(ctl), "controllers": len(consumers)}


def project(shape: Shape, devices: int, flow, schema: Schema, devices_per_node: int = 8,
            warehouses_per_node: int = 1) -> dict[str, float]:
    """The model at ``devices`` devices: one warehouse per node (S = devices / devices_per_node), every
    device a worker of each stage (N = devices), global batch fixed at ``shape``."""
    if devices % devices_per_node:
        raise ValueError(f"project: devices={devices} is not a multiple of devices_per_node={devices_per_node}")
    S = devices // devices_per_node * warehouses_per_node
    central = centralized_bytes(shape, flow, schema)
    dock = dock_bytes(shape, S, flow, schema)
    update = next(s for s in flow if s.name == "update")
    return {"devices": devices, "S": S, "central_busiest": central, "dock_busiest": dock["busiest"],
            "ratio": central / dock["busiest"], "worker_update": worker_bytes(shape, update, devices, schema)}


def stored_bytes(shape: Shape, column: str, schema: Schema) -> float:
    """s_c: bytes one cell of ``column`` takes in a warehouse (its payload; its length is not stored apart)."""
    return cell_bytes(shape, column, schema) - (LENGTH_BYTES if schema[column].kind == "var" else 0)


def pools_flow(put, taken) -> tuple[Stage, Stage]:
    """Separate pools' flow: the rollout pool puts a step's rows (columns ``put``), the train pool takes them."""
    return Stage("rollout", (), tuple(put)), Stage("train", tuple(taken), ())


def streaming(shape: Shape, warehouses: int, put, taken, schema: Schema, staleness: int,
              readers: int = 1) -> dict[str, float]:
    """The dock of separate pools per step (see the module): Eq. (4) over ``pools_flow`` with the take read by
    ``readers`` ranks (the tp x pp ranks of a data-parallel part of the train layout each read its rows) and the
    slot's release at every warehouse, and ``held_per_warehouse``: the bytes of staleness + 1 steps' rows there.
    ``warehouses``: those the rows are put in (the rollout pool's nodes': a row goes to its producer's node)."""
    put_stage, take_stage = pools_flow(put, taken)
    d = dock_bytes(shape, warehouses, (put_stage, take_stage), schema)
    moved = stage_bytes(shape, put_stage, schema) + readers * stage_bytes(shape, take_stage, schema)
    wh = moved / warehouses + shape.rows * INDEX_BYTES
    held = (staleness + 1) * shape.rows * sum(stored_bytes(shape, c, schema) for c in put) / warehouses
    return {**d, "warehouse": wh, "busiest": max(wh, d["controller"]), "total": d["total"] + (wh - d["warehouse"])
            * warehouses, "held_per_warehouse": held}
