"""The GRPO loop trains identically whether its stages hand batches over in memory or through a
transfer dock (in-process here; the Ray dock has the same client)."""

import dataclasses

import pytest
import torch

from rlflow import optim
from rlflow.algos.grpo import GRPOConfig
from rlflow.data import PromptSource
from rlflow.dock import Dock
from rlflow.rewards import per_sample
from rlflow.runtime.graph import GRPO
from rlflow.models import decoder
from rlflow.models.config import get_config
from rlflow.rollout import SamplingConfig
from rlflow.runtime import loop
from rlflow.runtime.hooks import OnStep
from rlflow.runtime.state import init
from rlflow.runtime.step import context
from rlflow.tokenizer import CharTokenizer


def _run(dock, **gkw):
    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    params = decoder.init_params(cfg, seed=0)
    P, G = 4, 4
    gcfg = GRPOConfig(group_size=G, **gkw)
    mini = P * G if gcfg.epochs == 1 else P * G // 2
    lcfg = loop.LoopConfig(steps=3, prompts_per_step=P, grpo=gcfg, mini_batch_size=mini, micro_batch_size=mini // 2,
                           optim=optim.AdamWConfig(lr=3e-3),
                           sampling=SamplingConfig(max_new_tokens=4, eos_id=tok.eos_id, pad_id=tok.pad_id))
    d = None if dock is None else Dock.local(GRPO.schema, GRPO.consumers, capacity=P * G, warehouses=dock, group_size=G)
    # a dense reward (response length) so that groups differ and every step has a gradient
    state = init(params, PromptSource(task="sum_mod10", seed=1), kl=bool(gcfg.kl_coef))
    state, hist = loop.train(state, context(cfg, tok, per_sample(lambda resp, ans: len(resp) / 4), lcfg, dock=d))
    return state.policy, hist, d


@pytest.mark.parametrize("gkw", [dict(), dict(kl_coef=0.1, epochs=2, loss_agg="seq-mean-token-sum-norm")])
def test_dock_flow_trains_like_memory_flow(gkw):
    p_mem, h_mem, _ = _run(None, **gkw)
    p_dock, h_dock, d = _run(2, **gkw)
    keys = ["reward_mean", "loss", "grad_norm", "prompt_tokens", "response_tokens"] + (["kl"] if gkw else [])
    for a, b in zip(h_mem, h_dock):
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    assert all(m["grad_norm"] > 0 for m in h_mem)
    for k in p_mem:
        torch.testing.assert_close(p_dock[k], p_mem[k], rtol=1e-5, atol=1e-6)
    t = d.traffic()
    assert sum(v["bytes_in"] for k, v in t.items() if k.startswith("warehouse")) > 0  # rows went through it


def test_a_continued_run_keeps_its_optimizer_state_and_lr_warm_up():
    """Two calls of 2 steps, the second given the first's optimizer state: the step count carries over
    and the LR warm-up continues where it was instead of starting again."""
    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    lcfg = loop.LoopConfig(steps=4, prompts_per_step=4, grpo=GRPOConfig(group_size=4), mini_batch_size=16,
                           micro_batch_size=16, optim=optim.AdamWConfig(lr=3e-3), warmup_lr_steps=4,
                           sampling=SamplingConfig(max_new_tokens=4, eos_id=tok.eos_id, pad_id=tok.pad_id))
    reward = per_sample(lambda resp, ans: len(resp) / 4)
    _, h = loop.train(init(decoder.init_params(cfg, seed=0), PromptSource(task="sum_mod10", seed=1)),
                      context(cfg, tok, reward, lcfg))
    two = dataclasses.replace(lcfg, steps=2)
    half, h1 = loop.train(init(decoder.init_params(cfg, seed=0), PromptSource(task="sum_mod10", seed=1)),
                          context(cfg, tok, reward, two))
    half, h2 = loop.train(half, context(cfg, tok, reward, lcfg))
    st = half.opt_state
    assert st.step == 4
    assert [m["lr"] for m in h] == pytest.approx([3e-3 * k / 4 for k in (1, 2, 3, 4)])
    assert [m["lr"] for m in h1 + h2] == pytest.approx([m["lr"] for m in h])


