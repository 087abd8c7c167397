"""The recipe on one rank: ``run(rank, world, r, dock)`` builds the run's pieces from the flags, resumes
from a checkpoint, trains with ``rlflow.runtime.loop.train``, evaluates, logs to the metrics sinks, writes
checkpoints and the reward plot; and what only it uses."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import torch

from rlflow import metrics, optim
from rlflow.algos.corrections import LogprobMismatchError
from rlflow.algos.critic import Critic
from rlflow.models import hf
from rlflow.parallel.context import shard_params
from rlflow.recipe.evals import eval_examples, eval_line, evaluation, full_params
from rlflow.recipe.pieces import build, placement, train_layout_name
from rlflow.runtime import checkpoint, loop
from rlflow.runtime.weights import same_layout
from rlflow.sharding.dist import all_reduce

if TYPE_CHECKING:
    from rlflow.recipe.flags import Recipe


def resume_point(r: Recipe, cfg, source, dev, dtype, say, rank: int = 0, where=None):
    """(checkpoint or None) for --resume: the directory given, or under --out the newest one that verifies; with
    ``where`` (the run's placement, world > 1) rank ``rank``'s shards of its train layout, resharded when the
    checkpoint was written in another; else whole tensors."""
    if not r.resume:
        return None
    path, verified = r.resume, r.resume == "auto"
    if r.resume == "auto":
        path, skipped = checkpoint.find_resumable(r.out)  # verifies it
        for line in skipped:
            say(f"resume: {line}")
        if path is None:
            say(f"resume: no checkpoint under {r.out}; starting from scratch")
            return None
    try:
        if hf.load_config(path) != cfg:  # before any shard is cut to this run's layout
            raise SystemExit(f"error: --resume {path}: its model config differs from this run's (--model/--preset)")
        wrote = checkpoint.read_args(path).get("dtype")
        if wrote not in (None, r.dtype):  # the optimizer's float32 masters exist only for a low-precision run
            raise SystemExit(f"error: --dtype {r.dtype}: --resume {path} was trained in {wrote}; resume it with "
                             f"--dtype {wrote}, or start from its weights with --model (a fresh optimizer)")
        ck = checkpoint.load(path, dtype=dtype, device=dev, rank=rank, verified=verified,
                             layout=None if where is None else where.train,
                             critic_layout=None if where is None else where.critic)
    except (checkpoint.CheckpointError, FileNotFoundError) as e:
        raise SystemExit(f"error: --resume {r.resume}: {e}") from None
    checkpoint.restore_source(source, ck.source_state)
    was = ck.resharded_from
    say(f"resumed from {path} after {ck.steps_done} steps" + ("" if was is None else
        f" (resharded from train {was['train_layout']} on {was['world']} ranks)"))
    return ck


class Interrupt:
    """SIGINT / SIGTERM (Ctrl-C, a scheduler's preemption) ask the run to stop after the current step; a
    second one stops at once."""

    def __init__(self):
        self.signal, self._old = None, {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, sig, _frame):
        if self.signal is not None:
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)
        self.signal = sig

    def __call__(self) -> bool:
        return self.signal is not None


def run(rank: int, world: int, r: Recipe, dock=None) -> list[dict]:
    """The recipe on rank ``rank`` of ``world`` (rank 0 prints and writes the outputs); ``dock``: the
    transfer dock the driver made (None: in memory, one process)."""
    torch.manual_seed(r.seed)
    cfg, params, tok, source, reward_fn, lcfg, dev = build(r)
    interrupt = Interrupt()
    dtype = next(iter(params.values())).dtype
    where = None if world == 1 else placement(r, cfg, dtype)
    lead = rank == 0
    say = print if lead else (lambda *a, **k: None)
    n = sum(p.numel() for p in params.values())
    moe = f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}" if cfg.num_experts else "dense"
    say(f"model: {r.model or r.preset} ({cfg.model_type}, {n / 1e6:.2f}M params, {moe}) on {dev} x {world}; "
        f"task: {r.dataset or r.task}")
    say(f"sizes: {r.prompts_per_step} prompts x {r.group_size} samples = {lcfg.global_batch} per step, "
        f"mini-batch {lcfg.mini_batch_size}, micro-batch {lcfg.micro_batch_size}")
    if where is not None:
        say(f"layouts: train {where.train.mesh}, rollout {where.rollout.mesh} on {world} ranks; transfer dock "
            f"{type(dock.transport).__name__.removesuffix('Transport').lower()} with {len(dock.warehouses)} "
            "warehouses")
    say(loop.TPS_DEFINITION)
    init = {k: v.clone() for k, v in params.items()} if r.kl_coef else None  # the reference: the run's start
    ck = resume_point(r, cfg, source, dev, dtype, say, rank, where)
    done = 0 if ck is None else ck.steps_done
    opt_state = None if ck is None else ck.opt_state
    if ck is not None:
        params = ck.params
    critic = None if ck is None else ck.critic  # PPO's critic; a fresh one is made below from the policy's shards
    if lcfg.critic is not None and ck is not None and ck.critic is None:
        raise SystemExit(f"error: --resume {ck.path}: the checkpoint has no critic (a run without "
                         "--adv-estimator gae); it cannot continue as a PPO run")
    if where is not None:  # this rank's shards of the train layout (a sharded checkpoint holds them as they are)
        mine = lambda full: shard_params(full, where.train, rank)  # noqa: E731
        init = None if init is None else mine(init)
    if where is not None and (ck is None or ck.sharded is None):
        params = mine(params)
        if opt_state is not None:
            opt_state = optim.map_state(opt_state, mine)
        if critic is not None:
            ours = lambda full: shard_params(full, where.critic, rank)  # noqa: E731
            critic = Critic(params=ours(critic.params), opt_state=optim.map_state(critic.opt_state, ours))
    if lcfg.critic is not None and critic is None:  # the critic's shards are the policy's, with its value head
        critic = Critic.from_policy(params, cfg, seed=r.seed)
    if done >= r.steps:
        say(f"nothing to do: {done} of {r.steps} steps are done")
        return []
    lcfg = dataclasses.replace(lcfg, steps=r.steps - done)
    sinks: list[metrics.Sink] = []
    if lead:
        if r.out:
            with open(os.path.join(r.out, "args.json"), "w") as f:
                json.dump(dataclasses.asdict(r), f, indent=2)
        # a resumed run does the steps after its checkpoint again: the sinks drop what they logged from there on
        sinks = metrics.make_sinks(sink_spec(r), r.out, dataclasses.asdict(r), first_step=done,
                                   wandb_project=r.wandb_project, wandb_mode=r.wandb_mode)

    def save(name, steps_done, p, state, keep=None):
        """Every rank calls it: with several ranks each writes its own shards, the weights are gathered for
        the consolidated export (a collective), and the lead writes the rest."""
        kw = dict(steps_done=steps_done, cfg=cfg, source=source, args=dataclasses.asdict(r), tokenizer=tok,
                  keep_last=keep)
        if where is None:
            return checkpoint.save(r.out, name, params=p, opt_state=state, critic=critic, **kw)
        got = [checkpoint.begin(r.out, name) if lead else None]
        torch.distributed.broadcast_object_list(got, src=0)
        failed = None
        try:
            checkpoint.write_shard(got[0], rank, world, params=p, opt_state=state, critic=critic)
        except Exception as e:  # noqa: BLE001 -- every rank must still reach the collectives below
            failed = e
        full = full_params(cfg, where, p)
        if float(all_reduce(torch.tensor([failed is not None], dtype=torch.float64))[0]):  # any rank's file missing
            if lead:
                shutil.rmtree(got[0], ignore_errors=True)
            if failed is not None:
                raise failed
            raise checkpoint.CheckpointError(f"{name}: another rank could not write its shards; nothing was saved")
        if not lead:
            return None
        return checkpoint.save(r.out, name, params=full, opt_state=None, tmp=got[0], **kw,
                               sharded={"world": world, "train_layout": train_layout_name(r)})

    evals = eval_examples(r) if r.eval_dataset else None

    def evaluate_at(steps_done, p):
        """Every rank calls it (the weights and the shares' scores are gathered: collectives); the lead logs
        the eval/* row at the steps done."""
        m = evaluation(r, cfg, tok, evals, reward_fn, p, where, rank, world)
        for s in sinks:
            s.log(steps_done, {"step": steps_done, **m})
        (bar.write if bar is not None else say)(f"eval after {steps_done} steps: {eval_line(m)}")

    def after_step(steps_done, p, state):
        if evals is not None and (steps_done == r.steps or (r.eval_every and steps_done % r.eval_every == 0)):
            evaluate_at(steps_done, p)
        if r.out and r.save_every and steps_done % r.save_every == 0 and steps_done < r.steps:
            save(f"checkpoint-{steps_done:06d}", steps_done, p, state, keep=r.keep_last)
    bar = None
    if lead:
        try:
            from tqdm import tqdm
            bar = tqdm(total=r.steps, initial=done, unit="step", file=sys.stdout, mininterval=0.5,
                       dynamic_ncols=True)
        except ImportError:
            pass
    t0 = time.perf_counter()

    def on_step(m):
        for s in sinks:
            s.log(m["step"], m)
        if bar is not None:
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", tps=f"{m['tps']:.0f}", step_s=f"{m['step_time_s']:.2f}",
                            refresh=False)
            bar.update(1)

    def on_samples(step, rows):
        for s in sinks:
            s.log_samples(step, rows)

    try:
        if evals is not None:
            evaluate_at(done, params)
        params, opt_state, history = loop.train(
            params, cfg, tok, source, reward_fn, lcfg, on_step=on_step, device=dev, dock=dock, placement=where,
            opt_state=opt_state, first_step=done, ref_params=init, after_step=after_step, should_stop=interrupt,
            on_samples=on_samples if lead else None, critic=critic)
    except (loop.NonFiniteError, LogprobMismatchError) as e:  # the run's verdict, not a crash: no traceback;
        raise SystemExit(f"error: {e}" if lead else 1) from None  # every rank reaches it, the lead says it
    finally:
        interrupt.restore()
        for s in sinks:
            s.close()
    if bar is not None:
        bar.close()
    steps_done = done + len(history)
    if steps_done < r.steps:  # interrupted: keep what was done, say how to go on
        path = save(f"checkpoint-{steps_done:06d}", steps_done, params, opt_state) if r.out else None
        if path is not None:
            print(f"interrupted after step {steps_done - 1}: wrote {path}; continue with --resume auto "
                  f"(or --resume {path})", file=sys.stderr)
        raise SystemExit(128 + int(interrupt.signal or 0))
    wall = time.perf_counter() - t0
    first = sum(m["reward_mean"] for m in history[:10]) / len(history[:10])
    last = sum(m["reward_mean"] for m in history[-10:]) / len(history[-10:])
    tps = sum(m["prompt_tokens"] + m["response_tokens"] for m in history) / sum(m["step_time_s"] for m in history)
    say(f"done: {len(history)} steps in {wall:.1f}s; mean reward first 10 steps {first:.3f} -> last 10 "
        f"{last:.3f} (+{last - first:.3f}); mean TPS {tps / world:.0f}")
    mean = lambda k: sum(m.get(k, 0.0) for m in history) / len(history)  # noqa: E731
    if where is not None and not _same_layouts(where):
        say(f"weights train -> rollout layout (allgather-swap): {mean('transition_out_s') * 1e3:.1f} ms per step, "
            f"{mean('transition_recv_bytes') / 2**20:.2f} MiB received by rank 0; back (swap-in): "
            f"{mean('transition_back_s') * 1e3:.1f} ms")
    if dock is not None:
        say(f"transfer dock: {len(dock.warehouses)} warehouses, busiest dock process moved "
            f"{sum(m.get('dock_busiest_bytes', 0.0) for m in history) / 2**20:.1f} MiB in all "
            f"({mean('dock_busiest_bytes') / 2**10:.1f} KiB per step)")
    if r.out:
        names = metrics.sink_names(r.log_to)
        if lead:  # metrics.jsonl holds a resumed run's earlier steps too; without it, this call's steps
            jsonl = os.path.join(r.out, "metrics.jsonl")
            plot_rewards([json.loads(ln) for ln in open(jsonl)] if "jsonl" in names else history,
                         os.path.join(r.out, "reward.png"))
        path = save("checkpoint-final", steps_done, params, opt_state)
        shown = ["args.json", *("metrics.jsonl" if n == "jsonl" else "tensorboard/" for n in names if n != "wandb"),
                 "reward.png"]
        say(f"wrote {', '.join(f'{r.out}/{n}' for n in shown)}, {path}/ (--model {path} loads it)")
    return history


def _same_layouts(where) -> bool:
    return same_layout(where.train, where.rollout)


def sink_spec(r: Recipe) -> str:
    """--log-to less jsonl when there is no --out (nothing is written then, as the default run does)."""
    return ",".join(n for n in metrics.sink_names(r.log_to) if r.out or n != "jsonl")


def plot_rewards(history: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    evals = [m for m in history if "eval/reward_mean" in m]
    history = [m for m in history if "reward_mean" in m]
    steps = [m["step"] for m in history]
    r = [m["reward_mean"] for m in history]
    k = 10
    smooth = [sum(r[max(0, i - k + 1):i + 1]) / len(r[max(0, i - k + 1):i + 1]) for i in range(len(r))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, r, alpha=0.35, label="reward (step mean)")
    ax.plot(steps, smooth, label=f"reward ({k}-step moving mean)")
    if evals:
        ax.plot([m["step"] for m in evals], [m["eval/reward_mean"] for m in evals], "o-", label="eval reward (mean)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
