"""Separate device pools (``--rollout-ranks``): the rollout pool generates while the train pool trains, the
rows cross through the dock's slots and the weights through the push. At staleness 0 the pools change where
work runs, not what is computed; at staleness k no step is trained more than k updates after the weights
that sampled it; what the pools cannot run yet is refused by its flag."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import recipe_module
from safetensors.torch import load_file

from rlflow.runtime.pools import Link, Pools, TrainSide
from rlflow.runtime.report import Figures, RolloutReport

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--steps", "4", "--prompts-per-step", "4", "--group-size", "4", "--lr", "1e-3"]


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out, name: str = "checkpoint-final") -> dict[str, torch.Tensor]:
    d = out / name
    return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors") for k, v in load_file(d / f).items()}


@pytest.mark.slow
@pytest.mark.parametrize("multiturn, lora", [(False, False), (True, False), (False, True)],
                         ids=["single-turn", "multi-turn", "lora"])
def test_pools_at_staleness_0_train_as_the_synchronous_run(tmp_path, multiturn, lora):
    """1 rollout rank + 1 train rank at --max-staleness 0 against one process on one thread, as each rank
    computes: the same rewards every step and bitwise the same weights after the steps; with multi-turn
    episodes (their loss mask through the dock), the same episodes' counts too. Single-turn, both evaluate
    every 2 steps (the train pool evaluates the weights it trained): the same eval figures. LoRA: the same, with
    the model pushed once and the adapters alone after it (the weights compared are the adapters)."""
    one, pools = tmp_path / "one", tmp_path / "pools"
    script = os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py")
    envs = os.path.join(ROOT, "tests", "multiturn_envs.py")
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(json.dumps({"prompt": f"max:{d}=", "answer": max(d)}) + "\n"
                             for d in ("381920", "112233", "907156", "012345", "765432")))
    env = ["--env", f"{envs}:Hint", "--max-turns", "2", "--reward", f"{envs}:spread"] if multiturn else \
        ["--eval-dataset", str(evals), "--eval-every", "2", "--eval-samples", "2"]
    # LoRA: every version's weights, the model pushed once and the adapters after it, are those trained
    env += ["--check-logprobs", "1e-4", "--lora-rank", "4", "--lr", "1e-2"] if lora else []
    for out, flags in ((one, ["--world", "1", "--save-every", "2"]), (pools, ["--world", "2", "--rollout-ranks", "1"])):
        res = subprocess.run([sys.executable, script, *SMALL, *flags, *env, "--out", str(out)], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == 0, res.stderr[-3000:]
    a, b = _metrics(one), _metrics(pools)
    if not multiturn:
        ea, eb = ([m for m in rows if "eval/pass@1" in m] for rows in (a, b))
        assert [m["step"] for m in eb] == [0, 2, 4] and ea == eb, (ea, eb)
        assert lora or len({m["eval/response_len"] for m in eb}) > 1  # the evaluated weights changed
        a, b = ([m for m in rows if "reward_mean" in m] for rows in (a, b))
    assert [m["step"] for m in b] == [0, 1, 2, 3]
    for x, y in zip(a, b):
        assert y["staleness"] == 0
        assert (x["reward_mean"], x["response_tokens"]) == pytest.approx((y["reward_mean"], y["response_tokens"]))
        if multiturn:
            assert x["env/turns"] == y["env/turns"] == 32 and y["env/max_turns"] == 16
    wa, wb = _weights(one), _weights(pools)
    assert wa.keys() == wb.keys()
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []
    before = _weights(one, "checkpoint-000002")  # and the steps trained: the weights are not the start's
    assert max(float((wa[k] - before[k]).abs().max()) for k in wa) > 1e-4
    if not multiturn:  # resumed when every step is done: the rollout pool is told to stop, the run ends cleanly
        res = subprocess.run([sys.executable, script, *SMALL, "--world", "2", "--rollout-ranks", "1", "--out",
                              str(pools), "--resume", "auto", *env[-4:] * lora], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0 and "nothing to do: 4 of 4 steps are done" in res.stdout, res.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial-rollout"])
def test_pools_at_staleness_2_train_no_step_older_than_2(tmp_path, partial):
    """A rollout pool two versions ahead at most: every step's staleness is in [0, 2], every sampled token's
    too (with partial rollout a row may span versions: its oldest token bounds it), every step was trained
    once, and the run reports the pools' figures. The partial run trains on 2 ranks in tp=2: its token counts
    count each row once, not once per tp rank."""
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--rollout-ranks", "1",
           "--max-staleness", "2", "--steps", "8", "--prompts-per-step", "4", "--group-size", "4", "--out", str(out),
           *(["--partial-rollout", "--world", "3", "--train-layout", "tp=2"] if partial else [])]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _metrics(out)
    assert [m["step"] for m in rows] == list(range(8))
    assert all(0 <= m["staleness"] <= 2 for m in rows), [m["staleness"] for m in rows]
    for m in rows:  # every sampled token counted once, none older than its step's oldest version
        tokens = [m[f"stale_tokens/{s}"] for s in range(3)]
        assert sum(tokens) == m["response_tokens"] and sum(tokens[int(m["staleness"]) + 1:]) == 0, m
        if not partial:  # the step's tokens all share its version
            assert tokens[int(m["staleness"])] == m["response_tokens"], m
    assert "sampled tokens by staleness" in res.stdout
    assert all(m["unscored"] == 0 and m["response_tokens"] > 0 for m in rows)  # each step trained a whole batch
    assert f"separate pools: ranks 0..0 generate and score, ranks 1..{2 if partial else 1} train; --max-staleness 2" \
        in res.stdout
    assert "separate pools: staleness" in res.stdout and "rows produced after the last step trained" in res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--rollout-ranks", "2", "--adv-estimator", "gae"],
                                   ["--rollout-ranks", "1", "--train-layout", "pp=2"]],
                         ids=["ppo-2-rollout", "train-pp"])
def test_pools_run_ppo_on_a_rollout_pool_of_two_and_a_pp_train_pool(tmp_path, flags):
    """Two layouts each pool runs its side of: PPO with two rollout ranks (the critic is the train pool's; the
    rollout ranks were refused for lacking its layout) and a pp=2 train pool (its own placement never generates;
    the rollout pool's no-pp rule refused it). Both ended in rc 1 before."""
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--world", "3", *flags, "--steps", "2",
           "--prompts-per-step", "4", "--group-size", "4", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [m["step"] for m in _metrics(out)] == [0, 1]


@pytest.mark.slow
def test_pools_at_staleness_1_learn_the_default_task():
    """The recipe's default workload with 1 rollout rank and 1 train rank, one version off-policy: after the
    default learning test's 150 steps (its samples) the mean reward of the last 10 steps is 0.25 above the
    first 10 (the synchronous run reaches about +0.38 there, this one about +0.35: bench/async.py)."""
    history = recipe_module().main(["--rollout-ranks", "1", "--max-staleness", "1", "--steps", "150"])
    r = [m["reward_mean"] for m in history]
    assert [m["step"] for m in history] == list(range(150))
    assert max(m["staleness"] for m in history) <= 1
    assert sum(r[-10:]) / 10 - sum(r[:10]) / 10 >= 0.25, r


@pytest.mark.slow
def test_a_killed_rollout_rank_fails_naming_it_and_resume_reaches_the_uninterrupted_weights(tmp_path):
    """SIGKILL the rollout rank (the OOM killer, a lost node) after the first periodic checkpoint: the run fails
    at once naming it, and ``--resume auto`` (the versions continue from the checkpoint's step, the rollout pool
    reads the prompt stream from there) ends at staleness 0 with bitwise the weights of the uninterrupted run,
    each step trained once."""
    import psutil

    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--rollout-ranks", "1", "--steps", "8",
           "--save-every", "3", "--kl-coef", "0.05"]  # KL: the reference too, and the weights move after step 3
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole, out = tmp_path / "whole", tmp_path / "run"
    res = subprocess.run(cmd + ["--out", str(whole)], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    p = subprocess.Popen(cmd + ["--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 300
        while not (out / "checkpoint-000003").exists():
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.05)
        ranks = sorted((c for c in psutil.Process(p.pid).children() if "spawn_main" in " ".join(c.cmdline())),
                       key=lambda c: c.create_time())
        assert len(ranks) == 2
        ranks[0].send_signal(signal.SIGKILL)  # spawned in rank order: rank 0, the rollout pool
        t0 = time.time()
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0 and "rank 0 was killed by signal SIGKILL" in err, err[-2000:]
    assert time.time() - t0 < 30
    assert not (out / "checkpoint-final").exists()
    res = subprocess.run(cmd + ["--out", str(out), "--resume", "auto"], capture_output=True, text=True, timeout=300,
                         env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout
    rows = _metrics(out)
    assert [m["step"] for m in rows] == list(range(8))
    assert all(m["staleness"] == 0 for m in rows)
    wa, wb, start = _weights(whole), _weights(out), _weights(out, "checkpoint-000003")
    assert max(float((wa[k] - start[k]).abs().max()) for k in wa) > 1e-4  # the steps resumed moved the weights
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []


@pytest.mark.slow
def test_pools_under_torchrun_and_slurm_train_as_the_local_launch_does(tmp_path):
    """torchrun (one node, 2 ranks) and two processes with Slurm's variables, --rollout-ranks 1: the ranks make
    the dock over the whole world, then split into the pools (``launch.split_world``); at staleness 0 they reach
    the local launch's rewards and weights exactly."""
    from rlflow.runtime.launch import free_port
    script = os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py")
    flags = [*SMALL, "--rollout-ranks", "1", "--kl-coef", "0.05"]
    slurm = dict(SLURM_NTASKS="2", SLURM_NODEID="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {"local": [([sys.executable, script], env)],
            "torchrun": [([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           script], env)],
            "slurm": [([sys.executable, script], {**env, **slurm, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)})
                      for i in (0, 1)]}
    got = {}
    for name, cmds in runs.items():
        out = tmp_path / name
        procs = [subprocess.Popen(c + flags + ["--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=e) for c, e in cmds]
        ends = [p.communicate(timeout=300) for p in procs]
        for p, (_, err) in zip(procs, ends):
            assert p.returncode == 0, (name, err[-3000:])
        assert any("separate pools: ranks 0..0 generate and score" in so for so, _ in ends), name
        got[name] = [m["reward_mean"] for m in _metrics(out)], _weights(out)
    want_r, want_w = got["local"]
    assert len(set(want_r)) > 1 or want_r[0] > 0, "the rewards must vary to mean something"
    for name in ("torchrun", "slurm"):
        r, w = got[name]
        assert r == want_r, (name, r, want_r)
        assert [k for k in want_w if not torch.equal(w[k], want_w[k])] == [], name


@pytest.mark.parametrize("flags, named", [
    (["--rollout-ranks", "2"], "--rollout-ranks 2: leaves no rank of --world 2 to train"),
    (["--rollout-ranks", "-1"], "--rollout-ranks -1: must be >= 0"),
    (["--max-staleness", "1"], "--max-staleness 1: needs separate pools (colocated steps are synchronous); "
                               "--rollout-ranks K makes them"),
    (["--rollout-ranks", "1", "--max-staleness", "-1"], "--max-staleness -1: must be an integer >= 0"),
    (["--rollout-ranks", "1", "--steps", "20", "--max-staleness", "1000000000"],
     "--max-staleness 1000000000: must be <= --steps 20"),
    (["--rollout-ranks", "1", "--dock-backend", "local"], "--dock-backend local: "),
    (["--world", "3", "--rollout-ranks", "1", "--train-layout", "tp=3"], "--train-layout tp=3"),
    (["--partial-rollout"], "--partial-rollout: needs separate pools"),
    (["--world", "3", "--rollout-ranks", "2", "--rollout-layout", "tp=2", "--partial-rollout"],
     "--partial-rollout: rollout layout mesh(pp=1,dp=1,ep=1,tp=2): its ranks decode in lockstep"),
    (["--rollout-ranks", "1", "--partial-rollout", "--env", "max_digit_feedback"],
     "--partial-rollout=True: swapping weights mid-generation is built for single-turn rows"),
])
def test_what_pools_cannot_run_is_refused_by_its_flag(flags, named, capsys):
    recipe = recipe_module()
    with pytest.raises(SystemExit) as e:
        recipe.parse_args(flags)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_pools_number_their_ranks_rollout_first():
    p = Pools(2, 5)
    assert [p.pool(r) for r in range(5)] == ["rollout"] * 2 + ["train"] * 3
    assert [p.local(r) for r in range(5)] == [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    assert p.train_lead == 2
    for bad, why in (((0, 2), "rollout=0: must be >= 1"), ((2, 2), "rollout=2: leaves no rank of a world of 2")):
        with pytest.raises(ValueError, match=why):
            Pools(*bad)


def test_the_train_lead_sums_the_rollout_ranks_counts_and_takes_their_slowest_times_and_oldest_version():
    """Two rollout ranks' reports of one step, as the train lead reads them: counts summed; times and vLLM's load
    figures (a rank's own, reported "per rank") the slowest rank's; the version the oldest (the staleness bound)."""

    class Reports(dict):
        def get(self, key):
            return self[key]

        def delete_key(self, key):
            del self[key]
    rows = (RolloutReport(3, Figures({"reward_sum": 1.5}, {"rollout_time_s": 0.2, "engine_load_s": 0.1,
                                                            "engine_load_bytes": 100.0}), rows=8, version=2),
            RolloutReport(3, Figures({"reward_sum": 2.0}, {"rollout_time_s": 0.5, "engine_load_s": 0.3,
                                                            "engine_load_bytes": 100.0}), rows=8, version=3))
    reports = Reports({f"{r}/1": row.to_bytes() for r, row in enumerate(rows)})
    side = TrainSide(Link(Pools(2, 3), 2, None, reports), 0, plan=None)
    got = side.figures(3)
    assert (got.rows, got.figures.counts["reward_sum"]) == (16, 3.5)
    times = got.figures.times
    assert (times["rollout_time_s"], times["engine_load_s"], times["engine_load_bytes"]) == (0.5, 0.3, 100.0)
    assert got.version == 2


@pytest.mark.parametrize("setting", [dict(max_staleness=1), dict(partial_rollout=True)])
def test_a_colocated_context_refuses_the_pools_settings(setting):
    """Through the library (no recipe flags): a colocated step would run synchronously, ignoring a staleness bound or
    partial rollout it was given; ``step.context`` refuses them by name instead."""
    import dataclasses

    from rlflow.rewards import per_sample
    from rlflow.runtime.step import context
    from tests.test_runtime import CFG, TOK, lcfg, reward

    conf = dataclasses.replace(lcfg(), **setting)
    with pytest.raises(ValueError, match=f"{next(iter(setting))}={next(iter(setting.values()))}"):
        context(CFG, TOK, per_sample(reward), conf)
    context(CFG, TOK, per_sample(reward), lcfg())  # the same without them builds


def test_the_library_refuses_what_a_placement_cannot_run_as_the_recipe_does():
    """One rule, one place (``config.placement_problems``): ``step.context`` refuses multi-turn episodes and partial
    rollout on a rollout layout that decodes in lockstep (the recipe names the same rule's flag: test_recipe,
    the list above), before any rank's groups are made."""
    import dataclasses

    from rlflow.models.sharding import layout
    from rlflow.rewards import per_sample
    from rlflow.runtime.placement import Colocated
    from rlflow.runtime.step import context
    from rlflow.sharding.mesh import Mesh
    from tests.test_runtime import CFG, TOK, lcfg, reward

    tp2 = layout(CFG, Mesh(tp=2), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"multiturn=.*rollout layout mesh\(pp=1,dp=1,ep=1,tp=2\): multi-turn"):
        context(CFG, TOK, per_sample(reward), lcfg(mt=True), placement=Colocated(tp2, tp2))
    with pytest.raises(ValueError, match="partial_rollout=True: needs separate pools"):
        context(CFG, TOK, per_sample(reward), dataclasses.replace(lcfg(), partial_rollout=True),
                placement=Colocated(tp2, tp2))


def test_train_shards_of_another_dtype_than_the_train_layout_are_refused_before_the_first_push():
    """The push casts into the rollout layout's dtype and the rollout side's buffers are that layout's: float32
    weights under bfloat16 layouts (``rlflow.layout``'s default) would generate in bfloat16 without a word."""
    from rlflow.models import decoder
    from rlflow.models.sharding import layout
    from rlflow.sharding.mesh import Mesh
    from rlflow.sharding.plan import push_plan
    from tests.test_runtime import CFG

    lay = layout(CFG, Mesh(), dtype=torch.bfloat16)
    side = TrainSide(Link(Pools(1, 2), 1, None, None), 0, push_plan(lay, lay))
    with pytest.raises(ValueError, match="train shards' .* is torch.float32, the train layout's torch.bfloat16"):
        side.push(decoder.init_params(CFG, seed=0), 0)


def test_a_disaggregated_placement_outside_its_launched_pools_is_refused_by_name():
    """``step.context`` with separate pools in a process its launcher did not put in them (no link), or in pools
    of another split, says so instead of waiting for a push that never comes."""
    from rlflow.dock.client import Dock
    from rlflow.models.sharding import layout
    from rlflow.rewards import per_sample
    from rlflow.runtime import pools
    from rlflow.runtime.graph import GRPO
    from rlflow.runtime.placement import Disaggregated
    from rlflow.runtime.step import context
    from rlflow.sharding.mesh import Mesh
    from tests.test_runtime import CFG, TOK, lcfg, reward

    lay = layout(CFG, Mesh(), dtype=torch.float32)
    where = Disaggregated(rollout=lay, train=lay)
    dock = Dock.local(GRPO.schema, GRPO.consumers, capacity=64, group_size=4)
    try:
        with pytest.raises(ValueError, match="Disaggregated placement of 2 ranks .* no rank of separate pools"):
            context(CFG, TOK, per_sample(reward), lcfg(), dock=dock, placement=where)
        pools._JOINED[0] = Link(Pools(1, 3), 0, None, None)
        with pytest.raises(ValueError, match=r"a rank of Pools\(rollout=1, world=3\)"):
            context(CFG, TOK, per_sample(reward), lcfg(), dock=dock, placement=where)
    finally:
        pools.leave()
        dock.close()


@pytest.mark.slow
def test_a_dock_process_killed_under_separate_pools_is_one_line():
    """kill -9 of a dock process mid-run: the rank that reaches it says DockLost in one line; the others, whose
    connections to it closed, end without a word (there was 'terminate called without an active exception',
    the rollout rank's traceback and torch's notes on each rank it stopped)."""
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--world", "3", "--rollout-ranks", "1",
           "--steps", "300", "--prompts-per-step", "4", "--group-size", "4"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 120
    while True:  # the dock's servers are the launcher's forked children (the ranks are spawned)
        kids = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(p.pid)], capture_output=True,
                              text=True).stdout.splitlines()
        ranks = [k for k in kids if "spawn_main" in k]
        docks = [int(k.split()[0]) for k in kids if "spawn_main" not in k and "resource_tracker" not in k]
        if len(ranks) == 3 and docks:
            break
        assert p.poll() is None and time.time() < deadline, (kids, p.communicate()[0][-300:])
        time.sleep(0.2)
    time.sleep(6)  # the ranks started and stepping
    os.kill(docks[0], signal.SIGKILL)
    out, _ = p.communicate(timeout=120)
    errors = re.findall(r"error: [^\n]*", out)  # after the progress bar's last frame, on its line
    assert p.returncode != 0 and len(errors) == 1 and "transfer dock" in errors[0], out[-3000:]
    for noise in ("Traceback", "terminate called", "Terminating process", "Unable to shutdown"):
        assert noise not in out, out[-3000:]
