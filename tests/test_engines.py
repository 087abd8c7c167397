"""The engine seam: an engine is one file (a class declaring its capabilities and one ``register`` call), the
runtime and the recipe ask capabilities, never names."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys

import pytest

from rlflow import engines, optim
from rlflow.algos.grpo import GRPOConfig
from rlflow.data import PromptSource
from rlflow.models import decoder
from rlflow.models.config import get_config
from rlflow.rollout import SamplingConfig, generate
from rlflow.runtime import loop
from rlflow.runtime.state import init
from rlflow.runtime.step import context
from rlflow.tokenizer import CharTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1] / "rlflow"


# ---- what a new engine's file holds ----
class GreedyEngine:
    """A toy engine: rlflow's generation at temperature 0, whatever the run samples with; it can do nothing
    beyond load / generate / release."""
    capabilities = engines.Capabilities()
    built: list = []

    def __init__(self, cfg, sampling, ex):
        self.cfg, self.sampling, self.ex, self.weights, self.calls = cfg, sampling, ex, None, 0
        GreedyEngine.built.append(self)

    def load(self, weights):
        self.weights = weights

    def generate(self, prompts, *, group_size, seed):
        self.calls += 1
        greedy = dataclasses.replace(self.sampling, temperature=0.0)
        return generate(self.weights, self.cfg, prompts, greedy, group_size=group_size, seed=seed, ex=self.ex)

    def release(self):
        weights, self.weights = self.weights, None
        return weights

    def figures(self):
        return {"greedy_calls": float(self.calls)}

    def close(self):
        pass


TOY = engines.EngineKind("toy-greedy", GreedyEngine.capabilities, lambda cfg, s, ex, o: GreedyEngine(cfg, s, ex),
                         why_not={"partial_rollout": "it has no decode loop of its own"})
# ---- end of the file ----


@pytest.fixture
def toy():
    engines.register(TOY)
    GreedyEngine.built.clear()
    try:
        yield TOY
    finally:
        engines.base.REGISTRY.pop(TOY.name)


def test_a_registered_engine_runs_the_step(toy):
    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    lcfg = loop.LoopConfig(steps=2, prompts_per_step=2, grpo=GRPOConfig(group_size=2), mini_batch_size=4,
                           micro_batch_size=4, optim=optim.AdamWConfig(), rollout_engine=toy.name,
                           sampling=SamplingConfig(max_new_tokens=3, eos_id=tok.eos_id, pad_id=tok.pad_id))
    state = init(decoder.init_params(cfg, seed=0), PromptSource(task="max_digit"))
    _, history = loop.train(state, context(cfg, tok, lambda resp, ans: [float(r == ans) for r in resp], lcfg))
    (engine,) = GreedyEngine.built
    assert engine.calls == 2 and [h["greedy_calls"] for h in history] == [1.0, 2.0], history
    assert engine.weights is None  # the step handed the weights back to the transition


def test_what_an_engine_cannot_do_is_refused_by_its_capabilities(toy):
    cfg = get_config("qwen3-moe-tiny")
    got = dict(engines.unsupported(toy.name, cfg, sharded=True, compile_decode=True, record_routes=True,
                                   partial_rollout=True))
    assert set(got) == {"rollout_layout", "compile_decode", "routing_replay", "partial_rollout"}, got
    assert got["partial_rollout"].endswith("it has no decode loop of its own"), got
    assert engines.unsupported("builtin", cfg, sharded=True, compile_decode=True, record_routes=True,
                               partial_rollout=True) == []
    with pytest.raises(ValueError, match="routing_replay: records the rollout's expert choices, which the toy-greedy engine does not"):
        engines.check(toy.name, cfg, record_routes=True)
    with pytest.raises(ValueError, match="registered already"):
        engines.register(engines.EngineKind(toy.name, engines.Capabilities(), lambda *a: None))
    assert engines.option_problems(toy.name, {"vllm_memory_utilization": 0.3}) == [
        ("vllm_memory_utilization", "is an option of the vllm engine only")]


def test_an_engine_that_declares_no_serve_is_driven_call_by_call(toy):
    """The multi-turn driver serves turns as they come only to an engine that declares ``serve``."""
    assert engines.capabilities(object()).serve is False
    assert engines.BuiltinEngine.capabilities.serve and not GreedyEngine.capabilities.serve


def test_no_module_outside_the_engines_compares_an_engine_name():
    """``rollout_engine == "vllm"`` was in four modules; capabilities replace it."""
    bad = []
    for f in sorted(ROOT.rglob("*.py")):
        if f.parent.name == "engines":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in engines.names()
                                                     for c in [node.left, *node.comparators]):
                text = ast.unparse(node)
                if "engine" in text:
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno}: {text}")
    assert not bad, "\n".join(bad)


def test_the_name_check_sees_a_planted_comparison(tmp_path, monkeypatch):
    planted = tmp_path / "rlflow"
    (planted / "runtime").mkdir(parents=True)
    (planted / "runtime" / "x.py").write_text('def f(conf):\n    return conf.rollout_engine != "builtin"\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", planted)
    with pytest.raises(AssertionError, match="x.py:2"):
        test_no_module_outside_the_engines_compares_an_engine_name()
