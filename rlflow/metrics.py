"""Where a run's per-step metrics and sampled texts go: metrics sinks.

A sink takes one dict of numbers per step (``log``), now and then a table of sampled rows (``log_samples``:
prompt, response, reward), and is closed at the end of the run. ``make_sinks`` builds them from a
comma-separated list such as the recipe's ``--log-to jsonl,tensorboard,wandb``. TensorBoard and W&B are
optional packages (the ``logging`` extra); JSONL needs nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Protocol

from torch import Tensor

from rlflow.batch import RolloutBatch, unpad

INSTALL_HINT = "pip install 'rlflow[logging]'"
PACKAGES = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb"}  # sink -> the package it needs


class Sink(Protocol):
    def log(self, step: int, metrics: dict) -> None: ...

    def log_samples(self, step: int, rows: list[dict]) -> None: ...

    def close(self) -> None: ...


def sink_names(spec: str) -> list[str]:
    """The sinks of a comma-separated list (ValueError naming an unknown or repeated one)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for i, n in enumerate(names):
        if n not in PACKAGES:
            raise ValueError(f"unknown sink {n!r} (known: {', '.join(PACKAGES)})")
        if n in names[:i]:
            raise ValueError(f"sink {n!r} is given twice")
    return names


def missing_package(name: str) -> str | None:
    """The package sink ``name`` needs when it is not installed (checked before a run starts, not at its end)."""
    pkg = PACKAGES[name]
    return pkg if pkg is not None and importlib.util.find_spec(pkg) is None else None


def _require(name: str) -> None:
    pkg = missing_package(name)
    if pkg is not None:
        raise ImportError(f"--log-to {name} needs the {pkg} package, which is not installed: {INSTALL_HINT}")


def sample_rows(batch: RolloutBatch, tokenizer, rewards: Tensor) -> list[dict]:
    """(prompt, response, reward) of every row of a scored rollout batch, decoded, for ``Sink.log_samples``."""
    prompts = unpad(batch.prompt_ids_BTp.cpu(), batch.prompt_mask_BTp.cpu())
    responses = unpad(batch.response_ids_BTr.cpu(), batch.response_mask_BTr.cpu())
    return [{"prompt": tokenizer.decode(p.tolist()), "response": tokenizer.decode(r.tolist()), "reward": x}
            for p, r, x in zip(prompts, responses, rewards.tolist())]


def _kept(path: str, first_step: int) -> list[str]:
    """The lines of an earlier JSONL file before ``first_step`` (a resumed run does the later steps again)."""
    if not (first_step and os.path.exists(path)):
        return []
    with open(path) as f:
        return [ln for ln in f if ln.strip() and json.loads(ln)["step"] < first_step]


class JsonlSink:
    """``metrics.jsonl``: one JSON object per step, as given; ``samples.jsonl``: one object per sampled row
    with its step (written only once samples are logged)."""

    def __init__(self, out_dir: str, first_step: int = 0):
        path = os.path.join(out_dir, "metrics.jsonl")
        kept = _kept(path, first_step)
        self._metrics = open(path, "w")
        self._metrics.writelines(kept)
        self._samples_path = os.path.join(out_dir, "samples.jsonl")
        kept = _kept(self._samples_path, first_step)
        self._samples = None
        if kept:
            self._samples = open(self._samples_path, "w")
            self._samples.writelines(kept)
        elif os.path.exists(self._samples_path):  # an overwritten run's samples
            os.remove(self._samples_path)

    def log(self, step: int, metrics: dict) -> None:
        self._metrics.write(json.dumps(metrics) + "\n")
        self._metrics.flush()

    def log_samples(self, step: int, rows: list[dict]) -> None:
        if self._samples is None:
            self._samples = open(self._samples_path, "a")
        self._samples.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        self._samples.flush()

    def close(self) -> None:
        self._metrics.close()
        if self._samples is not None:
            self._samples.close()


def _cell(v) -> str:
    """A markdown table cell: the text on one line, its pipes escaped."""
    return str(v).replace("|", "\\|").replace("\n", "<br>")


class TensorBoardSink:
    """Event files in ``out_dir/tensorboard``: a scalar per metric name, the samples as a markdown table (the
    Text tab), the run's config as text at its first step. A resumed run purges the events from its first
    step on, so the steps it does again are not shown twice."""

    def __init__(self, out_dir: str, config: dict | None = None, first_step: int = 0):
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter
        self.log_dir = os.path.join(out_dir, "tensorboard")
        self._w = SummaryWriter(self.log_dir, purge_step=first_step)
        if config is not None:
            self._w.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", first_step)

    def log(self, step: int, metrics: dict) -> None:
        for k, v in metrics.items():
            if k != "step" and isinstance(v, (int, float)):
                self._w.add_scalar(k, v, step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        cols = list(rows[0]) if rows else ["prompt", "response", "reward"]
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_cell(row[c]) for c in cols) + " |" for row in rows]
        self._w.add_text("samples", "\n".join(lines), step)

    def close(self) -> None:
        self._w.close()


class WandbSink:
    """A Weights & Biases run: the metrics as its history, the samples as a ``wandb.Table`` per logged step,
    the run's config as its config. ``mode``: online, offline (synced later with ``wandb sync``), or None for
    W&B's own default (``WANDB_MODE``, else online). A resumed run is a new W&B run."""

    def __init__(self, out_dir: str | None, config: dict | None = None, project: str | None = None,
                 mode: str | None = None):
        _require("wandb")
        import wandb
        self._wandb = wandb
        kw = {} if mode is None else {"mode": mode}
        self.run = wandb.init(project=project, dir=out_dir, config=config,
                              name=os.path.basename(os.path.normpath(out_dir)) if out_dir else None, **kw)

    def log(self, step: int, metrics: dict) -> None:
        self.run.log({k: v for k, v in metrics.items() if k != "step"}, step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        cols = list(rows[0]) if rows else ["prompt", "response", "reward"]
        table = self._wandb.Table(columns=cols, data=[[row[c] for c in cols] for row in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


def make_sinks(spec: str, out_dir: str | None, config: dict | None = None, *, first_step: int = 0,
               wandb_project: str | None = None, wandb_mode: str | None = None) -> list[Sink]:
    """The sinks of ``spec`` ("jsonl,tensorboard,wandb"), writing into ``out_dir`` (ValueError naming an
    unknown sink, or one that needs a directory when there is none). ``first_step``: the run's first step
    (a resumed run: the steps done); what earlier files hold from it on is dropped. ``config``: the run's
    settings (TensorBoard text, W&B config)."""
    names = sink_names(spec)
    if out_dir is None:
        for n in names:
            if n != "wandb":
                raise ValueError(f"sink {n!r} needs an output directory")
    sinks: list[Sink] = []
    try:
        for n in names:
            if n == "jsonl":
                sinks.append(JsonlSink(out_dir, first_step))
            elif n == "tensorboard":
                sinks.append(TensorBoardSink(out_dir, config, first_step))
            else:
                sinks.append(WandbSink(out_dir, config, wandb_project, wandb_mode))
    except BaseException:
        for s in sinks:
            s.close()
        raise
    return sinks
