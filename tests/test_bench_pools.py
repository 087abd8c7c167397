"""``bench/pools_projection.py``'s pricing of separate pools from dry traces, on a small world: each split's step is
its slower pool's plus the push beyond it, its memory the dry step's peak plus the push's copies, and the same traces
give the colocated step ``bench/dryrun.py`` prices."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def projection(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import pools_projection
    return pools_projection


def test_a_splits_step_is_its_slower_pool_and_the_push_beyond_it(projection):
    pp = projection
    s = pp.Scenario("tiny", "qwen3-moe-tiny", 4, 4, 2, 16, 64, ("pp=2,dp=2", "ep=2,dp=2"),
                    ((2, "ep=2", "dp=2"), (2, "dp=2", "tp=2")))
    out = pp.dry_priced(s, micro=2, inter=1e3)  # a slow link: the push is longer than either pool
    assert set(out) == set(pp.DATASHEETS)
    for rows in out.values():
        lo, hi, graph = rows["colocated_s"]
        assert 0 < graph <= lo <= hi
        for K, _, rl in s.splits:
            r = rows[f"pools_K{K}_{rl}"]
            for i in range(3):
                g, t, push = r["gen_s"][i], r["train_s"][i], r["push_s"]
                assert r["step_s"][i] == pytest.approx(max(g, t + max(0.0, push - max(g, t))), abs=2e-3)
            assert r["push_s"] > max(r["gen_s"][1], r["train_s"][1])  # so the step is the push's
            assert 0 < r["gen_s"][2] <= r["gen_s"][0] <= r["gen_s"][1] and 0 < r["train_s"][0] <= r["train_s"][1]
            assert r["fits"] and r["rollout_peak_bytes"] > 0 and r["train_peak_bytes"] > 0
