"""Hypothesis strategies for random layout pairs (used by the other test_plan*/test_sharding* files),
and checks that what they draw is well formed."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.sharding.layout import Layout, ParamLayout
from rlflow.sharding.mesh import AXES, Mesh
from rlflow.sharding.spec import P

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.uint8, torch.bool)


def factorizations(world: int) -> list[tuple[int, int, int, int]]:
    divs = [d for d in range(1, world + 1) if world % d == 0]
    return [f for f in itertools.product(divs, repeat=4) if math.prod(f) == world]


@st.composite
def meshes(draw, world: int, pp: bool = True) -> Mesh:
    fs = [f for f in factorizations(world) if pp or f[0] == 1]
    return Mesh(*draw(st.sampled_from(fs)))


@st.composite
def specs(draw, mesh: Mesh, ndim: int, mesh_order: bool = False) -> P:
    """Each of dp/ep/tp goes to one dim or nowhere; axes of one dim in random order (or mesh order)."""
    entries: list[list[str]] = [[] for _ in range(ndim)]
    axes = ["dp", "ep", "tp"] if mesh_order else draw(st.permutations(["dp", "ep", "tp"]))
    for a in axes:
        where = draw(st.integers(-1, ndim - 1))
        if where >= 0:
            entries[where].append(a)
    return P(*[tuple(e) if e else None for e in entries])


@dataclass(frozen=True)
class Case:
    src: Layout
    dst: Layout
    seed: int
    bucket_bytes: int

    def full(self) -> dict[str, torch.Tensor]:
        """Deterministic random full tensors: random bits, so every bit pattern (NaNs too) appears."""
        g = torch.Generator().manual_seed(self.seed)
        out = {}
        for p in self.src.params:
            nbytes = p.numel * p.itemsize
            raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
            if p.dtype == torch.bool:
                raw = raw % 2
            out[p.name] = raw.view(p.dtype).reshape(p.shape)
        return out


@st.composite
def cases(draw, max_world: int = 8, world: int | None = None, same_mesh: bool = False,
          pp: bool = True, mesh_order: bool = False, dtypes=DTYPES) -> Case:
    world = world or draw(st.integers(1, max_world))
    sm = draw(meshes(world, pp))
    dm = sm if same_mesh else draw(meshes(world, pp))
    src, dst = [], []
    for i in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(1, 3))
        ss, ds = draw(specs(sm, ndim, mesh_order)), draw(specs(dm, ndim, mesh_order))
        view = tuple(math.lcm(a, b) * draw(st.integers(1, 3))
                     for a, b in zip(ss.divisors(sm), ds.divisors(dm)))
        if ndim >= 2 and draw(st.booleans()):  # a stored dim made of two view dims (like heads*head_dim)
            shape, merge = (view[0] * view[1],) + view[2:], (2,) + (1,) * (ndim - 2)
        else:
            shape, merge = view, (1,) * ndim
        dtype = draw(st.sampled_from(dtypes))
        name = f"layers.{i}.w"
        common = dict(name=name, shape=shape, dtype=dtype, view=view, merge=merge)
        src.append(ParamLayout(spec=ss, stage=draw(st.integers(0, sm.pp - 1)), **common))
        dst.append(ParamLayout(spec=ds, stage=draw(st.integers(0, dm.pp - 1)), **common))
    bucket = draw(st.sampled_from([1, 64, 1024, 1 << 20]))
    return Case(Layout(sm, tuple(src)), Layout(dm, tuple(dst)), draw(st.integers(0, 2**31 - 1)), bucket)


def collect(strategy, n: int) -> list:
    """``n`` examples of ``strategy``, drawn by hypothesis under the repo's (deterministic) profile."""
    out = []

    @settings(max_examples=n)
    @given(strategy)
    def draw(x):
        out.append(x)

    draw()
    return out[:n]


@given(cases())
def test_cases_are_valid_layout_pairs(case):
    assert case.src.mesh.size == case.dst.mesh.size
    for p in case.src.params:
        q = case.dst[p.name]
        assert (p.shape, p.view, p.dtype) == (q.shape, q.view, q.dtype)
        assert math.prod(p.shape) == math.prod(p.view)
        assert set(p.spec.axes) <= set(AXES) - {"pp"}
    full = case.full()
    assert all(t.shape == case.src[n].shape for n, t in full.items())
