"""The weight push between separate device pools (``plan.push_plan``): on random train layouts over one rank
set and rollout layouts over another, of any sizes, the simulated push gives every rollout rank bitwise the
shard that slicing the whole tensor by the rollout layout gives, each distinct train block is read once per
receiver, and the bytes are what the plan says."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan_cases import meshes, specs
from test_plan_props import assert_same

from rlflow.sharding import geometry as geo
from rlflow.sharding.reference import shard
from rlflow.sharding.push import push_pieces, simulate_push
from rlflow.sharding.layout import Layout, ParamLayout
from rlflow.sharding.mesh import Mesh
from rlflow.sharding.plan import push_plan
from rlflow.sharding.spec import P


@st.composite
def pool_cases(draw):
    tm = draw(meshes(draw(st.integers(1, 6))))
    rm = draw(meshes(draw(st.integers(1, 4)), pp=False))
    src, dst = [], []
    for i in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(1, 3))
        ss, ds = draw(specs(tm, ndim)), draw(specs(rm, ndim))
        view = tuple(math.lcm(a, b) * draw(st.integers(1, 3)) for a, b in zip(ss.divisors(tm), ds.divisors(rm)))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
        common = dict(name=f"layers.{i}.w", shape=view, view=view, merge=(1,) * ndim)
        src.append(ParamLayout(spec=ss, stage=draw(st.integers(0, tm.pp - 1)), dtype=torch.float32, **common))
        dst.append(ParamLayout(spec=ds, stage=0, dtype=dtype, **common))
    return Layout(tm, tuple(src)), Layout(rm, tuple(dst)), draw(st.integers(0, 2**31 - 1))


def full_of(layout: Layout, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {p.name: torch.randn(p.shape, generator=g) for p in layout.params}


def empty_shards(layout: Layout) -> list[dict]:
    return [{n: torch.full_like(t, float("nan")) for n, t in d.items()}
            for d in shard({p.name: torch.zeros(p.shape, dtype=p.dtype) for p in layout.params}, layout)]


@settings(max_examples=120)
@given(pool_cases())
def test_push_gives_every_rollout_rank_its_shard_in_the_rollout_dtype(case):
    train, rollout, seed = case
    full = full_of(train, seed)
    plan = push_plan(train, rollout)
    got = empty_shards(rollout)
    simulate_push(plan, shard(full, train), got)
    assert_same(got, shard({n: t.to(rollout[n].dtype) for n, t in full.items()}, rollout))
    # the bytes as planned: every rollout rank receives exactly its shards, the train ranks send as much in all
    sent, recv = plan.bytes_sent(), plan.bytes_received()
    want = np.array([sum(t.numel() * t.element_size() for t in d.values()) for d in got])
    assert recv.tolist() == want.tolist()
    assert sent.sum() == recv.sum()
    for r, d in enumerate(shard(full, train)):
        assert sum(x.numel() * x.element_size() for _, x in push_pieces(plan, r, d)) == sent[r]


@settings(max_examples=60)
@given(pool_cases())
def test_replicated_train_blocks_share_the_sending(case):
    """Each piece comes from a holder of its block; a block held by several train ranks is sent by them in
    turns, so no replica sends more than its share plus one piece."""
    train, rollout, _ = case
    plan = push_plan(train, rollout)
    for name, t in plan.pieces:
        bl = geo.blocks(*geo.placement(train, name))
        for k in range(len(t.recv)):
            assert geo.intersect(bl.box_of(int(t.send[k])), t.boxes[k]) == t.boxes[k]
        holders: dict[tuple, list[int]] = {}
        for row, r in enumerate(bl.ranks.tolist()):
            holders.setdefault(bl.box(row), []).append(r)
        for box, ranks in holders.items():
            mine = [k for k in range(len(t.recv)) if geo.intersect(box, t.boxes[k]) == t.boxes[k]
                    and int(t.send[k]) in ranks]
            per = [sum(int(t.numel[k]) for k in mine if int(t.send[k]) == r) for r in ranks]
            biggest = max((int(t.numel[k]) for k in mine), default=0)
            assert max(per) - min(per) <= biggest, (name, box, per)


def test_push_plan_refuses_what_it_cannot_send():
    a = Layout(Mesh(tp=2), (ParamLayout("w", (4, 4), torch.float32, P(None, "tp")),))
    with pytest.raises(ValueError, match="only in train"):
        push_plan(a, Layout(Mesh(), (ParamLayout("v", (4, 4), torch.float32, P(None, None)),)))
    with pytest.raises(ValueError, match=r"param w: train is \(4, 4\)"):
        push_plan(a, Layout(Mesh(), (ParamLayout("w", (2, 8), torch.float32, P(None, None)),)))
    with pytest.raises(ValueError, match="no pp"):
        push_plan(a, Layout(Mesh(pp=2), (ParamLayout("w", (4, 4), torch.float32, P(None, None), stage=1),)))


def test_describe_says_the_pools_and_the_bytes():
    lay = lambda mesh, spec: Layout(mesh, (ParamLayout("w", (8, 8), torch.float32, spec),))  # noqa: E731
    text = push_plan(lay(Mesh(tp=2), P(None, "tp")), lay(Mesh(dp=2), P(None, None))).describe()
    assert "tp=2) (2 ranks) -> rollout" in text and "4 point-to-point pieces" in text
    assert "sent max 256 B/train rank, received 256 B/rollout rank" in text  # 8 x 8 float32, each half twice