def test_a_nan_reward_skips_the_update_and_repeated_ones_stop_the_run(caplog):
    """One NaN from a custom reward turned every parameter into NaN while training went on."""
    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    params = decoder.init_params(cfg, seed=0)
    P, G = 4, 4
    lcfg = loop.LoopConfig(steps=5, prompts_per_step=P, grpo=GRPOConfig(group_size=G), mini_batch_size=P * G,
                           micro_batch_size=P * G, optim=optim.AdamWConfig(lr=3e-3), max_bad_steps=3,
                           sampling=SamplingConfig(max_new_tokens=4, eos_id=tok.eos_id, pad_id=tok.pad_id))
    calls = {"n": 0}

    def reward(resp, ans):  # step 0: fine; step 1: one NaN; steps 2, 3: NaN everywhere
        calls["n"] += 1
        step, row = divmod(calls["n"] - 1, P * G)
        return float("nan") if (step == 1 and row == 5) or step >= 2 else len(resp) / 4

    seen = []
    with pytest.raises(loop.NonFiniteError, match="steps 1..3"):
        loop.train(init({k: v.clone() for k, v in params.items()}, PromptSource(task="sum_mod10", seed=1)),
                   context(cfg, tok, per_sample(reward), lcfg), hooks=[OnStep(seen.append)])
    assert [m["update_skipped"] for m in seen] == [0.0, 1.0, 1.0, 1.0]
    assert [m["bad_rewards"] for m in seen] == [0, 1, P * G, P * G]
    assert f"step 1: non-finite rewards [nan] at sample indices [{P * G + 5}]" in caplog.text  # global index
    # the parameters after the skipped steps are those of step 0's update, finite
    one = dataclasses.replace(lcfg, steps=1)
    p1 = loop.train(init({k: v.clone() for k, v in params.items()}, PromptSource(task="sum_mod10", seed=1)),
                    context(cfg, tok, per_sample(lambda resp, ans: len(resp) / 4), one))[0].policy
    calls["n"] = 0
    lcfg2 = dataclasses.replace(lcfg, steps=2)
    s2, h2 = loop.train(init({k: v.clone() for k, v in params.items()}, PromptSource(task="sum_mod10", seed=1)),
                        context(cfg, tok, per_sample(reward), lcfg2))
    p2 = s2.policy
    assert h2[1]["update_skipped"] == 1.0
    assert all(torch.equal(p1[k], p2[k]) and torch.isfinite(p2[k]).all() for k in p1)


def test_steps_in_which_no_row_is_scored_stop_the_run():
    """Every row unscored (every episode failed; here a reward that returns None): nothing to learn from, so
    max_bad_steps such steps in a row stop the run (5 of them ran to the end); one scored step resets the count."""
    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    P, G = 2, 4
    lcfg = loop.LoopConfig(steps=6, prompts_per_step=P, grpo=GRPOConfig(group_size=G), mini_batch_size=P * G,
                           micro_batch_size=P * G, optim=optim.AdamWConfig(lr=3e-3), max_bad_steps=2,
                           sampling=SamplingConfig(max_new_tokens=4, eos_id=tok.eos_id, pad_id=tok.pad_id))
    calls = {"n": 0}

    def reward(resps, answers):  # the batched form; step 1 scored, steps 0, 2, 3, ... unscored
        calls["n"] += 1
        return [len(r) / 4 if calls["n"] == 2 else None for r in resps]

    seen = []
    with pytest.raises(loop.NonFiniteError, match="steps 2..3: 2 steps in a row had no row scored"):
        loop.train(init(decoder.init_params(cfg, seed=0), PromptSource(task="sum_mod10", seed=1)),
                   context(cfg, tok, reward, lcfg), hooks=[OnStep(seen.append)])
    assert [m["unscored"] for m in seen] == [P * G, 0, P * G, P * G]


def test_the_reference_policy_stays_frozen_and_the_kl_grows_once_the_policy_moves(monkeypatch):
    """A reference that aliased the live parameters would keep the KL at 0 and pass every other test."""
    from rlflow.algos import stages
    seen = []
    real = stages.batched_logprobs

    def spy(weights, cfg, batch, **kw):
        seen.append({k: v.clone() for k, v in weights.items()})
        return real(weights, cfg, batch, **kw)
    monkeypatch.setattr(stages, "batched_logprobs", spy)
    params, hist, _ = _run(None, kl_coef=0.1)
    assert len(seen) == 3  # ref_logprob once per step (one update per step: old log-probs need no pass)
    assert all(torch.equal(seen[0][k], s[k]) for s in seen for k in s), "the reference moved"
    assert any(not torch.equal(seen[0][k], params[k]) for k in params), "the policy did not move"
    assert hist[0]["kl"] == 0.0 and hist[-1]["kl"] > 0, [m["kl"] for m in hist]


def test_bf16_training_accumulates_gradients_in_float32(monkeypatch):
    from rlflow.algos import stages
    from rlflow.optim import step as real_step
    dtypes = set()

    def spy(params, grads, state, cfg, **kw):
        dtypes.update(g.dtype for g in grads.values())
        return real_step(params, grads, state, cfg, **kw)
    monkeypatch.setattr(stages.optim, "step", spy)
    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    params = decoder.init_params(cfg, seed=0, dtype=torch.bfloat16)
    lcfg = loop.LoopConfig(steps=1, prompts_per_step=4, grpo=GRPOConfig(group_size=4), mini_batch_size=16,
                           micro_batch_size=4, optim=optim.AdamWConfig(lr=3e-3),
                           sampling=SamplingConfig(max_new_tokens=4, eos_id=tok.eos_id, pad_id=tok.pad_id))
    new = loop.train(init(params, PromptSource(task="sum_mod10", seed=1)),
                     context(cfg, tok, per_sample(lambda r, a: len(r) / 4), lcfg))[0].policy
    assert dtypes == {torch.float32}
    assert all(v.dtype == torch.bfloat16 for v in new.values())


