"""Layouts: a mesh, one spec per parameter, and the pipeline stage of every parameter.

A parameter is sharded in its *logical view*: the stored tensor reshaped so that each dim is one
logical dim. ``q_proj.weight`` [H*hd, D] is viewed as [H, hd, D] (heads, head_dim, embed), so a split
over ``tp`` falls between heads; ``experts.gate_up_proj`` [E, 2F, D] is viewed as [E, 2, F, D]
(experts, gate_up, expert_mlp, embed), so each ``tp`` rank gets matching rows of the gate and of the up
projection. A rank's stored shard is its view shard reshaped back (view dims merge into stored dims),
which is what column-parallel code wants.

Who holds what: rank ``r`` holds parameter ``p`` iff ``coords(r).pp == stage(p)``; along view dim ``d``
with spec entry ``(a0, a1, ...)`` it holds chunk ``((c[a0] * n[a1] + c[a1]) ...)`` of
``prod(n[a])`` equal contiguous chunks; it is replicated over every axis the spec does not name.

``Layout.build`` makes a layout from a table of logical dim names (one per view dim, from
``rlflow.models.sharding``) and *rules* mapping each logical name to ``None``, an axis or a tuple of
axes. A logical name without a rule is an error, never silently replicated.
"""

from __future__ import annotations

import dataclasses

import functools
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from rlflow.sharding.mesh import Mesh
from rlflow.sharding.spec import P, dtype_name

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Logical:
    """A parameter's stored ``shape`` and its logical ``view``: one name in ``dims`` per view dim;
    ``merge[k]`` view dims make stored dim ``k``."""

    shape: tuple[int, ...]
    dims: tuple[str, ...]
    view: tuple[int, ...]
    merge: tuple[int, ...]


@dataclass(frozen=True)
class ParamLayout:
    name: str
    shape: tuple[int, ...]  # stored shape
    dtype: torch.dtype
    spec: P  # over the view dims
    stage: int = 0
    view: tuple[int, ...] | None = None  # logical shape; None: the stored shape
    merge: tuple[int, ...] | None = None  # view dims per stored dim; None: one each
    dims: tuple[str, ...] | None = None  # logical dim names (for printing)

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.view is None:
            object.__setattr__(self, "view", self.shape)
            object.__setattr__(self, "merge", (1,) * len(self.shape))
        object.__setattr__(self, "view", tuple(int(s) for s in self.view))
        if not isinstance(self.spec, P):
            object.__setattr__(self, "spec", P(*self.spec))
        if self.merge is None or sum(self.merge) != len(self.view) or len(self.merge) != len(self.shape):
            raise ValueError(f"param {self.name}: merge={self.merge} does not map view {self.view} "
                             f"onto shape {self.shape}")
        k = 0
        for n, m in zip(self.shape, self.merge):
            if int(np.prod(self.view[k:k + m], dtype=np.int64)) != n:
                raise ValueError(f"param {self.name}: view {self.view} does not reshape to {self.shape}")
            k += m

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def local_view(self, mesh: Mesh) -> tuple[int, ...]:
        return self.spec.local_shape(self.view, mesh)

    def local_shape(self, mesh: Mesh) -> tuple[int, ...]:
        """Stored shape of one rank's shard: the local view with view dims merged back."""
        lv, out, k = self.local_view(mesh), [], 0
        for m in self.merge:
            out.append(int(np.prod(lv[k:k + m], dtype=np.int64)))
            k += m
        return tuple(out)

    def local_bytes(self, mesh: Mesh) -> int:
        return int(np.prod(self.local_view(mesh), dtype=np.int64)) * self.itemsize

    def describe(self, mesh: Mesh) -> str:
        names = [f"{d}:{n}" for d, n in zip(self.dims, self.view)] if self.dims else self.view
        st = f"  stage {self.stage}" if mesh.pp > 1 else ""
        return f"{self.name}: {self.spec.format(names, self.dtype)}{st}"


