"""Device meshes: named axes ``pp``, ``dp``, ``ep``, ``tp`` over a world of ranks.

Rank order is Megatron's: ``tp`` varies fastest, then ``ep``, then ``dp``, then ``pp``::

    rank = ((pp_i * dp + dp_i) * ep + ep_i) * tp + tp_i

Who holds what (MoE parallel folding, as in Megatron-Core):

- ``tp`` shards the dims a layout maps to it (heads, MLP width, vocab ...).
- ``pp`` holds pipeline stages: a parameter of stage ``s`` lives only on the ranks with ``pp_i == s``.
- ``ep`` shards the ``experts`` dim of expert parameters. Dense (non-expert) parameters do not name
  ``ep`` in their spec, so they are replicated over it: for dense parameters the ``ep`` ranks are
  simply more data-parallel ranks. This is the *folding*: expert parallelism reuses ranks that dense
  parameters use for data parallelism.
- ``dp`` replicates everything that does not name it.
- The batch is split over ``("dp", "ep")``: a rank's data-parallel index is ``dp_i * ep + ep_i`` of
  ``dp * ep``. Dense gradients are all-reduced over ``("dp", "ep")``, expert gradients over ``dp``.

A mesh is pure data: its process groups are made by their one owner, ``rlflow.sharding.dist``
(``create_groups`` / ``mesh_group``).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

AXES = ("pp", "dp", "ep", "tp")  # slowest to fastest
BATCH_AXES = ("dp", "ep")


def _axes_tuple(axes) -> tuple[str, ...]:
    return _checked((axes,) if isinstance(axes, str) else tuple(axes))


@functools.lru_cache(maxsize=None)
def _checked(axes: tuple) -> tuple[str, ...]:
    """``axes`` validated (the plan executor asks for the same few axis sets thousands of times)."""
    for a in axes:
        if a not in AXES:
            raise ValueError(f"unknown mesh axis {a!r}; axes are {AXES}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"mesh axes {axes} name an axis twice")
    return axes


@dataclass(frozen=True)
class Mesh:
    """A grid of ``pp * dp * ep * tp`` ranks. Sizes are positive ints; the product is the world size."""

    pp: int = 1
    dp: int = 1
    ep: int = 1
    tp: int = 1

    def __post_init__(self):
        for a in AXES:
            v = getattr(self, a)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Mesh axis {a}={v!r} must be a positive int")
            object.__setattr__(self, a, int(v))

    # ---- construction ----
    @classmethod
    def parse(cls, text: str, world: int | None = None) -> "Mesh":
        """``"pp=6,ep=16,tp=4"``; axes not named are 1, except ``dp`` which fills ``world`` if given."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise ValueError(f"mesh spec {text!r}: {part!r} is not axis=size")
            k, v = (s.strip() for s in part.split("=", 1))
            _axes_tuple(k)
            if k in sizes:
                raise ValueError(f"mesh spec {text!r}: axis {k} given twice")
            try:
                sizes[k] = int(v)
            except ValueError:
                raise ValueError(f"mesh spec {text!r}: size {v!r} of axis {k} is not an int") from None
            if sizes[k] < 1:
                raise ValueError(f"mesh spec {text!r}: axis {k}={sizes[k]} must be >= 1")
        if world is not None:
            rest = int(np.prod([sizes.get(a, 1) for a in AXES if a != "dp"]))
            if "dp" not in sizes:
                if world % rest:
                    raise ValueError(f"mesh spec {text!r}: world={world} does not divide by "
                                     f"pp*ep*tp={rest}")
                sizes["dp"] = world // rest
        mesh = cls(**sizes)
        if world is not None and mesh.size != world:
            raise ValueError(f"mesh spec {text!r} has {mesh.size} ranks, not world={world}")
        return mesh

    # ---- sizes and coordinates ----
    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.ep, self.tp)

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.ep * self.tp

    def axis_size(self, axes) -> int:
        n = 1
        for a in _axes_tuple(axes):
            n *= getattr(self, a)
        return n

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside {self} (size {self.size})")
        out = {}
        for a in reversed(AXES):
            n = getattr(self, a)
            out[a] = rank % n
            rank //= n
        return {a: out[a] for a in AXES}

    def rank(self, **coords: int) -> int:
        r = 0
        for a in AXES:
            c, n = coords.pop(a, 0), getattr(self, a)
            if not 0 <= c < n:
                raise ValueError(f"coordinate {a}={c} is outside {self}")
            r = r * n + c
        if coords:
            raise ValueError(f"unknown mesh axes {sorted(coords)}")
        return r

    @functools.cached_property
    def coord_array(self) -> np.ndarray:
        """``[size, 4]`` int64: the (pp, dp, ep, tp) coordinates of every rank, row = rank."""
        grid = np.indices(self.shape).reshape(4, -1).T
        return np.ascontiguousarray(grid.astype(np.int64))

    def index(self, axes, rank: int | None = None):
        """Mixed-radix index of ``rank`` (or of every rank, as an array) along ``axes``, major to minor."""
        axes = _axes_tuple(axes)
        c = self.coord_array if rank is None else self.coord_array[rank:rank + 1]
        idx = np.zeros(len(c), dtype=np.int64)
        for a in axes:
            idx = idx * getattr(self, a) + c[:, AXES.index(a)]
        return idx if rank is None else int(idx[0])

    # ---- groups ----
    def groups(self, axes) -> tuple[tuple[int, ...], ...]:
        """The partition of all ranks into groups that vary only along ``axes`` (each group sorted;
        members ordered by their index along ``axes``, which for Megatron order is rank order)."""
        axes = _axes_tuple(axes)
        rest = [a for a in AXES if a not in axes]
        key = self.index(rest) if rest else np.zeros(self.size, dtype=np.int64)
        order = np.lexsort((np.arange(self.size), key))
        n = self.axis_size(axes) if axes else 1
        return tuple(tuple(int(r) for r in order[i:i + n]) for i in range(0, self.size, n))

    def group_ranks(self, axes, rank: int) -> tuple[int, ...]:
        axes = _axes_tuple(axes)
        c = self.coords(rank)
        ranges = [range(getattr(self, a)) if a in axes else (c[a],) for a in AXES]
        return tuple(sorted(self.rank(**dict(zip(AXES, cc))) for cc in itertools.product(*ranges)))

    def data_parallel_index(self, rank: int) -> int:
        """Which slice of the batch ``rank`` takes: ``dp_i * ep + ep_i`` of ``dp * ep`` (folding)."""
        return self.index(BATCH_AXES, rank)

    @property
    def data_parallel_size(self) -> int:
        return self.dp * self.ep

    def __str__(self) -> str:
        return "mesh(" + ",".join(f"{a}={getattr(self, a)}" for a in AXES) + ")"

    def short(self) -> str:
        """Only the axes larger than 1, e.g. ``pp2.ep4.tp2`` (``1`` for a single rank)."""
        s = ".".join(f"{a}{getattr(self, a)}" for a in AXES if getattr(self, a) > 1)
        return s or "1"