@pytest.mark.parametrize("ppo", [False, True])
def test_an_update_that_makes_weights_non_finite_stops_the_run_before_any_checkpoint(ppo, monkeypatch, tmp_path):
    """Finite gradients can still give non-finite weights (an overflow; before the flags were checked,
    --lr inf made every weight NaN with update_skipped 0, and every later checkpoint was all-NaN yet
    verified). The loop stops at that step, before its hooks run: the checkpoint of step 0 is the last one.
    And a checkpoint of non-finite weights is refused by name, nothing written."""
    from rlflow.runtime import checkpoint, hooks

    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    P, G = 2, 2
    from rlflow.algos import critic as critics
    conf = loop.LoopConfig(steps=3, prompts_per_step=P, grpo=GRPOConfig(group_size=G, adv_estimator="gae" if ppo
                                                                        else "grpo"),
                           mini_batch_size=P * G, micro_batch_size=P * G, optim=optim.AdamWConfig(lr=1e-3),
                           sampling=SamplingConfig(max_new_tokens=3, eos_id=tok.eos_id, pad_id=tok.pad_id),
                           critic=critics.CriticConfig(optim=optim.AdamWConfig(lr=1e-3)) if ppo else None)
    real, calls = optim.step, []

    def overflowing(params, *a, **k):  # the second step's policy update overflows one weight (with PPO: one
        out = real(params, *a, **k)  # whose name the critic's weights share)
        if "lm_head.weight" in params:
            calls.append(1)
            if len(calls) == 2:
                params["model.embed_tokens.weight"].view(-1)[0] = float("inf")
        return out
    monkeypatch.setattr(optim, "step", overflowing)
    saved = []
    ck = hooks.Checkpointer(lambda name, s, keep: saved.append(name), every=1, keep_last=5, last=3,
                            say=lambda *a, **k: None)
    params = decoder.init_params(cfg, seed=0)
    state = init(params, PromptSource(task="max_digit", seed=1),
                 critic=critics.Critic.from_policy(params, cfg) if ppo else None)
    with pytest.raises(loop.NonFiniteError, match="step 1: its update made 1 parameter tensors non-finite"):
        loop.train(state, context(cfg, tok, per_sample(lambda r, a: len(r) / 4), conf), hooks=[ck])
    assert saved == ["checkpoint-000001"]  # step 0's only
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint-x: not written: .* not finite"):
        checkpoint.save_state(str(tmp_path), "checkpoint-x", state, cfg=cfg, args={})
    assert not any(tmp_path.iterdir())


def test_one_step_moves_the_policy_up_its_rows_with_positive_advantage():
    """A negated advantage anywhere in the step (estimator, loss, the rows' order) was caught only by the 6-minute
    learning test. To first order an AdamW step from fresh moments moves along the gradient, so the summed
    advantage-weighted change of the rows' log-probs, sum_i A_i (log p_after - log p_before), must be positive."""
    from rlflow.algos import estimators
    from rlflow.models.logprobs import response_logprobs
    from rlflow.runtime.hooks import Hook

    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    params = decoder.init_params(cfg, seed=0)
    P, G = 4, 8
    lcfg = loop.LoopConfig(steps=1, prompts_per_step=P, grpo=GRPOConfig(group_size=G), mini_batch_size=P * G,
                           micro_batch_size=P * G, optim=optim.AdamWConfig(lr=1e-4),
                           sampling=SamplingConfig(max_new_tokens=6, eos_id=tok.eos_id, pad_id=tok.pad_id))

    class Rows(Hook):
        def after_step(self, state, metrics, out):
            self.rows, self.rewards = out.rows, out.rewards

    seen = Rows()
    reward = per_sample(lambda resp, ans: resp.count("1") / 6)  # varies within every group
    state, _ = loop.train(init({k: v.clone() for k, v in params.items()}, PromptSource(task="sum_mod10", seed=1)),
                          context(cfg, tok, reward, lcfg), hooks=[seen])
    rows = seen.rows
    adv = estimators.group_advantages(seen.rewards, rows.group_B)
    assert bool((adv != 0).any())
    with torch.no_grad():
        before, _, _ = response_logprobs(params, cfg, rows, with_aux=False)
        after, _, _ = response_logprobs(state.policy, cfg, rows, with_aux=False)
    moved = (adv[:, None] * (after - before) * rows.response_mask_BTr).sum()
    assert float(moved) > 0, float(moved)
