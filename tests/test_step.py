"""The step's seams on their own: the dock columns it takes come from the graph, the run state's checks,
and the hooks' policies (when they act), without running a model where none is needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlflow import optim
from rlflow.algos.grpo import GRPOConfig
from rlflow.data import PromptSource
from rlflow.models import decoder
from rlflow.models.config import get_config
from rlflow.rollout import SamplingConfig
from rlflow.runtime import hooks, loop
from rlflow.runtime.graph import GRPO, PPO
from rlflow.runtime.state import init
from rlflow.runtime.step import context, dock_columns
from rlflow.tokenizer import CharTokenizer


@pytest.mark.parametrize("graph,replay,want", [
    (GRPO, "off", ["rewards", "advantages"]),
    (PPO, "off", ["rewards", "scored"]),
    (GRPO, "on", ["rewards", "advantages", "prompt_routes", "response_routes"]),
])
def test_the_train_group_takes_what_its_stages_read_from_the_rollout_group(graph, replay, want):
    assert dock_columns(graph, replay) == want


def _lcfg(**kw):
    tok = CharTokenizer()
    return loop.LoopConfig(**{**dict(steps=1, prompts_per_step=2, grpo=GRPOConfig(group_size=2), mini_batch_size=4,
                                     micro_batch_size=4, optim=optim.AdamWConfig(),
                                     sampling=SamplingConfig(max_new_tokens=2, eos_id=tok.eos_id, pad_id=tok.pad_id)),
                              **kw})


def test_the_state_must_carry_what_the_loop_config_asks_for():
    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    params = decoder.init_params(cfg, seed=0)
    reward = lambda resp, ans: [0.0] * len(resp)  # noqa: E731
    with_kl = _lcfg(grpo=GRPOConfig(group_size=2, kl_coef=0.1))
    with pytest.raises(ValueError, match="needs the state's reference policy"):
        loop.train(init(params, PromptSource(task="max_digit")), context(cfg, tok, reward, with_kl))
    with pytest.raises(ValueError, match="carries a reference policy"):
        loop.train(init(params, PromptSource(task="max_digit"), kl=True), context(cfg, tok, reward, _lcfg()))
    state = init(params, PromptSource(task="max_digit"), kl=True)
    assert all(state.ref[k] is not params[k] and state.ref[k].equal(params[k]) for k in params)  # a frozen copy


def test_checkpoints_every_n_steps_the_final_one_and_the_interrupt_one():
    saved = []
    said = []

    def save(name, state, keep):
        saved.append((name, keep))
        return f"out/{name}"
    ck = hooks.Checkpointer(save, every=2, keep_last=3, last=6, say=lambda *a, **k: said.append(a[0]))
    for n in range(1, 7):
        ck.after_step(SimpleNamespace(steps_done=n), {}, None)
    ck.end(SimpleNamespace(steps_done=6))  # the last step's checkpoint is the final one, not also a numbered one
    assert saved == [("checkpoint-000002", 3), ("checkpoint-000004", 3), ("checkpoint-final", None)]
    assert ck.path == "out/checkpoint-final" and not said
    saved.clear()
    ck.end(SimpleNamespace(steps_done=3))  # stopped early: the steps done, and how to go on
    assert saved == [("checkpoint-000003", None)] and ck.path == "out/checkpoint-000003"
    assert said and "--resume auto" in said[0] and "after step 2" in said[0]


def test_evaluates_before_the_first_step_every_n_and_after_the_last():
    seen = []
    ev = hooks.Evaluator(lambda s: {"eval/x": s.steps_done}, every=3, last=7, report=lambda n, m: seen.append(n))
    ev.start(SimpleNamespace(steps_done=0))
    for n in range(1, 8):
        ev.after_step(SimpleNamespace(steps_done=n), {}, None)
    assert seen == [0, 3, 6, 7]


def test_sinks_log_every_step_and_samples_every_n():
    logged, samples = [], []

    class Sink:
        def log(self, step, m):
            logged.append(step)

        def log_samples(self, step, rows):
            samples.append(step)

        def close(self):
            logged.append("closed")
    import torch
    from rlflow.batch import RolloutBatch
    tok = CharTokenizer()
    rows = RolloutBatch(prompt_ids_BTp=torch.tensor([[5]]), prompt_mask_BTp=torch.tensor([[True]]),
                        index_B=torch.tensor([0]), group_B=torch.tensor([0]), answers=("1",),
                        response_ids_BTr=torch.tensor([[6]]), response_mask_BTr=torch.tensor([[True]]),
                        sample_logprobs_BTr=torch.tensor([[-1.0]]))
    h = hooks.Sinks([Sink()], tok, samples_every=2)
    for step in range(4):
        h.after_step(None, {"step": step}, SimpleNamespace(rows=rows, rewards=torch.tensor([1.0])))
    h.close()
    assert logged == [0, 1, 2, 3, "closed"] and samples == [0, 2]


def test_a_stage_added_to_the_graph_runs_in_the_step_with_nothing_else_changed():
    """A new stage is a function and a graph entry: here a bonus of 1 added to every reward between the scoring
    and the advantages (placement-independent: it runs on whatever ranks score). The step runs it: every reward is
    1 higher, and the advantages (a group's rewards shifted together) and so the update are the same."""
    import dataclasses

    from rlflow.runtime.graph import Graph, Stage

    def bonus(work):
        work.cols["rewards"] = work.cols["rewards"] + 1.0

    i = [s.name for s in GRPO.stages].index("score") + 1
    with_bonus = Graph(GRPO.columns, GRPO.stages[:i] + (Stage("bonus", ("rewards",), ("rewards",), "every", fn=bonus),)
                       + GRPO.stages[i:])
    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    reward = lambda resp, ans: [float(r == a) for r, a in zip(resp, ans)]  # noqa: E731
    runs = []
    for graph in (GRPO, with_bonus):
        ctx = dataclasses.replace(context(cfg, tok, reward, _lcfg(steps=2)), graph=graph)
        runs.append(loop.train(init(decoder.init_params(cfg, seed=0), PromptSource(task="max_digit")), ctx)[1])
    for plain, bonused in zip(*runs):
        assert bonused["reward_mean"] == pytest.approx(plain["reward_mean"] + 1.0, abs=1e-6)
        assert bonused["loss"] == plain["loss"] and bonused["grad_norm"] == plain["grad_norm"]
