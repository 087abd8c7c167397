"""Smoke run of bench/e2e_vs_trl.py: rlflow and TRL's GRPOTrainer on the same tiny workload, four timed steps;
its TPS figures and their ratio recomputed here from the step times it printed."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "e2e_vs_trl.py")
ARGS = ["--max-new-tokens", "4", "--prompts-per-step", "4", "--group-size", "4", "--warmup", "1", "--steps", "4",
        "--threads", "1"]
# same work on both sides: 4 x 4 samples of (1 BOS + 11 prompt chars) + 4 response tokens each
TOKENS_PER_STEP = 16 * (12 + 4)
STEP_LINE = re.compile(r"^  step (\d+) \((warm-up|timed)\): rlflow ([0-9.]+)s  TRL ([0-9.]+)s$", re.M)


def _median(xs: list[float]) -> float:
    """Written out (not statistics.median) so that the reference shares no code with the benchmark."""
    s, n = sorted(xs), len(xs)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def check_figures(stdout: str, warmup: int = 1, steps: int = 4) -> dict:
    """The last JSON line's TPS and ratio against an independent computation from the step times (Eq. 5 with
    one device: tokens of a step / median timed step time; the ratio is rlflow's TPS over TRL's). Tolerances
    are what the printed rounding allows: step times to 4 decimals (5e-5 s), TPS to 0.1, the ratio to 1e-3."""
    out = json.loads(stdout.strip().splitlines()[-1])
    lines = STEP_LINE.findall(stdout)
    assert [(int(i), tag) for i, tag, _, _ in lines] == [(i, "warm-up" if i < warmup else "timed")
                                                         for i in range(warmup + steps)]
    times = {"rlflow": out["rlflow_step_times_s"], "trl": out["trl_step_times_s"]}
    for k, name in ((2, "rlflow"), (3, "trl")):  # the JSON lists are the timed steps printed as they ran
        printed = [float(x[k]) for x in lines[warmup:]]
        assert len(times[name]) == steps and all(abs(a - b) <= 5.5e-4 for a, b in zip(times[name], printed)), \
            (name, times[name], printed)
    assert out["tokens_per_step"] == TOKENS_PER_STEP
    med = {name: _median(t) for name, t in times.items()}
    tps = {name: TOKENS_PER_STEP / m for name, m in med.items()}
    for name in ("rlflow", "trl"):
        assert abs(out[f"{name}_step_s"] - med[name]) <= 1.1e-4, (name, out[f"{name}_step_s"], med[name])
        assert abs(out[f"{name}_tps"] - tps[name]) <= tps[name] * 6e-5 / med[name] + 0.05, (name, out, tps)
    ratio = tps["rlflow"] / tps["trl"]  # = median TRL step / median rlflow step: the same tokens on both sides
    slack = ratio * (6e-5 / med["rlflow"] + 6e-5 / med["trl"]) + 5e-4
    assert abs(out["ratio"] - ratio) <= slack, (out["ratio"], ratio, slack)
    return out


@pytest.mark.slow
def test_e2e_vs_trl_prints_both_tps_and_ratio_as_last_json_line():
    res = subprocess.run([sys.executable, SCRIPT, *ARGS], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TPS = (prompt tokens + response tokens" in res.stdout
    out = check_figures(res.stdout)
    assert out["rlflow_tps"] > 0 and out["trl_tps"] > 0
    w = out["workload"]
    assert (w["prompts_per_step"], w["group_size"], w["max_new_tokens"], w["timed_steps"]) == (4, 4, 4, 4)
    assert out["init_logits_max_abs_diff"] < 1e-4
    assert out["torch_threads"] == 1 and out["device"] == "cpu"


@pytest.mark.slow
def test_peak_memory_mode_measures_each_system_alone():
    """--memory: each system's steps in a process of its own; the peak covers the steps (at least the resident set
    before them) and the ratio is the two peaks'."""
    res = subprocess.run([sys.executable, SCRIPT, *ARGS, "--steps", "1", "--warmup", "0", "--memory"], capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for name in ("rlflow", "trl"):
        run = out["runs"][name]
        assert run["system"] == name and run["steps"] == 1
        assert run["peak_rss_mib"] >= run["rss_before_mib"] > 0 and out[f"{name}_peak_rss_mib"] == run["peak_rss_mib"]
    assert abs(out["trl_over_rlflow"] - out["trl_peak_rss_mib"] / out["rlflow_peak_rss_mib"]) < 1e-3
