"""Invariants and hand-computed cases of the GRPO math."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlflow.algos import estimators, grpo
from rlflow.algos.grpo import GRPOConfig

floats = st.floats(-100, 100, allow_nan=False, width=32)


@st.composite
def grouped_rewards(draw):
    n_groups = draw(st.integers(1, 6))
    G = draw(st.integers(2, 8))
    r = draw(st.lists(floats, min_size=n_groups * G, max_size=n_groups * G))
    perm = draw(st.permutations(range(n_groups * G)))  # groups need not be contiguous
    group = torch.arange(n_groups).repeat_interleave(G)[list(perm)]
    return torch.tensor(r, dtype=torch.float32), group


@given(grouped_rewards(), st.booleans())
def test_advantages_zero_mean_per_group(rg, scale):
    r, g = rg
    a = estimators.group_advantages(r, g, scale=scale)
    for k in g.unique():
        assert abs(a[g == k].mean().item()) < 1e-3 * (1 + a[g == k].abs().max().item())


@given(grouped_rewards(), st.floats(-50, 50, allow_nan=False, width=32), st.booleans())
def test_advantages_invariant_to_constant_shift_of_a_group(rg, c, scale):
    r, g = rg
    shifted = r.clone()
    shifted[g == g[0]] += c
    a, b = estimators.group_advantages(r, g, scale=scale), estimators.group_advantages(shifted, g, scale=scale)
    torch.testing.assert_close(a, b, atol=5e-3, rtol=1e-3)


def test_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    a = estimators.group_advantages(r, g)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1,0,0,1]
    expect = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + estimators.ADV_EPS)
    torch.testing.assert_close(a[:4], expect)
    assert torch.equal(a[4:], torch.zeros(2))  # all-equal group: no signal
    torch.testing.assert_close(estimators.group_advantages(r, g, scale=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))


@pytest.mark.parametrize("spread", [1.0, 2e19, 1e30, 3e38])
def test_advantages_of_a_huge_reward_spread_are_those_of_the_same_rewards_scaled_down(spread):
    """In float32 the group's squared deviations overflowed past a spread of ~1.8e19: every advantage came out 0,
    with no bad reward counted. The advantages are scale-invariant: those of [0, 1, 0, 1] at any finite scale."""
    g = torch.tensor([0, 0, 0, 0])
    a = estimators.group_advantages(torch.tensor([0.0, spread, 0.0, spread]), g)
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, estimators.group_advantages(torch.tensor([0.0, 1.0, 0.0, 1.0]), g))


@given(st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=1, max_size=20),
       st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=1, max_size=20))
def test_k3_nonnegative_and_zero_at_equality(a, b):
    n = min(len(a), len(b))
    lp, ref = torch.tensor(a[:n]), torch.tensor(b[:n])
    assert (grpo.kl_penalty(lp, ref, "k3") >= -1e-6).all()
    assert (grpo.kl_penalty(lp, ref, "k2") >= 0).all()
    assert torch.allclose(grpo.kl_penalty(lp, lp, "k3"), torch.zeros(n))
    assert (grpo.kl_penalty(lp, ref, "low_var_kl") <= grpo.KL_CLAMP).all()


def test_kl_hand_computed():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    d = -1.0
    assert grpo.kl_penalty(lp, ref, "k1").item() == pytest.approx(1.0)
    assert grpo.kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5)
    assert grpo.kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(d) - d - 1)


@given(st.floats(-3, 3, allow_nan=False), st.floats(-2, 2, allow_nan=False).filter(lambda x: abs(x) > 1e-3),
       st.sampled_from([(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)]))
def test_clipped_loss_gradient_zero_exactly_where_clipped(log_ratio, adv, clips):
    cl, ch = clips
    cfg = GRPOConfig(clip_low=cl, clip_high=ch)
    logp = torch.tensor([[log_ratio]], requires_grad=True)
    loss, _ = grpo.policy_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1, dtype=torch.bool), cfg)
    loss.backward()
    ratio = math.exp(log_ratio)
    clipped_against_sign = (adv > 0 and ratio > 1 + ch) or (adv < 0 and ratio < 1 - cl)
    if clipped_against_sign:
        assert logp.grad.item() == 0.0
    else:  # unclipped: d/dlogp (-A rho) = -A rho
        assert logp.grad.item() == pytest.approx(-adv * ratio, rel=1e-5)


def test_dual_clip_caps_negative_advantage_loss():
    cfg = GRPOConfig(dual_clip=3.0)
    logp = torch.tensor([[math.log(10.0)]], requires_grad=True)  # ratio 10, A < 0: loss would be 10
    loss, _ = grpo.policy_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool), cfg)
    assert loss.item() == pytest.approx(3.0)
    loss.backward()
    assert logp.grad.item() == 0.0


def test_loss_aggregation_modes_hand_computed():
    l = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[True, True, True], [True, False, False]])
    assert grpo.aggregate(l, m, "token-mean").item() == pytest.approx(10 / 4)
    assert grpo.aggregate(l, m, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert grpo.aggregate(l, m, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3))
    # micro-batch with mini-batch normalizers: the two halves sum to the whole
    halves = [grpo.aggregate(l[i:i + 1], m[i:i + 1], "token-mean", n_tokens=4) for i in range(2)]
    assert sum(h.item() for h in halves) == pytest.approx(10 / 4)


def test_policy_loss_kl_and_entropy_terms():
    cfg = GRPOConfig(kl_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, met = grpo.policy_loss(logp, logp, torch.tensor([0.0]), mask, cfg, ref_logp_BT=logp - 1.0,
                                 entropy_BT=torch.tensor([[2.0, 4.0]]))
    # pg = 0 (A = 0); kl k1 = logp - ref = 1; entropy mean 3
    assert loss.item() == pytest.approx(0.5 * 1.0 - 0.1 * 3.0)
    assert met["kl"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="ref_logp_BT"):
        grpo.policy_loss(logp, logp, torch.tensor([0.0]), mask, cfg)


@pytest.mark.parametrize("kw,field", [(dict(group_size=1), "group_size"), (dict(loss_agg="mean"), "loss_agg"),
                                      (dict(kl_estimator="k4"), "kl_estimator"), (dict(dual_clip=0.5), "dual_clip")])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        GRPOConfig(**kw)


@given(st.integers(1, 5), st.integers(2, 16), st.floats(-1e4, 1e4, allow_nan=False, width=32),
       st.sampled_from([torch.float32, torch.bfloat16]), st.booleans())
def test_a_group_of_equal_rewards_gets_advantages_of_exactly_zero(n_other, G, value, dtype, scale):
    """In float32 the mean of 16 rewards of 123.456 is not 123.456, and (r - mean) / (std + 1e-6) gave up
    to 0.93; next to other groups, in float32 and bfloat16 rewards."""
    g = torch.Generator().manual_seed(G)
    same = torch.full((G,), value, dtype=dtype)
    other = torch.randn(n_other * G, generator=g).to(dtype)
    r = torch.cat([same, other])
    group = torch.cat([torch.zeros(G, dtype=torch.long), 1 + torch.arange(n_other).repeat_interleave(G)])
    a = estimators.group_advantages(r, group, scale=scale)
    assert torch.equal(a[:G], torch.zeros(G)), a[:G]
    assert a[G:].abs().sum() > 0  # the other groups are untouched


def test_the_documented_equal_rewards_case():
    a = estimators.group_advantages(torch.full((16,), 123.456), torch.zeros(16, dtype=torch.long))
    assert torch.equal(a, torch.zeros(16))


@pytest.mark.parametrize("estimator", grpo.KL_ESTIMATORS)
@given(st.floats(-200, 200, allow_nan=False, width=32))
def test_extreme_log_ratios_give_finite_gradients(estimator, gap):
    """exp of a log-ratio beyond float32's range (|gap| > ~88) gave a correct loss but NaN gradients."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = (logp.detach() - gap).clone()
    ref = (logp.detach() + gap).clone()
    cfg = GRPOConfig(group_size=2, kl_coef=0.1, kl_estimator=estimator)
    for adv in (1.0, -1.0):
        loss, _ = grpo.policy_loss(logp, old, torch.tensor([adv]), torch.ones(1, 3, dtype=torch.bool), cfg,
                                   ref_logp_BT=ref)
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (gap, adv, loss, grad)


def test_clip_frac_hand_computed():
    """clip_frac: the share of real tokens whose clipped term is the one taken (it binds)."""
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.0]]))  # ratios (old logp = 0): 1.5, 0.5, 1.1, padding
    mask = torch.tensor([[True, True, True, False]])
    cfg = GRPOConfig(group_size=2, clip_low=0.2, clip_high=0.2)
    _, met = grpo.policy_loss(logp, torch.zeros(1, 4), torch.tensor([1.0]), mask, cfg)
    assert float(met["clip_frac"]) == pytest.approx(1 / 3)  # A > 0: only 1.5 > 1.2 binds (0.5 is not clipped up)
    _, met = grpo.policy_loss(logp, torch.zeros(1, 4), torch.tensor([-1.0]), mask, cfg)
    assert float(met["clip_frac"]) == pytest.approx(1 / 3)  # A < 0: only 0.5 < 0.8 binds


def test_tps_is_eq5_on_known_counts():
    from rlflow.runtime.loop import tps
    assert tps(300, 500, 2, 4.0) == 100.0  # (300 + 500) / (2 devices x 4 s)
    assert tps(0, 10, 1, 0.5) == 20.0
