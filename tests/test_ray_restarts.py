"""--max-restarts on Ray: a rank that dies mid-step (its process SIGKILLed) is restarted with the whole world and a
fresh dock from the run's newest checkpoint, and the run ends with the weights of a run nobody interrupted; the
restart loop's choices (which checkpoint, how many times, which failures) and the launcher's verdicts on what a
failed Ray world lost; the flag refused where it cannot work."""

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import recipe_module

from rlflow.models import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py")]
RUN = ["--world", "2", "--steps", "6", "--save-every", "2", "--prompts-per-step", "4", "--group-size", "4"]

# A reward with spread in every group (the weights move from the first step). In the run whose --out is OUT, rank
# KILLED SIGKILLs its own process once (MARK records it), in its first scoring after checkpoint-000002 was written:
# mid-step.
FAULT = '''
import os, signal
OUT, MARK, KILLED = {out!r}, {mark!r}, {killed!r}


def distinct(prompts, completions, answers, **kwargs):
    if os.environ.get("RANK") == KILLED and os.path.isdir(os.path.join(OUT, "checkpoint-000002")) \\
            and not os.path.exists(MARK):
        open(MARK, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return [len(set(c)) / 4 for c in completions]
'''


def _weights(path):
    return hf.load(str(path))[1]


def _rows(out):
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("pools", [False, True], ids=["colocated", "pools"])
def test_a_rank_killed_mid_step_is_restarted_from_the_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path, pools):
    """Colocated, rank 1 is killed; with separate pools (--rollout-ranks 1, staleness 0), the rollout rank 0."""
    pytest.importorskip("ray")
    out, mark = tmp_path / "run", tmp_path / "killed"
    fault = tmp_path / "fault.py"
    killed = 0 if pools else 1
    fault.write_text(FAULT.format(out=str(out), mark=str(mark), killed=str(killed)))
    reward = ["--reward", f"{fault}:distinct"] + (["--rollout-ranks", "1"] if pools else [])
    # the uninterrupted run: the same world (colocated: train tp=2, rollout dp=2; pools: 1 + 1 ranks; gloo) as local
    # processes, which train exactly as the Ray actors do (the same ranks and collectives) and start in a third of the
    # time
    whole = tmp_path / "whole"
    res = subprocess.run(RECIPE + RUN + reward + ["--out", str(whole)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not mark.exists()

    t0 = time.monotonic()
    res = subprocess.run(RECIPE + RUN + reward + ["--launcher", "ray", "--max-restarts", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=400)
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr[-3000:]
    assert mark.exists(), f"rank {killed} was never killed"
    restarts = [ln for ln in res.stderr.splitlines() if ln.startswith("restart ")]
    assert len(restarts) == 1, res.stderr[-3000:]
    assert restarts[0].startswith(f"restart 1 of 1: rank {killed} was lost: its Ray actor died"), restarts
    assert restarts[0].endswith(f"restarting from {out / 'checkpoint-000002'}"), restarts
    assert f"resumed from {out / 'checkpoint-000002'} after 2 steps" in res.stdout
    assert "Traceback" not in res.stderr, res.stderr[-3000:]

    a, b = _weights(whole / "checkpoint-final"), _weights(out / "checkpoint-final")
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6, diff
    first = _weights(out / "checkpoint-000002")
    assert max(float((b[k] - first[k]).abs().max()) for k in b) > 1e-4, "the weights must move after the restart"
    assert [m["step"] for m in _rows(out)] == list(range(6))  # each step once: the redone one not twice
    assert [m["reward_mean"] for m in _rows(out)] == [m["reward_mean"] for m in _rows(whole)]
    print(f"the run with one restart took {took:.0f} s")


@pytest.mark.parametrize("flags, why", [
    (["--out", "OUT", "--save-every", "2"], "needs --launcher ray"),  # the local launcher
    (["--launcher", "ray", "--world", "1", "--out", "OUT", "--save-every", "2"], "needs --world > 1"),
    (["--launcher", "ray", "--out", "OUT"], "needs --out and --save-every"),
    (["--launcher", "ray"], "needs --out and --save-every"),
])
def test_max_restarts_is_refused_where_it_cannot_restart_naming_the_flag(flags, why, tmp_path, capsys):
    recipe = recipe_module()
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        recipe.parse_args(["--max-restarts", "1", *(str(out) if f == "OUT" else f for f in flags)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"--max-restarts 1: {why}" in err[-1] and "Traceback" not in "\n".join(err), err
    assert not out.exists()


def _checkpoint(root, name):
    """A checkpoint directory that verifies (a manifest listing no files)."""
    os.makedirs(root / name)
    (root / name / "manifest.json").write_text(json.dumps({"format": 1, "files": {}}))


def test_the_restart_loop_resumes_from_this_runs_newest_checkpoint_and_gives_up_after_k(tmp_path, monkeypatch,
                                                                                       capsys):
    """Ray itself is replaced here: each attempt gets a fresh dock (the old one closed), a restart resumes from
    the newest checkpoint this run wrote (not an earlier run's left in --out by --overwrite), the K + 1-th loss
    ends the run naming the rank, and a failure that is not a lost rank is not retried."""
    recipe = recipe_module()
    from rlflow.recipe import driver  # run_on_ray's module: the make_dock it calls
    from rlflow.runtime import launch
    out = tmp_path / "run"
    _checkpoint(out, "checkpoint-000008")  # an earlier run's
    r = recipe.parse_args(["--launcher", "ray", "--max-restarts", "2", "--save-every", "2", "--out", str(out),
                           "--overwrite"])
    docks, resumed = [], []

    class FakeDock:
        closed = False

        def close(self):
            self.closed = True
    monkeypatch.setattr(driver, "make_dock", lambda r, capacity: docks.append(FakeDock()) or docks[-1])

    def lose_rank_1(fn, world, attempt, dock, **kw):
        resumed.append(attempt.resume)
        _checkpoint(out, f"checkpoint-{2 * len(resumed):06d}")
        raise launch.RankLost([1], "its Ray actor died")
    monkeypatch.setattr(launch, "ray_spawn", lose_rank_1)
    with pytest.raises(SystemExit, match=r"^error: rank 1 was lost: its Ray actor died; the other ranks were "
                                         r"stopped \(after 2 restarts, --max-restarts 2\)$"):
        recipe.run_on_ray(r)
    assert resumed == [None, str(out / "checkpoint-000002"), str(out / "checkpoint-000004")]
    assert len(docks) == 3 and all(d.closed for d in docks)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"restart {i} of 2: rank 1 was lost: its Ray actor died; the other ranks were stopped; "
                     f"restarting from {out / f'checkpoint-{2 * i:06d}'}" for i in (1, 2)], lines

    def crash(fn, world, attempt, dock, **kw):
        resumed.append(attempt.resume)
        raise ValueError("a bug in the ranks' code")
    monkeypatch.setattr(launch, "ray_spawn", crash)
    resumed.clear()
    with pytest.raises(ValueError, match="a bug"):
        recipe.run_on_ray(r)
    assert resumed == [None] and docks[-1].closed


def _exits(rank, world):
    raise SystemExit("error: the lead's verdict" if rank == 0 else 1)


def _raises(rank, world):
    import torch
    import torch.distributed as dist
    if rank == 1:
        raise ValueError("boom")
    dist.all_reduce(torch.zeros(1))  # waits for rank 1 (torch's default timeout: 30 min)


def _hangs(rank, world):
    import torch
    import torch.distributed as dist
    if rank == 1:
        time.sleep(120)  # alive, never reaching the collective
    dist.all_reduce(torch.zeros(1))


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    from rlflow.runtime import launch
    launch.ray_init(None)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    yield launch
    ray.shutdown()


@pytest.mark.slow
def test_what_a_failed_ray_world_lost_decides_the_error(local_ray):
    """Only a lost rank is a RankLost (the one the restarts act on): a hung rank is named once the others'
    collectives time out; a rank's own exception and a rank's SystemExit (the recipe's verdicts) are raised as
    themselves, the others stopped within seconds, not after torch's 30 min timeout."""
    launch = local_ray
    t0 = time.monotonic()
    with pytest.raises(launch.RankLost, match=r"^rank 1 was lost: it stopped answering \(rank 0: RuntimeError: "
                                              r".*Timed out") as e:
        launch.ray_spawn(_hangs, 2, timeout_s=3)
    assert e.value.ranks == (1,) and time.monotonic() - t0 < 60
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="boom") as e:
        launch.ray_spawn(_raises, 2)
    assert not isinstance(e.value, launch.RankLost) and "raised on rank 1" in "".join(e.value.__notes__)
    assert time.monotonic() - t0 < 60
    with pytest.raises(SystemExit) as e:
        launch.ray_spawn(_exits, 2)
    assert e.value.code == "error: the lead's verdict"
