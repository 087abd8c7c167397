"""The recipe on one rank: ``run(rank, world, r, dock)`` builds the run from the flags (``pieces.build``), makes
this rank's state (fresh, or resumed from a checkpoint in any layout), the step's context and the hooks (sinks,
progress bar, evaluation, checkpoints), trains with ``rlflow.runtime.loop.train`` and reports."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time

import torch

from rlflow import metrics
from rlflow.algos.corrections import LogprobMismatchError
from rlflow.data import PromptTooLong
from rlflow.dock.proc_backend import DockLost
from rlflow.models import adapters
from rlflow.sharding.layout import fmt_bytes
from rlflow.recipe.evals import eval_examples, eval_line, evaluation
from rlflow.recipe.flags import Recipe
from rlflow.recipe.output import Report, introduce, plot_rewards
from rlflow.recipe.pieces import RunSpec, build, concrete, placement
from rlflow.rewards import RewardError
from rlflow.runtime import checkpoint, hooks, loop, pools, state as run_state, step
from rlflow.runtime.placement import Disaggregated, Placement
from rlflow.startup import stop_at_once



def resume_point(r: Recipe, cfg, dev, dtype, say, rank: int = 0, where=None):
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
        if adapters.config_of(path) != cfg:  # before any shard is cut to this run's layout
            raise SystemExit(f"error: --resume {path}: its model config differs from this run's (--model/--preset"
                             f"{', --lora-*' if cfg.lora is not None or adapters.is_adapter_dir(path) else ''})")
        wrote = checkpoint.read_args(path).get("dtype")
        if wrote not in (None, r.dtype):  # the optimizer's float32 masters exist only for a low-precision run
            raise SystemExit(f"error: --dtype {r.dtype}: --resume {path} was trained in {wrote}; resume it with "
                             f"--dtype {wrote}, or start from its weights with --model (a fresh optimizer)")
        changed = data_changes(r, checkpoint.read_args(path))
        if changed:
            raise SystemExit(f"error: {changed[0]}: --resume {path} drew its prompts from other data"
                             f"{''.join('; ' + c for c in changed[1:])}; resume it with the flags it was trained "
                             f"with, or start from its weights with --model (a fresh data stream and optimizer)")
        ck = checkpoint.load(path, dtype=dtype, device=dev, rank=rank, verified=verified,
                             layout=None if where is None else where.train,
                             critic_layout=None if where is None else where.critic)
    except (checkpoint.CheckpointError, FileNotFoundError) as e:
        raise SystemExit(f"error: --resume {r.resume}: {e}") from None
    was = ck.resharded_from
    say(f"resumed from {path} after {ck.steps_done} steps" + ("" if was is None else
        f" (resharded from train {was['train_layout']} on {was['world']} ranks)"))
    return ck


# the flags that make the prompt stream a checkpoint's data position counts in
DATA_FLAGS = ("dataset", "dataset_split", "prompt_key", "answer_key", "task", "chat_template", "system_prompt")


def data_changes(r: Recipe, wrote: dict) -> list[str]:
    """'--flag now (trained with was)' for each data flag that differs from the checkpoint's run (a flag its
    args.json lacks, from an older rlflow, is not compared); a --dataset file is compared by what it is."""
    out = []
    for k in DATA_FLAGS:
        if k not in wrote:
            continue
        was, now = wrote[k], getattr(r, k)
        if k == "dataset" and was and now and os.path.exists(was) and os.path.exists(now):
            same = os.path.samefile(was, now)
        else:
            same = was == now
        if not same:
            out.append(f"--{k.replace('_', '-')} {now} (trained with {was})")
    return out


SAME_SIGNAL_S = 1.0  # a second signal this soon after the first is the same request (it stops at once later)


class Interrupt(hooks.Hook):
    """SIGINT / SIGTERM (Ctrl-C, a scheduler's preemption) ask the run to stop after the current step; a
    second one (``SAME_SIGNAL_S`` or more after the first) stops at once, and so does the first before this
    run's first step is done (there is nothing to save yet, and the start-up, a kernel build or an engine's,
    may take long). Once the steps are over (``end``, before the final or the interrupt checkpoint is
    written) the handlers are the process's own again."""

    def __init__(self, announce: bool = True):
        self.signal, self._old, self.stepped, self._at, self.announce = None, {}, False, 0.0, announce
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def after_step(self, state, metrics: dict, out) -> None:
        self.stepped = True

    def end(self, state) -> None:
        self.restore()

    def close(self) -> None:
        self.restore()

    def __enter__(self) -> "Interrupt":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, sig, _frame):
        now = time.monotonic()
        if self.signal is not None and now - self._at < SAME_SIGNAL_S:
            return  # the same request again: a scheduler signals every process, and the launcher forwards
        if self.signal is not None or not self.stepped:
            stop_at_once(sig, say=None if not self.announce else "\ninterrupted " + (  # after the bar
                "again: stopped without a checkpoint" if self.signal is not None else
                "before the first step was done: nothing saved"))
        self.signal, self._at = sig, now

    def __call__(self) -> bool:
        return self.signal is not None


