"""Evaluation: the pass@k estimator, rlflow.eval.evaluate on a tiny random model, and the recipe's --eval-* flags
(periodic eval rows in the metrics, --eval-only, refusals)."""

import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import recipe_module
from hypothesis import given
from hypothesis import strategies as st

from rlflow import rewards
from rlflow.data import Example
from rlflow.eval import Scores, cat, evaluate, pass_at_k, sample_scores, summarize
from rlflow.models import decoder
from rlflow.models.config import get_config
from rlflow.tokenizer import CharTokenizer

TOK = CharTokenizer()
CFG = get_config("qwen3-moe-tiny").replace(eos_token_id=TOK.eos_id)
PARAMS = decoder.init_params(CFG, seed=0)
EXAMPLES = [Example(f"max:{d}=", max(d)) for d in ("381920", "112233", "907156", "444444", "012345", "765432",
                                                   "550055")]
FIRST = set(CharTokenizer.CHARS[::2])  # a completion that starts with one of these is "correct"


@pytest.mark.parametrize("n, c, k, want", [
    (5, 0, 1, 0.0), (5, 5, 3, 1.0), (5, 1, 1, 0.2), (5, 2, 2, 1 - 3 / 10),  # C(3,2) / C(5,2)
    (10, 3, 5, 1 - 21 / 252),  # C(7,5) / C(10,5)
    (4, 1, 4, 1.0),  # n - c < k: every draw of 4 holds the correct one
    (1, 1, 1, 1.0), (200, 1, 1, 0.005),
])
def test_pass_at_k_against_hand_computed_values(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-15)


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_share_of_k_draws_that_hold_a_correct_sample(nck):
    """Brute force: of all k-subsets of n samples (the first c correct), the share with a correct one."""
    n, c, k = nck
    draws = list(itertools.combinations(range(n), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(i < c for i in d) for d in draws) / len(draws), abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def _recording_reward():
    seen = []

    def reward(completions, answers):
        seen.extend(completions)
        return [float(c[:1] in FIRST) for c in completions]
    return reward, seen


@pytest.mark.parametrize("samples", [1, 4])
def test_evaluate_metrics_follow_from_the_scored_completions(samples):
    reward, seen = _recording_reward()
    m = evaluate(PARAMS, CFG, TOK, EXAMPLES, reward, samples=samples, temperature=1.0, max_new_tokens=3,
                 batch_size=3, seed=5)
    extra = {"eval/accuracy"} if samples == 1 else {f"eval/pass@{samples}"}
    assert set(m) == {"eval/reward_mean", "eval/pass@1", "eval/response_len", "eval/prompts", "eval/unscored"} | extra
    assert m["eval/prompts"] == len(EXAMPLES) and len(seen) == len(EXAMPLES) * samples and m["eval/unscored"] == 0
    ok = [[c[:1] in FIRST for c in seen[i * samples:(i + 1) * samples]] for i in range(len(EXAMPLES))]
    assert m["eval/reward_mean"] == pytest.approx(sum(map(sum, ok)) / len(seen))
    assert m["eval/pass@1"] == pytest.approx(sum(sum(o) / samples for o in ok) / len(ok))
    if samples == 1:
        assert m["eval/accuracy"] == m["eval/pass@1"]
    else:
        assert m[f"eval/pass@{samples}"] == pytest.approx(sum(any(o) for o in ok) / len(ok))
        assert m[f"eval/pass@{samples}"] >= m["eval/pass@1"]
    assert all(0.0 <= v <= 1.0 for k, v in m.items() if k not in ("eval/response_len", "eval/prompts",
                                                                   "eval/unscored"))
    assert 1.0 <= m["eval/response_len"] <= 3.0


def test_a_reward_of_one_everywhere_is_full_marks():
    m = evaluate(PARAMS, CFG, TOK, EXAMPLES, lambda cs, ans: [1.0] * len(cs), samples=2, max_new_tokens=2,
                 batch_size=4)
    assert (m["eval/reward_mean"], m["eval/pass@1"], m["eval/pass@2"]) == (1.0, 1.0, 1.0)


def test_greedy_eval_is_deterministic():
    reward, _ = _recording_reward()
    kw = dict(samples=1, max_new_tokens=3, batch_size=3)
    assert evaluate(PARAMS, CFG, TOK, EXAMPLES, reward, seed=0, **kw) == \
        evaluate(PARAMS, CFG, TOK, EXAMPLES, reward, seed=1, **kw)  # greedy: no noise, the seed does not matter


def test_shares_concatenate_to_the_whole_sets_scores():
    """What a world of ranks does: contiguous shares, each at its index in the set, concatenated."""
    reward, _ = _recording_reward()
    kw = dict(samples=3, temperature=1.0, max_new_tokens=3, batch_size=2, seed=7)
    whole = sample_scores(PARAMS, CFG, TOK, EXAMPLES, reward, **kw)
    got = cat([sample_scores(PARAMS, CFG, TOK, EXAMPLES[:3], reward, first_index=0, **kw),
               sample_scores(PARAMS, CFG, TOK, EXAMPLES[3:], reward, first_index=3, **kw)])
    assert all(torch.equal(a, b) for a, b in zip(got, whole)) and whole.rewards_PK.shape == (len(EXAMPLES), 3)
    assert summarize(got) == evaluate(PARAMS, CFG, TOK, EXAMPLES, reward, **kw)


def test_unscored_samples_are_left_out_of_the_reward_mean_and_are_not_correct():
    s = summarize(Scores(rewards_PK=torch.tensor([[1.0, 0.0], [0.0, 0.5]]),
                         scored_PK=torch.tensor([[True, True], [False, True]]),
                         lengths_PK=torch.tensor([[1, 2], [3, 4]])))
    assert s == {"eval/reward_mean": pytest.approx(1.5 / 3), "eval/pass@1": 0.25, "eval/pass@2": 0.5,
                 "eval/response_len": 2.5, "eval/prompts": 2, "eval/unscored": 1}


def test_evaluate_refuses_bad_sizes():
    reward, _ = _recording_reward()
    with pytest.raises(ValueError, match="samples=0 must be >= 1"):
        evaluate(PARAMS, CFG, TOK, EXAMPLES, reward, samples=0, max_new_tokens=2, batch_size=2)
    with pytest.raises(ValueError, match="no examples"):
        evaluate(PARAMS, CFG, TOK, [], reward, max_new_tokens=2, batch_size=2)


def _eval_file(tmp_path, **extra) -> str:
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": ex.prompt, "answer": ex.answer, **extra}) + "\n" for ex in EXAMPLES))
    return str(path)


def _rows(path):
    return [json.loads(ln) for ln in open(path)]


def test_the_recipe_logs_eval_rows_before_every_n_steps_and_after(tmp_path):
    out = tmp_path / "run"
    history = recipe_module().main(["--world", "1", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
                                    "--eval-dataset", _eval_file(tmp_path), "--eval-every", "1", "--out", str(out)])
    rows = _rows(out / "metrics.jsonl")
    evals = [m for m in rows if "eval/reward_mean" in m]
    assert [m["step"] for m in evals] == [0, 1, 2]  # before the first step, after step 1, after the last
    for m in evals:
        assert set(m) == {"step", "eval/reward_mean", "eval/pass@1", "eval/accuracy", "eval/response_len",
                          "eval/prompts", "eval/unscored"}
        assert m["eval/prompts"] == len(EXAMPLES) and 0.0 <= m["eval/accuracy"] <= 1.0
    assert [m for m in rows if "reward_mean" in m] == json.loads(json.dumps(history))  # the training rows
    assert (out / "reward.png").exists() and (out / "checkpoint-final").is_dir()


def test_eval_only_writes_eval_json_and_trains_nothing(tmp_path):
    out = tmp_path / "eval"
    got = recipe_module().main(["--eval-only", "--eval-dataset", _eval_file(tmp_path), "--eval-samples", "3",
                                "--eval-max-prompts", "4", "--out", str(out)])
    assert os.listdir(out) == ["eval.json"]  # no metrics, no checkpoint
    m = json.loads((out / "eval.json").read_text())
    assert got == [m] and m["eval/prompts"] == 4 and set(m) >= {"eval/reward_mean", "eval/pass@1", "eval/pass@3"}
    assert math.isfinite(m["eval/response_len"])


@pytest.mark.slow
def test_two_ranks_evaluate_what_one_process_does(tmp_path):
    """--world 2: every rank gathers the weights and evaluates its share; the merged row before the first step is
    evaluate() on the whole set with the same init, and the run ends (no rank is left in a collective)."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "grpo_qwen3_moe.py")
    res = subprocess.run([sys.executable, script, "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
                          "--max-new-tokens", "3", "--eval-dataset", _eval_file(tmp_path), "--eval-samples", "2",
                          "--out", str(tmp_path / "w2")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    evals = [m for m in _rows(tmp_path / "w2" / "metrics.jsonl") if "eval/prompts" in m]
    assert [m["step"] for m in evals] == [0, 1]
    want = evaluate(PARAMS, CFG, TOK, EXAMPLES, rewards.CombinedReward.load(["exact"]).score, samples=2,
                    temperature=1.0, max_new_tokens=3, batch_size=2, seed=0)
    assert {k: v for k, v in evals[0].items() if k != "step"} == pytest.approx(want)


@pytest.mark.parametrize("flags, named", [
    (["--eval-every", "2"], "--eval-every 2: needs --eval-dataset"),
    (["--eval-only"], "--eval-only: needs --eval-dataset"),
    (["--eval-samples", "0", "--eval-dataset", "{data}"], "--eval-samples 0: must be >= 1"),
    (["--eval-max-prompts", "0", "--eval-dataset", "{data}"], "--eval-max-prompts 0: must be >= 1"),
    (["--eval-every", "-1", "--eval-dataset", "{data}"], "--eval-every -1: must be >= 0"),
    (["--eval-temperature", "0", "--eval-dataset", "{data}"], "--eval-temperature 0.0: must be > 0"),
    (["--eval-dataset", "{tmp}/none.jsonl"], "--eval-dataset {tmp}/none.jsonl: {tmp}/none.jsonl: no such file"),
    (["--eval-dataset", "{data}", "--reward", "{tmp}/rw.py:strict"], "--eval-dataset {data}: reward"),
    (["--eval-only", "--eval-dataset", "{data}", "--resume", "auto", "--out", "{tmp}/o"],
     "--resume auto: --eval-only trains nothing"),
])
def test_bad_eval_flags_are_one_line_naming_the_flag(flags, named, tmp_path, capsys):
    data = _eval_file(tmp_path, source="x")  # a column that the strict reward below does not take
    (tmp_path / "rw.py").write_text("def strict(prompts, completions, answers):\n    return [0.0] * len(completions)\n")
    fmt = dict(data=data, tmp=str(tmp_path))
    with pytest.raises(SystemExit) as e:
        recipe_module().parse_args([f.format(**fmt) for f in flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert named.format(**fmt) in err[-1], err


def test_the_keys_name_the_eval_sets_columns_too(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "max:12=", "solution": "2"}) + "\n")
    r = recipe_module().parse_args(["--eval-dataset", str(path), "--answer-key", "solution"])
    assert r.answer_key == "solution"
