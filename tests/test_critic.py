"""PPO with a critic: GAE against a direct loop, the clipped value loss on hand cases, the critic model (its
values, its gradient, its update), the batch and config checks, and the recipe's flags."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow import optim
from rlflow.algos import critic, estimators, grpo, stages
from rlflow.batch import TrainBatch
from rlflow.models import decoder, logprobs
from rlflow.models.config import get_config
from rlflow.models.shapes import VALUE_HEAD
from rlflow.models.sharding import layout, model_shapes
from rlflow.rollout import SamplingConfig
from rlflow.runtime.config import check_features
from rlflow.runtime import loop
from rlflow.sharding.mesh import Mesh
from tests.helpers import recipe_module

CFG = get_config("qwen3-moe-tiny")


def gae_loop(rewards, values, lengths, gamma, lam):
    """GAE per sample with plain Python floats: the reward on the last token, V after it 0."""
    adv, ret = [], []
    for r, v, n in zip(rewards, values, lengths):
        a, nxt_a, out = 0.0, 0.0, [0.0] * len(v)
        for t in reversed(range(n)):
            nxt_v = v[t + 1] if t + 1 < n else 0.0
            delta = (r if t == n - 1 else 0.0) + gamma * nxt_v - v[t]
            a = delta + gamma * lam * nxt_a
            out[t], nxt_a = a, a
        adv.append(out)
        ret.append([out[t] + v[t] if t < n else 0.0 for t in range(len(v))])
    return adv, ret


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 7), st.floats(0, 1), st.floats(0, 1), st.integers(0, 10_000))
def test_gae_equals_a_direct_loop(B, T, gamma, lam, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, generator=g)
    values = torch.randn(B, T, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    adv, ret = estimators.gae(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    want_a, want_r = gae_loop(rewards.tolist(), values.tolist(), lengths.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want_a), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, torch.tensor(want_r), atol=1e-5, rtol=1e-5)
    assert bool((adv[~mask] == 0).all()) and bool((ret[~mask] == 0).all())


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 70), st.floats(0, 1), st.integers(0, 10_000))
def test_the_doubling_discounted_sum_equals_the_token_loop(B, T, c, seed):
    """GAE's backward recursion A_t = delta_t + c A_{t+1}, run by doubling in log2(T) elementwise steps (a
    Python step per token was T kernel launches per step on a GPU)."""
    x = torch.randn(B, T, generator=torch.Generator().manual_seed(seed))
    want, nxt = torch.zeros(B, T), torch.zeros(B)
    for t in reversed(range(T)):
        nxt = x[:, t] + c * nxt
        want[:, t] = nxt
    torch.testing.assert_close(estimators.discounted_reverse_cumsum(x, c), want, atol=1e-5, rtol=1e-5)


def test_gae_hand_case_and_whitening():
    # gamma = lam = 1: A_t = R - V_t (the Monte-Carlo return minus the value), R_t = R
    mask = torch.tensor([[True, True, True], [True, False, False]])
    v = torch.tensor([[0.5, 0.25, -1.0], [2.0, 9.0, 9.0]])
    adv, ret = estimators.gae(torch.tensor([1.0, 0.0]), v, mask, whiten=False)
    assert adv.tolist() == [[0.5, 0.75, 2.0], [-2.0, 0.0, 0.0]]
    assert ret.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    # gamma = 0.5, lam = 0: A_t = r_t + 0.5 V_{t+1} - V_t
    adv, _ = estimators.gae(torch.tensor([1.0, 0.0]), v, mask, gamma=0.5, lam=0.0, whiten=False)
    assert adv[0].tolist() == [0.5 * 0.25 - 0.5, 0.5 * -1.0 - 0.25, 1.0 + 1.0]
    white, _ = estimators.gae(torch.tensor([1.0, 0.0]), v, mask)
    real = white[mask].double()
    assert abs(float(real.mean())) < 1e-6 and abs(float(real.std()) - 1) < 1e-5
    assert bool((white[~mask] == 0).all())


def test_value_loss_hand_case():
    v = torch.tensor([[1.0, 0.0, 3.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0]])
    ret = torch.tensor([[2.0, 1.0, 3.0]])
    mask = torch.tensor([[True, True, False]])
    loss, met = critic.value_loss(v, old, ret, mask, value_clip=0.5)
    # token 0: unclipped (1 - 2)^2 = 1, clipped (0.5 - 2)^2 = 2.25 -> 2.25 (the clipped term, no gradient);
    # token 1: both (0 - 1)^2 = 1; token 2 is padding
    assert float(loss.detach()) == pytest.approx(0.5 * (2.25 + 1.0) / 2)
    assert float(met["vf_clip_frac"]) == pytest.approx(0.5)
    loss.backward()
    assert v.grad.tolist() == [[0.0, 0.5 * 2 * (0.0 - 1.0) / 2, 0.0]]
    unclipped, _ = critic.value_loss(v, old, ret, mask, value_clip=None)
    assert float(unclipped) == pytest.approx(0.5 * (1.0 + 1.0) / 2)


def batch(params, seed=0, B=6, Tp=3, Tr=4):
    g = torch.Generator().manual_seed(seed)
    resp_len = torch.randint(1, Tr + 1, (B,), generator=g)
    rmask = torch.arange(Tr)[None] < resp_len[:, None]
    pmask = torch.ones(B, Tp, dtype=torch.bool)
    pmask[0, 0] = False  # a left-padded prompt
    ids = lambda *s: torch.randint(0, CFG.vocab_size, s, generator=g)  # noqa: E731
    rewards = torch.rand(B, generator=g)
    return TrainBatch(prompt_ids_BTp=ids(B, Tp), prompt_mask_BTp=pmask, index_B=torch.arange(B),
                      group_B=torch.arange(B) // 2, response_ids_BTr=ids(B, Tr) * rmask, response_mask_BTr=rmask,
                      sample_logprobs_BTr=torch.zeros(B, Tr), old_logprobs_BTr=torch.zeros(B, Tr), rewards_B=rewards,
                      advantages_B=torch.zeros(B))


def test_the_critic_is_the_policy_with_a_value_head():
    params = decoder.init_params(CFG, seed=1)
    c = critic.Critic.from_policy(params, CFG, seed=2)
    assert set(c.params) == set(model_shapes(CFG, head="value"))
    assert "lm_head.weight" not in c.params and c.params[VALUE_HEAD].shape == (1, CFG.hidden_size)
    assert all(torch.equal(c.params[k], params[k]) for k in c.params if k != VALUE_HEAD)
    assert c.params["model.norm.weight"].data_ptr() != params["model.norm.weight"].data_ptr()  # a copy
    b = batch(params)
    v = critic.values(c.params, CFG, b)
    assert v.shape == b.response_mask_BTr.shape and bool((v[~b.response_mask_BTr] == 0).all())
    # the value of response token t reads the state before it: the same as the policy's hidden state there
    h, _ = logprobs.sequence_hidden(params, CFG, b)
    want = (h[:, b.prompt_ids_BTp.shape[1] - 1:] @ c.params[VALUE_HEAD][0]) * b.response_mask_BTr
    torch.testing.assert_close(v, want)
    torch.testing.assert_close(critic.batched_values(c.params, CFG, b, micro_batch_size=4), v)
    # the value loss reaches the head and the backbone
    leaves = {k: t.detach().requires_grad_(True) for k, t in c.params.items()}
    critic.values(leaves, CFG, b).sum().backward()
    assert float(leaves[VALUE_HEAD].grad.abs().sum()) > 0
    assert float(leaves["model.layers.0.self_attn.q_proj.weight"].grad.abs().sum()) > 0


def test_critic_update_fits_the_returns():
    params = decoder.init_params(CFG, seed=1)
    c = critic.Critic.from_policy(params, CFG, seed=2)
    b = batch(params)
    old = critic.batched_values(c.params, CFG, b, micro_batch_size=6)
    adv, ret = estimators.gae(b.rewards_B, old, b.response_mask_BTr)
    b = b.replace(values_BTr=old, returns_BTr=ret, token_advantages_BTr=adv, advantages_B=None)
    ucfg = stages.UpdateConfig(mini_batch_size=6, micro_batch_size=3)
    ccfg = critic.CriticConfig(optim=optim.AdamWConfig(lr=1e-2), value_clip=None)

    def err():
        return float(((critic.values(c.params, CFG, b) - ret) ** 2)[b.response_mask_BTr].mean())

    before = err()
    c, first = critic.update(c, b, CFG, ccfg, ucfg)
    for _ in range(20):
        c, m = critic.update(c, b, CFG, ccfg, ucfg)
    assert first["critic_loss"] == pytest.approx(0.5 * before, rel=1e-4)  # the loss of the values before the step
    assert err() < 0.1 * before, (before, err())
    assert m["critic_grad_norm"] > 0 and c.opt_state.step == 21
    assert "lm_head.weight" not in c.params


def test_the_policy_loss_takes_per_token_advantages():
    lp = torch.randn(3, 4, requires_grad=True)
    mask = torch.ones(3, 4, dtype=torch.bool)
    adv_B = torch.tensor([1.0, -2.0, 0.5])
    cfg = grpo.GRPOConfig(group_size=2)
    a, _ = grpo.policy_loss(lp, lp.detach(), adv_B, mask, cfg)
    b, _ = grpo.policy_loss(lp, lp.detach(), adv_B[:, None].expand(3, 4), mask, cfg)
    assert float(a) == float(b)
    per_token = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 3)
    grad, = torch.autograd.grad(grpo.policy_loss(lp, lp.detach(), per_token, mask, cfg)[0], lp)
    assert bool((grad[:, 1:] == 0).all()) and bool((grad[:, 0] != 0).all())


def test_batches_and_configs_refuse_a_missing_or_doubled_advantage():
    params = decoder.init_params(CFG, seed=1)
    b = batch(params)
    with pytest.raises(ValueError, match="exactly one of advantages_B"):
        b.replace(token_advantages_BTr=torch.zeros(b.response_mask_BTr.shape))
    with pytest.raises(ValueError, match="exactly one of advantages_B"):
        b.replace(advantages_B=None)
    with pytest.raises(ValueError, match="come together"):
        b.replace(values_BTr=torch.zeros(b.response_mask_BTr.shape))
    kw = dict(steps=1, prompts_per_step=2, mini_batch_size=4, micro_batch_size=4, optim=optim.AdamWConfig(),
              sampling=SamplingConfig(max_new_tokens=2, eos_id=0, pad_id=0))
    with pytest.raises(ValueError, match="needs a CriticConfig"):
        loop.LoopConfig(grpo=grpo.GRPOConfig(group_size=2, adv_estimator="gae"), **kw)
    with pytest.raises(ValueError, match="has no critic"):
        loop.LoopConfig(grpo=grpo.GRPOConfig(group_size=2), critic=critic.CriticConfig(optim=optim.AdamWConfig()), **kw)
    with pytest.raises(ValueError, match="use 'gspo-token'"):
        grpo.GRPOConfig(group_size=2, adv_estimator="gae", policy_loss="gspo")
    with pytest.raises(ValueError, match="gae_lambda"):
        grpo.GRPOConfig(group_size=2, gae_lambda=1.5)
    with pytest.raises(ValueError, match="pp layout"):
        check_features(CFG, 2, routing_replay="off", check_logprobs=None, adv_estimator="gae")
    with pytest.raises(ValueError, match="needs a critic's values"):
        estimators.advantages("gae", torch.zeros(4), torch.zeros(4, dtype=torch.long))


def test_the_critic_layout_replicates_the_value_head():
    lay = layout(CFG, Mesh(tp=2), dtype=torch.float32, head="value")
    assert lay[VALUE_HEAD].spec.axes == () and "lm_head.weight" not in lay.names
    assert lay["model.embed_tokens.weight"].spec == layout(CFG, Mesh(tp=2), dtype=torch.float32)[
        "model.embed_tokens.weight"].spec


@pytest.mark.parametrize("argv,flag", [
    (["--critic-lr", "1e-3"], "--critic-lr"),
    (["--gae-lambda", "0.9"], "--gae-lambda"),
    (["--adv-estimator", "gae", "--gae-gamma", "1.5"], "--gae-gamma"),
    (["--adv-estimator", "gae", "--value-clip", "0"], "--value-clip"),
    (["--adv-estimator", "gae", "--policy-loss", "gspo"], "--policy-loss"),
])
def test_recipe_refuses_critic_flags_by_name(argv, flag, capsys):
    with pytest.raises(SystemExit):
        recipe_module().parse_args(argv)
    assert flag in capsys.readouterr().err


def test_recipe_refuses_gae_with_a_pp_train_layout(capsys):
    with pytest.raises(SystemExit, match="pp layout"):
        recipe_module().main(["--adv-estimator", "gae", "--world", "2", "--train-layout", "pp=2", "--steps", "1"])


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_resumed_ppo_run_continues_its_critic(tmp_path, world):
    """A PPO run continued from its step-2 checkpoint ends with the uninterrupted run's policy and critic (the
    critic's weights and AdamW state are in the checkpoint: whole in one process, each rank's shards with 2
    ranks); with 2 ranks also when resumed in another train layout (dp=2: the critic resharded with the policy);
    a checkpoint without a critic is refused."""
    import shutil

    from rlflow.runtime import checkpoint

    main = recipe_module().main
    flags = ["--world", str(world), "--adv-estimator", "gae", "--steps", "4", "--prompts-per-step", "4", "--group-size", "4",
             "--critic-lr", "1e-2"]
    whole = main(flags + ["--out", str(tmp_path / "a")])
    main(flags + ["--out", str(tmp_path / "b"), "--save-every", "2", "--keep-last", "5"])
    shutil.rmtree(tmp_path / "b" / "checkpoint-final")  # as if the run had stopped after step 2
    resumed = main(flags + ["--out", str(tmp_path / "b"), "--resume", "auto"])
    assert [m["step"] for m in resumed] == [2, 3]
    assert [m["reward_mean"] for m in resumed] == [m["reward_mean"] for m in whole[2:]]
    if world > 1:  # b resumed in train dp=2 from the tp=2 checkpoint
        main(flags + ["--train-layout", "dp=2", "--out", str(tmp_path / "c"),
                      "--resume", str(tmp_path / "b" / "checkpoint-000002")])
    # whole tensors (a sharded checkpoint's put together): the states of every run compare, whatever their layouts
    a, *others = (checkpoint.load(str(tmp_path / d / "checkpoint-final")) for d in ("a", "b", "c")[:2 + (world > 1)])
    assert a.critic is not None and a.critic.opt_state.step == 4
    # the same layout resumed: the same arithmetic; another layout: its reductions in another order (measured
    # 1.2e-6 on the critic after 4 steps of lr 1e-2)
    for b, tol in zip(others, (1e-6, 5e-6)):
        assert b.critic.opt_state.step == 4
        for want, got in ((a.params, b.params), (a.critic.params, b.critic.params),
                          (a.critic.opt_state.v, b.critic.opt_state.v)):
            diff = max(float((want[k] - got[k]).abs().max()) for k in want)
            assert diff <= tol, (diff, tol)
    start = checkpoint.load(str(tmp_path / "b" / "checkpoint-000002")).critic.params
    assert max(float((a.critic.params[k] - start[k]).abs().max()) for k in start) > 1e-4  # the critic trained on
    if world > 1:
        return
    main(["--world", "1", "--steps", "1", "--prompts-per-step", "4", "--group-size", "4", "--out", str(tmp_path / "g")])
    with pytest.raises(SystemExit, match="has no critic"):
        main(flags + ["--out", str(tmp_path / "c"), "--resume", str(tmp_path / "g" / "checkpoint-final")])


def test_unscored_rows_take_no_part_in_gae_or_the_critic():
    """A row the reward left unscored (None) gets zero advantages and returns, is left out of the whitening,
    and moves neither the policy nor the critic: the same as training on the scored rows alone."""
    g = torch.Generator().manual_seed(4)
    rewards, values = torch.rand(6, generator=g), torch.randn(6, 5, generator=g)
    mask = torch.arange(5)[None] < torch.tensor([5, 3, 4, 1, 5, 2])[:, None]
    scored = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.uint8)
    adv, ret = estimators.gae(rewards, values, mask, scored_B=scored)
    keep = scored.bool()
    sub_a, sub_r = estimators.gae(rewards[keep], values[keep], mask[keep])
    torch.testing.assert_close(adv[keep], sub_a)
    torch.testing.assert_close(ret[keep], sub_r)
    assert bool((adv[~keep] == 0).all()) and bool((ret[~keep] == 0).all())

    params = decoder.init_params(CFG, seed=1)
    b = batch(params)
    c = critic.Critic.from_policy(params, CFG, seed=2)
    old = critic.batched_values(c.params, CFG, b, micro_batch_size=6)
    s = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.uint8)
    adv, ret = estimators.gae(b.rewards_B, old, b.response_mask_BTr, scored_B=s)
    full = b.replace(values_BTr=old, returns_BTr=ret + 100.0 * (1 - s.float())[:, None] * b.response_mask_BTr,
                     token_advantages_BTr=adv, advantages_B=None, scored_B=s)  # junk returns on the unscored rows
    ucfg = stages.UpdateConfig(mini_batch_size=6, micro_batch_size=6)
    ccfg = critic.CriticConfig(optim=optim.AdamWConfig(lr=1e-2), value_clip=None)
    a, z = critic.Critic.from_policy(params, CFG, seed=2), critic.Critic.from_policy(params, CFG, seed=2)
    a, _ = critic.update(a, full, CFG, ccfg, ucfg)
    z, _ = critic.update(z, full.replace(returns_BTr=ret), CFG, ccfg, ucfg)  # the same without the junk
    assert all(torch.equal(a.params[k], z.params[k]) for k in a.params)


def test_the_loop_hands_gae_its_configured_gamma_and_lambda(monkeypatch):
    """PPO's step calls GAE with the run's --gae-gamma and --gae-lambda (a step passing lam=1.0 passed
    every other test)."""
    import dataclasses

    from rlflow.data import PromptSource
    from rlflow.rewards import per_sample
    from rlflow.runtime.state import init
    from rlflow.runtime.step import context
    from tests.test_runtime import CFG, TOK, full_critic, full_params, lcfg, reward

    seen = []
    real = estimators.gae

    def gae(*a, **k):
        seen.append((k["gamma"], k["lam"]))
        return real(*a, **k)
    monkeypatch.setattr(estimators, "gae", gae)
    conf = lcfg(gae=True)
    conf = dataclasses.replace(conf, steps=1, grpo=dataclasses.replace(conf.grpo, gae_gamma=0.9, gae_lambda=0.7))
    loop.train(init(full_params(), PromptSource(task="max_digit", seed=1), critic=full_critic(True)),
               context(CFG, TOK, per_sample(reward), conf))
    assert seen == [(0.9, 0.7)]
