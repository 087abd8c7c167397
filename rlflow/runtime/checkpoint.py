"""Atomic, verifiable, resumable checkpoints of a run, in one process or sharded over the ranks of a layout.

A checkpoint is a directory ``<root>/checkpoint-<step>`` (``checkpoint-final`` at the end):

    config.json, model.safetensors (or shards)   the weights in transformers' format (``hf.save``):
    tokenizer files                              ``--model CKPT`` and ``AutoModelForCausalLM`` load it
    adapter_config.json, adapter_model.safetensors   a LoRA run's adapters as peft saves them, not the
                                                 weights (``models/adapters.py``; the frozen base is the
                                                 run's --model); ``merge``: the merged model's weights too
    trainer_state.pt                             the prompt stream's position, torch's RNG state, the
                                                 number of GRPO steps done; in one process also the
                                                 AdamW state (step, moments, float32 masters)
    critic.pt                                    one process, PPO's critic: its weights (value head
                                                 included) and AdamW state
    rank-<r>-of-<W>.pt                           a sharded run (W ranks): rank r's own shards of the
                                                 weights, the AdamW state and the critic, its RNG state
    args.json                                    the run's full configuration
    manifest.json                                every file above with its size and SHA-256, and for a
                                                 sharded run its world and train layout; written last

In a sharded run every rank writes its own file (``write_shard``: nothing of the optimizer state is
gathered), and the weights are gathered once for the consolidated transformers export, tensor by tensor to
rank 0's host (``weights.gather_to_host``: no rank's device holds the whole model). The directory
is written under a temporary name in ``root`` (``begin``), every file fsynced, the manifest last, then
renamed into place (a crash leaves a temporary directory, never a half checkpoint under a real name).
A sharded checkpoint resumes in any train layout on any world: in the layout that wrote it each rank
reads its own file; in another (or in one process) each rank reads, one tensor at a time, the blocks of
the writers' files where they overlap its own blocks (``load(..., layout=)``), weights, AdamW moments and
masters, and the critic's alike. Its export loads anywhere as ``--model``.
``load`` refuses a checkpoint whose manifest is missing or whose files are missing, truncated or
altered, naming the file and what is wrong; ``find_resumable(root)`` returns the newest checkpoint
that verifies and says which newer ones it skipped, and why.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlflow import optim
from rlflow.algos.critic import Critic, with_policy
from rlflow.models import adapters, hf, lora
from rlflow.models.config import ModelConfig
from rlflow.models.shapes import keeps_float32
from rlflow.runtime.weights import gather_to_host
from rlflow.sharding.dist import all_reduce

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
    critic: Critic | None = None  # PPO's critic, when the run has one
    # {"world": W, "train_layout": mesh}: params, opt_state and critic are the loading rank's shards of that
    # layout (the run's); None: whole tensors
    sharded: dict | None = None
    resharded_from: dict | None = None  # the writer's {"world", "train_layout"} when it was another layout


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


def begin(root: str, name: str) -> str:
    """The temporary directory checkpoint ``root/name`` is written into (``write_shard``, then ``save``). The
    temporary directories an interrupted save left in ``root`` are removed first (one run writes there)."""
    os.makedirs(root, exist_ok=True)
    for n in os.listdir(root):
        if n.startswith(".checkpoint-") and ".tmp-" in n:
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root)


def shard_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.pt"


def write_shard(tmp: str, rank: int, world: int, *, params: dict, opt_state: optim.AdamWState,
                critic: Critic | None = None) -> None:
    """Rank ``rank``'s own shards (weights, AdamW state, the critic's) and RNG state into ``tmp``, fsynced. A
    LoRA run's weights are its adapters (the frozen base is the run's --model)."""
    if not os.path.isdir(tmp):
        raise CheckpointError(f"{tmp}: rank {rank} cannot see the checkpoint's directory (rank 0 made it): a sharded "
                              "run's --out must be on a filesystem every rank sees")
    path = os.path.join(tmp, shard_file(rank, world))
    try:
        torch.save({"params": lora.trainable(params), "opt_state": _state_dict(opt_state),
                    "torch_rng": torch.get_rng_state(),
                    "critic": None if critic is None else _critic_dict(critic)}, path)
        _fsync(path)
    except Exception as e:
        full = disk_full(e, tmp)
        if full:
            raise CheckpointError(f"{path}: not written: {full}") from e
        raise


# torch.save on a full disk says "unexpected pos" or "file write failed", safetensors "No space left" or
# "os error 28": such a write error, with this little room left, is taken for a full disk
FULL_BELOW = 64 << 20
_WRITE_FAILED = re.compile(r"unexpected pos|file write failed|no space left|os error 28", re.I)


def disk_full(e: BaseException, where: str) -> str | None:
    """What to say when ``e`` (a failed write under ``where``) came from a full disk or quota, else None."""
    try:
        free = shutil.disk_usage(where if os.path.exists(where) else os.path.dirname(where) or ".").free
    except OSError:
        return None
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk under {where} is full or over its quota ({free / 2**20:.1f} MiB free)"
    if not isinstance(e, OSError) and _WRITE_FAILED.search(str(e)) and free < FULL_BELOW:
        return f"the disk under {where} is full ({free / 2**20:.1f} MiB free)"
    return None


def save(root: str, name: str, *, steps_done: int, cfg: ModelConfig, params: dict,
         opt_state: optim.AdamWState | None, source, args: dict, tokenizer=None, keep_last: int | None = None,
         critic: Critic | None = None, tmp: str | None = None, sharded: dict | None = None, merge: bool = False) -> str:
    """Write checkpoint ``root/name`` atomically; returns its path. ``params``: the whole weights (the
    export). ``tokenizer``: saved beside the weights (its ``save(dir)``), with a ``generation_config.json``.
    ``keep_last``: then delete all but the newest ``keep_last`` numbered checkpoints. ``critic``: PPO's
    critic (whole tensors). A sharded run: ``tmp`` from ``begin``, holding every rank's ``write_shard``
    file, ``sharded`` = {"world", "train_layout"}, and no ``opt_state`` or ``critic`` here. ``params`` with LoRA's
    adapters: the adapters as peft saves them and the base's config; ``merge``: the merged model's weights too
    (``adapters.merged``; then ``params`` must hold the base too)."""
    if (sharded is None) == (opt_state is None) or (sharded is not None and (tmp is None or critic is not None)):
        raise ValueError("checkpoint.save: give opt_state (one process), or sharded= and tmp= (the ranks' files)")
    tmp = begin(root, name) if tmp is None else tmp
    try:
        adapters.export(tmp, cfg, params, merge=merge, base_model=args.get("model"))
        if tokenizer is not None:
            tokenizer.save(tmp)
            with open(os.path.join(tmp, "generation_config.json"), "w") as f:
                json.dump({"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id,
                           "bos_token_id": tokenizer.bos_id}, f, indent=2)
        if sharded is not None:
            want = {shard_file(r, sharded["world"]) for r in range(sharded["world"])}
            missing = sorted(want - set(os.listdir(tmp)))
            if missing:
                raise CheckpointError(f"{tmp}: the ranks' files {missing[:3]} are missing")
        torch.save({"steps_done": steps_done, "opt_state": None if opt_state is None else _state_dict(opt_state),
                    "source": source_state(source), "torch_rng": torch.get_rng_state()}, os.path.join(tmp, STATE))
        if critic is not None:
            torch.save(_critic_dict(critic), os.path.join(tmp, CRITIC))
        with open(os.path.join(tmp, ARGS), "w") as f:
            json.dump(args, f, indent=2, default=str)
        files = sorted(n for n in os.listdir(tmp))
        for n in files:
            _fsync(os.path.join(tmp, n))
        manifest = {"format": 1, "steps_done": steps_done, **({} if sharded is None else {"sharded": sharded}),
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
    except BaseException as e:
        full = disk_full(e, root)  # before the partial checkpoint's bytes are freed
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise CheckpointError(f"{os.path.join(root, name)}: not written: {full}; the earlier checkpoints "
                                  "are intact") from e
        raise
    if keep_last is not None:
        numbered = sorted((int(m.group(1)), n) for n in os.listdir(root)
                          if (m := _NAME.match(n)) and m.group(1) != "final")
        for _, n in numbered[:-keep_last] if keep_last > 0 else numbered:
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    return final


def save_state(root: str, name: str, state, *, cfg: ModelConfig, args: dict, tokenizer=None,
               keep_last: int | None = None, train=None, rank: int = 0, world: int = 1, merge: bool = False
               ) -> str | None:
    """Checkpoint ``root/name`` of a run's ``state`` (``runtime.state.RunState``); every rank calls it. In one
    process (``train`` None) ``save`` writes everything. With several ranks (``train``: the train layout)
    each writes its own shards (``write_shard``), the weights are gathered for the consolidated export (a
    collective) and rank 0 writes the rest; returns the path on rank 0, None elsewhere. A rank that cannot
    write its shards makes every rank raise and nothing is saved."""
    kw = dict(steps_done=state.steps_done, cfg=cfg, source=state.source, args=args, tokenizer=tokenizer,
              keep_last=keep_last, merge=merge)
    bad = optim.nonfinite(with_policy(state.policy, state.critic))
    refused = CheckpointError(f"{name}: not written: {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} "
                              "not finite (a checkpoint that verifies must hold weights that can be trained on)")
    if train is None:
        if bad:
            raise refused
        return save(root, name, params=state.policy, opt_state=state.opt_state, critic=state.critic, **kw)
    lead = rank == 0
    got = [begin(root, name) if lead else None]
    dist.broadcast_object_list(got, src=0)
    failed = None
    try:
        if bad:
            raise refused
        write_shard(got[0], rank, world, params=state.policy, opt_state=state.opt_state, critic=state.critic)
    except Exception as e:  # noqa: BLE001 -- every rank must still reach the collectives below
        failed = e
    # on rank 0's host, tensor by tensor; a LoRA run's adapters (the base is its --model) unless merged
    exported = train if merge else train.only(lora.trainable(dict.fromkeys(train.names)))
    full = gather_to_host(state.policy, exported)
    if float(all_reduce(torch.tensor([failed is not None], dtype=torch.float64))[0]):  # any rank's file missing
        if lead:
            shutil.rmtree(got[0], ignore_errors=True)
        if failed is not None:
            raise failed
        raise CheckpointError(f"{name}: another rank could not write its shards; nothing was saved")
    if not lead:
        return None
    return save(root, name, params=full, opt_state=None, tmp=got[0], **kw,
                sharded={"world": world, "train_layout": str(train.mesh)})


def read_manifest(path: str) -> dict:
    """Checkpoint ``path``'s manifest, its files not checked (``verify`` does)."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{mpath}: missing (an interrupted or foreign checkpoint)") from None
    except ValueError as e:
        raise CheckpointError(f"{mpath}: not valid JSON ({e})") from None


