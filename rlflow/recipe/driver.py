"""What a recipe script runs: ``parse_args`` makes the command line of ``Recipe``'s fields and refuses a bad
value by its flag (``checks``), ``main`` refuses what the model and the layouts cannot run before any process
starts and picks the launcher (one process, local processes, Ray actors, or the ranks
torchrun / Slurm started); nothing here runs per rank (that is ``run.run``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import os
import socket
import sys
import tempfile

import torch

from rlflow.models import gguf, hf
from rlflow.models.config import get_config
from rlflow.recipe.checks import problems, started_problems
from rlflow.recipe.evals import evaluate_only
from rlflow.recipe.flags import Recipe, choices
from rlflow.recipe.pieces import check_tokenizer, layouts, make_dock
from rlflow.recipe.run import run
from rlflow.runtime import checkpoint, launch, pools
from rlflow.runtime.config import check_features
from rlflow.startup import interruptible


RUN_FILES = ("args.json", "metrics.jsonl", "samples.jsonl", "tensorboard", "reward.png", "checkpoint-final",
             "eval.json")


def prepare_out(r: Recipe) -> None:
    """Check --out before anything is trained or written: an earlier run there is refused unless
    --overwrite, and the directory must be writable (a run that cannot save would lose its weights at the end)."""
    if not r.out:
        return
    earlier = [n for n in RUN_FILES if os.path.exists(os.path.join(r.out, n))]
    earlier += sorted(n for n in (os.listdir(r.out) if os.path.isdir(r.out) else ()) if n.startswith("checkpoint-")
                      and n not in earlier)
    if earlier and not (r.overwrite or r.resume):
        raise SystemExit(f"error: --out {r.out} holds an earlier run ({', '.join(earlier)}); choose another "
                         "directory or pass --overwrite")
    try:
        os.makedirs(r.out, exist_ok=True)
        with tempfile.TemporaryFile(dir=r.out):
            pass
    except OSError as e:
        raise SystemExit(f"error: --out {r.out}: cannot write there ({e.strerror or e})") from None


OUT_LOCK = ".rlflow-run.lock"
_HELD: list = [None]  # the --out lock's fd while a run holds it


def _drop_lock_in_child() -> None:
    """A forked child (the dock's servers) does not keep the run's --out lock: left alive after the run was
    killed, it would refuse every later run there."""
    if _HELD[0] is not None:
        with contextlib.suppress(OSError):
            os.close(_HELD[0])
        _HELD[0] = None


os.register_at_fork(after_in_child=_drop_lock_in_child)


@contextlib.contextmanager
def holding_out(r: Recipe):
    """One run per --out, for the run's life: an OS lock (``flock``: released when its holder ends, killed too)
    on a file in --out that names its holder, removed when the run ends. A second run there (two jobs started
    together, a requeued ``--resume auto`` beside the first) is refused with that name before it writes
    anything."""
    if not r.out:
        yield
        return
    path = os.path.join(r.out, OUT_LOCK)
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "a process that has not said who it is yet"
            f.close()
            raise SystemExit(f"error: --out {r.out} is in use by another run ({holder}); wait for it to end or "
                             "choose another directory") from None
        try:  # the file locked is still the one at the path (an ending run removes it while it holds it)
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        _HELD[0] = f.fileno()
        yield
    finally:
        _HELD[0] = None
        try:
            with contextlib.suppress(FileNotFoundError):  # --out removed meanwhile: the run's own error stands
                os.unlink(path)
        finally:
            f.close()  # releases the lock


def parse_args(argv=None, defaults: dict | None = None, doc: str | None = None) -> Recipe:
    """The Recipe of the command line; ``defaults`` replace Recipe's field defaults and ``doc`` the --help
    text (another recipe reusing this one, e.g. recipes/grpo_qwen25_dense.py)."""
    defaults = dict(defaults or {})
    unknown = set(defaults) - {f.name for f in dataclasses.fields(Recipe)}
    if unknown:
        raise TypeError(f"defaults: not Recipe fields: {sorted(unknown)}")
    started = launch.env_world()  # this process is one rank of a world torchrun or Slurm started: its size is --world's
    if started is not None:
        defaults.setdefault("world", started[1])
    # without ``doc``: the package's docstring (rlflow/recipe/__init__.py), the recipe's own --help text
    p = argparse.ArgumentParser(description=doc or sys.modules[__package__].__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    fixed = choices()
    for f in dataclasses.fields(Recipe):
        default = defaults.get(f.name, f.default)
        flag, help = "--" + f.name.replace("_", "-"), f"{f.metadata['help']} (default: {default})"
        if str(f.type) == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help)
            continue
        if str(f.type) == "tuple[str, ...] | None":
            p.add_argument(flag, action="append", default=None, help=help)
            continue
        typ = {"int | None": int, "str | None": str, "float | None": float}.get(str(f.type), None) or \
            {"int": int, "float": float, "str": str}[str(f.type)]
        p.add_argument(flag, type=typ, default=default, help=help,
                       **({"choices": fixed[f.name]} if f.name in fixed else {}))
    args = vars(p.parse_args(argv))
    args.update({k: v for k, v in defaults.items() if args[k] is None})  # --reward: a given one replaces the default
    r = Recipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in args.items()})
    if r.model and gguf.is_gguf(r.model):  # a GGUF file or a packaged model: its converted directory from here on
        try:
            r = dataclasses.replace(r, model=gguf.resolve(r.model))
        except ValueError as e:
            p.error(f"--model {r.model}: {e}")
    for name, why in (started_problems(r, started[1]) if started is not None else []) + problems(r):
        if name is None:  # a config's refusal that names no flag: its message as it is
            p.error(why)
        v = getattr(r, name)
        shown = "" if isinstance(v, bool) else " " + (" ".join(v) if isinstance(v, tuple) else str(v))
        p.error(f"--{name.replace('_', '-')}{shown}: {why}")  # one line, exit 2, nothing written
    for line in warnings(r) if started is None or started[0] == 0 else []:
        print(f"{p.prog}: warning: {line}", file=sys.stderr)
    return r


LR_WARN = 1e-2  # AdamW moves each weight by about lr a step: past this, fine-tuning destroys the model


def warnings(r: Recipe) -> list[str]:
    """What the run will do, though it is likely not what was meant (said once, the run goes on)."""
    out = []
    for name in ("lr", "critic_lr"):
        v = getattr(r, name, None)
        if v is not None and v > LR_WARN:
            out.append(f"--{name.replace('_', '-')} {v}: above {LR_WARN}; AdamW moves every weight by about the "
                       f"learning rate each step (RL fine-tuning uses 1e-6 to 1e-5, these toy presets 3e-4)")
    return out


def main(argv=None, defaults: dict | None = None, doc: str | None = None) -> list[dict]:
    with interruptible():  # Ctrl-C before the run's own handlers (recipe/run.py: Interrupt) are in place
        return _main(argv, defaults, doc)


def _main(argv, defaults, doc) -> list[dict]:
    r = parse_args(argv, defaults, doc)
    where = launch.env_world()  # started by torchrun / Slurm: this process is one rank (parse_args checked --world)
    cfg = hf.load_config(r.model) if r.model else get_config(r.preset)
    if r.model:
        check_tokenizer(r, cfg)
    if r.eval_only:  # in this process (under torchrun / Slurm: rank 0's): no layouts, no dock
        if where is not None and where[0] != 0:
            return []
        prepare_out(r)
        with holding_out(r):
            return [evaluate_only(r)]
    try:  # what the model and the layouts cannot run is refused here, once, before any process starts
        pp = layouts(r, cfg, torch.float32)["train_layout"].mesh.pp if r.world > 1 else 1
        check_features(cfg, pp, routing_replay=r.routing_replay, check_logprobs=r.check_logprobs,
                       adv_estimator=r.adv_estimator)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    lead = where is None or where[0] == 0
    if lead:
        prepare_out(r)
    with holding_out(r) if lead else contextlib.nullcontext():
        return _launch(r, where)


def _launch(r: Recipe, where) -> list[dict]:
    """``main`` once --out is this run's: the checkpoint to resume verified, the dock made, the ranks run."""
    if r.resume and r.resume != "auto":  # a damaged checkpoint is refused before any rank starts
        try:
            checkpoint.verify(r.resume)
        except (checkpoint.CheckpointError, FileNotFoundError) as e:
            raise SystemExit(f"error: --resume {r.resume}: {e}") from None
    if r.resume == "auto":  # checkpoints, none of them whole: a fresh start would overwrite them and the metrics
        found, skipped = checkpoint.find_resumable(r.out)
        if found is None and skipped:
            raise SystemExit(f"error: --resume auto: no checkpoint under {r.out} verifies, nothing was written: "
                             + "; ".join(s.removeprefix("skipped ") for s in skipped[:3])
                             + (f"; and {len(skipped) - 3} more" if len(skipped) > 3 else "")
                             + ". Repair one, pass --resume DIR, or start afresh in another --out")
    on_ray = where is None and r.world > 1 and r.launcher == "ray"  # run_on_ray makes a dock per attempt
    dock = make_dock(r, dock_rows(r)) if (where is None or r.world == 1) and not on_ray else None
    try:
        if where is not None and r.world > 1:  # no driver: the ranks start the dock's servers themselves
            return launch.from_env(run_started, r, where[2], timeout_s=r.dist_timeout)
        if where is not None:
            return launch.from_env(run, r, dock, timeout_s=r.dist_timeout)
        if r.world == 1:
            return run(0, 1, r, dock)
        if on_ray:
            return run_on_ray(r)
        split = pools.Pools(r.rollout_ranks, r.world) if r.rollout_ranks else None  # the train lead's result: the run's
        out = launch.spawn(run, r.world, r, dock, timeout_s=r.dist_timeout, pools=split)  # torch.distributed: gloo on
        return out[r.rollout_ranks]  # CPU, nccl on CUDA, hccl on NPU
    finally:
        if dock is not None:
            dock.close()


def dock_rows(r: Recipe) -> int:
    """The dock's capacity in rows: one step's, or with separate pools --max-staleness + 1 steps' (the rollout
    pool may be that many steps ahead of the train pool)."""
    return r.prompts_per_step * r.group_size * (r.max_staleness + 1)


def run_started(rank: int, world: int, r: Recipe, local_rank: int) -> list[dict]:
    """``run`` on a rank of a world torchrun or Slurm started: the ranks make the dock together
    (``proc_backend.node_dock``: each node's first rank serves that node's warehouses), then with separate
    pools split into them (``launch.split_world``), and each stops the servers it started once every rank is
    done with them."""
    dock = make_dock(r, dock_rows(r), local_rank=local_rank)  # over every rank, before the pools split them
    try:
        if r.rollout_ranks:
            launch.split_world(pools.Pools(r.rollout_ranks, world), rank, timeout_s=r.dist_timeout)
        out = run(rank, world, r, dock)
        if r.rollout_ranks:  # no rank reads the dock any more
            pools.barrier(pools.joined())
        else:
            torch.distributed.barrier()
        return out
    finally:
        dock.close()


def run_on_ray(r: Recipe) -> list[dict]:
    """--launcher ray: the ranks as actors of a placement group, the dock's warehouses and controllers as actors
    too. When a rank is lost (``launch.RankLost``: its actor died, or it stopped answering) the actors and the
    placement group are gone and the dock is closed (its rows are the interrupted step's); with --max-restarts K
    the run starts again, up to K times, with new actors and a fresh dock from the newest checkpoint this run
    wrote under --out (none yet: from where it started). Other failures (an exception in the ranks' code, a
    rank's exit) would repeat, and end the run."""
    earlier = checkpoints_in(r.out)  # an earlier run's (--overwrite) are not this run's to resume from
    attempt = r
    split = pools.Pools(r.rollout_ranks, r.world) if r.rollout_ranks else None
    for restart in range(r.max_restarts + 1):
        dock = make_dock(attempt, dock_rows(r))
        try:
            out = launch.ray_spawn(run, r.world, attempt, dock, address=r.ray_address, timeout_s=r.dist_timeout,
                                   pools=split)
            return out[r.rollout_ranks]  # the train lead's (rank 0 without pools)
        except launch.RankLost as e:
            if restart == r.max_restarts:
                tried = f" (after {restart} restart{'s' * (restart > 1)}, --max-restarts {r.max_restarts})"
                raise SystemExit(f"error: {e}{tried if restart else ''}") from None
            ck = newest_checkpoint(r.out, earlier)
            attempt = dataclasses.replace(r, resume=ck or r.resume)
            start = ck or (f"--resume {r.resume}" if r.resume else "the start (no checkpoint yet)")
            print(f"restart {restart + 1} of {r.max_restarts}: {e}; restarting from {start}", file=sys.stderr,
                  flush=True)
        finally:
            dock.close()


def checkpoints_in(root: str) -> dict[str, int]:
    """{name: its manifest's mtime} of the checkpoints under ``root``."""
    found = {}
    for n in os.listdir(root) if root and os.path.isdir(root) else ():
        m = os.path.join(root, n, checkpoint.MANIFEST)
        if n.startswith("checkpoint-") and os.path.isfile(m):
            found[n] = os.stat(m).st_mtime_ns
    return found


def newest_checkpoint(root: str, earlier: dict[str, int]) -> str | None:
    """The newest checkpoint under ``root`` that verifies and is not one of ``earlier`` (``checkpoints_in``)."""
    ours = [n for n, t in checkpoints_in(root).items() if earlier.get(n) != t]
    for n in sorted(ours, key=lambda n: (n == "checkpoint-final", n), reverse=True):
        try:
            checkpoint.verify(os.path.join(root, n))
            return os.path.join(root, n)
        except checkpoint.CheckpointError:
            continue
    return None
