"""The update step: gradient accumulation is exact, dynamic batching and remat change nothing numerically."""

import pytest
import torch
from helpers import random_prompts

from rlflow import optim
from rlflow.algos import stages
from rlflow.algos.estimators import group_advantages
from rlflow.algos.grpo import GRPOConfig
from rlflow.batch import TrainBatch, extend
from rlflow.models import decoder as model
from rlflow.models.config import get_config
from rlflow.rollout import SamplingConfig, generate

CFG = get_config("qwen3-moe-tiny")


def _batch(seed=0, P=4, G=4):
    g = torch.Generator().manual_seed(seed)
    prompts = random_prompts(CFG.vocab_size, P, g)
    params = model.init_params(CFG, seed=seed, std=0.2)
    ro = generate(params, CFG, prompts, SamplingConfig(max_new_tokens=10, eos_id=5), group_size=G, seed=seed)
    r = torch.rand(ro.size, generator=g)
    old = stages.batched_logprobs(params, CFG, ro, micro_batch_size=64)
    tb = extend(ro, TrainBatch, rewards_B=r, advantages_B=group_advantages(r, ro.group_B), old_logprobs_BTr=old)
    return params, tb


def _run(params, tb, **ukw):
    params = {k: v.clone() for k, v in params.items()}
    ucfg = stages.UpdateConfig(mini_batch_size=tb.size, **{"micro_batch_size": tb.size, **ukw})
    # eps 1e-3: the first Adam step is lr * g / (|g| + eps), smooth in g; with a tiny eps it is lr * sign(g),
    # which turns float noise in near-zero gradients into whole-step differences
    new, _, met = stages.update(params, optim.init(params), tb, CFG, GRPOConfig(group_size=4), ucfg,
                                optim.AdamWConfig(lr=1e-2, eps=1e-3))
    return new, met


@pytest.mark.parametrize("ukw", [dict(micro_batch_size=3), dict(max_tokens_per_micro_batch=40), dict(remat=True)])
def test_micro_batching_dynamic_batching_and_remat_are_exact(ukw):
    params, tb = _batch()
    ref, mref = _run(params, tb)
    new, met = _run(params, tb, **ukw)
    assert abs(met["grad_norm"] - mref["grad_norm"]) < 1e-5 * max(1.0, mref["grad_norm"])
    # The reported loss too. It is a token mean of -A * ratio whose terms (|A| ~ 0.8, ratio ~ 1) cancel down to
    # ~0.016, so float32 noise in the log-probs of the two paths (~1e-6) shows at ~1e-7 (measured up to
    # 1.2e-7): compare relative to the terms' scale, not to the small result.
    A, m = tb.advantages_B.abs()[:, None], tb.response_mask_BTr.float()
    scale = float((A * m).sum() / m.sum())
    assert abs(met["loss"] - mref["loss"]) <= 1e-5 * scale, (met["loss"], mref["loss"], scale)
    # and the loss itself: old log-probs are the current ones, so ratio = 1 up to that noise (|ratio - 1| <=
    # logp_diff_max ~ 5e-6) and the loss is minus the token mean of the advantages, here in float64 (measured
    # gap 9e-10)
    want = -float((tb.advantages_B.double()[:, None] * m.double()).sum() / m.double().sum())
    assert abs(mref["loss"] - want) <= 1e-5 * scale, (mref["loss"], want, scale)
    assert mref["grad_norm"] > 0
    for k in ref:
        torch.testing.assert_close(new[k], ref[k], atol=1e-5, rtol=1e-5)


def test_token_budget_micro_batches_cover_rows_once():
    _, tb = _batch(1)
    ucfg = stages.UpdateConfig(mini_batch_size=tb.size, micro_batch_size=tb.size, max_tokens_per_micro_batch=50)
    rows = torch.randperm(tb.size)
    mbs = stages.micro_batches(tb, rows, ucfg)
    assert sorted(torch.cat(mbs).tolist()) == sorted(rows.tolist())
    for mb in mbs:  # what _trim pads a micro-batch to: longest prompt + longest response
        padded = int(tb.prompt_mask_BTp[mb].sum(-1).max() + tb.response_mask_BTr[mb].sum(-1).max()) * len(mb)
        assert len(mb) == 1 or padded <= 50
    assert len(mbs) > 1


def test_old_is_current_refuses_several_optimizer_steps():
    params, tb = _batch()
    ucfg = stages.UpdateConfig(mini_batch_size=tb.size // 2, micro_batch_size=tb.size // 2)
    with pytest.raises(ValueError, match="old_is_current"):
        stages.update(params, optim.init(params), tb, CFG, GRPOConfig(group_size=4), ucfg, optim.AdamWConfig(),
                      old_is_current=True)


def test_old_is_current_equals_recomputed_old_logprobs():
    """The single-update fast path (ratio denominator = current log-prob, detached) gives the same step
    as recomputing old log-probs with a forward pass."""
    params, tb = _batch(3)
    old = stages.batched_logprobs(params, CFG, tb, micro_batch_size=64)
    tb = tb.replace(old_logprobs_BTr=old)
    ucfg = stages.UpdateConfig(mini_batch_size=tb.size, micro_batch_size=tb.size)
    outs = []
    for fast in (False, True):
        p = {k: v.clone() for k, v in params.items()}
        new, _, met = stages.update(p, optim.init(p), tb, CFG, GRPOConfig(group_size=4), ucfg,
                                    optim.AdamWConfig(lr=1e-3), old_is_current=fast)
        outs.append((new, met))
    assert outs[0][1]["grad_norm"] == pytest.approx(outs[1][1]["grad_norm"], rel=1e-4)
    for k in params:
        torch.testing.assert_close(outs[0][0][k], outs[1][0][k], atol=1e-5, rtol=1e-5)


def test_the_importance_weights_scale_the_policy_gradient():
    """The rollout's importance weights reach the loss: with the sampler's log-probs 0.5 below the trainer's
    on every real token, token-level weights are e^0.5 (under the cap 2) and, the ratio being 1 (one
    optimizer step on the sampling weights, no KL, no entropy), the gradient is exactly e^0.5 times the
    unweighted one. It would be 1 if the weights were computed and dropped in stages.update or in policy_loss."""
    import math

    params, tb = _batch()
    tb = tb.replace(sample_logprobs_BTr=tb.old_logprobs_BTr - 0.5 * tb.response_mask_BTr.float())
    norms = {}
    for level in ("none", "token"):
        p = {k: v.clone() for k, v in params.items()}
        ucfg = stages.UpdateConfig(mini_batch_size=tb.size, micro_batch_size=tb.size)
        _, _, met = stages.update(p, optim.init(p), tb, CFG, GRPOConfig(group_size=4, rollout_is=level), ucfg,
                                  optim.AdamWConfig(lr=1e-2, eps=1e-3))
        norms[level] = met["grad_norm"]
    assert norms["none"] > 0
    assert norms["token"] / norms["none"] == pytest.approx(math.exp(0.5), rel=1e-4), norms
