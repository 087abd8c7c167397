"""The user's reward functions: loaded from a file or a module, called batched (TRL's convention), combined with
weights, and their failures named."""

import json
import os

import pytest
from helpers import recipe_module

from rlflow import rewards
from rlflow.data import Example
from rlflow.rewards import CombinedReward, RewardError, load_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_FILE = '''
import asyncio


def by_level(prompts, completions, answers, level, **kwargs):
    """1 for the right answer, scaled by the row's level column; None where the level is missing."""
    return [None if lv is None else float(c.strip() == a) * lv for c, a, lv in zip(completions, answers, level)]


async def judge(prompts, completions, answers, **kwargs):
    await asyncio.sleep(0)
    return [len(c) / 10 for c in completions]


def strict(prompts, completions, answers):
    return [0.0] * len(completions)


def broken(prompts, completions, answers, **kwargs):
    raise KeyError("boom")


def short(prompts, completions, answers, **kwargs):
    return [1.0]


def texty(prompts, completions, answers, **kwargs):
    return ["1"] * len(completions)


def bonus(prompts, completions, answers, bonus, **kwargs):
    """The row's bonus column, when the recipe hands the right prompts and answers over (else 0)."""
    ok = [p.startswith("max:") and a == max(p[4:10]) for p, a in zip(prompts, answers)]
    return [b if k else 0.0 for b, k in zip(bonus, ok)]
'''
PROMPTS, COMPLETIONS, ANSWERS = ["1+1=", "2+2=", "3+3="], ["2", "5", "6"], ["2", "4", "6"]