def run(rank: int, world: int, r: Recipe, dock=None) -> list[dict]:
    """The recipe on rank ``rank`` of ``world`` (rank 0 prints and writes the outputs); ``dock``: the
    transfer dock the driver made (None: in memory, one process)."""
    torch.manual_seed(r.seed)
    r = concrete(r)
    return _run(rank, world, r, dock, build(r), Interrupt(announce=rank == 0))  # the spec's only reference is _run's


def _run(rank: int, world: int, r: Recipe, dock, spec: RunSpec, interrupt: Interrupt) -> list[dict]:
    """``run`` with ``spec`` and the interrupt's handlers (restored on every way out). With separate pools a
    rollout rank runs the producer; a train rank the steps below, in its pool's world."""
    cfg, dev = spec.cfg, spec.device
    dtype = next(iter(spec.params.values())).dtype
    whole = placement(r, cfg, dtype)
    link, where = pools.joined(), whole
    if isinstance(whole, Disaggregated):
        if link is None:
            raise SystemExit("error: --rollout-ranks: this process is no rank of separate pools (the launcher splits "
                             "the world into them: launch.spawn(..., pools=...))")
        rank, world = link.pools.local(link.rank)
        where = whole.own(link.pools.pool(link.rank))
        if link.pools.pool(link.rank) == "rollout":
            interrupt.restore()
            spec = dataclasses.replace(spec, params={})  # the weights arrive by the push: none of these stays alive
            return _produce(r, dock, spec, whole)
    with interrupt:
        lead = rank == 0
        say = print if lead else (lambda *a, **k: None)
        introduce(r, spec, where, dock, r.world, say)
        if isinstance(whole, Disaggregated):
            k = link.pools.rollout
            plan = whole.push_plan()
            later = pools.adapters_plan(plan)
            say(f"separate pools: ranks 0..{k - 1} generate and score, ranks {k}..{link.pools.world - 1} train; "
                f"--max-staleness {r.max_staleness}; {plan.describe()}" + ("" if later is None else
                f"; LoRA: the model with the first version, then the adapters alone (sent max "
                f"{fmt_bytes(later.bytes_sent().max())}/train rank)"))
        ck = resume_point(r, cfg, dev, dtype, say, rank, where)
        if ck is not None and ck.steps_done >= r.steps:
            say(f"nothing to do: {ck.steps_done} of {r.steps} steps are done")
            if link is not None:  # the rollout pool waits for a first version: it is told to stop
                pools.TrainSide(link, rank, whole.push_plan()).stop()
            return []
        try:
            state = run_state.start(spec.params, spec.source, cfg, kl=bool(r.kl_coef),
                                    with_critic=spec.config.critic is not None, placement=where, rank=rank, ck=ck,
                                    seed=r.seed)
        except checkpoint.CheckpointError as e:
            raise SystemExit(f"error: --resume {ck.path}: {e}") from None
        # the state holds what the run needs: neither the whole initial weights nor the checkpoint stay alive
        spec, ck = dataclasses.replace(spec, params={}), None
        ctx = step.context(cfg, spec.tokenizer, spec.reward_fn, spec.config, device=dev, dock=dock, placement=whole,
                           template=spec.template)
        if lead and r.out:
            with open(os.path.join(r.out, "args.json"), "w") as f:
                json.dump(dataclasses.asdict(r), f, indent=2)
        run_hooks = make_hooks(r, spec, where, dock, rank, world, state.steps_done, interrupt)
        try:
            state, history = loop.train(state, ctx, hooks=run_hooks, should_stop=interrupt)
            if ctx.pool is not None:  # the rollout pool stops; what it produced past the last step trained is dropped
                dropped = ctx.pool.stop()
                say(f"separate pools: {dropped} rows produced after the last step trained were dropped")
        except (loop.NonFiniteError, LogprobMismatchError) as e:  # the run's verdict, not a crash: no traceback;
            raise SystemExit(f"error: {e}" if lead else 1) from None  # every rank reaches it, the lead says it
        except RewardError as e:  # the user's function, on the ranks whose rows it failed on: where, in one line
            raise SystemExit(f"error: --{e}") from None
        except DockLost as e:  # the ranks that reached it say it
            raise SystemExit(f"error: {e}") from None
        except checkpoint.CheckpointError as e:  # a checkpoint that could not be written (a full disk): the lead,
            # and the rank whose own write failed, say it
            raise SystemExit(f"error: {e}" if lead or "another rank" not in str(e) else 1) from None
        except (MemoryError, RuntimeError) as e:  # the sizes asked for more than the device has
            if not out_of_memory(e):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SystemExit(f"error: out of memory on {dev} in step {state.steps_done} ({first[:200]}); the step "
                             f"holds --prompts-per-step {r.prompts_per_step} x --group-size {r.group_size} samples of "
                             f"up to --max-new-tokens {r.max_new_tokens}, micro-batches of --micro-batch-size "
                             f"{spec.config.micro_batch_size}: lower them") from None
        except PromptTooLong as e:  # the same prompts on every rank: the lead says it
            why = str(e).replace("(truncate with max_prompt_len)", "(truncate with --max-prompt-len)")
            raise SystemExit(f"error: --max-new-tokens {r.max_new_tokens}: {why}" if lead else 1) from None
        finally:
            if ctx.engine is not None:
                ctx.engine.close()
        if state.steps_done < r.steps:  # interrupted: the checkpointer kept what was done and said how to go on
            raise SystemExit(128 + int(interrupt.signal or 0))
        if r.out:
            names = metrics.sink_names(r.log_to)
            plotted = False
            if lead:  # metrics.jsonl holds a resumed run's earlier steps too; without it, this call's steps
                jsonl = os.path.join(r.out, "metrics.jsonl")
                plotted = plot_rewards([json.loads(ln) for ln in open(jsonl)] if "jsonl" in names else history,
                                       os.path.join(r.out, "reward.png"))
                if not plotted:
                    say("reward.png: skipped, matplotlib is not installed")
            path = next(h.path for h in run_hooks if isinstance(h, hooks.Checkpointer))
            shown = ["args.json", *("metrics.jsonl" if n == "jsonl" else "tensorboard/" for n in names if n != "wandb"),
                     *(["reward.png"] if plotted else [])]
            loads = f"--model {path} loads it" if cfg.lora is None or r.merge else \
                f"peft's adapters: --model {r.model or '(the preset)'} --lora-resume {path} continues them"
            say(f"wrote {', '.join(f'{r.out}/{n}' for n in shown)}, {path}/ ({loads})")
        return history


