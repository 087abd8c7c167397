"""Checkpoints and resume: a run interrupted (SIGINT, as Ctrl-C or a scheduler's preemption sends it) and
continued with --resume auto ends with the weights of an uninterrupted run; damaged checkpoints are refused
naming the file, and --resume auto falls back to the previous good one; the final checkpoint loads as --model."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from rlflow.models import hf
from rlflow.runtime import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py")]
RUN = ["--steps", "10", "--save-every", "3", "--keep-last", "2", "--kl-coef", "0.05"]  # KL: the reference too


def _weights(path):
    return hf.load(str(path))[1]


def _run(args, **kw):
    res = subprocess.run(RECIPE + args, capture_output=True, text=True, timeout=600, **kw)
    return res


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    res = _run(RUN + ["--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the long start-up here is vLLM's")
def test_a_signal_before_the_first_step_ends_the_run_at_once(tmp_path):
    """A SIGTERM while a run starts up (here the vLLM engine's start, seconds long, in the first step) was
    only noted: the run went on to finish its first step (17 s here), and one stuck in its start-up could not
    be stopped by ``timeout`` or a scheduler at all. Before any step is done there is nothing to save: the
    first signal ends the run at once, with exit code 128 + the signal and one line."""
    p = subprocess.Popen([sys.executable, "-u", *RECIPE[1:], "--world", "1", "--rollout-engine", "vllm", "--steps",
                          "50", "--out", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    for line in p.stdout:  # the handlers are installed before the run's first lines
        if line.startswith("TPS ="):
            break
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, p.returncode
    assert time.time() - t0 < 5
    assert "interrupted before the first step was done: nothing saved" in err and "Traceback" not in err, err[-2000:]


def test_interrupted_and_resumed_equals_uninterrupted(uninterrupted, tmp_path):
    out = tmp_path / "run"
    p = subprocess.Popen(RECIPE + RUN + ["--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / "checkpoint-000003").exists():  # interrupt once a periodic checkpoint was written
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "Traceback" not in err and "--resume auto" in err, err[-2000:]
    assert not (out / "checkpoint-final").exists()
    res = _run(RUN + ["--out", str(out), "--resume", "auto"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout
    a, b = _weights(uninterrupted / "checkpoint-final"), _weights(out / "checkpoint-final")
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6, diff
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(10)), steps  # each step once, the redone ones not twice
    ra = [json.loads(ln)["reward_mean"] for ln in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(ln)["reward_mean"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert ra == rb


def test_keep_last_and_the_final_checkpoint_loads_as_model(uninterrupted, tmp_path):
    names = sorted(n for n in os.listdir(uninterrupted) if n.startswith("checkpoint-"))
    assert names == ["checkpoint-000006", "checkpoint-000009", "checkpoint-final"], names
    final = uninterrupted / "checkpoint-final"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "trainer_state.pt",
            "args.json", "manifest.json"} <= set(os.listdir(final))
    res = _run(["--model", str(final), "--steps", "1", "--out", str(tmp_path / "again")])
    assert res.returncode == 0, res.stderr[-3000:]


def test_a_damaged_checkpoint_is_refused_and_auto_falls_back(uninterrupted, tmp_path):
    import shutil
    root = tmp_path / "run"
    shutil.copytree(uninterrupted, root)
    shutil.rmtree(root / "checkpoint-final")
    st = root / "checkpoint-000009" / "trainer_state.pt"
    st.write_bytes(st.read_bytes()[:-10])  # truncated
    with pytest.raises(checkpoint.CheckpointError, match=f"{st}: .* bytes, the manifest says"):
        checkpoint.verify(str(root / "checkpoint-000009"))
    path, skipped = checkpoint.find_resumable(str(root))
    assert path == str(root / "checkpoint-000006") and "skipped checkpoint-000009" in skipped[0]
    w = root / "checkpoint-000006" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1  # one flipped bit
    w.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="SHA-256 differs"):
        checkpoint.verify(str(root / "checkpoint-000006"))
    res = _run(["--steps", "10", "--out", str(root), "--resume", str(root / "checkpoint-000006")])
    assert res.returncode != 0 and "SHA-256" in res.stderr.strip().splitlines()[-1], res.stderr[-2000:]
    (root / "checkpoint-000006" / checkpoint.MANIFEST).unlink()
    assert checkpoint.find_resumable(str(root))[0] is None
    # every checkpoint damaged: --resume auto is refused, naming them, and overwrites nothing (it started
    # from scratch and replaced the metrics, exit 0)
    def files():  # the run's lock file names its holder: not the run's data
        return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()
                and p.name != ".rlflow-run.lock"}
    before = files()
    res = _run(["--steps", "10", "--out", str(root), "--resume", "auto"])
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and f"no checkpoint under {root} verifies" in last and "checkpoint-000009" in last \
        and "checkpoint-000006" in last, res.stderr[-2000:]
    assert files() == before


def test_a_sharded_run_writes_each_ranks_own_shards_and_loads_them_in_any_layout(uninterrupted, tmp_path):
    """The default run (2 ranks, train tp=2): each rank writes its shards of the weights and of the AdamW state
    (none of the optimizer state is gathered); they are the whole run's state split by the train layout. Loaded
    for another layout (dp=2, ep=2, pp=2, one process), each rank gets exactly its shards of that whole state:
    weights, AdamW moments and step."""
    from rlflow.models.config import get_config
    from rlflow.models.sharding import layout
    from rlflow.parallel.context import shard_params
    from rlflow.sharding import Mesh

    final = uninterrupted / "checkpoint-final"
    manifest = json.loads((final / checkpoint.MANIFEST).read_text())
    assert manifest["sharded"] == {"world": 2, "train_layout": str(Mesh.parse("tp=2", 2))}
    files = set(manifest["files"])
    assert {checkpoint.shard_file(0, 2), checkpoint.shard_file(1, 2)} <= files
    assert torch.load(final / checkpoint.STATE, weights_only=False)["opt_state"] is None
    whole = hf.load(str(final))[1]
    lay = layout(get_config("qwen3-moe-tiny"), Mesh.parse("tp=2", 2), dtype=torch.float32)  # the run's train layout
    split = 0
    own = []
    for rank in (0, 1):
        ck = checkpoint.load(str(final), rank=rank, layout=lay)
        assert ck.sharded == manifest["sharded"] and ck.resharded_from is None
        want = shard_params(whole, lay, rank)
        assert set(ck.params) == set(want) == set(ck.opt_state.v)
        for k in want:
            assert torch.equal(ck.params[k], want[k]), k  # the export is the shards put together
        split += sum(v.shape != whole[k].shape for k, v in ck.params.items())
        assert ck.opt_state.step == 10 and all(float(v.abs().sum()) > 0 for v in ck.opt_state.v.values())
        own.append(ck.opt_state)
    assert split > 0  # tp=2 did split some parameters
    from rlflow.sharding.reference import full_from_shards
    moments = {f: full_from_shards([getattr(s, f) for s in own], lay) for f in ("m", "v")}  # replicas agree
    cfg = get_config("qwen3-moe-tiny")
    for spec in ("dp=2", "ep=2", "pp=2", None):
        dst = None if spec is None else layout(cfg, Mesh.parse(spec, 2), dtype=torch.float32)
        for rank in (0, 1) if dst else (0,):
            ck = checkpoint.load(str(final), rank=rank, layout=dst)
            assert ck.resharded_from == manifest["sharded"] and ck.opt_state.step == 10
            cut = (lambda full: dict(full)) if dst is None else (lambda full: shard_params(full, dst, rank))  # noqa: B023
            for got, full in ((ck.params, whole), (ck.opt_state.m, moments["m"]), (ck.opt_state.v, moments["v"])):
                want = cut(full)
                assert set(got) == set(want), (spec, rank)
                for k in want:
                    assert torch.equal(got[k], want[k]), (spec, rank, k)


def test_a_sharded_checkpoint_resumed_in_another_layout_reaches_the_uninterrupted_weights(uninterrupted, tmp_path):
    """The tp=2 run's checkpoint after 6 steps, resumed with train dp=2 (the AdamW moments and step resharded
    with the weights), ends where the uninterrupted run did (one process: the exact shards, above)."""
    out = tmp_path / "run"
    ck = uninterrupted / "checkpoint-000006"
    res = _run(RUN[:2] + ["--kl-coef", "0.05", "--train-layout", "dp=2", "--out", str(out), "--resume", str(ck)])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resharded from train mesh(pp=1,dp=1,ep=1,tp=2) on 2 ranks" in res.stdout, res.stdout[-2000:]
    a, b, start = _weights(uninterrupted / "checkpoint-final"), _weights(out / "checkpoint-final"), _weights(ck)
    assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e-4  # steps 6-9 moved the weights
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6, diff


def test_a_killed_rank_then_resume_auto_reaches_the_uninterrupted_weights(uninterrupted, tmp_path):
    """Kill one rank (SIGKILL, as the OOM killer does) after the first periodic checkpoint: the run fails naming
    it, and ``--resume auto`` ends with the weights of the uninterrupted run."""
    import psutil

    out = tmp_path / "run"
    p = subprocess.Popen(RECIPE + RUN + ["--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (out / "checkpoint-000003").exists():
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.05)
        ranks = [c for c in psutil.Process(p.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(ranks) == 2
        ranks[1].send_signal(signal.SIGKILL)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0 and "killed by signal SIGKILL" in err, err[-2000:]
    res = _run(RUN + ["--out", str(out), "--resume", "auto"])
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = _weights(uninterrupted / "checkpoint-final"), _weights(out / "checkpoint-final")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def test_a_bfloat16_checkpoint_reshards_its_float32_masters_and_keeps_its_router_float32(tmp_path):
    """deepseek-tiny in bfloat16 on 2 ranks (train tp=2), 2 steps: loaded for dp=2 or ep=2, each rank's AdamW
    float32 masters are exactly its shards of the masters the writers hold (put together by full_from_shards,
    code of its own), the router (float32 in any dtype) has none and loads float32; resuming it with another
    --dtype is refused naming the flag."""
    import dataclasses

    from rlflow.models.config import get_config
    from rlflow.models.sharding import layout
    from rlflow.parallel.context import shard_params
    from rlflow.sharding import Layout, Mesh
    from rlflow.sharding.reference import full_from_shards

    out = tmp_path / "ds"
    flags = ["--preset", "deepseek-tiny", "--dtype", "bfloat16", "--prompts-per-step", "4", "--group-size", "4"]
    res = _run(flags + ["--steps", "2", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    final, cfg = out / "checkpoint-final", get_config("deepseek-tiny")

    def lay(spec, names=None):  # the masters' own layout: their names, float32
        full = layout(cfg, Mesh.parse(spec, 2), dtype=torch.bfloat16)
        return full if names is None else Layout(mesh=full.mesh, params=tuple(
            dataclasses.replace(p, dtype=torch.float32) for p in full.params if p.name in names))
    own = [checkpoint.load(str(final), rank=r, layout=lay("tp=2")) for r in (0, 1)]
    names = set(own[0].opt_state.master)
    router = {n for n in own[0].params if n.endswith((".gate.weight", ".e_score_correction_bias"))}
    assert names and router and not names & router
    masters = full_from_shards([o.opt_state.master for o in own], lay("tp=2", names))
    for spec in ("dp=2", "ep=2"):
        for rank in (0, 1):
            ck = checkpoint.load(str(final), rank=rank, layout=lay(spec), dtype=torch.bfloat16)
            assert ck.resharded_from is not None
            assert all(ck.params[n].dtype == torch.float32 for n in router)
            assert ck.params["model.embed_tokens.weight"].dtype == torch.bfloat16
            want = shard_params(masters, lay(spec, names), rank)
            assert set(ck.opt_state.master) == set(want)
            for n in want:
                assert ck.opt_state.master[n].dtype == torch.float32 and torch.equal(ck.opt_state.master[n], want[n])
    res = _run(flags[:2] + ["--steps", "3", "--out", str(tmp_path / "again"), "--resume", str(final)])
    assert res.returncode != 0 and "--dtype float32: --resume" in res.stderr.strip().splitlines()[-1], res.stderr[-2000:]


def test_resume_with_other_data_is_refused_naming_what_changed(tmp_path):
    """A run trained on --dataset, resumed without it, trained on the built-in task from the dataset's position."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}{b}{c}=", "answer": str(max(a, b, c))}) + "\n"
                            for a, b, c in [(1, 5, 2), (7, 3, 0), (4, 4, 9), (2, 8, 6)] * 4))
    flags = ["--world", "1", "--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "2"]
    out = tmp_path / "run"
    res = _run(flags + ["--dataset", str(data), "--steps", "1", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    res = _run(flags + ["--steps", "2", "--out", str(tmp_path / "again"), "--resume", str(out / "checkpoint-final")])
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode != 0 and last.startswith("error: --dataset None (trained with ") and "other data" in last, last
    assert not (tmp_path / "again" / "metrics.jsonl").exists()
    # the same file by another path is the same data
    res = _run(flags + ["--dataset", "d.jsonl", "--steps", "2", "--out", str(tmp_path / "same"),
                        "--resume", str(out / "checkpoint-final")], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.slow
def test_a_terminal_ctrl_c_gives_one_checkpoint_and_a_clean_exit_every_time(tmp_path):
    """Ctrl-C in a terminal reaches the whole foreground process group: the launcher and every rank. The
    launcher forwarded it again, each rank saw two and stopped at once, and about half the runs ended with
    'ranks ended with exit codes [-2, 1]' and no checkpoint. Now the ranks hear the launcher only: every
    time one interrupt checkpoint that verifies, exit 130, no traceback."""
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        p = subprocess.Popen(RECIPE + ["--steps", "200", "--out", str(out)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)  # its own group, as a shell's job
        deadline = time.time() + 300
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 2 + attempt:
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.02)
        os.killpg(p.pid, signal.SIGINT)  # what the terminal does
        _, err = p.communicate(timeout=120)
        assert p.returncode == 128 + signal.SIGINT, (attempt, p.returncode, err[-2000:])
        assert "Traceback" not in err and "--resume auto" in err, err[-2000:]
        saved = [n for n in os.listdir(out) if n.startswith("checkpoint-")]
        assert len(saved) == 1, saved
        checkpoint.verify(str(out / saved[0]))


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.3, 1.2, 1.8, 2.6])
def test_a_terminal_ctrl_c_during_start_up_is_one_line(after_s, tmp_path):
    """Ctrl-C while the libraries load, the flags are checked, the ranks import torch and meet, or before the
    first step: exit 130 and one line saying what was kept (there were KeyboardInterrupt tracebacks from the
    launcher or the ranks, and 'ranks ended with exit codes [-2]')."""
    p = subprocess.Popen(RECIPE + ["--steps", "200", "--out", str(tmp_path / "run")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    time.sleep(after_s)
    os.killpg(p.pid, signal.SIGINT)  # what the terminal does
    out, _ = p.communicate(timeout=120)
    lines = [ln.split("\r")[-1] for ln in out.splitlines()]
    said = [ln for ln in lines if ln.startswith("interrupted")]
    assert p.returncode == 128 + signal.SIGINT and "Traceback" not in out and len(said) == 1, (p.returncode, out[-3000:])


_SWALLOWED = """
import signal, time
from rlflow.startup import loading
with loading():
    try:  # what torch's C code did with a KeyboardInterrupt raised inside its import of numpy
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.2)
    except BaseException:
        pass
    print("went on")
"""


@pytest.mark.parametrize("ignored", [False, True])
def test_ctrl_c_while_the_libraries_load_ends_the_process_even_if_the_import_swallows_it(ignored):
    """An interrupted import of numpy under torch was swallowed: the run trained on as if never interrupted, or
    failed later on a half-imported numpy. A process started with SIGINT ignored (a rank importing the recipe)
    keeps ignoring it."""
    p = subprocess.run([sys.executable, "-c", _SWALLOWED], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None)
    if ignored:
        assert (p.returncode, p.stdout.strip(), p.stderr) == (0, "went on", ""), p
    else:
        assert (p.returncode, p.stdout, p.stderr.strip()) == (130, "", "interrupted while starting: nothing was run"), p


def test_a_full_disk_during_a_checkpoint_says_so_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    """torch.save on a full disk says 'unexpected pos' or 'file write failed', never that the disk is full;
    the run died with that traceback. Now the checkpoint is refused naming the disk and its free space, its
    temporary directory removed; the recipe turns it into one line."""
    import shutil
    from collections import namedtuple

    from rlflow.data import PromptSource
    from rlflow.models import decoder
    from rlflow.models.config import get_config
    from rlflow.runtime.state import init

    cfg = get_config("qwen3-moe-tiny")
    state = init(decoder.init_params(cfg, seed=0), PromptSource(task="max_digit"))

    def full(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1024 vs 0")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, 10 << 30, 1 << 20))
    with pytest.raises(checkpoint.CheckpointError, match=f"{tmp_path}/checkpoint-000001: not written: the disk "
                                                         rf"under {tmp_path} is full \(1.0 MiB free\); the earlier"):
        checkpoint.save_state(str(tmp_path), "checkpoint-000001", state, cfg=cfg, args={})
    assert list(tmp_path.iterdir()) == []  # no temporary directory left
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, 0, 10 << 30))  # not the disk: as it was
    with pytest.raises(RuntimeError, match="unexpected pos"):
        checkpoint.save_state(str(tmp_path), "checkpoint-000001", state, cfg=cfg, args={})
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, 10 << 30, 1 << 20))
    from tests.helpers import recipe_module
    with pytest.raises(SystemExit, match=r"^error: .*/run/checkpoint-final: not written: the disk under .* is full"):
        recipe_module().main(["--world", "1", "--steps", "1", "--out", str(tmp_path / "run")])


@pytest.mark.slow
def test_a_lora_run_resumed_equals_the_uninterrupted_one_and_its_adapters_continue_elsewhere(tmp_path):
    """A LoRA run's checkpoints hold its adapters as peft saves them and their AdamW state (no base weights): a run
    of 6 steps and one of 3 resumed to 6 end with the same adapters; --lora-resume starts another run (one
    process, --merge) from them, whose merged export is the base plus the adapters."""
    from rlflow.models import adapters
    lora = ["--lora-rank", "4", "--kl-coef", "0.05", "--steps", "6"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert (res := _run(lora + ["--out", str(whole)])).returncode == 0, res.stderr[-3000:]
    assert (res := _run(lora[:-1] + ["3", "--out", str(part)])).returncode == 0, res.stderr[-3000:]
    assert (res := _run(lora + ["--out", str(part), "--resume", "auto"])).returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout
    final = whole / "checkpoint-final"
    assert not (final / "model.safetensors").exists()  # the base is --model's (here the preset's)
    cfg = adapters.config_of(str(final))
    a, b = adapters.load(str(final), cfg), adapters.load(str(part / "checkpoint-final"), cfg)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    assert max(float(a[k].abs().max()) for k in a if k.endswith(".lora_B.weight")) > 0  # trained
    more = tmp_path / "more"
    res = _run(["--lora-resume", str(final), "--steps", "1", "--world", "1", "--merge", "--out", str(more)])
    assert res.returncode == 0, res.stderr[-3000:]
    got = adapters.load(str(more / "checkpoint-final"), cfg)
    base = _weights(more / "checkpoint-final")  # the merged model, as --model loads it
    from rlflow.models.config import get_config
    from rlflow.models import decoder
    start = decoder.init_params(get_config("qwen3-moe-tiny"), seed=0)  # the preset's base (--seed 0)
    want = adapters.merged({**start, **got}, cfg)
    assert max(float((base[k] - want[k]).abs().max()) for k in want) <= 1e-6