@pytest.fixture
def user_file(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text(USER_FILE)
    return str(f)


def test_a_file_reward_is_called_batched_with_the_extra_columns(user_file):
    r = load_reward(f"{user_file}:by_level")
    assert r.name == f"{user_file}:by_level" and not r.per_sample
    assert r(PROMPTS, COMPLETIONS, ANSWERS, level=[2, 3, None]) == [2.0, 0.0, None]
    assert load_reward(f"{user_file}:judge")(PROMPTS, ["ab", "", "abcd"], ANSWERS) == [0.2, 0.0, 0.4]  # async def


def test_a_module_reward_and_the_registry(tmp_path, monkeypatch):
    (tmp_path / "team_rewards.py").write_text(USER_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("team_rewards:judge")(["p"], ["abc"], ["a"]) == [pytest.approx(0.3)]
    exact = load_reward("exact")
    assert exact.per_sample and exact(PROMPTS, COMPLETIONS, ANSWERS) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("spec, match", [
    ("nope", r"unknown reward 'nope': not registered \(\['exact', 'math'\]\)"),
    ("{f}:missing", r"reward {f}:missing: {f} has no function 'missing' \(it defines \['bonus', 'broken', "),
    ("{d}/none.py:fn", r"reward {d}/none.py:fn: no file {d}/none.py"),
    ("no_such_module_xyz:fn", r"reward no_such_module_xyz:fn: cannot import module 'no_such_module_xyz'"),
    ("{d}/bad.py:fn", r"reward {d}/bad.py:fn: importing {d}/bad.py raised NameError: name 'undefined' is not"),
])
def test_bad_reward_specs_name_the_spec(spec, match, user_file, tmp_path):
    (tmp_path / "bad.py").write_text("x = undefined\n")
    fmt = dict(f=user_file, d=str(tmp_path))
    with pytest.raises(ValueError, match=match.format(**{k: v.replace(".", r"\.") for k, v in fmt.items()})):
        load_reward(spec.format(**fmt))


def test_weights_sum_what_scored_and_none_only_when_nothing_did(user_file):
    c = CombinedReward.load(["exact", f"{user_file}:by_level"], [0.5, 2])
    assert c(PROMPTS, COMPLETIONS, ANSWERS, level=[1, 1, None]) == [0.5 + 2.0, 0.0, 0.5]  # by_level skipped row 2
    only = CombinedReward.load([f"{user_file}:by_level"])
    assert only(PROMPTS, COMPLETIONS, ANSWERS, level=[1, None, None]) == [1.0, None, None]
    with pytest.raises(ValueError, match="2 weights for 1 reward functions"):
        CombinedReward.load(["exact"], [1, 2])


def test_failures_name_the_function_and_the_sample(user_file):
    with pytest.raises(RewardError, match=rf"reward {user_file}:broken raised KeyError: 'boom' \(at {user_file}:\d+ "
                                          r"in broken\) on a batch of 3 samples \(first prompt '1\+1='\)") as e:
        load_reward(f"{user_file}:broken")(PROMPTS, COMPLETIONS, ANSWERS)
    assert isinstance(e.value.__cause__, KeyError)
    with pytest.raises(RewardError, match=rf"reward {user_file}:short returned 1 values for 3 samples"):
        load_reward(f"{user_file}:short")(PROMPTS, COMPLETIONS, ANSWERS)
    with pytest.raises(RewardError, match=rf"reward {user_file}:texty returned '1' for sample 0 .*expected a float"):
        load_reward(f"{user_file}:texty")(PROMPTS, COMPLETIONS, ANSWERS)
    rewards.REGISTRY["_raises"] = lambda response, answer: 1 / 0
    try:
        with pytest.raises(RewardError, match=r"reward _raises raised ZeroDivisionError: .* on sample 0 "
                                              r"\(prompt '1\+1='\)"):
            load_reward("_raises")(PROMPTS, COMPLETIONS, ANSWERS)
    finally:
        del rewards.REGISTRY["_raises"]


def test_signatures_are_checked_against_the_columns(user_file):
    CombinedReward.load([f"{user_file}:by_level", "math"]).check_columns(["level", "source"])
    with pytest.raises(ValueError, match=rf"reward {user_file}:strict cannot be called as fn\(prompts=, completions=, "
                                         r"answers=, level=\) .* add \*\*kwargs"):
        load_reward(f"{user_file}:strict").check_columns(["level"])
    with pytest.raises(ValueError, match="by_level cannot be called"):  # its level column is missing
        load_reward(f"{user_file}:by_level").check_columns([])


def test_the_loop_form_carries_prompt_answer_and_columns_with_the_row(user_file):
    c = CombinedReward.load([f"{user_file}:by_level"])
    (ex,) = c.carry([Example("1+1=", "2", None, {"level": 3})])
    assert json.loads(ex.answer) == {"prompt": "1+1=", "answer": "2", "extra": {"level": 3}}
    (ex2,) = c.carry([Example("2+2=", "4", None, {"level": 1})])
    assert c.score([" 2 ", "4"], [ex.answer, ex2.answer]) == [3.0, 1.0]  # one call for the scorer's rows
    (unscored,) = c.carry([Example("1+1=", "2", None, {"level": None})])
    assert c.score(["2", "4"], [unscored.answer, ex2.answer]) == [None, 1.0]  # no function scored it
    registry = CombinedReward.load(["exact"])  # answers only: nothing to carry
    assert registry.carry([Example("p", "9")]) == [Example("p", "9")]
    assert registry.score(["9", "8"], ["9", "9"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"prompt 'p': its extra columns \['blob'\] reach the reward functions"):
        c.carry([Example("p", "a", None, {"blob": object()})])




def test_recipe_runs_a_parquet_dataset_with_a_reward_file(user_file, tmp_path, monkeypatch):
    """Two steps, one process: the reward is 2 x the file's bonus column (given the right prompts and answers)
    plus 0 x exact, so every sample scores exactly 0.5."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    f = tmp_path / "d.parquet"
    prompts = ["max:381920=", "max:123456=", "max:700000="]
    datasets.Dataset.from_list([{"prompt": p, "answer": max(p[4:10]), "bonus": 0.25} for p in prompts]).to_parquet(f)
    history = recipe_module().main(["--world", "1", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
                                     "--dataset", str(f), "--reward", f"{user_file}:bonus", "--reward", "exact",
                                     "--reward-weights", "2,0"])
    assert [m["reward_mean"] for m in history] == [0.5, 0.5]


@pytest.mark.parametrize("flags, line", [
    (["--reward", "exact", "--reward-weights", "0.5,1"],
     "--reward-weights 0.5,1: gives 2 weights for 1 --reward functions (exact)"),
    (["--reward-weights", "a,b"], "--reward-weights a,b: expected comma-separated numbers"),
    (["--reward", "{f}:nope"], "--reward {f}:nope: reward {f}:nope: {f} has no function 'nope'"),
    (["--reward", "exact", "--reward", "{f}:strict", "--dataset", "{data}"],
     "--reward exact {f}:strict: reward {f}:strict cannot be called as fn(prompts=, completions=, answers=, level=)"),
])
def test_bad_reward_flags_are_one_line_naming_the_flag(flags, line, user_file, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2", "level": 1}) + "\n")
    fmt = dict(f=user_file, data=data)
    with pytest.raises(SystemExit) as e:
        recipe_module().parse_args([x.format(**fmt) for x in flags])
    assert e.value.code == 2
    assert line.format(**fmt) in capsys.readouterr().err.strip().splitlines()[-1]
