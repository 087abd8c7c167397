"""Multi-turn rollouts (``rlflow/multiturn.py``): token in / token out across turns, the loss over the model's own
tokens only, the trainer's log-probs of a multi-turn row against the engine's, the stated handling of every way an
environment can fail or an episode can hit a limit, and the overlap of a slow environment with the others'
generation."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from rlflow import optim
from rlflow.algos import grpo, stages
from rlflow.batch import PromptBatch, RolloutBatch, TrainBatch, extend, pad, unpad
from rlflow.data import Example, prompt_batch
from rlflow.engines import BuiltinEngine
from rlflow.models import qwen3_moe as model
from rlflow.models.config import get_config
from rlflow.models.logprobs import response_logprobs
from rlflow.multiturn import MultiTurn, MultiTurnConfig
from rlflow.rewards import per_sample
from rlflow.rollout import SamplingConfig
from rlflow.tokenizer import CharTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
TOK = CharTokenizer()
CFG = get_config("qwen3-moe-tiny").replace(eos_token_id=TOK.eos_id)


def env(name: str) -> str:
    return f"{HERE}/multiturn_envs.py:{name}"


def spread(text: str, answer: str) -> float:
    return len(set(text)) / 4.0


def driver(name: str, *, tok=TOK, new_tokens: int = 3, reward=spread, **kw) -> MultiTurn:
    return MultiTurn(MultiTurnConfig(env=env(name), **kw), render=tok.encode, decode=tok.decode,
                     reward_fn=per_sample(reward), max_new_tokens=new_tokens,
                     max_positions=CFG.max_position_embeddings, vocab_size=CFG.vocab_size)


def prompts(answers: list[str]) -> PromptBatch:
    return prompt_batch([Example(f"first:{a}12=", a) for a in answers], TOK)


def engine(new_tokens: int = 3, seed: int = 0) -> BuiltinEngine:
    e = BuiltinEngine(CFG, SamplingConfig(max_new_tokens=new_tokens, eos_id=TOK.eos_id, pad_id=TOK.pad_id))
    e.load(model.init_params(CFG, seed=seed, std=0.3))
    return e


class Scripted:
    """An engine that records the contexts it is given and samples ``script(context) -> ids`` for each."""

    def __init__(self, script):
        self.script, self.seen = script, []

    def generate(self, prompts: PromptBatch, *, group_size: int, seed: int) -> RolloutBatch:
        ctxs = [c.tolist() for c in unpad(prompts.prompt_ids_BTp, prompts.prompt_mask_BTp)]
        self.seen.append((prompts.index_B.tolist(), ctxs))
        ids, mask = pad([torch.tensor(self.script(c)) for c in ctxs], 0)
        return extend(prompts, RolloutBatch, response_ids_BTr=ids, response_mask_BTr=mask,
                      sample_logprobs_BTr=torch.full(ids.shape, -0.5) * mask)


def test_token_in_token_out_where_decoding_and_encoding_again_gives_other_tokens():
    """The model samples "1" and "2" as two tokens, which decode to "12" and encode again as one: the context of
    the next turn and the row trained on hold the two sampled ids, followed by the observation's ids."""
    from tokenizers import Tokenizer, models
    vocab = {"<eos>": 0, "1": 1, "2": 2, "12": 3, "f": 4, "=": 5, "+": 6}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("1", "2")]))

    class Tok:
        encode = staticmethod(lambda text: bpe.encode(text).ids)
        decode = staticmethod(lambda ids: bpe.decode(ids).replace(" ", ""))

    assert Tok.encode(Tok.decode([1, 2])) == [3], "the case: decoding and encoding again merges the two tokens"
    prompt = PromptBatch(prompt_ids_BTp=torch.tensor([[4, 5]]), prompt_mask_BTp=torch.ones(1, 2, dtype=torch.bool),
                         index_B=torch.tensor([0]), group_B=torch.tensor([0]), answers=("x",))
    eng = Scripted(lambda ctx: [1, 2])
    rows = driver("Echo", tok=Tok, max_turns=3).rollout(eng, prompt, group_size=1, seed=0)
    # turn, observation (the turn's text "12" rendered: one token), turn, observation, turn
    want = [1, 2, 3, 1, 2, 3, 1, 2]
    assert rows.response_ids_BTr[0].tolist() == want
    assert rows.loss_mask_BTr[0].tolist() == [True, True, False, True, True, False, True, True]
    assert [ctxs[0] for _, ctxs in eng.seen] == [[4, 5], [4, 5, 1, 2, 3], [4, 5, 1, 2, 3, 1, 2, 3]]
    assert Tok.encode(Tok.decode(want)) != want  # what re-tokenizing the text would have trained on instead
    assert rows.sample_logprobs_BTr[0].tolist() == [-0.5, -0.5, 0.0, -0.5, -0.5, 0.0, -0.5, -0.5]


