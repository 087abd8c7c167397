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
