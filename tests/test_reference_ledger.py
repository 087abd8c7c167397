"""The memory ledger (``rlflow.sharding.memory``) against references that share none of its code: a case
worked out by hand, and the bytes the torch.distributed executor really holds on each rank after every
step, for allgather-swap and for the naive transition (the train state kept on the device).

On CPU a swap moves a tensor from the executor's device-side containers (its shard dict, the train
state's ``grads`` and ``optim``) to ``state.host`` without copying it, so "held on the device" is
measured as: the bytes of the tensors still in those containers, plus every storage the executor
allocated that is still alive (rollout weights, collective buffers; recorded by a dispatch mode)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from test_plan_dist import MEM_CFG, _tracker

from rlflow.runtime.launch import spawn
from rlflow.sharding.layout import Layout, ParamLayout
from rlflow.sharding.memory import ledger
from rlflow.sharding.mesh import Mesh
from rlflow.sharding.plan import allgather_swap, plan
from rlflow.sharding.spec import P

WORLD = 2


def hand_case() -> tuple[Layout, Layout, int]:
    """Two float32 params of 8 x 4 (128 B each), train tp=2 (rows split: 64 B per rank) -> rollout dp=2
    (replicated: 128 B per rank); buckets of 128 B, so one param per bucket."""
    def params(spec):
        return tuple(ParamLayout(f"layers.{i}.w", (8, 4), torch.float32, spec) for i in range(2))
    return Layout(Mesh(tp=2), params(P("tp", None))), Layout(Mesh(dp=2), params(P(None, None))), 128


# Per rank, in bytes. Train state at the start: weights 2 x 64 = 128, fp32 grads 4 B x 32 elements = 128,
# Adam (fp32 master + two moments) 12 B x 32 = 384: 640. An all-gather over tp fills a 128 B buffer (the
# whole param), the slice copies the rank's rollout shard (the whole param, 128 B) out of it.
#   allgather-swap: start 640; swap_out grads -128 -> 512; swap_out optim -384 -> 128; then per param:
#   all_gather +128, slice +128, swap_out train (its 64 B shard) -64, free tmp -128:
#   b0: 256, 384, 320, 192; b1: 320, 448, 384, 256 (the rollout weights, 2 x 128)
HAND_SWAP = [640, 512, 128, 256, 384, 320, 192, 320, 448, 384, 256]
#   naive (nothing swapped): start 640; b0: +128 -> 768, +128 -> 896, -128 -> 768; b1: 896, 1024, 896.
#   Its peak, 1024 = 128 + 128 + 384 + 256 + 128: the whole train state, the whole rollout copy, one bucket.
HAND_NAIVE = [640, 768, 896, 768, 896, 1024, 896]


def test_ledger_of_a_hand_worked_case():
    src, dst, bucket = hand_case()
    fwd = allgather_swap(src, dst, bucket_bytes=bucket)
    swap, naive = ledger(fwd), ledger(fwd, naive=True)
    assert swap.total.tolist() == [[b] * WORLD for b in HAND_SWAP]
    assert naive.total.tolist() == [[b] * WORLD for b in HAND_NAIVE]
    assert swap.peak.tolist() == [640] * WORLD and naive.peak.tolist() == [1024] * WORLD
    # once grads and optimizer state are out, the transition itself peaks at 448 = 256 + 64 + 128
    assert swap.total[3:].max() == 448


def _pairs(world: int):
    """(train, rollout, bucket bytes) pairs whose collectives keep their whole buffer until ``free tmp``
    (all-gather, broadcast, local slice), so that at every step boundary the executor holds exactly what the
    ledger counts (a point-to-point send buffer is dropped as soon as the collective returns; test_plan_dist
    checks those)."""
    from rlflow.models.sharding import layout
    out = [hand_case()]
    for s, d in [("tp=2", "dp=2"), ("pp=2", "dp=2"), ("ep=2", "dp=2"), ("dp=2", "tp=2")]:  # all-gather,
        # broadcast along pp, all-gather of the experts, local slices
        out.append((layout(MEM_CFG, Mesh.parse(s, world), dtype=torch.float32),
                    layout(MEM_CFG, Mesh.parse(d, world), dtype=torch.float32), 32 << 10))
    return out


def _device_bytes(shards: dict, state) -> int:
    """Bytes of the distinct storages of the tensors still in the executor's device-side containers."""
    opt = state.optim
    tensors = [*shards.values(), *state.grads.values(),
               *(() if opt is None else (*opt.m.values(), *opt.v.values(), *opt.master.values()))]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def worker(rank: int, world: int) -> dict:
    from rlflow.sharding.dist import execute
    from rlflow.optim import AdamWState
    from rlflow.sharding.execute import TrainState
    from rlflow.sharding.reference import shard

    out, fails = [], []
    for k, (src, dst, bucket) in enumerate(_pairs(world)):
        fwd = allgather_swap(src, dst, bucket_bytes=bucket)
        naive_plan = plan(src, dst, bucket_bytes=bucket)
        # the naive transition is the allgather-swap plan with its swaps left out
        assert list(naive_plan.steps) == [s for s in fwd.steps if s.op not in ("swap_out", "swap_in")]
        assert all((b.tmp == b.keep).all() for b in fwd.buckets), "pair with a p2p bucket"
        g = torch.Generator().manual_seed(k)
        full = {p.name: torch.randn(p.shape, generator=g) for p in src.params}
        res = {}
        for label, p, led in (("swap", fwd, ledger(fwd)), ("naive", naive_plan, ledger(fwd, naive=True))):
            mine = {n: t.clone() for n, t in shard(full, src)[rank].items()}  # own storages, not views of full
            # the train state as StateBytes() counts it: an fp32 gradient, fp32 master + two Adam moments
            zeros = lambda: {n: torch.zeros(t.shape) for n, t in mine.items()}  # noqa: E731
            state = TrainState(grads=zeros(), optim=AdamWState(step=1, m=zeros(), v=zeros(), master=zeros()))
            want = led.total[:, rank].tolist()
            seen = [_device_bytes(mine, state)]

            def on_step(i):
                # gloo's worker thread may drop its reference to a buffer a moment after the collective
                # returns: wait (briefly) for the ledger's figure before reading
                deadline = time.monotonic() + (0.5 if seen == want[:len(seen)] else 0)
                while (v := tr.live() + _device_bytes(mine, state)) != want[i + 1] and time.monotonic() < deadline:
                    time.sleep(0.001)
                seen.append(v)

            with _tracker() as tr:
                rollout = execute(p, mine, state, on_step=on_step)
            if seen != want:
                i = next(i for i, (a, b) in enumerate(zip(seen, want)) if a != b)
                fails.append(f"pair {k} {label}: after {led.labels[i]}: {seen[i]} B held, ledger {want[i]} B")
            res[label] = max(seen)
            del rollout
        out.append(res)
    return {"fails": fails, "peaks": out}


@pytest.mark.slow
def test_ledger_peaks_equal_the_bytes_the_executor_holds_swap_and_naive():
    results = spawn(worker, WORLD)
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["fails"]]
    assert not fails, "\n".join(fails)
    for k, (src, dst, bucket) in enumerate(_pairs(WORLD)):
        fwd = allgather_swap(src, dst, bucket_bytes=bucket)
        swap = [res["peaks"][k]["swap"] for res in results]
        naive = [res["peaks"][k]["naive"] for res in results]
        assert swap == ledger(fwd).peak.tolist() and naive == ledger(fwd, naive=True).peak.tolist(), k
        holds_train = np.asarray(src.bytes_per_rank()) > 0
        assert all(s < n for s, n, h in zip(swap, naive, holds_train) if h), (k, swap, naive)
    assert [results[r]["peaks"][0] for r in range(WORLD)] == [{"swap": 640, "naive": 1024}] * WORLD
