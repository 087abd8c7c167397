"""Smoke run of the recipe, and the start-up size checks."""

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import recipe_module

from rlflow.models import hf
from rlflow.runtime.config import validate_sizes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_recipe_two_steps_writes_metrics_plot_and_checkpoint(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--steps", "2",
           "--prompts-per-step", "4", "--group-size", "4", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TPS = (prompt tokens + response tokens" in res.stdout
    # the default: 2 processes, the weights moved between two layouts every step, the rows through the dock
    assert "layouts: train mesh(pp=1,dp=1,ep=1,tp=2), rollout mesh(pp=1,dp=2,ep=1,tp=1) on 2 ranks" in res.stdout
    assert "weights train -> rollout layout (allgather-swap)" in res.stdout and "transfer dock: 2 warehouses" in res.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert {"step", "reward_mean", "tps", "step_time_s"} <= set(r)
        assert r["tps"] > 0 and 0.0 <= r["reward_mean"] <= 1.0
    assert (out / "reward.png").stat().st_size > 1000
    assert (out / "checkpoint-final" / "config.json").exists()


def test_recipe_through_the_dock(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--steps", "2",
           "--prompts-per-step", "4", "--group-size", "4", "--world", "1", "--dock", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "transfer dock: 2 warehouses" in res.stdout


@pytest.mark.slow
def test_recipe_through_the_ray_dock(tmp_path):
    pytest.importorskip("ray")
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--steps", "2",
           "--prompts-per-step", "4", "--group-size", "4", "--world", "1", "--dock", "2", "--dock-backend", "ray"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "transfer dock: 2 warehouses" in res.stdout
    assert "done: 2 steps" in res.stdout


def test_recipe_help_lists_the_flags():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0
    for flag in ["--model", "--dataset", "--steps", "--prompts-per-step", "--group-size", "--max-new-tokens",
                 "--lr", "--kl-coef", "--seed", "--out"]:
        assert flag in res.stdout


@pytest.mark.parametrize("kw,msg", [
    (dict(prompts_per_step=6, group_size=5, mini_batch_size=4, micro_batch_size=2),
     "global batch 30 .*prompts_per_step 6 x group_size 5.* not divisible by mini_batch_size 4"),
    (dict(prompts_per_step=4, group_size=4, mini_batch_size=8, micro_batch_size=3),
     "mini_batch_size 8 is not divisible by micro_batch_size 3"),
    (dict(prompts_per_step=0, group_size=4, mini_batch_size=8, micro_batch_size=8), "prompts_per_step must be"),
])
def test_sizes_validated_with_numbers(kw, msg):
    with pytest.raises(ValueError, match=msg):
        validate_sizes(steps=1, **kw)


@pytest.mark.slow
def test_recipe_data_parallel_two_processes(tmp_path):
    out = tmp_path / "dp"
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--steps", "2",
           "--prompts-per-step", "4", "--group-size", "4", "--train-layout", "dp=2", "--rollout-layout", "dp=2",
           "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "layouts: train mesh(pp=1,dp=2,ep=1,tp=1), rollout mesh(pp=1,dp=2,ep=1,tp=1)" in res.stdout
    assert "weights train -> rollout" not in res.stdout  # the same layout: nothing to move
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["prompt_tokens"] for r in rows] == [4 * 4 * 12] * 2  # global token counts (both ranks' rows)


def test_recipe_with_rloo_gspo_and_token_is_runs_and_logs_the_mismatch(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--steps", "2", "--prompts-per-step", "4",
           "--group-size", "4", "--adv-estimator", "rloo", "--policy-loss", "gspo", "--loss-agg", "seq-mean-token-mean",
           "--clip-low", "0.0003", "--clip-high", "0.0004", "--rollout-is", "token", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # rollout and trainer run the same float32 path here: the log-probs agree to rounding
        assert 0 <= r["logp_diff_mean"] <= r["logp_diff_max"] < 1e-4 and abs(r["ratio_mean"] - 1) < 1e-4, r
        assert r["out_of_band"] == 0




@pytest.mark.slow
def test_under_torchrun_or_slurm_the_ranks_start_the_dock_and_train_as_a_local_launch_does(tmp_path):
    """torchrun on one node with 2 ranks, on two nodes of one rank each (two torchrun launches joined by a
    static rendezvous, as on a cluster), and two processes with the variables Slurm's srun sets (one node, two
    tasks): no driver, the ranks start the dock's servers themselves; with the same seed they reach the same
    rewards and weights as the default local launch."""
    from rlflow.runtime.launch import free_port
    flags = ["--steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "4", "--overwrite"]
    script = os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    runs = {"local": [[sys.executable, script]],
            "one node": [torchrun + ["--standalone", "--nproc-per-node", "2", script]]}
    port = free_port()
    runs["two nodes"] = [torchrun + ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(n), "--master-addr",
                                     "127.0.0.1", "--master-port", str(port), script] for n in (0, 1)]
    slurm = dict(SLURM_NTASKS="2", SLURM_NODEID="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    runs["slurm"] = [[sys.executable, script]] * 2
    envs = {"slurm": [dict(os.environ, **slurm, SLURM_PROCID=str(i), SLURM_LOCALID=str(i)) for i in (0, 1)]}
    got = {}
    for name, cmds in runs.items():
        out = tmp_path / name.replace(" ", "_")
        procs = [subprocess.Popen(c + flags + ["--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=envs[name][i] if name in envs else None) for i, c in enumerate(cmds)]
        ends = [p.communicate(timeout=300) for p in procs]
        for p, (so, se) in zip(procs, ends):
            assert p.returncode == 0, (name, se[-3000:])
        assert "transfer dock: 2 warehouses" in ends[0][0] and "allgather-swap" in ends[0][0], (name, ends[0][0])
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        weights = hf.load(str(out / "checkpoint-final"))[1]
        got[name] = [r["reward_mean"] for r in rows], weights, rows[-1]["dock_busiest_bytes"]
    want_r, want_w, _ = got["local"]
    assert len(want_r) == 3 and (len(set(want_r)) > 1 or want_r[0] > 0), "the rewards must vary to mean something"
    for name in ("one node", "two nodes", "slurm"):
        r, w, dock_bytes = got[name]
        assert r == want_r, (name, r, want_r)
        assert dock_bytes > 0
        diff = max(float((w[k] - want_w[k]).abs().max()) for k in want_w)
        assert diff < 1e-6, (name, diff)


@pytest.mark.parametrize("flags, named", [
    (["--world", "4"], "--world 4: torchrun / Slurm started 2 ranks"),
    (["--launcher", "ray"], "--launcher ray: this process is already one rank"),
    (["--dock-backend", "ray"], "--dock-backend ray: under torchrun / Slurm the dock is procs"),
    (["--dock-backend", "local"], "--dock-backend local: under torchrun / Slurm the dock is procs"),
    (["--max-restarts", "2"], "--max-restarts 2: the ranks are not Ray actors under torchrun / Slurm"),
])
def test_under_torchrun_what_a_rank_cannot_run_is_refused_by_flag(flags, named, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    recipe = recipe_module()
    assert recipe.parse_args([]).world == 2  # --world defaults to the world torchrun started
    with pytest.raises(SystemExit) as e:
        recipe.parse_args(flags)
    assert e.value.code == 2
    assert named in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("flags, named", [
    (["--mini-batch-size", "0"], "--mini-batch-size 0"),  # fell back to the default
    (["--micro-batch-size", "0"], "--micro-batch-size 0"),
    (["--world", "0"], "--world 0"),
    (["--max-prompt-len", "-3"], "--max-prompt-len -3"),  # dropped the first tokens of every prompt
    (["--dtype", "float16"], "--dtype"),  # a bare KeyError
    (["--group-size", "1"], "--group-size 1"),
    (["--top-p", "0"], "--top-p 0.0"),
    (["--world", "2", "--dock-backend", "local"], "--dock-backend local"),
    (["--world", "2", "--dock", "0"], "--dock 0"),
    (["--world", "2", "--train-layout", "tp=3"], "--train-layout tp=3"),
    (["--world", "1", "--rollout-layout", "tp=2"], "--rollout-layout tp=2"),
    (["--world", "2", "--rollout-layout", "pp=2"], "--rollout-layout pp=2: mesh(pp=2,dp=1,ep=1,tp=1): generation "
                                                   "runs every layer on each rank (no pp)"),
    (["--world", "2", "--env", "max_digit_feedback", "--rollout-layout", "tp=2"],
     "--rollout-layout tp=2: rollout layout mesh(pp=1,dp=1,ep=1,tp=2): multi-turn rollouts drive each rank's engine"),
    (["--dual-clip", "0.5"], "--dual-clip must be > 1, got 0.5"),
    (["--rollout-is-cap", "1"], "--rollout-is-cap must be > 1"),
    (["--adv-estimator", "ppo"], "--adv-estimator"),
    (["--max-grad-norm", "0"], "--max-grad-norm 0.0"),
    # not finite: every weight NaN after step 0 with a finite gradient norm, and every checkpoint after it
    (["--lr", "inf"], "--lr must be finite"),
    (["--weight-decay", "nan"], "--weight-decay must be finite"),
    (["--kl-coef", "nan"], "--kl-coef must be finite"),
    (["--entropy-coef", "inf"], "--entropy-coef must be finite"),
    (["--temperature", "inf"], "--temperature must be finite"),
    (["--adv-estimator", "gae", "--critic-lr", "nan"], "--critic-lr must be finite"),
    # the natural-language task through the built-in character tokenizer; an eval split a task does not have
    (["--task", "addition"], "--task addition: has natural-language prompts: it needs a --model"),
    (["--eval-dataset", "task:max_digit"], "--eval-dataset task:max_digit: built-in task 'max_digit' has no held-out"),
    (["--eval-dataset", "task:nosuch"], "--eval-dataset task:nosuch: unknown built-in task 'nosuch'"),
    # training on the held-out split itself; an eval split that does not apply
    (["--dataset", "task:addition"], "--dataset task:addition: task:addition is a built-in task's held-out split, "
                                     "for --eval-dataset only; train on the task with --task addition"),
    (["--eval-dataset", "task:max_digit", "--eval-split", "test"], "--eval-dataset task:max_digit: task:max_digit is "
                                                                   "one split already"),
    # LoRA: what the model cannot adapt, a rank below 1, its flags without it, an adapter directory that is none
    (["--lora-rank", "8", "--lora-targets", "experts"], "--lora-targets experts: 'experts': the routed experts"),
    (["--lora-rank", "8", "--lora-targets", "gate_proj"], "'gate_proj' names no module of this qwen3_moe model"),
    # a pipeline stage with no adapters would train its frozen weights
    (["--lora-rank", "8", "--lora-targets", "lm_head", "--train-layout", "pp=2"],
     "--lora-targets lm_head: pipeline stage 0 of 2 holds none of the LoRA adapters"),
    (["--lora-rank", "-1"], "--lora-rank -1: must be >= 1"),
    (["--lora-alpha", "3"], "--lora-alpha 3.0: needs --lora-rank"),
    (["--merge"], "--merge: needs --lora-rank"),
    (["--lora-resume", "/nonexistent"], "--lora-resume /nonexistent: /nonexistent: no adapter_config.json"),
    # refused by the ranks once started, with a traceback each
    (["--world", "2", "--prompts-per-step", "3", "--mini-batch-size", "24", "--micro-batch-size", "24"],
     "--prompts-per-step 3: is not divisible by the 2 ranks"),
    (["--world", "4", "--train-layout", "dp=2,tp=2", "--prompts-per-step", "4", "--group-size", "2",
      "--mini-batch-size", "8", "--micro-batch-size", "1"], "--micro-batch-size 1: is not divisible by the train "),
])
def test_bad_flags_are_one_line_naming_the_flag_and_write_nothing(flags, named, tmp_path, capsys):
    recipe = recipe_module()
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        recipe.parse_args(flags + ["--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert named in err[-1] and "Traceback" not in "\n".join(err), err
    assert not out.exists()


def test_a_learning_rate_no_fine_tuning_survives_is_warned_of_and_run(capsys):
    """--lr 1e10 was accepted without a word (every weight moved by about 1e10 a step)."""
    recipe = recipe_module()
    r = recipe.parse_args(["--lr", "1e10"])
    assert r.lr == 1e10  # accepted: the user may mean it
    assert "warning: --lr 10000000000.0: above 0.01" in capsys.readouterr().err
    recipe.parse_args(["--lr", "3e-4"])
    assert "warning" not in capsys.readouterr().err


def _model_dir(d, kind: str):
    """A --model directory that is wrong in one way (``kind``)."""
    import json

    from rlflow.models import hf
    from rlflow.models.config import get_config
    from rlflow.models import decoder
    from rlflow.tokenizer import CharTokenizer

    d.mkdir()
    cfg = get_config("qwen3-moe-tiny")
    if kind == "accented data":  # the built-in tokenizer has no 'é': the run died when row 1 was drawn
        (d / "data.jsonl").write_text('{"prompt": "max:12=", "answer": "2"}\n{"prompt": "max:3é4=", "answer": "4"}\n')
    elif kind == "gemma":
        (d / "config.json").write_text(json.dumps({"model_type": "gemma", "hidden_size": 64}))
    elif kind == "bad json":
        (d / "config.json").write_text("{bad")
    elif kind in ("no tokenizer", "truncated weights"):
        hf.save(str(d), cfg, decoder.init_params(cfg, seed=0))
        if kind == "truncated weights":
            CharTokenizer().save(str(d))
            w = d / hf.SINGLE
            w.write_bytes(w.read_bytes()[:1000])


@pytest.mark.parametrize("kind, flags, named", [
    (None, ["--preset", "nosuch"], "--preset nosuch: unknown model name 'nosuch'; known: ["),
    (None, ["--model", "{d}"], "--model {d}: no such directory"),
    ("empty", ["--model", "{d}"], "--model {d}: has no config.json"),
    ("gemma", ["--model", "{d}"], "--model {d}: config.json model_type='gemma' is not supported"),
    ("bad json", ["--model", "{d}"], "--model {d}: config.json: Expecting property name"),
    ("no tokenizer", ["--model", "{d}"], "--model {d}: has no tokenizer.json"),
    (None, ["--world", "3"], "--world 3: the default --train-layout: mesh spec 'tp=2': world=3 does not divide"),
    (None, ["--world", "1", "--resume", "{d}"], "--resume {d}: no such checkpoint directory"),
    ("accented data", ["--world", "1", "--dataset", "{d}/data.jsonl"],
     "--dataset {d}/data.jsonl: row 1's prompt 'max:3é4=' has characters the built-in tokenizer does not have"),
])
def test_model_preset_resume_and_world_problems_are_one_line_naming_the_flag(kind, flags, named, tmp_path, capsys):
    """Each was a traceback (a KeyError, a FileNotFoundError of config.json or tokenizer.json), blamed
    --train-layout None, or called a missing --resume directory a missing manifest."""
    recipe = recipe_module()
    d = tmp_path / "m"
    if kind is not None:
        _model_dir(d, kind)
    with pytest.raises(SystemExit) as e:
        recipe.parse_args([f.replace("{d}", str(d)) for f in flags] + ["--out", str(tmp_path / "run")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert named.replace("{d}", str(d)) in err[-1] and "Traceback" not in "\n".join(err), err
    assert not (tmp_path / "run").exists()


def test_damaged_weights_under_model_are_one_line_naming_the_flag_and_the_file(tmp_path):
    """They are read where the ranks load the model (after the flags were checked): one line, no traceback."""
    recipe = recipe_module()
    d = tmp_path / "m"
    _model_dir(d, "truncated weights")
    with pytest.raises(SystemExit, match=f"error: --model {d}: {d}/model.safetensors: not a readable safetensors"):
        recipe.main(["--model", str(d), "--world", "1", "--steps", "1"])


def test_a_reward_function_that_raises_is_one_line_naming_the_flag_and_where(tmp_path):
    """The user's reward raising, or returning the wrong length, ended the run with a traceback through
    rlflow's frames; now one line: the flag, the function, the exception and the line that raised it."""
    recipe = recipe_module()
    f = tmp_path / "rw.py"
    f.write_text("def boom(completions, **kw):\n    raise ZeroDivisionError('x')\n\n\n"
                 "def short(completions, **kw):\n    return [1.0]\n")
    base = ["--world", "1", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2"]
    with pytest.raises(SystemExit, match=f"^error: --reward {f}:boom raised ZeroDivisionError: x \\(at {f}:2 in boom\\)"):
        recipe.main(base + ["--reward", f"{f}:boom"])
    with pytest.raises(SystemExit, match=f"^error: --reward {f}:short returned 1 values for 4 samples"):
        recipe.main(base + ["--reward", f"{f}:short"])


def test_a_prompt_past_the_models_positions_is_one_line_naming_the_flag_and_the_prompt():
    recipe = recipe_module()
    with pytest.raises(SystemExit, match=r"^error: --max-new-tokens 600: prompt 0 has \d+ tokens; with "
                                         r"max_new_tokens=600 .* max_position_embeddings=512 \(truncate with "
                                         r"--max-prompt-len\)"):
        recipe.main(["--world", "1", "--steps", "1", "--max-new-tokens", "600"])


@pytest.mark.parametrize("kind", ["accelerator", "host"])
def test_out_of_memory_is_one_line_naming_the_sizes(kind, monkeypatch):
    """Sizes the device cannot hold ended the run with torch's OutOfMemoryError traceback (on a CPU a plain
    RuntimeError of its allocator); now one line that names the step and the flags that size it."""
    import torch

    from rlflow.algos import stages

    said = {"accelerator": "CUDA out of memory. Tried to allocate 80.00 GiB",
            "host": "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory"}[kind]

    def oom(*a, **k):
        raise (torch.OutOfMemoryError if kind == "accelerator" else RuntimeError)(said)
    monkeypatch.setattr(stages, "update", oom)
    recipe = recipe_module()
    with pytest.raises(SystemExit, match=r"^error: out of memory on cpu in step 0 \(" + re.escape(said)
                       + r"\); the step holds --prompts-per-step 2 x --group-size 2 samples of up to --max-new-tokens "
                       r"\d+, micro-batches of --micro-batch-size"):
        recipe.main(["--world", "1", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2"])
    monkeypatch.setattr(stages, "update", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("another failure")))
    with pytest.raises(RuntimeError, match="another failure"):  # not taken for memory
        recipe.main(["--world", "1", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2"])


def test_an_earlier_run_in_out_is_refused_and_left_untouched(tmp_path, capsys):
    """A run that failed late truncated the previous metrics.jsonl to 0 bytes."""
    recipe = recipe_module()
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(SystemExit, match=f"--out {out} holds an earlier run \\(metrics.jsonl\\)"):
        recipe.main(["--out", str(out), "--steps", "1"])
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'
    recipe.prepare_out(recipe.parse_args(["--out", str(out), "--overwrite"]))  # allowed when asked


def test_a_second_run_on_one_out_is_refused_naming_the_first(tmp_path):
    """Two runs started together on one --out both trained and corrupted metrics.jsonl; two --resume auto
    (a requeued job beside the first) deleted each other's temporary checkpoints. The second is refused
    before it writes anything, naming the holder (this process here); once the first ends, --out is free."""
    import multiprocessing as mp
    import os

    recipe = recipe_module()
    out = tmp_path / "run"
    first = recipe.parse_args(["--out", str(out), "--world", "1"])
    recipe.prepare_out(first)
    with recipe.holding_out(first):
        for again in (["--world", "1"], ["--world", "1", "--resume", "auto"]):
            with pytest.raises(SystemExit, match=f"--out {out} is in use by another run \\(pid {os.getpid()} on "):
                recipe.main(["--out", str(out), "--steps", "1", *again])
        assert sorted(p.name for p in out.iterdir()) == [recipe.driver.OUT_LOCK]
        # another process is refused too (the lock is the OS's, not this process's)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_try_out, args=(str(out), q))
        p.start()
        p.join(60)
        assert "is in use by another run" in q.get(timeout=5)
    assert not (out / recipe.driver.OUT_LOCK).exists()  # removed when the first run ended
    with recipe.holding_out(first):  # and free again
        pass


def _try_out(out: str, q) -> None:
    from rlflow import recipe
    try:
        with recipe.holding_out(recipe.parse_args(["--out", out, "--world", "1"])):
            q.put("held")
    except SystemExit as e:
        q.put(str(e))


def test_an_unwritable_out_is_refused_before_training(tmp_path):
    """A run whose checkpoint path was unwritable trained to the end and then lost the weights."""
    recipe = recipe_module()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match="cannot write there"):
        recipe.main(["--out", str(blocker / "run"), "--steps", "1"])


LEARN_STEPS, LEARN_MARGIN = 150, 0.15  # the default run reaches ~+0.3 by step 150 and ~+0.87 by step 500


def _rise(history) -> float:
    r = [m["reward_mean"] for m in history]
    return sum(r[-10:]) / 10 - sum(r[:10]) / 10


def test_the_default_run_learns():
    """The recipe's default task from scratch on a fixed seed, one process: the mean reward of the last 10 steps is clearly
    above the first 10. A flipped advantage sign, a zero learning rate or a detached loss keep it near 0."""
    recipe = recipe_module()
    rise = _rise(recipe.main(["--world", "1", "--steps", str(LEARN_STEPS)]))
    assert rise >= LEARN_MARGIN, rise


@pytest.mark.slow
def test_the_default_run_learns_on_its_two_processes(tmp_path):
    """The default: train tp=2, rollout dp=2, the weights moved every step, the rows through the dock."""
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--steps", str(LEARN_STEPS),
           "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rise = _rise([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    assert rise >= LEARN_MARGIN, rise


@pytest.mark.slow
def test_a_killed_rank_stops_the_run_at_once_naming_it(tmp_path):
    """A rank that dies (SIGKILL: the OOM killer, a lost node) must not leave the others blocked in a collective
    until its timeout: the driver stops them, says which rank died and how, and exits non-zero."""
    import signal as sig
    import time

    import psutil
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--steps", "100000",
           "--prompts-per-step", "4", "--group-size", "4"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        ranks = []
        while time.monotonic() < deadline and len(ranks) < 2:  # the two rank processes (not the dock's)
            time.sleep(0.5)
            ranks = [c for c in psutil.Process(p.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(ranks) == 2, "the ranks did not start"
        time.sleep(8)  # well into training
        victim = ranks[1]
        victim.send_signal(sig.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        assert time.monotonic() - t0 < 30, "the other rank was left waiting"
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    # the driver's one error line (a warning of the killed process's resource tracker may follow it)
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert errors and "killed by signal SIGKILL; the other ranks were stopped" in errors[-1], err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    time.sleep(1)
    alive = [r.pid for r in ranks if r.is_running() and r.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"ranks {alive} outlived the run"


def _hang(rank, world):
    import time

    import torch
    import torch.distributed as dist
    if rank == 1:
        time.sleep(60)  # a hung rank: alive, never reaching the collective
    dist.all_reduce(torch.zeros(1))


@pytest.mark.slow
def test_a_hung_rank_fails_the_run_after_the_collective_timeout():
    """A rank that stops answering (a deadlock, a stuck device) must not hold the others forever: with
    --dist-timeout the waiting ranks' collective raises and the run ends."""
    import time

    import torch

    from rlflow.runtime import launch
    t0 = time.perf_counter()
    with pytest.raises(torch.multiprocessing.ProcessRaisedException, match=r"Timed out waiting 3000ms"):
        launch.spawn(_hang, 2, timeout_s=3)
    assert time.perf_counter() - t0 < 40, "the run waited for the hung rank (it sleeps 60 s)"
