"""Data-parallel GRPO over gloo processes: each rank updates on its share of the batch, gradients are
summed, and the step equals the one-process step on the whole batch."""

import pytest
import torch

from rlflow import optim
from rlflow.algos import stages
from rlflow.algos.grpo import GRPOConfig
from rlflow.models import sharding as model_sharding
from rlflow.sharding import Mesh
from rlflow.runtime.launch import spawn
from rlflow.sharding.dist import create_groups


def _case():
    from test_update import CFG, _batch  # the same small batch as the update tests
    params, tb = _batch(5)
    return CFG, params, tb


def _update(params, cfg, tb, world, layout=None):
    ucfg = stages.UpdateConfig(mini_batch_size=tb.size, micro_batch_size=max(1, tb.size // 2), layout=layout)
    p = {k: v.clone() for k, v in params.items()}
    new, _, met = stages.update(p, optim.init(p), tb, cfg, GRPOConfig(group_size=4, loss_agg="token-mean"), ucfg,
                                optim.AdamWConfig(lr=1e-2, eps=1e-3))
    return new, met


def _rank(rank, world):
    cfg, params, tb = _case()
    layout = model_sharding.layout(cfg, Mesh(dp=world), dtype=torch.float32)
    create_groups([layout.mesh])
    share = torch.arange(tb.size).chunk(world)[rank]  # uneven response lengths: token counts differ per rank
    new, met = _update(params, cfg, tb.select(share), world, layout)
    return {k: v for k, v in new.items()}, met


@pytest.mark.slow
def test_data_parallel_update_equals_one_process():
    cfg, params, tb = _case()
    ref, mref = _update(params, cfg, tb, 1)
    for rank_params, met in spawn(_rank, 2):
        assert met["loss"] == pytest.approx(mref["loss"], rel=1e-5, abs=1e-7)
        assert met["grad_norm"] == pytest.approx(mref["grad_norm"], rel=1e-5)
        for k in ref:
            torch.testing.assert_close(rank_params[k], ref[k], atol=1e-5, rtol=1e-5)


def _overlap_rank(rank, world):
    """``OverlappedGrads`` with small buckets against ``all_reduce_grads`` on the same gradients: leaves made
    ready out of order, one never (no gradient on this rank: zeros), another only on rank 1."""
    from rlflow.parallel import dp
    cfg, params, _ = _case()
    layout = model_sharding.layout(cfg, Mesh(dp=world), dtype=torch.float32)
    create_groups([layout.mesh])
    names = list(params)
    leaves = [params[n] for n in names]
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(t.shape, generator=g) for t in leaves]
    grads[0] = None  # never ready on any rank
    if rank == 0:
        grads[3] = None  # ready on rank 1 only
    want = dp.all_reduce_grads({n: torch.zeros(t.shape) if gr is None else gr.clone()
                                for n, t, gr in zip(names, leaves, grads)}, layout)
    red = dp.OverlappedGrads(names, leaves, layout, first_bucket_bytes=4096, bucket_bytes=4096)  # many buckets
    red.start()
    order = torch.randperm(len(names), generator=torch.Generator().manual_seed(10 + rank)).tolist()
    for j in order:  # each rank's own order
        if grads[j] is not None:
            red.ready(j, grads)
    got = red.finish(list(grads))
    return len(red.buckets), {n: float((got[j] - want[n]).abs().max()) for j, n in enumerate(names)}


@pytest.mark.slow
def test_the_overlapped_gradient_sum_equals_all_reduce_grads():
    for buckets, diff in spawn(_overlap_rank, 2):
        assert buckets > 1
        assert max(diff.values()) == 0.0, diff