def verify(path: str) -> dict:
    """The manifest of checkpoint ``path`` after checking every file it lists; ``CheckpointError`` names
    the first problem."""
    manifest = read_manifest(path)
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


def read_args(path: str) -> dict:
    """The configuration of the run that wrote checkpoint ``path``."""
    with open(os.path.join(path, ARGS)) as f:
        return json.load(f)


def load(path: str, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu", rank: int = 0,
         verified: bool = False, layout=None, critic_layout=None) -> Checkpoint:
    """Read a checkpoint after ``verify`` (``verified``: the caller just did) for rank ``rank`` of a run whose
    train layout is ``layout`` (a ``sharding.Layout``; None: one process) and whose critic's is
    ``critic_layout``. A one-process checkpoint gives whole tensors (``sharded`` None: the caller cuts its
    shards); a sharded one gives the rank's shards of ``layout`` (whole tensors when ``layout`` is None),
    from the rank's own file in the layout that wrote it, else resharded (``sharding.reference.reshard``) with
    the RNG state of writer rank ``rank % W``."""
    sharded = (read_manifest(path) if verified else verify(path)).get("sharded")
    st = torch.load(os.path.join(path, STATE), map_location=device, weights_only=False)
    args = read_args(path)
    critic, cfg = None, adapters.config_of(path)
    want = None if layout is None else {"world": layout.mesh.size, "train_layout": str(layout.mesh)}
    if sharded is None:  # whole tensors; a sharded run cuts its shards from them
        if cfg.lora is not None:  # the adapters alone: the run's --model is the frozen base
            params = adapters.load(path, cfg, device=device)
        else:
            cfg, params = hf.load(path, dtype=dtype, device=device)
        opt_state, rng = _state(st["opt_state"]), st["torch_rng"]
        if os.path.exists(os.path.join(path, CRITIC)):
            critic = _critic(torch.load(os.path.join(path, CRITIC), map_location=device, weights_only=False))
        return _loaded(path, st, cfg, params, opt_state, critic, args, rng, None)
    W = sharded["world"]
    if sharded == want:  # the layout that wrote it: the rank's own file
        mine = torch.load(os.path.join(path, shard_file(rank, W)), map_location=device, weights_only=False)
        params, opt_state = mine["params"], _state(mine["opt_state"])
        critic = None if mine["critic"] is None else _critic(mine["critic"])
        return _loaded(path, st, cfg, params, opt_state, critic, args, mine["torch_rng"], sharded, dtype)
    from rlflow.models.sharding import layout as layout_of
    from rlflow.sharding import Mesh
    from rlflow.sharding.reference import reshard
    mesh = Mesh.parse(sharded["train_layout"].removeprefix("mesh(").removesuffix(")"))
    if mesh.size != W:
        raise CheckpointError(f"{path}: its manifest says {W} ranks and train layout {mesh}")
    files = [torch.load(os.path.join(path, shard_file(r, W)), map_location="cpu", mmap=True, weights_only=False)
             for r in range(W)]  # mapped: only the blocks this rank needs are read
    src = layout_of(cfg, mesh, dtype=torch.float32)

    def cut(per_rank: list[dict], src, dst) -> dict:
        return {k: v.to(device) for k, v in reshard(per_rank, src, dst, rank).items()}

    def state(per_rank: list[dict], src, dst) -> optim.AdamWState:
        return optim.AdamWState(step=per_rank[0]["step"], m=cut([d["m"] for d in per_rank], src, dst),
                                v=cut([d["v"] for d in per_rank], src, dst),
                                master=cut([d["master"] for d in per_rank], src, dst))
    params = cut([f["params"] for f in files], src, layout)
    opt_state = state([f["opt_state"] for f in files], src, layout)
    if files[0]["critic"] is not None and (layout is None or critic_layout is not None):  # else: no critic here
        csrc = layout_of(cfg, mesh, dtype=torch.float32, head="value")
        critic = Critic(params=cut([f["critic"]["params"] for f in files], csrc, critic_layout),
                        opt_state=state([f["critic"]["opt_state"] for f in files], csrc, critic_layout))
    return _loaded(path, st, cfg, params, opt_state, critic, args, files[rank % W]["torch_rng"], want, dtype,
                   resharded_from=sharded)


def _loaded(path, st, cfg, params, opt_state, critic, args, rng, sharded, dtype=None, resharded_from=None):
    torch.set_rng_state(rng.cpu())  # loaded onto the run's device with the rest; the RNG state is a CPU tensor
    params = {k: v if dtype is None else v.to(torch.float32 if keeps_float32(cfg, k) else dtype)
              for k, v in params.items()}
    return Checkpoint(path=path, steps_done=int(st["steps_done"]), cfg=cfg, params=params, opt_state=opt_state,
                      source_state=st["source"], args=args, critic=critic, sharded=sharded,
                      resharded_from=resharded_from)


def _critic_dict(c: Critic) -> dict:
    return {"params": c.params, "opt_state": _state_dict(c.opt_state)}


def _critic(d: dict) -> Critic:
    return Critic(params=d["params"], opt_state=_state(d["opt_state"]))


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


__all__ = ["Checkpoint", "CheckpointError", "begin", "find_resumable", "load", "read_args", "read_manifest",
           "restore_source", "save", "save_state", "shard_file", "source_state", "verify", "write_shard"]