@dataclass(frozen=True)
class Layout:
    mesh: Mesh
    params: tuple[ParamLayout, ...]
    name: str = field(default="", compare=False)

    def __post_init__(self):
        seen = set()
        for p in self.params:
            if p.name in seen:
                raise ValueError(f"layout names param {p.name} twice")
            seen.add(p.name)
            if "pp" in p.spec.axes:
                raise ValueError(f"{p.spec!r} on param {p.name}: 'pp' holds pipeline stages, it cannot "
                                 "shard a dim")
            p.spec.check(p.view, self.mesh, what=f"param {p.name}")
            if not 0 <= p.stage < self.mesh.pp:
                raise ValueError(f"param {p.name}: stage {p.stage} is outside pp={self.mesh.pp}")

    @functools.cached_property
    def by_name(self) -> dict[str, ParamLayout]:
        return {p.name: p for p in self.params}

    def __getitem__(self, name: str) -> ParamLayout:
        try:
            return self.by_name[name]
        except KeyError:
            raise KeyError(f"layout has no param {name!r}") from None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def only(self, names) -> "Layout":
        """This layout of the parameters in ``names`` alone (e.g. LoRA's adapters)."""
        keep = set(names)
        return dataclasses.replace(self, params=tuple(p for p in self.params if p.name in keep))

    def holds(self, name: str, rank: int) -> bool:
        return self.mesh.coords(rank)["pp"] == self[name].stage

    def mismatched_dtypes(self, tensors: dict) -> list[str]:
        """The names of ``tensors`` this layout has whose dtype is not the layout's (its plans move, cast and
        allocate in the layout's dtypes)."""
        names = set(self.names)
        return [n for n, t in tensors.items() if n in names and t.dtype != self[n].dtype]

    def holders(self, name: str) -> np.ndarray:
        return np.flatnonzero(self.mesh.coord_array[:, 0] == self[name].stage)

    def bytes_per_rank(self) -> np.ndarray:
        """Bytes of weights each rank holds, ``[world]``."""
        out = np.zeros(self.mesh.size, dtype=np.int64)
        per_stage = np.zeros(self.mesh.pp, dtype=np.int64)
        for p in self.params:
            per_stage[p.stage] += p.local_bytes(self.mesh)
        out[:] = per_stage[self.mesh.coord_array[:, 0]]
        return out

    def __str__(self) -> str:
        head = f"layout {self.name + ' ' if self.name else ''}on {self.mesh}: {len(self.params)} params"
        return "\n".join([head] + ["  " + p.describe(self.mesh) for p in self.params])

    def summary(self) -> str:
        """Like ``str`` but with the layers folded: one line per distinct param suffix."""
        lines, seen = [], {}
        for p in self.params:
            key = _LAYER.sub(".layers.*.", p.name)
            if key in seen:
                seen[key][1].append(p.stage)
                continue
            seen[key] = (p, [p.stage])
        for key, (p, stages) in seen.items():
            desc = p.describe(self.mesh).split(": ", 1)[1].split("  stage")[0]
            st = ""
            if self.mesh.pp > 1:
                st = "  stages " + ",".join(str(s) for s in sorted(set(stages)))
            n = f" x{len(stages)}" if len(stages) > 1 else ""
            lines.append(f"  {key}{n}: {desc}{st}")
        head = f"layout {self.name + ' ' if self.name else ''}on {self.mesh}: {len(self.params)} params"
        return "\n".join([head] + lines)

    # ---- construction from a table ----
    @classmethod
    def build(cls, mesh: Mesh, logical: dict[str, Logical], rules: dict, *,
              dtype: torch.dtype | dict[str, torch.dtype] = torch.bfloat16,
              layers_per_stage: tuple[int, ...] | None = None, name: str = "") -> "Layout":
        """Spec of each param from ``rules`` (logical dim name -> None | axis | axes), stage from the
        layer index in its name (``layers.{i}.``); params before the first layer (embedding) go to
        stage 0, params after the last (final norm, head) to the last stage."""
        names = list(logical)
        stages = stage_of_params(names, mesh.pp, layers_per_stage)
        params = []
        for n in names:
            lg = logical[n]
            entries = []
            for d in lg.dims:
                if d not in rules:
                    raise ValueError(f"param {n}: no rule for logical dim {d!r} (rules name "
                                     f"{sorted(rules)})")
                entries.append(rules[d])
            try:
                spec = P(*entries)
            except ValueError as e:
                raise ValueError(f"param {n} (dims {lg.dims}): {e}") from None
            dt = dtype[n] if isinstance(dtype, dict) else dtype
            params.append(ParamLayout(name=n, shape=lg.shape, dtype=dt, spec=spec, stage=stages[n],
                                      view=lg.view, merge=lg.merge, dims=lg.dims))
        return cls(mesh=mesh, params=tuple(params), name=name)


def split_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage, as even as possible; the first ``num_layers % pp`` stages take one more."""
    if pp > max(num_layers, 1):
        raise ValueError(f"pp={pp} is larger than the number of layers {num_layers}")
    base, extra = divmod(num_layers, pp)
    return tuple(base + (s < extra) for s in range(pp))


def stage_of_params(names, pp: int, layers_per_stage=None) -> dict[str, int]:
    layer_of = {n: int(m.group(1)) if (m := _LAYER.search(n)) else None for n in names}
    layers = sorted({v for v in layer_of.values() if v is not None})
    num_layers = layers[-1] + 1 if layers else 0
    if layers_per_stage is None:
        layers_per_stage = split_layers(num_layers, pp) if num_layers else (0,) * pp
    layers_per_stage = tuple(layers_per_stage)
    if len(layers_per_stage) != pp or sum(layers_per_stage) != num_layers:
        raise ValueError(f"layers_per_stage={layers_per_stage} must have pp={pp} entries summing to "
                         f"{num_layers} layers")
    stage_of_layer = np.repeat(np.arange(pp), layers_per_stage)
    out, seen_layer = {}, False
    for n in names:
        li = layer_of[n]
        if li is not None:
            seen_layer = True
            out[n] = int(stage_of_layer[li])
        else:
            out[n] = pp - 1 if seen_layer else 0
    return out


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


__all__ = ["Layout", "Logical", "ParamLayout", "split_layers", "stage_of_params", "fmt_bytes",
           "dtype_name"]
