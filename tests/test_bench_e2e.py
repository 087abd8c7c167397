"""Smoke run of bench/e2e_vs_trl.py: rlflow and TRL's GRPOTrainer on the same tiny workload, one timed step."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_e2e_vs_trl_prints_both_tps_and_ratio_as_last_json_line():
    cmd = [sys.executable, os.path.join(ROOT, "bench", "e2e_vs_trl.py"), "--max-new-tokens", "4",
           "--prompts-per-step", "4", "--group-size", "4", "--warmup", "1", "--steps", "1", "--threads", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TPS = (prompt tokens + response tokens" in res.stdout
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["rlflow_tps"] > 0 and out["trl_tps"] > 0
    assert out["ratio"] == pytest.approx(out["rlflow_tps"] / out["trl_tps"], rel=1e-2)
    w = out["workload"]
    assert (w["prompts_per_step"], w["group_size"], w["max_new_tokens"]) == (4, 4, 4)
    # same work on both sides: 4 x 4 samples of (1 BOS + 11 prompt chars) + 4 response tokens each
    assert out["tokens_per_step"] == 16 * (12 + 4)
    assert out["init_logits_max_abs_diff"] < 1e-4
    assert out["torch_threads"] == 1 and out["device"] == "cpu"
