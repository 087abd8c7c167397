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
from rlflow.models import decoder as model
from rlflow.models.config import get_config
from rlflow.models.logprobs import response_logprobs
from rlflow.multiturn import MultiTurn, MultiTurnConfig, plain_render
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
    return MultiTurn(MultiTurnConfig(env=env(name), **kw), render=plain_render(tok.encode), decode=tok.decode,
                     reward_fn=per_sample(reward), max_new_tokens=new_tokens, eos_id=TOK.eos_id,
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


def test_a_micro_batch_of_episodes_that_never_reached_the_model_trains_as_nothing():
    """Rows whose episodes ended before the model's first turn (an environment whose start raised) fill a
    micro-batch of their own: it contributes no gradient (it crashed: the loss did not depend on the weights)
    and the update is the one over the other rows alone."""
    mt = driver("Faulty", max_turns=2, timeout_s=0.3)
    rows = mt.rollout(engine(), prompts(list("0123456789")), group_size=1, seed=0)
    empty = (~rows.loss_mask_BTr.any(-1)).nonzero()[:, 0]
    live = rows.loss_mask_BTr.any(-1).nonzero()[:, 0][:4]
    assert len(empty) >= 1 and len(live) == 4
    params = model.init_params(CFG, seed=0, std=0.3)
    lp, _, _ = response_logprobs(params, CFG, rows, with_aux=False)
    b = extend(rows, TrainBatch, rewards_B=torch.zeros(rows.size), advantages_B=torch.linspace(-1, 1, rows.size),
               old_logprobs_BTr=lp.detach() - 0.05 * rows.loss_mask_BTr)
    both, alone = b.select(torch.cat([empty[:1], live])), b.select(live)
    gcfg = grpo.GRPOConfig(group_size=2, kl_coef=0.0)  # the advantages are given: the group size is not read

    def run(batch, micro):
        p = {k: v.clone() for k, v in params.items()}
        ucfg = stages.UpdateConfig(mini_batch_size=batch.size, micro_batch_size=micro)
        return stages.update(p, optim.init(p), batch, CFG, gcfg, ucfg, optim.AdamWConfig(lr=1e-2), seed=0)[::2]
    got, met = run(both, 1)  # one row a micro-batch: the empty row is one of them
    want, _ = run(alone, 1)
    assert math.isfinite(met["loss"]) and met["update_skipped"] == 0.0
    assert max(float((want[k] - params[k]).abs().max()) for k in want) > 1e-3  # a real step (lr 1e-2)
    # the same step; the shuffle of 5 rows orders the micro-batches otherwise than that of 4 (float sums)
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-5


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
    calls = [index for index, _ in eng.seen]  # sample index i * 3 + turn
    second = next(k for k, c in enumerate(calls) if 1 in c)  # the call with episode 0's second turn
    before = sorted(i for c in calls[:second] for i in c)
    assert before == [0] + list(range(3, 12)), calls  # every fast episode's three turns came first
    assert rows.loss_mask_BTr.sum(-1).tolist() == [6, 6, 6, 6]


class Calls:
    """The built-in engine without ``serve``: the driver then generates a batch per call."""

    def __init__(self, e):
        self.generate = e.generate


def test_served_episodes_equal_episodes_generated_call_by_call():
    """Continuous batching across turns (``engine.serve``) samples each turn's tokens as a generation call over
    the same context would: the rows are the same whichever way the engine is driven."""
    p, e = prompts(list("2718")), engine(4)
    served = driver("Hint", max_turns=3, new_tokens=4).rollout(e, p, group_size=3, seed=5)
    called = driver("Hint", max_turns=3, new_tokens=4).rollout(Calls(e), p, group_size=3, seed=5)
    assert torch.equal(served.response_ids_BTr, called.response_ids_BTr)
    assert torch.equal(served.loss_mask_BTr, called.loss_mask_BTr)
    torch.testing.assert_close(served.sample_logprobs_BTr, called.sample_logprobs_BTr, atol=1e-5, rtol=1e-5)
    assert served.env_rewards_B.tolist() == called.env_rewards_B.tolist()


def test_a_slow_environment_does_not_hold_the_served_batch():
    """With the engine serving requests as they come, the fast episodes take all three turns while the slow
    one's environment sleeps through its first step."""
    import sys

    from rlflow.envs import load_env
    starts = sys.modules[load_env(env("SlowFirstLog")).__module__].STARTS  # the module as the driver loads it
    starts.clear()
    driver("SlowFirstLog", max_turns=3).rollout(engine(), prompts(list("0123")), group_size=1, seed=0)
    at = {(a, t): s for a, t, s in starts}
    assert max(at[(a, 3)] for a in "123") < at[("0", 2)], starts


def test_recipe_refuses_what_multi_turn_does_not_run_with_by_flag():
    from rlflow.recipe.checks import problems
    from rlflow.recipe.flags import Recipe
    base = Recipe()
    mt = dict(env="max_digit_feedback")
    cases = [("max_turns", dict(max_turns=3)), ("tools", dict(tools="calculator")), ("env", dict(env="no_such_env")),
             ("rollout_layout", dict(mt, rollout_layout="tp=2")),
             ("routing_replay", dict(mt, routing_replay="on")), ("adv_estimator", dict(mt, adv_estimator="gae")),
             ("env", dict(env="tools")), ("tools", dict(env="tools", tools="calculator")),  # no chat template
             ("tools", dict(mt, tools="calculator")), ("tools", dict(env="tools", tools="nope.py")),
             ("env", dict(mt, task="sum_mod10")),
             ("max_turns", dict(mt, max_turns=1000000)),  # more turns than 512 positions hold (ran 9 min a step)
             ("max_turns", dict(mt, max_turns=50, max_total_tokens=40))]
    for field, kw in cases:
        got = problems(dataclasses.replace(base, **kw))
        assert any(name == field for name, _ in got), (field, got)
    bad_turns = problems(dataclasses.replace(base, env="max_digit_feedback", max_turns=0))
    assert any(name == "max_turns" and "max_turns=0" not in why for name, why in bad_turns), bad_turns
    assert problems(dataclasses.replace(base, env="max_digit_feedback")) == []
    assert problems(dataclasses.replace(base, env="max_digit_feedback", rollout_ranks=1, max_staleness=1)) == []
    assert problems(dataclasses.replace(base, env="max_digit_feedback", max_turns=40, max_total_tokens=40)) == []


def test_the_max_digit_environment_under_a_chat_template_is_refused_by_flag(tmp_path):
    """Its hint reads the plain prompt: rendered by a chat template, every episode failed at its start."""
    from test_data_formats import QWEN25

    from rlflow.recipe.checks import problems
    from rlflow.recipe.flags import Recipe
    chat = _chat_dir(tmp_path / "chat", QWEN25)
    got = problems(Recipe(model=chat, env="max_digit_feedback"))
    assert any(name == "env" and "chat template" in why for name, why in got), got
    assert not any(name == "env" for name, _ in problems(Recipe(model=chat, env="max_digit_feedback",
                                                                chat_template=False)))


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


def _chat_dir(path, template: str) -> str:
    """A tokenizer directory with ``template`` whose end-of-sequence token is the template's end of a turn."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + ["hi"])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>")
    fast.chat_template = template
    fast.save_pretrained(str(path))
    return str(path)


def test_an_observation_renders_as_the_whole_conversations_template_renders_it(tmp_path):
    """The incremental form: prompt + the model's turn (ending at its EOS) + the continuation of a tool message is
    the template's rendering of the whole conversation, character for character, with tools shown or not."""
    from test_data_formats import QWEN25

    from rlflow.envs.tools import TOOLS, schema
    from rlflow.tokenizer import ChatTemplate
    t = ChatTemplate(_chat_dir(tmp_path / "q", QWEN25))
    for tools in (None, [schema(TOOLS["calculator"])]):
        user = [{"role": "user", "content": "What is 12*7?"}]
        turn = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
        result = [{"role": "tool", "content": "84"}]
        whole = t.render(user + [{"role": "assistant", "content": turn}] + result, tools=tools)
        assert whole == t.render(user, tools=tools) + turn + "<|im_end|>" + t.continuation(result, closed=True)
        # a turn cut at the token limit (no EOS sampled): the template's own end of the turn comes first
        assert t.continuation(result, closed=False) == "<|im_end|>" + t.continuation(result, closed=True)
        feedback = [{"role": "user", "content": "Try again."}]
        whole = t.render(user + [{"role": "assistant", "content": "85"}] + feedback, tools=tools)
        assert whole == t.render(user, tools=tools) + "85<|im_end|>" + t.continuation(feedback, closed=True)


def test_tool_calls_run_and_malformed_ones_are_answered_and_counted(tmp_path):
    from rlflow.envs import Feedback
    from rlflow.envs.tools import ToolEnv, load_tools
    f = tmp_path / "mytools.py"
    f.write_text('import sys\n\ndef add(a: int, b: int) -> int:\n    """Add two integers."""\n    return a + b\n\n'
                 'def quit(code: int) -> int:\n    """Exit, as a script would."""\n    sys.exit(code)\n\n'
                 'def _hidden(x: int):\n    return x\n')
    tools = load_tools(f"calculator,{f}")
    assert sorted(tools) == ["add", "calculator", "quit"]
    e = ToolEnv(Example("p", "a"), tools=tools)
    call = lambda body: f"<tool_call>\n{body}\n</tool_call>"  # noqa: E731
    got = e.step("let me add " + call('{"name": "add", "arguments": {"a": 2, "b": 40}}')
                 + call('{"name": "calculator", "arguments": {"expression": "6*7"}}'))
    assert got.observation == [{"role": "tool", "content": "42"}, {"role": "tool", "content": "42"}]
    assert got.counts == {"tool_calls": 2, "tool_errors": 0} and not got.done
    bad = e.step(call("{not json") + call('{"name": "nope", "arguments": {}}') + call('{"name": "add", "arguments": {"a": 1}}')
                 + call('{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}'))
    assert bad.counts == {"tool_calls": 4, "tool_errors": 4}
    assert [m["content"].split(":")[0] for m in bad.observation] == ["error"] * 4
    gone = e.step(call('{"name": "quit", "arguments": {"code": 3}}'))  # sys.exit: the call's error, not the episode's
    assert gone.observation == [{"role": "tool", "content": "error: quit exited (SystemExit: 3)"}] and not gone.done
    cut = e.step('<tool_call>\n{"name": "calculator", "argu')  # the turn's token limit cut the call
    assert cut.counts == {"tool_calls": 1, "tool_errors": 1} and cut.observation[0]["content"].startswith("error")
    assert e.step("The answer is 42.") == Feedback(done=True)
    with pytest.raises(ValueError, match="parameter x needs an annotation"):
        (tmp_path / "untyped.py").write_text("def f(x):\n    return x\n")
        load_tools(str(tmp_path / "untyped.py"))


def test_a_tool_episode_through_the_driver_with_the_chat_template(tmp_path):
    """The model calls the calculator, reads the result as the template renders a tool message, answers; the row
    is its two turns around the rendered result, the counts name the call, the run's reward scores the answer."""
    from test_data_formats import QWEN25
    from tokenizers import Tokenizer

    from rlflow.envs.tools import TOOLS
    from rlflow.multiturn import chat_render
    from rlflow.tokenizer import ChatTemplate
    d = _chat_dir(tmp_path / "q", QWEN25)
    t, hf = ChatTemplate(d), Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
    hf.add_tokens([call, "84", "\n", "<tool_response>", "</tool_response>", "user", "assistant"])
    eos, cid, aid = hf.token_to_id("<|im_end|>"), hf.token_to_id(call), hf.token_to_id("84")
    encode = lambda text: hf.encode(text, add_special_tokens=False).ids  # noqa: E731
    decode = lambda ids: hf.decode(ids, skip_special_tokens=True)  # noqa: E731
    mt = MultiTurn(MultiTurnConfig(env="tools", max_turns=3), render=chat_render(t, encode), decode=decode,
                   reward_fn=per_sample(lambda text, answer: float(text == answer)), max_new_tokens=4, eos_id=eos,
                   max_positions=512, vocab_size=hf.get_vocab_size(), tools={"calculator": TOOLS["calculator"]})
    prompt = PromptBatch(prompt_ids_BTp=torch.tensor([[hf.token_to_id("hi")]]), prompt_mask_BTp=torch.tensor([[True]]),
                         index_B=torch.tensor([0]), group_B=torch.tensor([0]), answers=("84",))
    eng = Scripted(lambda ctx: [cid, eos] if aid not in ctx else [aid, eos])
    rows = mt.rollout(eng, prompt, group_size=1, seed=0)
    obs = encode(t.continuation([{"role": "tool", "content": "84"}], closed=True))
    assert decode(obs) == decode(encode("\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n"
                                        "<|im_start|>assistant\n"))
    assert rows.response_ids_BTr[0].tolist() == [cid, eos] + obs + [aid, eos]
    assert rows.loss_mask_BTr[0].tolist() == [True, True] + [False] * len(obs) + [True, True]
    counts = mt.figures()[0]
    assert counts["env/tool_calls"] == 1 and counts["env/tool_errors"] == 0 and counts["env/turns"] == 2
    assert rows.env_rewards_B.tolist() == [1.0]


def test_the_documented_user_environment_runs_as_written(tmp_path):
    """docs/agentic.md's environment, copied out of the page, trains through the recipe's command line."""
    import json
    import re
    import subprocess
    import sys
    page = open(os.path.join(os.path.dirname(HERE), "docs", "agentic.md"), encoding="utf-8").read()
    code = re.search(r"## A user environment.*?```python\n(.*?)```", page, re.DOTALL)[1]
    assert len(code.strip().splitlines()) <= 20
    (tmp_path / "parity_hint.py").write_text(code)
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(os.path.dirname(HERE), "recipes", "grpo_qwen3_moe.py"), "--steps", "2",
           "--prompts-per-step", "4", "--group-size", "4", "--world", "1", "--task", "sum_mod10",
           "--env", f"{tmp_path}/parity_hint.py:ParityHint", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    for line in (out / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        assert m["env/episodes"] == 16 and m["env/turns"] > 16  # wrong first answers got their hint and a retry
        assert m["env/errors"] == m["env/malformed"] == m["env/timeouts"] == 0


@pytest.mark.slow
def test_the_built_in_multi_turn_task_learns_and_beats_one_turn(tmp_path):
    """`--env max_digit_feedback --max-turns 2` on the default 2 processes: the last 10 steps' mean reward is at
    least 0.25 above the first 10 steps', and above what the same steps (the same samples) reach with one turn."""
    import json
    import subprocess
    import sys
    last = {}
    for turns in (2, 1):
        out = tmp_path / f"turns{turns}"
        cmd = [sys.executable, os.path.join(os.path.dirname(HERE), "recipes", "grpo_qwen3_moe.py"), "--steps", "150",
               "--env", "max_digit_feedback", "--max-turns", str(turns), "--out", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        r = [json.loads(line)["reward_mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        last[turns] = sum(r[-10:]) / 10
        if turns == 2:
            assert last[2] - sum(r[:10]) / 10 >= 0.25, r
    assert last[2] > last[1], last


def test_the_recipe_with_a_chat_checkpoint_its_tools_and_an_environment(tmp_path):
    """--model with a chat template: --env tools --tools calculator (the prompts rendered with the tools' schemas),
    and a user environment whose observations the template renders as the conversation's next messages."""
    import json
    import subprocess
    import sys

    from test_data_formats import QWEN25
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlflow.tokenizer import ChatTemplate
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<|im_end|>", "<|im_start|>", *"0123456789+-=#?",
                                         "what", "is", "user", "assistant", "system"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN25
    model_dir = tmp_path / "model"
    Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        eos_token_id=vocab["<|im_end|>"])).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"question": f"what is {a} + {b} = ?", "answer": f"#### {a + b}"}) + "\n"
                            for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]))
    base = [sys.executable, os.path.join(os.path.dirname(HERE), "recipes", "grpo_qwen3_moe.py"), "--model",
            str(model_dir), "--dataset", str(data), "--steps", "2", "--prompts-per-step", "2", "--group-size", "4",
            "--max-new-tokens", "4", "--world", "1"]
    for name, flags in (("tools", ["--env", "tools", "--tools", "calculator", "--max-turns", "3"]),
                        ("hint", ["--env", env("Hint"), "--max-turns", "2"])):
        out = tmp_path / name
        res = subprocess.run(base + flags + ["--out", str(out)], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert all(r["env/episodes"] == 8 and r["env/errors"] == r["env/malformed"] == 0 for r in m), m
        if name == "tools":  # a random model calls no tool: each episode is its one answer, scored by --reward
            assert all(r["env/turns"] == 8 and r["env/tool_calls"] == 0 for r in m), m
        else:  # two turns, the observation between them rendered by the template (its user message's glue)
            glue = len(fast(ChatTemplate(str(model_dir)).continuation([{"role": "user", "content": "+="}],
                                                                      closed=True), add_special_tokens=False).input_ids)
            assert glue >= 3
            assert all(r["env/turns"] == 16 and r["response_tokens"] > 16 + 8 * glue for r in m), m


def test_the_loss_normaliser_of_dr_grpo_is_the_episodes_sampled_budget():
    from rlflow.runtime.config import LoopConfig
    from rlflow.runtime.work import sampled_budget
    conf = LoopConfig(steps=1, prompts_per_step=1, grpo=grpo.GRPOConfig(group_size=2), mini_batch_size=2,
                      micro_batch_size=2, optim=optim.AdamWConfig(lr=1e-3),
                      sampling=SamplingConfig(max_new_tokens=5, eos_id=TOK.eos_id))
    assert sampled_budget(conf) == 5
    assert sampled_budget(dataclasses.replace(conf, multiturn=MultiTurnConfig(env="max_digit_feedback", max_turns=3))) == 15


def test_the_timeout_counts_from_the_start_of_a_call_and_a_stubborn_step_cannot_hold_the_run():
    """Six 0.3 s steps on one thread take 1.8 s in all, yet none outlasts its 1 s timeout: the time a call waits
    for a thread is not its own. An async step that swallows its cancellation is timed out and left behind."""
    mt = driver("Slow", max_turns=2, timeout_s=1.0, concurrency=1)
    rows = mt.rollout(engine(), prompts(list("123")), group_size=2, seed=0)
    c = mt.figures()[0]
    assert c["env/timeouts"] == 0 and c["env/turns"] == 12, c
    assert not bool((rows.response_mask_BTr & ~rows.loss_mask_BTr).any())  # an empty observation: no tokens
    mt = driver("Stubborn", max_turns=2, timeout_s=0.2)
    mt.rollout(engine(), prompts(list("1")), group_size=2, seed=0)
    assert mt.figures()[0]["env/timeouts"] == 2


def test_an_async_step_that_blocks_the_event_loop_is_its_own_timeout_not_the_others(caplog):
    """time.sleep inside async def holds the loop: past the timeout that call is a timeout (it was never counted:
    the loop could not time it), said in one line; the episodes it stalled keep their own budget."""
    mt = driver("Blocking", max_turns=2, timeout_s=0.4)
    mt.rollout(engine(), prompts(list("0123")), group_size=1, seed=0)
    c = mt.figures()[0]
    assert c["env/timeouts"] == 1 and c["env/turns"] == 1 + 3 * 2, c  # episode 0 ends after its first turn
    assert caplog.text.count("held the event loop") == 1 and "blocked the event loop for 0.6 s" in caplog.text


def test_a_non_finite_reward_of_the_last_turn_is_a_bad_reward_not_an_unscored_row():
    """As in the single-turn path: the step sees it (and skips its update), it is not dropped as unscored."""
    rows = driver("Hint", max_turns=1, reward=lambda text, answer: float("nan")).rollout(
        engine(), prompts(list("1")), group_size=2, seed=0)
    rewards, scored = stages.score_rows(rows, TOK, None)
    assert scored.tolist() == [True, True] and bool(torch.isnan(rewards).all())


def test_qwen3s_template_renders_an_observation_after_the_turn(tmp_path):
    """Qwen3's template renders earlier assistant turns otherwise once others follow (their reasoning dropped): the
    continuation is what follows the turn's content in the longer conversation, the same as Qwen2.5's here."""
    from rlflow.tokenizer import ChatTemplate
    t = ChatTemplate(_chat_dir(tmp_path / "q3", open(os.path.join(HERE, "data", "qwen3_chat_template.jinja")).read()))
    assert t.continuation([{"role": "tool", "content": "84"}], closed=True) == \
        "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert t.continuation([{"role": "user", "content": "Try again."}], closed=False) == \
        "<|im_end|>\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n"