def _produce(r: Recipe, dock, spec: RunSpec, whole: Disaggregated) -> list[dict]:
    """A rollout rank of separate pools: generate and score until the train pool says stop (``loop.train`` runs
    ``runtime.producer`` on this rank). The train pool decides when the run stops (a signal reaches it too), so
    this rank ignores SIGINT and SIGTERM."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    ctx = step.context(spec.cfg, spec.tokenizer, spec.reward_fn, spec.config, device=spec.device, dock=dock,
                       placement=whole, template=spec.template)
    state = run_state.init({}, spec.source)  # the prompt stream: the train pool holds the weights and pushes them
    try:
        loop.train(state, ctx)
    except DockLost as e:  # as on the train ranks: one line
        raise SystemExit(f"error: {e}") from None
    except RewardError as e:
        raise SystemExit(f"error: --{e}") from None
    finally:
        ctx.engine.close()
    return []


def out_of_memory(e: BaseException) -> bool:
    """``e`` says an allocation failed: torch's OutOfMemoryError (an accelerator's), the CPU allocator's
    RuntimeError, Python's MemoryError."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(e)


def make_hooks(r: Recipe, spec: RunSpec, where: Placement | None, dock, rank: int, world: int, done: int,
               interrupt: Interrupt) -> list[hooks.Hook]:
    """The run's hooks on this rank, in the order they act: the lead's sinks and progress bar (closed when the
    steps are over), the closing report (the lead's lines then), the evaluation schedule (every rank: it
    gathers), the interrupt's signal handlers (restored when the steps are over), the checkpoint policy
    (every rank: each writes its shards)."""
    lead, tok = rank == 0, spec.tokenizer
    # a resumed run does the steps after its checkpoint again: the sinks drop what they logged from there on
    sinks = hooks.Sinks(metrics.make_sinks(sink_spec(r), r.out, dataclasses.asdict(r), first_step=done,
                                           wandb_project=r.wandb_project, wandb_mode=r.wandb_mode) if lead else [],
                        tok, r.log_samples_every if lead else 0)
    out: list[hooks.Hook] = [sinks]
    bar = hooks.Progress(r.steps, done) if lead else None
    if bar is not None:
        out.append(bar)
    out.append(Report(r.steps, where, dock, r.world, print if lead else (lambda *a, **k: None)))  # every device
    if r.eval_dataset:
        examples = eval_examples(r)

        def log_eval(steps_done: int, m: dict) -> None:
            sinks.log(steps_done, {"step": steps_done, **m})
            if lead:
                bar.write(f"eval after {steps_done} steps: {eval_line(m)}")
        out.append(hooks.Evaluator(lambda s: evaluation(r, spec.cfg, tok, examples, spec.reward_fn, s.policy, where,
                                                        rank, world),
                                   every=r.eval_every, last=r.steps, report=log_eval))
    if r.out:
        def save(name: str, s, keep: int | None) -> str | None:
            return checkpoint.save_state(r.out, name, s, cfg=spec.cfg, args=dataclasses.asdict(r), tokenizer=tok,
                                         keep_last=keep, train=None if where is None else where.train, rank=rank,
                                         world=world, merge=r.merge)
    out.append(interrupt)
    if r.out:
        out.append(hooks.Checkpointer(save, every=r.save_every, keep_last=r.keep_last, last=r.steps))
    return out


def sink_spec(r: Recipe) -> str:
    """--log-to less jsonl when there is no --out (nothing is written then, as the default run does)."""
    return ",".join(n for n in metrics.sink_names(r.log_to) if r.out or n != "jsonl")
