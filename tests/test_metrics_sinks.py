"""Metrics sinks (JSONL, TensorBoard, W&B), the recipe's logging flags, and the learning-rate schedules."""

import dataclasses
import glob
import json
import math
import os
import struct

import pytest
from helpers import recipe_module

from rlflow import metrics, optim

STEPS = [{"step": 0, "reward_mean": 0.25, "lr": 1e-3, "update_skipped": 0.0},
         {"step": 1, "reward_mean": 0.5, "lr": 5e-4, "update_skipped": 0.0},
         {"step": 2, "reward_mean": 0.75, "lr": 0.0, "update_skipped": 1.0}]
ROWS = [{"prompt": "max:381|920=", "response": "9\nx", "reward": 1.0},
        {"prompt": "max:12=", "response": "1", "reward": 0.0}]


def _log(sink, steps=STEPS):
    """As the loop calls them: a step's samples before its metrics (W&B drops what comes for an earlier step)."""
    for m in steps:
        if m["step"] == 1:
            sink.log_samples(1, ROWS)
        sink.log(m["step"], m)
    sink.close()


def test_jsonl_sink_writes_metrics_as_the_recipe_did_and_samples_beside(tmp_path):
    _log(metrics.JsonlSink(str(tmp_path)))
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(json.dumps(m) + "\n" for m in STEPS)
    assert [json.loads(ln) for ln in (tmp_path / "samples.jsonl").read_text().splitlines()] == \
        [{"step": 1, **r} for r in ROWS]
    # a run resumed at step 1 keeps the earlier steps and does the others again
    _log(metrics.JsonlSink(str(tmp_path), first_step=1), STEPS[1:])
    assert [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == len(ROWS)
    # a fresh run in the same directory (--overwrite) leaves no samples of the earlier one
    metrics.JsonlSink(str(tmp_path)).close()
    assert (tmp_path / "metrics.jsonl").read_text() == "" and not (tmp_path / "samples.jsonl").exists()


def _events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_sink_events_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    _log(metrics.TensorBoardSink(str(tmp_path), config={"lr": 1e-3}))
    acc = _events(str(tmp_path / "tensorboard"))
    assert "step" not in acc.Tags()["scalars"]
    for k in ("reward_mean", "lr", "update_skipped"):
        got = acc.Scalars(k)
        assert [e.step for e in got] == [0, 1, 2]
        assert [e.value for e in got] == pytest.approx([m[k] for m in STEPS])
    (text,) = acc.Tensors("samples/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 1 and table.splitlines()[0] == "| prompt | response | reward |"
    assert "| max:381\\|920= | 9<br>x | 1.0 |" in table  # one row per sample, pipes and newlines kept out
    assert '"lr": 0.001' in acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


def _wandb_history(run_dir):
    """The history records of an offline run's .wandb file (LevelDB-log framed protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    data, pos, buf, out = open(path, "rb").read(), 7, b"", []  # 7 bytes: the file's header
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or kind == 0:  # the block's padding
            pos += left
            continue
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return out


def test_wandb_sink_offline_writes_its_run_with_the_history(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for k, v in dict(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true", WANDB_CONSOLE="off",
                     WANDB_DISABLE_GIT="true", WANDB_DISABLE_CODE="true", WANDB_X_DISABLE_STATS="true",
                     WANDB_X_DISABLE_MACHINE_INFO="true").items():
        monkeypatch.setenv(k, v)
    sink = metrics.WandbSink(None, config={"lr": 1e-3}, project="rlflow-test")
    run_dir = os.path.dirname(sink.run.dir)
    _log(sink)
    wandb.teardown()  # finish() returns once the run is closed; the service may still be writing its file
    assert run_dir.startswith(str(tmp_path / "wandb" / "offline-run-"))
    hist = _wandb_history(run_dir)
    assert [h["_step"] for h in hist] == [0, 1, 2]
    assert [h["reward_mean"] for h in hist] == [m["reward_mean"] for m in STEPS]
    assert hist[1]["samples/_type"] == "table-file" and hist[1]["samples/nrows"] == len(ROWS)
    (table,) = glob.glob(os.path.join(run_dir, "files", "media", "table", "samples_*.table.json"))
    assert json.load(open(table))["data"] == [list(r.values()) for r in ROWS]


def test_unknown_or_repeated_sinks_and_missing_packages_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown sink 'csv'"):
        metrics.make_sinks("jsonl,csv", str(tmp_path))
    with pytest.raises(ValueError, match="sink 'jsonl' is given twice"):
        metrics.make_sinks("jsonl, jsonl", str(tmp_path))
    with pytest.raises(ValueError, match="sink 'tensorboard' needs an output directory"):
        metrics.make_sinks("tensorboard", None)
    assert not os.listdir(tmp_path)
    monkeypatch.setattr(metrics, "missing_package", lambda name: metrics.PACKAGES[name])
    with pytest.raises(ImportError, match=r"--log-to tensorboard needs the tensorboard package.*rlflow\[logging\]"):
        metrics.TensorBoardSink(str(tmp_path))
    with pytest.raises(ImportError, match="--log-to wandb needs the wandb package"):
        metrics.WandbSink(str(tmp_path))


@pytest.mark.parametrize("flags, named", [
    (["--log-to", "jsonl,csv"], "--log-to jsonl,csv: unknown sink 'csv' (known: jsonl, tensorboard, wandb)"),
    (["--log-to", "tensorboard"], "--log-to tensorboard: tensorboard needs --out"),
    (["--log-samples-every", "2"], "--log-samples-every 2: needs a sink to write to"),
    (["--log-samples-every", "-1", "--out", "{out}"], "--log-samples-every -1: must be >= 0"),
    (["--wandb-mode", "offline"], "--wandb-mode offline: needs --log-to wandb"),
    (["--wandb-mode", "cloud"], "--wandb-mode: invalid choice: 'cloud'"),
    (["--lr-schedule", "step"], "--lr-schedule: invalid choice: 'step'"),
    (["--min-lr-ratio", "0.1"], "--min-lr-ratio 0.1: needs --lr-schedule cosine or linear"),
    (["--lr-schedule", "cosine", "--min-lr-ratio", "1.5"], "--min-lr-ratio 1.5: must be in [0, 1]"),
])
def test_bad_logging_flags_are_one_line_naming_the_flag(flags, named, tmp_path, capsys):
    recipe = recipe_module()
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit) as e:
        recipe.parse_args([f.format(out=out) for f in flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert named in err[-1], err
    assert not os.path.exists(out)


def test_a_missing_sink_package_is_named_before_the_run(tmp_path, monkeypatch, capsys):
    recipe = recipe_module()
    monkeypatch.setattr(metrics, "missing_package", lambda name: metrics.PACKAGES[name])
    with pytest.raises(SystemExit):
        recipe.parse_args(["--log-to", "jsonl,wandb", "--out", str(tmp_path / "run")])
    assert "--log-to jsonl,wandb: wandb needs the wandb package, which is not installed: pip install " \
           "'rlflow[logging]'" in capsys.readouterr().err


ETA = 1e-3


@pytest.mark.parametrize("schedule, warmup, ratio, want", [
    ("constant", 0, 0.0, [ETA] * 5),
    ("constant", 2, 0.0, [ETA / 2, ETA, ETA, ETA, ETA]),
    # no warm-up: s / (T - 1) of the way at step s, the last step at the floor
    ("linear", 0, 0.0, [ETA, 0.75 * ETA, 0.5 * ETA, 0.25 * ETA, 0.0]),
    ("linear", 0, 0.2, [ETA, 0.8 * ETA, 0.6 * ETA, 0.4 * ETA, 0.2 * ETA]),
    ("cosine", 0, 0.0, [ETA, (1 + math.cos(math.pi / 4)) / 2 * ETA, 0.5 * ETA,
                        (1 + math.cos(3 * math.pi / 4)) / 2 * ETA, 0.0]),
    ("cosine", 0, 0.1, [ETA, ETA * (0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2), 0.55 * ETA,
                        ETA * (0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2), 0.1 * ETA]),
    # warm-up 2: ETA/2, ETA, then the decay over steps 2..4 (half-way at step 3)
    ("cosine", 2, 0.0, [ETA / 2, ETA, ETA, 0.5 * ETA, 0.0]),
    ("linear", 2, 0.5, [ETA / 2, ETA, ETA, 0.75 * ETA, 0.5 * ETA]),
])
def test_lr_schedules_against_hand_computed_values(schedule, warmup, ratio, want):
    got = [optim.lr_at(s, 5, ETA, warmup, schedule, ratio) for s in range(5)]
    assert got == pytest.approx(want, abs=1e-15)
    assert optim.lr_at(7, 5, ETA, warmup, schedule, ratio) == pytest.approx(want[-1], abs=1e-15)  # past the end


def test_lr_schedule_edge_cases_and_errors():
    assert optim.lr_at(0, 1, ETA, 0, "cosine") == ETA  # a one-step decay runs at the base lr, not 0
    assert [optim.lr_at(s, 3, ETA, 5, "cosine") for s in range(3)] == pytest.approx([ETA / 5, 2 * ETA / 5, 3 * ETA / 5])
    with pytest.raises(ValueError, match="lr schedule 'step' is not one of constant, cosine, linear"):
        optim.lr_at(0, 5, ETA, schedule="step")
    with pytest.raises(ValueError, match="min lr ratio 2 must be in"):
        optim.lr_at(0, 5, ETA, schedule="linear", min_ratio=2)


def test_a_resumed_loop_continues_the_cosine_schedule():
    """A run of 4 steps stopped after 2, then resumed as the recipe does (first_step, the optimizer state, the
    steps left): both calls follow the one 4-step schedule."""
    from rlflow.algos.grpo import GRPOConfig
    from rlflow.data import PromptSource
    from rlflow.models import decoder
    from rlflow.models.config import get_config
    from rlflow.rollout import SamplingConfig
    from rlflow.runtime import loop
    from rlflow.runtime.state import init
    from rlflow.runtime.step import context
    from rlflow.tokenizer import CharTokenizer
    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    lcfg = loop.LoopConfig(steps=4, prompts_per_step=2, grpo=GRPOConfig(group_size=2), mini_batch_size=4,
                           micro_batch_size=4, optim=optim.AdamWConfig(lr=ETA), warmup_lr_steps=1,
                           lr_schedule="cosine", min_lr_ratio=0.5,
                           sampling=SamplingConfig(max_new_tokens=2, eos_id=tok.eos_id, pad_id=tok.pad_id))
    reward = lambda resp, ans: [float(len(r)) for r in resp]  # noqa: E731
    src, asked = PromptSource(task="max_digit"), []
    state, h1 = loop.train(init(decoder.init_params(cfg, seed=0), src), context(cfg, tok, reward, lcfg),
                           should_stop=lambda: asked.append(1) or len(asked) == 2)
    _, h2 = loop.train(state, context(cfg, tok, reward, lcfg))
    assert [m["step"] for m in h1 + h2] == [0, 1, 2, 3]
    # warm-up 1 step, then cosine over steps 1..3 down to 0.5
    assert [m["lr"] for m in h1 + h2] == pytest.approx([ETA, ETA, ETA * 0.75, ETA * 0.5])
    with pytest.raises(ValueError, match="lr_schedule='step' is not one of"):
        dataclasses.replace(lcfg, lr_schedule="step")


def test_a_recipe_run_writes_args_metrics_lr_samples_and_events(tmp_path):
    pytest.importorskip("tensorboard")
    recipe = recipe_module()
    out = tmp_path / "run"
    history = recipe.main(["--world", "1", "--steps", "3", "--prompts-per-step", "2", "--group-size", "2",
                           "--log-to", "jsonl,tensorboard", "--log-samples-every", "1", "--lr-schedule", "cosine",
                           "--warmup-lr-steps", "0", "--out", str(out)])
    args = json.loads((out / "args.json").read_text())
    assert set(args) == {f.name for f in dataclasses.fields(recipe.Recipe)}
    assert args["lr_schedule"] == "cosine" and args["log_to"] == "jsonl,tensorboard"
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == json.loads(json.dumps(history))  # the loop's metrics, one object per step
    lr = [m["lr"] for m in rows]
    assert lr == pytest.approx([3e-4, 1.5e-4, 0.0]) and lr[0] > lr[1] > lr[2]
    samples = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 4 + [1] * 4 + [2] * 4  # every step, its 2 x 2 rows
    for s in samples:
        assert s["prompt"].startswith("max:") and set(s) == {"step", "prompt", "response", "reward"}
    for m in rows:  # the rows' rewards are the ones the step's mean was taken over
        assert sum(s["reward"] for s in samples if s["step"] == m["step"]) / 4 == pytest.approx(m["reward_mean"])
    acc = _events(str(out / "tensorboard"))
    assert [(e.step, e.value) for e in acc.Scalars("lr")] == [(i, pytest.approx(v)) for i, v in enumerate(lr)]
    assert [t.step for t in acc.Tensors("samples/text_summary")] == [0, 1, 2]
    assert (out / "reward.png").exists()
