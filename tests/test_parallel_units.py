"""rlflow.parallel without processes: pipeline schedules (each action once, in order, bounded memory; their
point-to-point programs are checked in tests/test_gpu_readiness.py), the layouts the executor accepts or
refuses, and the one-rank layout against the plain model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlflow.algos import stages
from rlflow.models import sharding as msh
from rlflow.models.config import get_config
from rlflow.parallel import context, pp, train
from rlflow.sharding.layout import split_layers
from rlflow.sharding.mesh import Mesh

CFG = get_config("qwen3-moe-tiny")


@given(st.sampled_from(pp.SCHEDULES), st.integers(1, 6), st.integers(1, 9))
def test_schedule_runs_each_micro_batch_once_in_order_with_bounded_activations(kind, n_stages, n_micro):
    for s in range(n_stages):
        acts = pp.schedule(kind, n_micro, s, n_stages)
        assert [m for op, m in acts if op == "F"] == list(range(n_micro))
        assert [m for op, m in acts if op == "B"] == list(range(n_micro))
        live, peak = set(), 0
        for op, m in acts:
            if op == "F":
                live.add(m)
            else:
                assert m in live, f"{kind}: stage {s} runs B{m} before F{m}"
                live.remove(m)
            peak = max(peak, len(live))
        assert peak <= (min(n_stages - s, n_micro) if kind == "1f1b" else n_micro)


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_layers_of_stage_follow_the_layout(n_stages):
    layout = msh.layout(CFG, Mesh(pp=n_stages), dtype=torch.float32)
    got = [pp.layers_of_stage(layout, CFG.num_hidden_layers, s) for s in range(n_stages)]
    sizes = split_layers(CFG.num_hidden_layers, n_stages)
    assert [len(g) for g in got] == list(sizes)
    assert [i for g in got for i in g] == list(range(CFG.num_hidden_layers))


@pytest.mark.parametrize("mesh,rules", [
    (Mesh(tp=2), {}), (Mesh(tp=4), {"kv_heads": None}), (Mesh(ep=4), {}), (Mesh(pp=2, dp=2, ep=2, tp=2), {}),
    (Mesh(ep=2), {"experts": None}), (Mesh(tp=2), {"expert_mlp": None, "vocab": None}),
    (Mesh(tp=2), {"heads": None, "kv_heads": None}),
])
def test_layouts_the_executor_accepts(mesh, rules):
    context.check_layout(msh.layout(CFG, mesh, rules, dtype=torch.float32), CFG)


@pytest.mark.parametrize("mesh,rules,cfg,match", [
    (Mesh(ep=2), {"embed": "ep", "experts": None}, CFG, r"model\.embed_tokens\.weight"),
    (Mesh(tp=2), {"router": "tp"}, CFG, r"model\.layers\.0\.mlp\.gate\.weight"),
    (Mesh(dp=2), {"experts": "dp"}, CFG, r"experts\.gate_up_proj"),
    (Mesh(tp=2), {"heads": None}, CFG, r"kv heads split over tp need the query heads"),
])
def test_layouts_the_executor_refuses_name_the_param(mesh, rules, cfg, match):
    layout = msh.layout(cfg, mesh, rules, dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        context.check_layout(layout, cfg)


def test_one_rank_layout_is_the_plain_model():
    g = torch.Generator().manual_seed(0)
    from test_parallel import make_batch, params_full
    batch = make_batch(3)
    layout = msh.layout(CFG, Mesh(), dtype=torch.float32)
    ctx = context.context(layout, CFG, rank=0)
    full = params_full()
    local = {n: t.clone().requires_grad_(True) for n, t in context.shard_params(full, layout, 0).items()}
    w = torch.randn(batch.response_ids_BTr.shape, generator=g)
    loss, grads = train.forward_backward(local, ctx, [batch], lambda lp, ent, mb: (lp * w).sum() + ent.sum(),
                                         aux_weights=[0.1], with_entropy=True)
    ref = {n: t.clone().requires_grad_(True) for n, t in full.items()}
    lp, ent, aux = stages.response_logprobs(ref, CFG, batch, with_entropy=True)
    ref_loss = (lp * w).sum() + ent.sum() + 0.1 * aux
    ref_loss.backward()
    assert abs(float(loss) - float(ref_loss.detach())) < 1e-5
    for n in full:
        torch.testing.assert_close(grads[n], ref[n].grad, atol=1e-6, rtol=1e-5)
    lp1, ent1, aux1 = train.response_logprobs({n: t.detach() for n, t in local.items()}, ctx, batch,
                                              with_entropy=True)
    torch.testing.assert_close(lp1, lp.detach())
