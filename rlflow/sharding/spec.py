"""``P``: a partition spec in JAX's notation, one entry per tensor dim.

An entry is ``None`` (the dim is whole on every rank), an axis name (the dim is split into that many
contiguous chunks), or a tuple of axes (split into ``prod(sizes)`` chunks, major to minor: chunk index
``= ((c[a0] * n[a1] + c[a1]) * n[a2] + c[a2]) ...``). Axes the spec does not name replicate the
tensor. Splits are even: a dim must divide by the product of its axes' sizes.

``P(None, "tp").format((8, 20), torch.float32)`` is ``f32[8, 20@tp]``; with dim letters,
``P("dp", "tp").format("TD", torch.float32)`` is ``f32[T@dp, D@tp]``.
"""

from __future__ import annotations

import torch

from rlflow.sharding.mesh import AXES, Mesh

DTYPE_NAMES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
    torch.bool: "bool",
}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()} | {
    "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
    "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _entry(e):
    if e is None:
        return None
    if isinstance(e, str):
        if e not in AXES:
            raise ValueError(f"unknown mesh axis {e!r} in P entry; axes are {AXES}")
        return e
    if isinstance(e, (tuple, list)):
        t = tuple(e)
        for a in t:
            if not isinstance(a, str) or a not in AXES:
                raise ValueError(f"unknown mesh axis {a!r} in P entry {t!r}; axes are {AXES}")
        if len(t) == 0:
            return None
        return t[0] if len(t) == 1 else t
    raise TypeError(f"P entry {e!r} must be None, an axis name or a tuple of axis names")


class P(tuple):
    """Partition spec: a frozen, hashable tuple of entries (``None``, ``"tp"``, ``("dp", "ep")``)."""

    def __new__(cls, *entries):
        t = tuple(_entry(e) for e in entries)
        seen: list[str] = []
        for e in t:
            for a in (e,) if isinstance(e, str) else (e or ()):
                if a in seen:
                    raise ValueError(f"P{t!r} names axis {a!r} twice")
                seen.append(a)
        return super().__new__(cls, t)

    @staticmethod
    def dim_axes(entry) -> tuple[str, ...]:
        return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis the spec names, in dim order."""
        return tuple(a for e in self for a in self.dim_axes(e))

    def divisors(self, mesh: Mesh) -> tuple[int, ...]:
        """Number of chunks of each dim on ``mesh``."""
        return tuple(mesh.axis_size(self.dim_axes(e)) for e in self)

    def check(self, shape, mesh: Mesh, *, what: str = "tensor") -> None:
        """Raise ``ValueError`` naming ``what`` unless ``shape`` splits evenly on ``mesh``."""
        if len(shape) != len(self):
            raise ValueError(f"{self!r} on {what}: spec has {len(self)} entries but the tensor has "
                             f"{len(shape)} dims {tuple(shape)}")
        for d, (n, e) in enumerate(zip(shape, self)):
            axes = self.dim_axes(e)
            k = mesh.axis_size(axes)
            if n % k:
                by = "*".join(f"{a}={getattr(mesh, a)}" for a in axes)
                raise ValueError(f"{self!r} on {what}: dim {d} of size {n} does not divide by {by}")

    def local_shape(self, shape, mesh: Mesh) -> tuple[int, ...]:
        return tuple(n // k for n, k in zip(shape, self.divisors(mesh)))

    def format(self, shape_or_names, dtype: torch.dtype | None = None) -> str:
        """``bf16[151936@tp, 2048]`` from a shape, or ``f32[T@dp, D@tp]`` from dim letters/names."""
        parts = []
        for n, e in zip(shape_or_names, self):
            axes = self.dim_axes(e)
            tag = "" if not axes else "@" + (axes[0] if len(axes) == 1 else "(" + ",".join(axes) + ")")
            parts.append(f"{n}{tag}")
        return (dtype_name(dtype) if dtype is not None else "") + "[" + ", ".join(parts) + "]"

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    __str__ = __repr__

    def __reduce__(self):
        return (P, tuple(self))
