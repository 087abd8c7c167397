"""Property tests of plans on random layouts: the simulated executor gives every rank exactly
(bitwise) the shard that slicing the full tensor by the destination layout gives; src -> dst -> src
is the identity; allgather-swap and its way back restore the train state; the ledger adds up."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan_cases import cases, meshes, specs

from rlflow.optim import AdamWState
from rlflow.sharding.execute import TrainState, simulate
from rlflow.sharding.reference import shard
from rlflow.sharding.layout import Layout, ParamLayout
from rlflow.sharding.memory import CATEGORIES, StateBytes, ledger
from rlflow.sharding.plan import allgather_swap, plan, swap_back


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for r, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"rank {r}: params {sorted(g.keys() ^ w.keys())}"
        for n in w:
            assert g[n].shape == w[n].shape and g[n].dtype == w[n].dtype, (r, n, g[n].shape, w[n].shape)
            gb, wb = g[n].contiguous().view(torch.uint8), w[n].contiguous().view(torch.uint8)
            assert torch.equal(gb, wb), f"rank {r} param {n}: bytes differ"


@settings(max_examples=150)
@given(cases())
def test_simulated_plan_gives_destination_shards(case):
    full = case.full()
    p = plan(case.src, case.dst, bucket_bytes=case.bucket_bytes)
    assert_same(simulate(p, shard(full, case.src)), shard(full, case.dst))
    # every parameter is in exactly one bucket
    names = [n for b in p.buckets for n in b.params]
    assert sorted(names) == sorted(case.src.names)


@settings(max_examples=60)
@given(cases())
def test_round_trip_is_identity(case):
    full = case.full()
    start = shard(full, case.src)
    there = simulate(plan(case.src, case.dst, bucket_bytes=case.bucket_bytes), start)
    back = simulate(plan(case.dst, case.src, bucket_bytes=case.bucket_bytes), there)
    assert_same(back, start)


@settings(max_examples=60)
@given(cases(dtypes=(torch.float32, torch.bfloat16)))
def test_allgather_swap_and_back(case):
    full = case.full()
    train = shard(full, case.src)
    ids = [{n: id(t) for n, t in d.items()} for d in train]
    states = [TrainState(grads={n: torch.zeros_like(t, dtype=torch.float32) for n, t in d.items()},
                         optim=AdamWState(step=1, m={n: t.float() for n, t in d.items()},
                                          v={n: t.float() * 2 for n, t in d.items()})) for d in train]
    vids = [{n: id(t) for n, t in s.optim.v.items()} for s in states]
    fwd = allgather_swap(case.src, case.dst, bucket_bytes=case.bucket_bytes)
    rollout = simulate(fwd, [dict(d) for d in train], states)
    assert_same(rollout, shard(full, case.dst))
    assert all(not s.grads and s.optim is None for s in states)
    back = simulate(swap_back(fwd), rollout, states)
    assert all(not d for d in rollout), "the way back frees the rollout weights"
    assert_same(back, train)
    assert [{n: id(t) for n, t in d.items()} for d in back] == ids  # CPU: swapped, not copied
    assert all(s.grads.keys() == d.keys() and s.optim.m.keys() == s.optim.v.keys() == d.keys()
               for s, d in zip(states, train))
    # the real AdamW state comes back: its step and its very tensors (CPU: swapped, not copied)
    assert [(s.optim.step, {n: id(t) for n, t in s.optim.v.items()}) for s in states] == [(1, v) for v in vids]


@settings(max_examples=80)
@given(cases(), st.sampled_from([StateBytes(), StateBytes(grad_bytes=2, optim_bytes=8)]))
def test_ledger_accounts(case, state):
    fwd = allgather_swap(case.src, case.dst, bucket_bytes=case.bucket_bytes)
    led, naive = ledger(fwd, state), ledger(fwd, state, naive=True)
    train, roll = case.src.bytes_per_rank(), case.dst.bytes_per_rank()
    assert np.array_equal(led.bytes[0, 0], train)
    end = dict(zip(CATEGORIES, led.bytes[-1]))
    assert np.array_equal(end["rollout_weights"], roll)
    assert not end["train_weights"].any() and not end["grads"].any() and not end["optim"].any()
    assert not end["tmp"].any() and (led.bytes >= 0).all()
    nend = dict(zip(CATEGORIES, naive.bytes[-1]))
    assert np.array_equal(nend["train_weights"], train) and np.array_equal(nend["rollout_weights"], roll)
    assert (led.peak <= naive.peak).all()
    # where a rank holds train weights it holds grads and optimizer state too, which allgather-swap
    # swaps out first: strictly below naive
    assert (led.peak[train > 0] < naive.peak[train > 0]).all()
    assert (naive.peak >= train + roll + led.bytes[0, 1] + led.bytes[0, 2]).all()
    back = ledger(swap_back(fwd), state)
    assert np.array_equal(back.bytes[0].sum(axis=0), roll)
    assert np.array_equal(back.bytes[-1], ledger(fwd, state).bytes[0])
    # point-to-point buckets receive only what the destination shards need; a collective is chosen
    # only where it moves no more than the alternative
    for b in fwd.buckets:
        if b.kind in ("slice", "all_to_all", "send_recv"):
            assert (b.recv <= b.dst_bytes).all()
        if b.alt:
            assert b.recv.max() <= b.alt_recv.max()


@settings(max_examples=150)
@given(st.data())
def test_impossible_layouts_fail_with_the_reason(data):
    """A dim that does not divide by its axes is refused naming the param, the dim, its size and the
    axes; a valid layout plans, and a destination with another shape is refused naming the param."""
    mesh = data.draw(st.integers(1, 8).flatmap(meshes))
    ndim = data.draw(st.integers(1, 3))
    spec = data.draw(specs(mesh, ndim))
    shape = tuple(data.draw(st.integers(1, 24)) for _ in range(ndim))
    p = ParamLayout(name="layers.0.w", shape=shape, dtype=torch.float32, spec=spec)
    bad = [d for d, (n, k) in enumerate(zip(shape, spec.divisors(mesh))) if n % k]
    if bad:
        d = bad[0]
        by = "*".join(f"{a}={getattr(mesh, a)}" for a in spec.dim_axes(spec[d]))
        msg = f"{spec!r} on param layers.0.w: dim {d} of size {shape[d]} does not divide by {by}"
        with pytest.raises(ValueError, match=re.escape(msg) + "$"):
            Layout(mesh, (p,))
        return
    lay = Layout(mesh, (p,))
    assert plan(lay, lay).bytes_received().sum() == 0
    other = dataclasses.replace(p, shape=shape[:-1] + (shape[-1] * 2,), view=None, merge=None,
                                spec=spec)
    if not any(n % k for n, k in zip(other.shape, spec.divisors(mesh))):
        with pytest.raises(ValueError, match=r"param layers.0.w: src is torch.float32 \("):
            plan(lay, Layout(mesh, (other,)))
