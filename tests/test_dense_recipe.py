"""The dense recipe (recipes/grpo_qwen25_dense.py): the MoE recipe's machinery with its own defaults."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DENSE = os.path.join(ROOT, "recipes", "grpo_qwen25_dense.py")


def dense_module():
    spec = importlib.util.spec_from_file_location("grpo_qwen25_dense", DENSE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_help_shows_the_dense_defaults():
    res = subprocess.run([sys.executable, DENSE, "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    text = " ".join(res.stdout.split())  # argparse wraps the help lines
    assert "GRPO on Qwen2.5 dense" in text  # its own description, not the MoE recipe's
    assert "--preset PRESET named model config used when --model is not given (default: qwen2.5-tiny)" in text
    assert "--entropy-coef ENTROPY_COEF entropy bonus coefficient (default: 0.01)" in text
    for flag in ["--model", "--dataset", "--train-layout", "--rollout-layout", "--world", "--out"]:
        assert flag in text


def test_defaults_replace_the_recipe_defaults_and_flags_override_them():
    from rlflow import recipe as moe
    dense = dense_module()
    r = moe.parse_args([], dense.DEFAULTS)
    assert (r.preset, r.entropy_coef) == ("qwen2.5-tiny", 0.01)
    assert moe.parse_args(["--preset", "qwen3-moe-tiny"], dense.DEFAULTS).preset == "qwen3-moe-tiny"
    assert moe.parse_args([]).preset == "qwen3-moe-tiny"  # the MoE recipe's own defaults are untouched
    with pytest.raises(TypeError, match="entropy_coeff"):
        moe.parse_args([], {"entropy_coeff": 0.1})


LEARN_STEPS, LEARN_MARGIN = 150, 0.15  # seed 0 reaches +0.24 by step 150


def test_the_default_dense_run_learns(capsys):
    """The dense recipe's defaults from scratch on a fixed seed, one process (~45-70 s on 2 busy cores): the mean
    reward of the last 10 steps is clearly above the first 10."""
    dense = dense_module()
    history = dense.main(["--world", "1", "--steps", str(LEARN_STEPS)], defaults=dense.DEFAULTS)
    assert "model: qwen2.5-tiny (qwen2, 0.27M params, dense)" in capsys.readouterr().out
    r = [m["reward_mean"] for m in history]
    rise = sum(r[-10:]) / 10 - sum(r[:10]) / 10
    assert rise >= LEARN_MARGIN, rise
