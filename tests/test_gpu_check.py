"""bench/gpu_check.sh on a bare accelerator machine (python with torch, transformers, hypothesis; no Ray, vLLM,
matplotlib or TRL): its timeouts fit the limit, and every step it launches gets past its imports and argument
parsing there. The steps run here on the CPU, small, with those packages hidden from python."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")
MISSING = ("ray", "vllm", "matplotlib", "trl")

# Put first on PYTHONPATH: every meta-path finder stops finding the missing packages, their modules and their
# distributions (so importlib.util.find_spec and importlib.metadata say "not installed" too, as on that machine).
HIDE = f"""
import sys

_MISSING = {set(MISSING)!r}


class _Without:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        find = getattr(self._finder, "find_spec", None)
        if find is None or name.partition(".")[0] in _MISSING:
            return None
        return find(name, path, target)

    def find_distributions(self, *args, **kwargs):
        find = getattr(self._finder, "find_distributions", None)
        dists = () if find is None else find(*args, **kwargs)
        return (d for d in dists if (d.metadata.get("Name") or "").lower() not in _MISSING)

    def __getattr__(self, name):
        return getattr(self._finder, name)


sys.meta_path[:] = [_Without(f) for f in sys.meta_path]
"""

RUN_LINE = re.compile(r"^\s*run (\w+) (\d+) (.*)$", re.M)


def script_steps() -> list[tuple[str, int, list[str]]]:
    """(name, timeout, argv after $PY) of every `run` line of the script, launched on this machine or not."""
    return [(m[1], int(m[2]), shlex.split(m[3])[1:]) for m in RUN_LINE.finditer(open(SCRIPT).read())]


def entry_point(argv: list[str]) -> str:
    return " ".join(argv[:2]) if argv[0] == "-m" else argv[0]


def test_the_timeouts_fit_the_limit():
    text = open(SCRIPT).read()
    limit = int(re.search(r"GPU_CHECK_LIMIT_S:-(\d+)", text)[1])
    allowance = int(re.search(r"^ALLOWANCE_S=(\d+)", text, re.M)[1])
    steps = script_steps()
    names = [name for name, _, _ in steps]
    assert len(names) == len(set(names)), names  # a step's name is its output file
    assert {"cuda_tests", "rollout_tiny", "rollout_0p5b", "ppo_recipe", "e2e_tiny", "e2e_0p5b"} <= set(names)
    # every step at its timeout, all branches taken, plus the start-up: inside the limit, and room left in a
    # 600 s device call for the machine's start and the transfers
    assert sum(t for _, t, _ in steps) + allowance <= limit <= 420
    from rlflow.models.config import get_config
    for _, _, argv in steps:
        if "--preset" in argv:
            get_config(argv[argv.index("--preset") + 1])  # the CPU runs below swap in the tiny preset


def _run(cmd, env, **kw):
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, **kw)
    return res, f"{' '.join(cmd)}\nrc={res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"


@pytest.mark.slow
def test_each_step_gets_past_its_imports_without_ray_vllm_matplotlib_trl(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE)
    base = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH", "GPU_CHECK_LIMIT_S")}
    env = {**base, "PYTHONPATH": str(hide), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}

    # the stand-in: those packages are gone, the rest is not
    probe = ("import importlib.util, sys\n"
             f"assert all(importlib.util.find_spec(m) is None for m in {MISSING!r})\n"
             f"for m in {MISSING!r}:\n"
             "    try:\n        __import__(m)\n    except ModuleNotFoundError as e:\n        assert e.name == m\n"
             "    else:\n        sys.exit(f'{m} imported')\n"
             "import torch, transformers, hypothesis\n")
    res, why = _run([sys.executable, "-c", probe], env)
    assert res.returncode == 0, why

    # the steps the script launches there, as it would launch them
    out = tmp_path / "gpu_out"
    res, why = _run(["bash", SCRIPT, str(out)], {**env, "GPU_CHECK_DRY": "1"})
    assert res.returncode == 0, why
    log = res.stdout
    assert f"budget: steps' timeouts {sum(t for _, t, _ in script_steps())}s" in log, log
    assert "=== e2e_tiny, e2e_0p5b: skipped, TRL is not installed" in log, log
    assert "elapsed" not in log, log  # within the default limit every step is launched
    launched = {m[1]: shlex.split(m[2]) for m in re.finditer(r"^=== (\w+) \(timeout \d+s\): (.*)$", log, re.M)}
    assert set(launched) == {"cuda_tests", "rollout_tiny", "rollout_0p5b", "ppo_recipe"}, log

    # each of them on the CPU, small: as the script's environment has it, but the device
    step_env = {**env, "PYTHONPATH": f"{ROOT}:{hide}", "RLFLOW_DEVICE": "cpu"}
    for name, argv in launched.items():
        assert argv[0] == sys.executable, argv
        entry = entry_point(argv[1:])
        if entry == "-m pytest":  # collecting imports every test module and conftest.py
            res, why = _run(argv + ["--collect-only"], step_env)
            assert res.returncode == 0 and "collected" in res.stdout, why
        elif entry == "bench/rollout_vs_hf.py":
            res, why = _run(argv + ["--device", "cpu", "--preset", "qwen3-moe-tiny", "--batch", "4",
                                    "--new-tokens", "2", "--repeats", "1"], step_env)
            assert res.returncode == 0, why
            assert json.loads(res.stdout.strip().splitlines()[-1])["rlflow_tokens_per_s"] > 0, why
        elif entry == "recipes/grpo_qwen3_moe.py":
            run_dir = argv[argv.index("--out") + 1]
            res, why = _run(argv + ["--steps", "2"], step_env)
            assert res.returncode == 0, why
            assert os.path.exists(os.path.join(run_dir, "checkpoint-final", "config.json")), why
            assert os.path.exists(os.path.join(run_dir, "metrics.jsonl")), why
            assert not os.path.exists(os.path.join(run_dir, "reward.png")), why
            assert "reward.png: skipped, matplotlib is not installed" in res.stdout, why
            wrote = [ln for ln in res.stdout.splitlines() if ln.startswith("wrote ")]
            assert len(wrote) == 1 and "reward.png" not in wrote[0], why
        else:
            pytest.fail(f"step {name} ({entry}): no CPU variant here; add one")

    # the entry points of the steps left out here (TRL's): their imports and flags
    for entry in sorted({entry_point(argv) for _, _, argv in script_steps()} - {entry_point(a[1:]) for a in
                                                                               launched.values()}):
        res, why = _run([sys.executable, *entry.split(), "--help"], step_env)
        assert res.returncode == 0 and "usage:" in res.stdout, why