def test_trainer_logprobs_of_a_multi_turn_row_equal_the_engines():
    """The trainer's forward over the whole episode (prompt, turns, observations) gives each sampled token the
    log-prob the engine sampled it with, in the context the engine had: within the single-turn path's tolerance."""
    mt = driver("Hint", max_turns=3, new_tokens=4)
    rows = mt.rollout(engine(4), prompts(list("0123")), group_size=3, seed=7)
    assert rows.loss_mask_BTr is not None and bool((rows.response_mask_BTr & ~rows.loss_mask_BTr).any())
    assert mt.figures()[0]["env/turns"] == 3 * 12
    lp, _, _ = response_logprobs(model.init_params(CFG, seed=0, std=0.3), CFG, rows, with_aux=False)
    m = rows.loss_mask_BTr
    torch.testing.assert_close(lp[m], rows.sample_logprobs_BTr[m], atol=1e-4, rtol=1e-4)
    assert bool((lp[rows.response_mask_BTr & ~m] == 0).all()), "the observations' log-probs are not computed"


def test_one_turn_samples_the_single_turn_rollouts_tokens():
    """Turn t of sample i draws the noise of sample i * max_turns + t: with one turn, the single-turn rollout's."""
    p, e = prompts(list("3141")), engine()
    rows = driver("Hint", max_turns=1).rollout(e, p, group_size=4, seed=11)
    single = e.generate(p, group_size=4, seed=11)
    assert torch.equal(rows.response_ids_BTr, single.response_ids_BTr[:, :rows.response_ids_BTr.shape[1]])
    assert torch.equal(rows.index_B, single.index_B)


def _update(batch: TrainBatch, params, **gkw):
    gcfg = grpo.GRPOConfig(group_size=2, **gkw)
    ucfg = stages.UpdateConfig(mini_batch_size=batch.size, micro_batch_size=batch.size)
    p = {k: v.clone() for k, v in params.items()}
    new, _, met = stages.update(p, optim.init(p), batch, CFG, gcfg, ucfg, optim.AdamWConfig(lr=1e-2), seed=0)
    return new, met


def test_observation_tokens_carry_no_gradient():
    """The update over a multi-turn row sees only the sampled tokens: planting other log-probs (the rollout's and
    the old policy's) at the observations changes nothing, while counting them as sampled does."""
    params = model.init_params(CFG, seed=0, std=0.3)
    rows = driver("Hint", max_turns=2).rollout(engine(), prompts(list("12")), group_size=2, seed=3)
    obs = rows.response_mask_BTr & ~rows.loss_mask_BTr
    assert bool(obs.any())
    lp, _, _ = response_logprobs(params, CFG, rows, with_aux=False)
    base = extend(rows, TrainBatch, rewards_B=torch.tensor([1.0, 0.0, 0.0, 1.0]), advantages_B=torch.tensor([1.0, -1.0, -1.0, 1.0]),
                  old_logprobs_BTr=lp.detach() - 0.05 * rows.loss_mask_BTr)
    planted = base.replace(old_logprobs_BTr=torch.where(obs, -7.0, base.old_logprobs_BTr),
                           sample_logprobs_BTr=torch.where(obs, -9.0, base.sample_logprobs_BTr))
    kw = dict(rollout_is="token", kl_coef=0.0, entropy_coef=0.01)
    want, met_a = _update(base, params, **kw)
    got, met_b = _update(planted, params, **kw)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert met_a["loss"] == met_b["loss"]
    counted, _ = _update(planted.replace(loss_mask_BTr=None), params, **kw)
    assert max(float((counted[k] - want[k]).abs().max()) for k in want) > 1e-4, "the test would see a leak"


def test_every_failure_and_limit_is_handled_as_stated_and_counted():
    mt = driver("Faulty", max_turns=2, timeout_s=0.3)
    answers = list("0123456789")
    rows = mt.rollout(engine(), prompts(answers), group_size=1, seed=0)
    counts = mt.figures()[0]
    assert (counts["env/errors"], counts["env/timeouts"], counts["env/malformed"]) == (2, 1, 5)
    r = rows.env_rewards_B.tolist()
    assert all(math.isnan(v) for v in r[:8]), r  # every failure: unscored
    assert r[8:] == [1.0, 1.0]  # the well-behaved ones: the environment's reward
    assert not bool(rows.response_mask_BTr[0].any()), "the episode whose start raised never generated"
    scored = stages.score_rows(rows, TOK, None)[1]
    assert scored.tolist() == [False] * 8 + [True] * 2


