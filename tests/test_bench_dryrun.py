"""``bench/dryrun.py`` itself on a small world: its JSON's memory and collectives checks, and its predictions'
arithmetic (the queue's bounds, the graph-decode step, tokens per device per second)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_dry_run_bench_checks_a_small_world_and_prices_its_step():
    out = subprocess.run([sys.executable, "bench/dryrun.py", "--cases", "tiny", "--world-check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (case,) = json.loads(out.stdout.strip().splitlines()[-1])["cases"]
    assert case["collectives_matched"] and case["ranks_stepped"] == 4 and case["fits_910b"]
    assert 0 < case["ledger_bytes_max"] <= case["peak_bytes_max"]
    tokens = case["rows"] * sum(case["tokens"])
    assert [p["device"] for p in case["predicted"]] == ["NVIDIA H200", "Ascend 910B"]
    for p in case["predicted"]:
        lo, hi = p["step_s"]
        assert 0 < p["graph"]["step_s"] <= lo <= hi
        assert p["graph"]["decode_s"] <= p["stages_s"]["decode"][0] <= p["stages_s"]["decode"][1]
        assert p["tps"] == pytest.approx([tokens / (4 * hi), tokens / (4 * lo)], rel=0.01)
        assert {"transition", "generate", "decode", "swap back", "ref_logprob", "update"} <= set(p["stages_s"])
        assert set(p["roofline_s"]) == {"gen", "train", "swap"}
