"""Column schemas of the transfer dock, and the wire format rows travel in.

A dock stores *cells*: one value of one column for one row. A column is declared once, with its dtype
and its kind:

- ``scalar``: one value per row (rewards, advantages, group).
- ``var``: a 1-D tensor per row whose length varies from row to row (prompt_ids, response_ids,
  log-probs). Columns that share a ``length_group`` must have the same length in every row (the
  log-probs of a response have one entry per response token).
- ``fixed``: a 1-D tensor of ``length`` entries per row.

Wire format (what warehouses, controllers and the centralized store see; numpy only, no torch):
a ``Wire`` is ``dict[column name, Cell]`` and a ``Cell`` is ``(values, lengths)``:
scalar -> ``values[k]``, ``lengths=None``; fixed -> ``values[k, L]``, ``lengths=None``;
var -> ``values[sum(lengths)]`` (the rows concatenated), ``lengths[k]`` int64.
bfloat16 has no numpy dtype: it travels as its int16 bit pattern and is viewed back on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

KINDS = ("scalar", "var", "fixed")
Cell = tuple[np.ndarray, "np.ndarray | None"]
Wire = dict[str, Cell]

_WIRE_DTYPE = {torch.bfloat16: torch.int16}  # dtypes numpy lacks -> same-width stand-in


@dataclass(frozen=True, slots=True)
class Packed:
    """A var column's ``k`` rows given whole: ``values`` the rows concatenated (1-D, or one row per leading
    index of a [N, ...] tensor, flattened per row), ``lengths`` [k] each row's count of leading entries.
    What the wire holds, without a tensor per row; ``from_padded`` builds it from a padded [B, T, ...]
    tensor and its [B, T] mask (left or right padding alike)."""

    values: Tensor
    lengths: Tensor

    @classmethod
    def from_padded(cls, padded: Tensor, mask: Tensor) -> "Packed":
        return cls(padded[mask], mask.sum(-1))


@dataclass(frozen=True, slots=True)
class Column:
    """One column: name, dtype, kind (scalar / var / fixed), and how it pads."""

    name: str
    dtype: torch.dtype
    kind: str = "var"
    length: int | None = None  # fixed columns only: entries per row
    length_group: str | None = None  # var columns in one group have equal lengths per row
    pad_left: bool = False  # pad on the left when returned padded (prompts, as in rlflow.batch)
    pad_value: int | float = 0

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"Column.name: expected an identifier, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"Column {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"Column {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        if (self.kind == "fixed") != (self.length is not None):
            raise ValueError(f"Column {self.name!r}: length is required for kind 'fixed' and only for it "
                             f"(kind={self.kind!r}, length={self.length})")
        if self.length is not None and self.length <= 0:
            raise ValueError(f"Column {self.name!r}: length must be positive, got {self.length}")
        if self.length_group is not None and self.kind != "var":
            raise ValueError(f"Column {self.name!r}: length_group applies to 'var' columns, kind is {self.kind!r}")

    @property
    def wire_dtype(self) -> torch.dtype:
        return _WIRE_DTYPE.get(self.dtype, self.dtype)

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        shape = {"scalar": "[]", "var": "[T]", "fixed": f"[{self.length}]"}[self.kind]
        return f"{self.name}: {dt}{shape}" + (f" ~{self.length_group}" if self.length_group else "")


class Schema:
    """An ordered set of columns, declared once per dock."""

    __slots__ = ("columns", "_by_name")

    def __init__(self, *columns: Column):
        names = [c.name for c in columns]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"Schema: duplicate column names {dup}")
        self.columns = tuple(columns)
        self._by_name = {c.name: c for c in columns}

    def __getitem__(self, name: str) -> Column:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(self.columns)

    def __len__(self) -> int:
        return len(self.columns)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def __repr__(self) -> str:
        return "Schema(" + ", ".join(str(c) for c in self.columns) + ")"

    def wire_spec(self) -> dict[str, tuple[str, str | None]]:
        """What warehouses need to know: name -> (kind, length_group)."""
        return {c.name: (c.kind, c.length_group) for c in self.columns}

    def check_names(self, where: str, names: Iterable[object]) -> tuple[str, ...]:
        names = tuple(names)
        for n in names:
            if n not in self._by_name:
                raise ValueError(f"{where}: unknown column {n!r} (known: {', '.join(self.names)})")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"{where}: column(s) {dup} named twice")
        if not names:
            raise ValueError(f"{where}: no columns given")
        return names

    # ---- torch -> wire, validating everything ----
    def encode(self, where: str, k: int, columns: Mapping[str, object]) -> Wire:
        """Validate ``columns`` (``k`` rows each) against the schema; return them as a fresh Wire."""
        self.check_names(where, columns.keys())
        wire: Wire = {}
        group_len: dict[str, tuple[str, np.ndarray]] = {}
        for name, value in columns.items():
            col = self._by_name[name]
            wire[name] = _encode_column(where, col, k, value)
            if col.length_group is not None:
                lens = wire[name][1]
                if col.length_group in group_len:
                    other, olens = group_len[col.length_group]
                    bad = np.flatnonzero(lens != olens)
                    if bad.size:
                        r = int(bad[0])
                        raise ValueError(f"{where}: column {name!r} row {r} has length {int(lens[r])} but "
                                         f"{other!r} has {int(olens[r])} (length group {col.length_group!r})")
                else:
                    group_len[col.length_group] = (name, lens)
        return wire


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _to_numpy(col: Column, t: Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if col.wire_dtype != col.dtype:
        t = t.view(col.wire_dtype)
    return t.numpy()


def _encode_column(where: str, col: Column, k: int, value: object) -> Cell:
    name, want = col.name, _dtype_name(col.dtype)
    if col.kind == "var" and isinstance(value, Packed):
        v, lens = value.values, value.lengths
        if not isinstance(v, Tensor) or not isinstance(lens, Tensor):
            raise ValueError(f"{where}: column {name!r}: Packed values and lengths must be tensors")
        if v.dtype != col.dtype:
            raise ValueError(f"{where}: column {name!r} expects dtype {want}, got {_dtype_name(v.dtype)}")
        if lens.dim() != 1 or len(lens) != k or lens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{where}: column {name!r}: Packed lengths must be {k} integers, got {lens.dtype} "
                             f"{tuple(lens.shape)}")
        lens = lens.detach().cpu().numpy().astype(np.int64)
        if v.dim() < 1 or (lens < 0).any() or int(lens.sum()) != v.shape[0]:
            raise ValueError(f"{where}: column {name!r}: Packed lengths (sum {int(lens.sum())}, min "
                             f"{int(lens.min()) if k else 0}) do not cover the {tuple(v.shape)} values")
        per = int(np.prod(v.shape[1:], dtype=np.int64))  # entries per leading index
        return np.array(_to_numpy(col, v.reshape(-1)), copy=True), lens * per  # the dock's own copy
    if col.kind == "var":
        if isinstance(value, Tensor) or not isinstance(value, Sequence):
            raise ValueError(f"{where}: column {name!r} is variable-length: give a sequence of {k} 1-D tensors "
                             f"or a Packed, got {type(value).__name__}")
        if len(value) != k:
            raise ValueError(f"{where}: column {name!r} has {len(value)} rows, indices has {k}")
        rows = []
        for r, t in enumerate(value):
            if not isinstance(t, Tensor):
                raise ValueError(f"{where}: column {name!r} row {r}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype != col.dtype:
                raise ValueError(f"{where}: column {name!r} expects dtype {want}, got {_dtype_name(t.dtype)} (row {r})")
            if t.dim() != 1:
                raise ValueError(f"{where}: column {name!r} row {r}: expected a 1-D tensor, got shape {tuple(t.shape)}")
            rows.append(_to_numpy(col, t))
        lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=k)
        flat = np.concatenate(rows) if rows else np.empty(0, dtype=_np_dtype(col))
        return np.ascontiguousarray(flat), lens
    if not isinstance(value, Tensor):
        raise ValueError(f"{where}: column {name!r} expects a tensor of shape "
                         f"{[k] if col.kind == 'scalar' else [k, col.length]}, got {type(value).__name__}")
    if value.dtype != col.dtype:
        raise ValueError(f"{where}: column {name!r} expects dtype {want}, got {_dtype_name(value.dtype)}")
    shape = (k,) if col.kind == "scalar" else (k, col.length)
    if tuple(value.shape) != shape:
        raise ValueError(f"{where}: column {name!r} expects shape {list(shape)}, got {list(value.shape)}")
    return np.array(_to_numpy(col, value), copy=True), None


def _np_dtype(col: Column) -> np.dtype:
    return torch.empty(0, dtype=col.wire_dtype).numpy().dtype


# ---- wire helpers (numpy only) ----
def cell_rows(cell: Cell) -> int:
    values, lengths = cell
    return len(lengths) if lengths is not None else len(values)


def take_rows(cell: Cell, rows: np.ndarray) -> Cell:
    """The cell restricted to ``rows`` (positions), in that order; always a fresh array."""
    values, lengths = cell
    rows = np.asarray(rows, dtype=np.int64)
    if lengths is None:
        return values[rows], None
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    sel = lengths[rows]
    total = int(sel.sum())
    starts = np.repeat(offsets[rows] - (np.cumsum(sel) - sel), sel)
    return values[starts + np.arange(total, dtype=np.int64)], sel.copy()


def concat_cells(cells: Sequence[Cell]) -> Cell:
    """Rows of several cells of one column, concatenated."""
    if cells[0][1] is None:
        return np.concatenate([c[0] for c in cells]), None
    return np.concatenate([c[0] for c in cells]), np.concatenate([c[1] for c in cells])
