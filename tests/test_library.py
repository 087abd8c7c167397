"""The public API (``rlflow.__all__``) and docs/library.md, which is run rather than read: its loop learns, its
second block runs, and its reference table names every public name with the object it is."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import rlflow

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "library.md"
# The doc's loop at 150 steps (2 CPU cores, torch 2.13): the mean reward of the first 10 steps is 0.001, of the last
# 10 0.373: +0.37 (seeds 1, 2, 3: +0.33 to +0.46), in 12 s with the cores free. With the advantages' sign flipped it
# stays at -0.001, with lr=1e-12 at 0.0.
LEARN_STEPS, LEARN_MARGIN = 150, 0.15
TABLE_ROW = re.compile(r"^\| `(\w+)` \| .+ \| `([\w.]+)` \|$", re.M)


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), re.S | re.M)


def _run_loop(steps: int) -> dict:
    """The doc's first block, exactly, with its ``STEPS`` set to ``steps``; its namespace."""
    code, n = re.subn(r"^(STEPS\b[^=\n]*=\s*)\d+", lambda m: f"{m.group(1)}{steps}", _blocks()[0], count=1,
                      flags=re.M)
    assert n == 1, "docs/library.md's first python block no longer starts its settings with `STEPS ... = <int>`"
    ns: dict = {"__name__": "library_md"}
    exec(compile(code, f"{DOC}: first python block", "exec"), ns)
    return ns


def test_the_docs_loop_learns(capsys):
    ns = _run_loop(LEARN_STEPS)
    r = ns["history"]
    assert len(r) == LEARN_STEPS and all(0.0 <= x <= 1.0 for x in r), r
    rise = sum(r[-10:]) / 10 - sum(r[:10]) / 10
    assert rise >= LEARN_MARGIN, f"reward rose {rise:+.3f} over {LEARN_STEPS} steps: {[round(x, 3) for x in r]}"
    assert f"step {LEARN_STEPS}: reward " in capsys.readouterr().out


def test_the_docs_second_block_runs_after_the_loop(capsys):
    ns = _run_loop(2)
    blocks = _blocks()
    assert len(blocks) >= 2
    exec(compile(blocks[1], f"{DOC}: second python block", "exec"), ns)
    out = capsys.readouterr().out
    assert len(ns["steps"]) == 2 and "kl" in ns["metrics"]
    assert "plan allgather_swap: mesh(pp=1,dp=1,ep=1,tp=2) -> mesh(pp=1,dp=2,ep=1,tp=1) on 2 ranks" in out


def test_the_docs_pools_block_trains_in_two_pools_within_the_staleness_bound(tmp_path):
    """The separate pools' block, saved as a file and run as the doc says: rank 0 generates, rank 1 trains every
    step, each on rows sampled at most K updates before (the first with the initial weights)."""
    (tmp_path / "pools.py").write_text(_blocks()[2])
    res = subprocess.run([sys.executable, "pools.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = ast.literal_eval(res.stdout.strip().splitlines()[-1])
    assert [s for s, _ in steps] == [0, 1, 2, 3], steps
    assert steps[0][1] == 0 and all(0 <= lag <= 1 for _, lag in steps), steps


def _resolve(path: str):
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for a in parts[i:]:
            obj = getattr(obj, a)
        return obj
    raise ImportError(path)


def test_every_public_name_resolves_to_what_the_table_says():
    rows = dict(TABLE_ROW.findall(DOC.read_text()))
    assert set(rows) == set(rlflow.__all__), (f"not in the table: {sorted(set(rlflow.__all__) - set(rows))}; "
                                              f"in the table, not public: {sorted(set(rows) - set(rlflow.__all__))}")
    assert len(rlflow.__all__) == len(set(rlflow.__all__))
    for name in rlflow.__all__:
        if name == "ray_dock" and importlib.util.find_spec("ray") is None:
            continue  # Ray is optional
        assert getattr(rlflow, name) is _resolve(rows[name]), (name, rows[name])
        assert name in dir(rlflow)


def test_the_docstring_lists_every_public_name():
    doc = rlflow.__doc__
    missing = [n for n in rlflow.__all__ if not re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", doc)]
    assert not missing, missing


def test_every_rlflow_name_the_doc_uses_exists():
    submodules = {m.name for m in pkgutil.iter_modules(rlflow.__path__)}
    used = set(re.findall(r"\brlflow\.(\w+)", DOC.read_text())) - {"__all__"}
    assert not used - set(rlflow.__all__) - submodules, sorted(used - set(rlflow.__all__) - submodules)
    code_used = set(re.findall(r"\brlflow\.(\w+)", "\n".join(_blocks())))
    assert code_used <= set(rlflow.__all__), sorted(code_used - set(rlflow.__all__))  # the loop: public names only


def test_no_public_name_hides_a_submodule():
    """``from rlflow import device`` must keep giving the module: a public name equal to a submodule's name is
    that submodule."""
    for m in pkgutil.iter_modules(rlflow.__path__):
        if m.name in rlflow.__all__:
            assert getattr(rlflow, m.name) is importlib.import_module(f"rlflow.{m.name}"), m.name
    from rlflow import device, optim
    assert device.__name__ == "rlflow.device" and optim.__name__ == "rlflow.optim"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rlflow.nope  # noqa: B018


def test_import_rlflow_is_cheap():
    """``import rlflow`` imports no torch, ray or transformers, and no rlflow module; a name pulls in its own."""
    code = ("import sys, rlflow; before = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('rlflow', 'torch', 'ray', 'transformers', 'datasets')); rlflow.Mesh; "
            "print(before, 'torch' in sys.modules, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['rlflow'] False False", out
