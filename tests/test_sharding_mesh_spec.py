"""Mesh (Megatron rank order, coordinates, groups, parsing) and P (validation, printing, errors)."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_plan_cases import factorizations, meshes

from rlflow.sharding.mesh import AXES, Mesh
from rlflow.sharding.spec import P


def test_megatron_rank_order_tp_fastest():
    m = Mesh(pp=2, dp=1, ep=2, tp=2)
    assert m.size == 8 and m.shape == (2, 1, 2, 2)
    assert [m.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert m.coords(5) == {"pp": 1, "dp": 0, "ep": 0, "tp": 1}
    assert m.rank(pp=1, ep=1, tp=0) == 6
    assert m.groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert m.groups("ep") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert m.groups("pp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert m.groups(("ep", "tp")) == ((0, 1, 2, 3), (4, 5, 6, 7))


@given(st.integers(1, 12).flatmap(lambda w: meshes(w)))
def test_rank_coords_round_trip_and_groups_partition(mesh):
    for r in range(mesh.size):
        c = mesh.coords(r)
        assert mesh.rank(**c) == r
        assert tuple(mesh.coord_array[r]) == tuple(c[a] for a in AXES)
    for k in range(len(AXES) + 1):
        for axes in itertools.combinations(AXES, k):
            part = mesh.groups(axes)
            flat = sorted(r for g in part for r in g)
            assert flat == list(range(mesh.size))
            n = math.prod(getattr(mesh, a) for a in axes)
            for g in part:
                assert len(g) == n and g == mesh.group_ranks(axes, g[0])
                fixed = [a for a in AXES if a not in axes]
                assert len({tuple(mesh.coords(r)[a] for a in fixed) for r in g}) == 1


def test_folding_batch_split_over_dp_and_ep():
    m = Mesh(dp=2, ep=2, tp=2)
    assert m.data_parallel_size == 4
    assert [m.data_parallel_index(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_parse_fills_dp_and_names_errors():
    assert Mesh.parse("pp=6,ep=16,tp=4", 384) == Mesh(pp=6, dp=1, ep=16, tp=4)
    assert Mesh.parse("tp=2,ep=64", 384) == Mesh(dp=3, ep=64, tp=2)
    assert Mesh.parse("tp=2") == Mesh(tp=2)
    with pytest.raises(ValueError, match="world=384 does not divide by pp\\*ep\\*tp=5"):
        Mesh.parse("tp=5", 384)
    with pytest.raises(ValueError, match="unknown mesh axis 'zz'"):
        Mesh.parse("zz=2", 4)
    with pytest.raises(ValueError, match="axis tp given twice"):
        Mesh.parse("tp=2,tp=2", 4)
    with pytest.raises(ValueError, match="size 'x' of axis tp is not an int"):
        Mesh.parse("tp=x", 4)
    with pytest.raises(ValueError, match="has 8 ranks, not world=4"):
        Mesh.parse("dp=2,tp=4", 4)
    with pytest.raises(ValueError, match="Mesh axis tp=0"):
        Mesh(tp=0)
    assert len(factorizations(8)) == 20


def test_spec_validation_and_printing():
    assert repr(P("tp", None)) == "P('tp', None)"
    assert P(("tp",)) == P("tp") and P(()) == P(None)
    assert hash(P("dp", ("ep", "tp"))) == hash(P("dp", ("ep", "tp")))
    assert P("dp", "tp").format("TD", torch.float32) == "f32[T@dp, D@tp]"
    assert P(("dp", "ep"), None).format((8, 4), torch.bfloat16) == "bf16[8@(dp,ep), 4]"
    assert P(("dp", "ep"), "tp").axes == ("dp", "ep", "tp")
    assert P(("dp", "ep"), "tp").divisors(Mesh(dp=2, ep=3, tp=4)) == (6, 4)
    with pytest.raises(ValueError, match="unknown mesh axis 'xp'"):
        P("xp")
    with pytest.raises(ValueError, match="names axis 'tp' twice"):
        P("tp", ("dp", "tp"))
    with pytest.raises(TypeError):
        P(3)


def test_spec_check_error_names_param_dim_and_sizes():
    msg = ("P('tp', None) on param model.layers.0.self_attn.q_proj.weight: dim 0 of size 20 does not "
           "divide by tp=3")
    with pytest.raises(ValueError, match=re.escape(msg)):
        P("tp", None).check((20, 8), Mesh(tp=3), what="param model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match=r"dim 1 of size 6 does not divide by dp=2\*tp=2"):
        P(None, ("dp", "tp")).check((4, 6), Mesh(dp=2, tp=2))
    with pytest.raises(ValueError, match="spec has 1 entries but the tensor has 2 dims"):
        P("tp").check((4, 4), Mesh(tp=2))
    P("tp", None).check((21, 8), Mesh(tp=3))
