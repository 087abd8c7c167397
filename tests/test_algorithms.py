"""Advantage estimators, GSPO and the rollout corrections: hand-computed cases, invariants (hypothesis) and
direct loop implementations as references."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlflow.algos import corrections, estimators, grpo
from rlflow.algos.grpo import GRPOConfig


@st.composite
def groups(draw):
    n = draw(st.integers(1, 4))
    G = draw(st.integers(2, 6))
    r = draw(st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=n * G, max_size=n * G))
    return torch.tensor(r), torch.arange(n).repeat_interleave(G)


@given(groups())
def test_rloo_excludes_the_sample_itself_and_sums_to_zero_per_group(rg):
    r, g = rg
    a = estimators.rloo(r, g)
    for i in range(len(r)):
        others = [float(r[j]) for j in range(len(r)) if g[j] == g[i] and j != i]
        assert float(a[i]) == pytest.approx(float(r[i]) - sum(others) / len(others), abs=1e-3)
    for k in g.unique():
        assert abs(float(a[g == k].sum())) < 1e-3 * (1 + float(a[g == k].abs().sum()))


def test_rloo_hand_computed_and_refuses_singleton_groups():
    a = estimators.rloo(torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 0, 1, 1]))
    torch.testing.assert_close(a, torch.tensor([1.0, -0.5, -0.5, 2.0, -2.0]))
    with pytest.raises(ValueError, match="group sizes"):
        estimators.rloo(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]))


def test_reinforce_pp_hand_computed_and_global_over_data_ranks():
    r, g = torch.tensor([1.0, 0.0, 3.0, 2.0]), torch.tensor([0, 0, 1, 1])
    std = torch.tensor([1.0, 0.0, 3.0, 2.0]).std()
    torch.testing.assert_close(estimators.advantages("reinforce++", r, g), (r - 1.5) / (std + estimators.ADV_EPS))
    c = torch.tensor([0.5, -0.5, 0.5, -0.5])  # r - group mean
    torch.testing.assert_close(estimators.advantages("reinforce++-baseline", r, g), c / (c.std() + estimators.ADV_EPS))
    # two data ranks holding halves: with their statistics summed they give the whole batch's advantages
    halves = [slice(0, 2), slice(2, 4)]
    parts = [torch.stack([r[h].double().sum(), r[h].double().square().sum(), torch.tensor(2.0, dtype=torch.float64)])
             for h in halves]
    total = lambda t: parts[0] + parts[1]  # noqa: E731  (what dp's all-reduce gives every rank)
    got = torch.cat([estimators.advantages("reinforce++", r[h], g[h], total=total) for h in halves])
    torch.testing.assert_close(got, estimators.advantages("reinforce++", r, g))


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce++-baseline", "reinforce++"])
def test_equal_rewards_give_exactly_zero(name):
    r = torch.full((8,), 0.1 + 0.2)
    assert torch.equal(estimators.advantages(name, r, torch.arange(2).repeat_interleave(4)), torch.zeros(8))


@given(st.lists(st.floats(-3, 3, allow_nan=False, width=32), min_size=1, max_size=6),
       st.lists(st.floats(-0.25, 0.25, allow_nan=False, width=32), min_size=1, max_size=6),
       st.sampled_from(["gspo", "gspo-token"]))
def test_gspo_equals_ppo_when_every_sequence_has_one_token(adv, gap, kind):
    n = min(len(adv), len(gap))
    A = torch.tensor(adv[:n])
    logp = torch.full((n, 1), -1.0, requires_grad=True)
    old = (logp.detach() - torch.tensor(gap[:n])[:, None])
    mask = torch.ones(n, 1, dtype=torch.bool)
    out = []
    for loss in ("ppo", kind):
        cfg = GRPOConfig(group_size=2, policy_loss=loss, clip_low=0.1, clip_high=0.1)
        val, _ = grpo.policy_loss(logp, old, A, mask, cfg)
        out.append((val.detach(), torch.autograd.grad(val, logp)[0]))
    torch.testing.assert_close(out[0][0], out[1][0])
    torch.testing.assert_close(out[0][1], out[1][1])


def test_gspo_sequence_ratio_against_a_loop():
    """GSPO's loss per sequence from its formula, sequence by sequence; GSPO-token has the same value and,
    with per-sequence advantages, the same gradient (the paper's remark)."""
    g = torch.Generator().manual_seed(0)
    B, T = 3, 5
    logp = (-torch.rand(B, T, generator=g)).requires_grad_(True)
    old = logp.detach() + 0.05 * torch.randn(B, T, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    A = torch.tensor([1.0, -0.5, 2.0])
    cfg = dict(group_size=2, clip_low=0.02, clip_high=0.03, loss_agg="seq-mean-token-mean")
    ref = 0.0
    for i in range(B):
        n = int(mask[i].sum())
        s = math.exp(float((logp.detach()[i, :n] - old[i, :n]).mean()))
        ref += max(-A[i] * s, -A[i] * min(max(s, 1 - 0.02), 1 + 0.03))
    vals = {}
    for kind in ("gspo", "gspo-token"):
        v, _ = grpo.policy_loss(logp, old, A, mask, GRPOConfig(policy_loss=kind, **cfg))
        vals[kind] = (v, torch.autograd.grad(v, logp)[0])
        assert float(v.detach()) == pytest.approx(float(ref) / B, rel=1e-5)
    torch.testing.assert_close(vals["gspo"][1], vals["gspo-token"][1])
    assert (vals["gspo"][1][~mask] == 0).all() and (vals["gspo"][1][mask] != 0).any()


@given(st.sampled_from(["token", "seq"]), st.sampled_from(["truncate", "mask"]), st.floats(1.1, 5.0))
def test_is_weights_are_one_when_the_log_probs_agree(level, mode, cap):
    lp = -torch.rand(3, 4, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    w = corrections.is_weights(lp, lp.clone(), mask, level=level, cap=cap, mode=mode)
    assert torch.equal(w, mask.float())


@given(st.lists(st.floats(-2, 2, allow_nan=False, width=32), min_size=4, max_size=4), st.floats(1.1, 3.0))
def test_truncated_is_is_capped_and_masked_is_drops_exactly_the_out_of_band_tokens(d, cap):
    sample = torch.zeros(1, 4)
    old = torch.tensor([d])
    mask = torch.ones(1, 4, dtype=torch.bool)
    w = corrections.is_weights(sample, old, mask, level="token", cap=cap, mode="truncate")
    torch.testing.assert_close(w, old.exp().clamp_max(cap))
    w = corrections.is_weights(sample, old, mask, level="token", cap=cap, mode="mask")
    r = old.exp()
    keep = (r >= 1 / cap) & (r <= cap)
    assert torch.equal(w == 0, ~keep) and torch.allclose(w[keep], r[keep])
    ws = corrections.is_weights(sample, old, mask, level="seq", cap=cap, mode="truncate")
    assert torch.allclose(ws, torch.full((1, 4), min(math.exp(sum(d)), cap)), rtol=1e-5)


def test_mismatch_is_zero_for_equal_log_probs_and_reports_a_difference():
    lp = -torch.rand(2, 3, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 3, dtype=torch.bool)
    m = corrections.mismatch(lp, lp.clone(), mask)
    assert float(m["logp_diff_mean"]) == 0 and float(m["logp_diff_max"]) == 0 and float(m["ratio_mean"]) == 1
    off = lp.clone()
    off[0, 0] += 1.0  # one token's trainer log-prob 1 nat above the rollout's
    m = corrections.mismatch(lp, off, mask, cap=2.0)
    assert float(m["logp_diff_max"]) == pytest.approx(1.0, abs=1e-6)
    assert float(m["logp_diff_mean"]) == pytest.approx(1 / 6, abs=1e-6)
    assert float(m["out_of_band"]) == pytest.approx(1 / 6)  # e^1 > 2


def test_the_logprob_gate_passes_a_consistent_run_and_fails_naming_the_worst_rows(tmp_path):
    """The rollout (decode with a KV cache) and the trainer (one forward over prompt + response) differ by
    float32 rounding only: a tolerance of 1e-3 passes, one below the rounding (1e-9) stops the run at the first
    step whose rounding is not exactly 0 (a step of few short responses can match to the bit)."""
    from helpers import recipe_module

    flags = ["--world", "1", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2"]
    history = recipe_module().main(flags + ["--check-logprobs", "1e-3", "--out", str(tmp_path / "a")])
    assert len(history) == 2 and 0 < max(h["logp_diff_mean"] for h in history) < 1e-3
    with pytest.raises(SystemExit, match=r"error: step [01]: .* mean \|d\| = .* above --check-logprobs 1e-09 .*worst "
                                                   r"rows:\n  sample \d+: mean \|d\| .* over \d+ tokens, max .* at token"):
        recipe_module().main(flags + ["--check-logprobs", "1e-9", "--out", str(tmp_path / "b")])


@pytest.mark.parametrize("name", estimators.OUTCOME_ESTIMATORS)
def test_unscored_samples_get_zero_and_take_no_part_in_any_baseline(name):
    """A reward's None ("no score"): the estimator on the scored rows alone, 0 for the others."""
    r = torch.tensor([1.0, 0.0, 0.5, 7.0, 0.2, 0.9, 0.4, 3.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    scored = torch.tensor([True, True, True, False, True, True, True, False])
    got = estimators.advantages(name, r, g, scored_B=scored)
    keep = scored.clone()
    if name == "rloo":
        keep[6] = False  # the one scored sample of group 2 has no leave-one-out baseline
    want = torch.zeros(8)
    want[keep] = estimators.advantages(name, r[keep], g[keep])
    assert torch.equal(got, want)
    assert got[3] == 0 and got[7] == 0
    assert torch.equal(estimators.advantages(name, r, g, scored_B=torch.ones(8, dtype=torch.bool)),
                       estimators.advantages(name, r, g))


@pytest.mark.parametrize("adv", ["grpo", "gae"])
def test_a_reward_that_leaves_samples_unscored_trains_on_the_others(adv):
    from rlflow import optim
    from rlflow.algos import critic
    from rlflow.data import PromptSource
    from rlflow.models import decoder
    from rlflow.models.config import get_config
    from rlflow.rollout import SamplingConfig
    from rlflow.runtime import loop
    from rlflow.runtime.state import init
    from rlflow.runtime.step import context
    from rlflow.tokenizer import CharTokenizer

    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    seen = []

    def reward(completions, answers):  # every other sample unscored; the rest by length
        out = [None if i % 2 else len(c) / 4 for i, c in enumerate(completions)]
        seen.append(out)
        return out
    lcfg = loop.LoopConfig(steps=2, prompts_per_step=4, mini_batch_size=16, micro_batch_size=16,
                           grpo=GRPOConfig(group_size=4, adv_estimator=adv), optim=optim.AdamWConfig(lr=1e-2),
                           sampling=SamplingConfig(max_new_tokens=4, eos_id=tok.eos_id, pad_id=tok.pad_id),
                           critic=critic.CriticConfig(optim=optim.AdamWConfig(lr=1e-2)) if adv == "gae" else None)
    params = decoder.init_params(cfg, seed=0)
    c = critic.Critic.from_policy(params, cfg) if adv == "gae" else None
    _, hist = loop.train(init(params, PromptSource(task="max_digit", seed=1), critic=c), context(cfg, tok, reward, lcfg))
    assert [h["unscored"] for h in hist] == [8, 8]
    scored = [v for v in seen[0] if v is not None]
    assert hist[0]["reward_mean"] == pytest.approx(sum(scored) / len(scored))
    assert all(math.isfinite(h["loss"]) for h in hist) and hist[0]["update_skipped"] == 0


def test_mismatch_is_rounding_sized_on_one_float32_path_and_reported_for_a_bfloat16_rollout():
    """The trainer (float32) recomputes the log-probs of tokens sampled by a float32 rollout (the decode path:
    a KV cache, other sums than one forward) within float32 rounding, and of a bfloat16 rollout's tokens
    (the same weights rounded to bfloat16) far outside it: the metric reports the engine mismatch."""
    from rlflow.algos import stages
    from rlflow.data import PromptSource, prompt_batch
    from rlflow.models import decoder
    from rlflow.models.config import get_config
    from rlflow.rollout import SamplingConfig, generate
    from rlflow.tokenizer import CharTokenizer

    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    params = decoder.init_params(cfg, seed=3, std=0.3)
    prompts = prompt_batch(PromptSource(task="max_digit", seed=0).take(4), tok)
    scfg = SamplingConfig(max_new_tokens=6, eos_id=tok.eos_id, pad_id=tok.pad_id)
    diffs = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        ro = generate({k: v.to(dtype) for k, v in params.items()}, cfg, prompts, scfg, group_size=4, seed=1)
        trainer = stages.batched_logprobs(params, cfg, ro, micro_batch_size=16)
        diffs[name] = float(corrections.mismatch(ro.sample_logprobs_BTr, trainer, ro.response_mask_BTr)["logp_diff_mean"])
    assert diffs["float32"] < 1e-5, diffs
    assert diffs["bfloat16"] > 1e-3 and diffs["bfloat16"] > 100 * diffs["float32"], diffs


@pytest.fixture
def registries(monkeypatch):
    """The estimator and policy-loss registries as they are, restored after the test."""
    monkeypatch.setattr(estimators, "_ADV_REGISTRY", dict(estimators._ADV_REGISTRY))
    monkeypatch.setattr(grpo, "_POLICY_LOSS_REGISTRY", dict(grpo._POLICY_LOSS_REGISTRY))
    for mod, name in ((estimators, "ADV_ESTIMATORS"), (estimators, "OUTCOME_ESTIMATORS"), (grpo, "POLICY_LOSSES")):
        monkeypatch.setattr(mod, name, getattr(mod, name))


def test_a_registered_advantage_estimator_is_used(registries):
    """A user's estimator (here the reward minus its group's best) is a name of ``GRPOConfig`` and runs
    through ``advantages``, with the unscored rows and ``min_group`` handled as for the built-in ones."""
    @estimators.register_adv_est("best-baseline", min_group=3)
    def best_baseline(rewards_B, group_B, *, scale, total):
        best = torch.full((int(group_B.max()) + 1,), float("-inf")).scatter_reduce(0, group_B, rewards_B, "amax")
        return rewards_B - best[group_B]

    assert estimators.OUTCOME_ESTIMATORS[-1] == "best-baseline" and estimators.ADV_ESTIMATORS[-2:] == \
        ("best-baseline", "gae")
    assert GRPOConfig(adv_estimator="best-baseline").adv_estimator == "best-baseline"
    r, g = torch.tensor([1.0, 3.0, 2.0, 0.5, 0.0, 4.0]), torch.tensor([0, 0, 0, 1, 1, 1])
    assert torch.equal(estimators.advantages("best-baseline", r, g), torch.tensor([-2.0, 0.0, -1.0, -3.5, -4.0, 0.0]))
    scored = torch.tensor([True, True, True, True, False, True])  # group 1 keeps 2 scored samples, under min_group
    assert torch.equal(estimators.advantages("best-baseline", r, g, scored_B=scored),
                       torch.tensor([-2.0, 0.0, -1.0, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="already registered"):
        estimators.register_adv_est("grpo")(best_baseline)
    with pytest.raises(ValueError, match="advantage estimator 'nope': expected one of"):
        estimators.advantages("nope", r, g)
    with pytest.raises(ValueError, match="adv_estimator"):
        GRPOConfig(adv_estimator="nope")


def test_the_recipe_offers_a_registered_estimator_and_policy_loss(registries):
    """The recipe's --adv-estimator / --policy-loss choices are read when its parser is built, after a recipe
    script registered its own."""
    from rlflow import recipe
    estimators.register_adv_est("mine")(lambda rewards_B, group_B, *, scale, total: rewards_B)
    grpo.register_policy_loss("mine")(lambda logp_BT, old_logp_BT, m_BT: logp_BT - old_logp_BT)
    r = recipe.parse_args(["--adv-estimator", "mine", "--policy-loss", "mine", "--world", "1"])
    assert (r.adv_estimator, r.policy_loss) == ("mine", "mine")


def test_a_registered_policy_loss_is_used(registries):
    """A user's log-ratio form (here half PPO's) is a name of ``GRPOConfig`` and is what ``policy_loss``
    clamps, exponentiates and clips."""
    @grpo.register_policy_loss("half-ppo")
    def half(logp_BT, old_logp_BT, m_BT):
        return 0.5 * (logp_BT - old_logp_BT)

    assert grpo.POLICY_LOSSES == ("ppo", "gspo", "gspo-token", "half-ppo")
    logp, old = torch.tensor([[0.2, -0.4, 1.0]]), torch.zeros(1, 3)
    mask = torch.tensor([[True, True, False]])
    cfg = GRPOConfig(policy_loss="half-ppo", clip_low=0.5, clip_high=0.5)
    loss, met = grpo.policy_loss(logp, old, torch.tensor([1.0]), mask, cfg)
    ratio = torch.exp(0.5 * logp[0, :2])
    torch.testing.assert_close(met["ratio_mean"], ratio.mean())
    torch.testing.assert_close(loss, -ratio.mean())
    with pytest.raises(ValueError, match="already registered"):
        grpo.register_policy_loss("ppo")(half)
    with pytest.raises(ValueError, match="policy_loss"):
        GRPOConfig(policy_loss="nope")


def test_micro_batch_gradients_of_half_precision_leaves_add_up_in_float32():
    """``stages.accumulate`` over three micro-batches: each leaf's float32 sum is the sum of its gradients,
    half-precision leaves (their later gradients cast through one buffer, the caller's from one micro-batch to the
    next: a new one above glibc's mmap threshold is faulted in afresh) and float32 ones alike."""
    from rlflow.algos import stages
    torch.manual_seed(0)
    leaves = [torch.randn(5, 3, dtype=torch.bfloat16, requires_grad=True), torch.randn(7, requires_grad=True),
              torch.randn(2, 2, dtype=torch.bfloat16, requires_grad=True)]
    xs = [torch.randn(3) for _ in range(3)]

    def loss(x):
        return (leaves[0].float() @ x).square().sum() + (leaves[1] * x.sum()).sum() + leaves[2].float().sum() * x[0]

    grads, cast, buffers = [None] * 3, [], []
    want = [torch.zeros(t.shape) for t in leaves]
    for x in xs:
        stages.accumulate(grads, loss(x), leaves, cast=cast)
        buffers += cast
        for w, g in zip(want, torch.autograd.grad(loss(x), leaves)):
            w += g.float()
    for g, w in zip(grads, want):
        assert g.dtype == torch.float32 and torch.equal(g, w), (g, w)
    # the later two micro-batches' one buffer, the largest gradient's size
    assert len(buffers) == 2 and buffers[0] is buffers[1] and buffers[0].numel() == 15, buffers
