"""Atomic, verifiable, resumable checkpoints of a run (one process, or data-parallel ranks that hold the
same parameters: rank 0 writes).

A checkpoint is a directory ``<root>/checkpoint-<step>`` (``checkpoint-final`` at the end):

    config.json, model.safetensors (or shards)   the weights in transformers' format (``hf.save``):
    tokenizer files                              ``--model CKPT`` and ``AutoModelForCausalLM`` load it
    trainer_state.pt                             AdamW state (step, moments, float32 masters), the
                                                 prompt stream's position, torch's RNG state, the
                                                 number of GRPO steps done
    args.json                                    the run's full configuration
    critic.pt                                    PPO's critic, when the run has one: its weights
                                                 (value head included) and AdamW state
    manifest.json                                every file above with its size and SHA-256; written last

It is written under a temporary name in ``root``, every file fsynced, the manifest last, then renamed
into place (a crash leaves a temporary directory, never a half checkpoint under a real name).
``load`` refuses a checkpoint whose manifest is missing or whose files are missing, truncated or
altered, naming the file and what is wrong; ``find_resumable(root)`` returns the newest checkpoint
that verifies and says which newer ones it skipped, and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass

import torch

from rlflow import optim
from rlflow.algos.critic import Critic
from rlflow.models import hf
from rlflow.models.config import ModelConfig

MANIFEST, STATE, ARGS, CRITIC = "manifest.json", "trainer_state.pt", "args.json", "critic.pt"
_NAME = re.compile(r"^checkpoint-(\d+|final)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message names the file and what is wrong."""


@dataclass
class Checkpoint:
    path: str
    steps_done: int
    cfg: ModelConfig
    params: dict[str, torch.Tensor]
    opt_state: optim.AdamWState
    source_state: object
    args: dict
    critic: Critic | None = None  # PPO's critic (whole tensors), when the run has one


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def source_state(source) -> tuple:
    """The position of a ``data.PromptSource``: its RNG state and the epoch order left."""
    return (source.rng.getstate(), list(source._order))


def restore_source(source, state) -> None:
    rng, order = state
    source.rng = random.Random()
    source.rng.setstate(rng)
    source._order = list(order)


def save(root: str, name: str, *, steps_done: int, cfg: ModelConfig, params: dict, opt_state: optim.AdamWState,
         source, args: dict, tokenizer=None, keep_last: int | None = None, critic: Critic | None = None) -> str:
    """Write checkpoint ``root/name`` atomically; returns its path. ``tokenizer``: saved beside the weights
    (its ``save(dir)``), with a ``generation_config.json``. ``keep_last``: then delete all but the newest
    ``keep_last`` numbered checkpoints. ``critic``: PPO's critic (whole tensors)."""
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root)
    try:
        hf.save(tmp, cfg, params)
        if tokenizer is not None:
            tokenizer.save(tmp)
            with open(os.path.join(tmp, "generation_config.json"), "w") as f:
                json.dump({"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id,
                           "bos_token_id": tokenizer.bos_id}, f, indent=2)
        torch.save({"steps_done": steps_done,
                    "opt_state": _state_dict(opt_state),
                    "source": source_state(source), "torch_rng": torch.get_rng_state()}, os.path.join(tmp, STATE))
        if critic is not None:
            torch.save({"params": critic.params, "opt_state": _state_dict(critic.opt_state)}, os.path.join(tmp, CRITIC))
        with open(os.path.join(tmp, ARGS), "w") as f:
            json.dump(args, f, indent=2, default=str)
        files = sorted(n for n in os.listdir(tmp))
        for n in files:
            _fsync(os.path.join(tmp, n))
        manifest = {"format": 1, "steps_done": steps_done,
                    "files": {n: {"size": os.path.getsize(os.path.join(tmp, n)), "sha256": _sha256(os.path.join(tmp, n))}
                              for n in files}}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        final = os.path.join(root, name)
        if os.path.exists(final):  # the same name again (a re-run with --overwrite): replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        numbered = sorted((int(m.group(1)), n) for n in os.listdir(root)
                          if (m := _NAME.match(n)) and m.group(1) != "final")
        for _, n in numbered[:-keep_last] if keep_last > 0 else numbered:
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    return final


def verify(path: str) -> dict:
    """The manifest of checkpoint ``path`` after checking every file it lists; ``CheckpointError`` names
    the first problem."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{mpath}: missing (an interrupted or foreign checkpoint)") from None
    except ValueError as e:
        raise CheckpointError(f"{mpath}: not valid JSON ({e})") from None
    for n, want in manifest.get("files", {}).items():
        f = os.path.join(path, n)
        if not os.path.exists(f):
            raise CheckpointError(f"{f}: listed in the manifest but missing")
        size = os.path.getsize(f)
        if size != want["size"]:
            raise CheckpointError(f"{f}: {size} bytes, the manifest says {want['size']} (truncated or rewritten)")
        if _sha256(f) != want["sha256"]:
            raise CheckpointError(f"{f}: its SHA-256 differs from the manifest's (corrupted)")
    return manifest


def load(path: str, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> Checkpoint:
    """Read a verified checkpoint (see ``verify``)."""
    verify(path)
    cfg, params = hf.load(path, dtype=dtype, device=device)
    st = torch.load(os.path.join(path, STATE), map_location=device, weights_only=False)
    torch.set_rng_state(st["torch_rng"])
    with open(os.path.join(path, ARGS)) as f:
        args = json.load(f)
    critic = None
    if os.path.exists(os.path.join(path, CRITIC)):
        c = torch.load(os.path.join(path, CRITIC), map_location=device, weights_only=False)
        critic = Critic(params=c["params"], opt_state=_state(c["opt_state"]))
    return Checkpoint(path=path, steps_done=int(st["steps_done"]), cfg=cfg, params=params,
                      opt_state=_state(st["opt_state"]), source_state=st["source"], args=args, critic=critic)


def _state_dict(s: optim.AdamWState) -> dict:
    return {"step": s.step, "m": s.m, "v": s.v, "master": s.master}


def _state(d: dict) -> optim.AdamWState:
    return optim.AdamWState(step=d["step"], m=d["m"], v=d["v"], master=d["master"])


def find_resumable(root: str) -> tuple[str | None, list[str]]:
    """(the newest checkpoint under ``root`` that verifies, or None; one line per newer one skipped)."""
    if not os.path.isdir(root):
        return None, []
    found = []
    for n in os.listdir(root):
        m = _NAME.match(n)
        if m:
            found.append((float("inf") if m.group(1) == "final" else int(m.group(1)), n))
    skipped = []
    for _, n in sorted(found, reverse=True):
        try:
            verify(os.path.join(root, n))
            return os.path.join(root, n), skipped
        except CheckpointError as e:
            skipped.append(f"skipped {n}: {e}")
    return None, skipped


__all__ = ["Checkpoint", "CheckpointError", "find_resumable", "load", "restore_source", "save", "source_state",
           "verify"]