def test_max_turns_and_max_total_tokens_end_episodes_by_the_stated_rules():
    mt = driver("Hint", max_turns=3)
    rows = mt.rollout(engine(), prompts(list("12")), group_size=2, seed=0)
    c = mt.figures()[0]
    assert c["env/max_turns"] == 4 and c["env/turns"] == 12
    # the last turn's text scored by the run's reward: the environment gave none
    last = [TOK.decode(ids) for ids in _last_turns(rows)]
    assert rows.env_rewards_B.tolist() == [spread(t, "") for t in last]
    # each turn takes up to 3 tokens and each observation 2: a budget of 8 holds turn, observation, turn only
    mt = driver("Hint", max_turns=5, max_total_tokens=8)
    rows = mt.rollout(engine(), prompts(list("12")), group_size=2, seed=0)
    c = mt.figures()[0]
    assert c["env/max_tokens"] == 4 and c["env/turns"] <= 8
    assert int(rows.response_mask_BTr.sum(-1).max()) <= 8


def _last_turns(rows):
    out = []
    for ids, m in zip(rows.response_ids_BTr, rows.loss_mask_BTr):
        pos = m.nonzero()[:, 0].tolist()
        run = [pos[-1]]
        while len(run) < len(pos) and pos[-len(run) - 1] == run[0] - 1:
            run.insert(0, pos[-len(run) - 1])
        out.append(ids[run].tolist())
    return out


def test_async_environment_and_its_rewards_add_up():
    mt = driver("AsyncHint", max_turns=2)
    rows = mt.rollout(engine(), prompts(list("12")), group_size=2, seed=0)
    assert rows.env_rewards_B.tolist() == [0.5] * 4  # 0.25 for each of the two steps


def test_a_slow_environment_delays_its_own_episode_not_the_others():
    """Episode 0's environment takes 0.5 s a step, the others none: while it waits, the others' next turns are
    generated without it (the engine does not wait for the batch's slowest environment)."""
    eng = Scripted(lambda ctx: [TOK.encode("5")[0], TOK.eos_id])
    rows = driver("SlowFirst", max_turns=3).rollout(eng, prompts(list("0123")), group_size=1, seed=0)
    calls = [sorted(i // 3 for i in index) for index, _ in eng.seen]
    assert calls[0] == [0, 1, 2, 3]
    k = next(i for i, c in enumerate(calls[1:]) if 0 in c)
    assert sorted(e for c in calls[1:1 + k] for e in c) == [1, 1, 2, 2, 3, 3], calls  # the fast ones' turns 2, 3 first
    assert rows.loss_mask_BTr.sum(-1).tolist() == [6, 6, 6, 6]


def test_recipe_refuses_what_multi_turn_does_not_run_with_by_flag():
    from rlflow.recipe.checks import problems
    from rlflow.recipe.flags import Recipe
    base = Recipe()
    cases = {
        "max_turns": dataclasses.replace(base, max_turns=3),
        "env": dataclasses.replace(base, env="no_such_env"),
        "rollout_ranks": dataclasses.replace(base, env="max_digit_feedback", rollout_ranks=1),
        "rollout_layout": dataclasses.replace(base, env="max_digit_feedback", rollout_layout="tp=2"),
        "routing_replay": dataclasses.replace(base, env="max_digit_feedback", routing_replay="on"),
    }
    for field, r in cases.items():
        got = problems(r)
        assert any(name == field for name, _ in got), (field, got)
    bad_turns = problems(dataclasses.replace(base, env="max_digit_feedback", max_turns=0))
    assert any(name == "max_turns" and "max_turns=0" not in why for name, why in bad_turns), bad_turns
    assert problems(dataclasses.replace(base, env="max_digit_feedback")) == []


def test_recipe_runs_a_multi_turn_env_and_logs_its_counts(tmp_path):
    """The default placement (2 processes, the rows and their loss mask through the dock)."""
    import json
    import subprocess
    import sys
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(os.path.dirname(HERE), "recipes", "grpo_qwen3_moe.py"), "--steps", "2",
           "--prompts-per-step", "4", "--group-size", "4", "--env", "max_digit_feedback",
           "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["env/episodes"] == 16 and 16 <= last["env/turns"] <= 32 and "rollout_idle_s" in last
