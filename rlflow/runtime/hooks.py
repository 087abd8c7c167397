"""What runs around the steps, each part deciding for itself when it acts: the metrics sinks, the progress
bar, the evaluation schedule and the checkpoint policy.

``loop.train`` calls every hook's ``start(state)`` before the first step, ``after_step(state, metrics,
out)`` after each (``metrics``: the step's global figures; ``out``: this rank's ``step.StepOut``),
``end(state)`` once the steps are over (done, or stopped early), and ``close()`` always, even when a step
raised. Hooks that run collectives (evaluation, sharded checkpoints) run on every rank; the others only
where they have something to do (the lead's sinks and bar).
"""

from __future__ import annotations

import sys
import threading
from typing import Callable

from rlflow import metrics as rl_metrics


class Hook:
    """A no-op at every point; subclasses act where they need to."""

    def start(self, state) -> None:
        pass

    def after_step(self, state, metrics: dict, out) -> None:
        pass

    def end(self, state) -> None:
        pass

    def close(self) -> None:
        pass


class OnStep(Hook):
    """``fn(metrics)`` after each step (a user's callback)."""

    def __init__(self, fn: Callable[[dict], None]):
        self.fn = fn

    def after_step(self, state, metrics: dict, out) -> None:
        self.fn(metrics)


class Sinks(Hook):
    """Each step's metrics to every sink; every ``samples_every`` steps (0: never) this rank's scored rows,
    decoded (``metrics.sample_rows``)."""

    def __init__(self, sinks: list[rl_metrics.Sink], tokenizer=None, samples_every: int = 0):
        self.sinks, self.tokenizer, self.samples_every = sinks, tokenizer, samples_every

    def log(self, step: int, row: dict) -> None:
        for s in self.sinks:
            s.log(step, row)

    def after_step(self, state, metrics: dict, out) -> None:
        step = metrics["step"]
        if self.samples_every and step % self.samples_every == 0:
            rows = rl_metrics.sample_rows(out.rows, self.tokenizer, out.rewards)
            for s in self.sinks:
                s.log_samples(step, rows)
        self.log(step, metrics)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


class Progress(Hook):
    """A progress bar over the run's steps with the step's reward, TPS and time (tqdm; nothing without it)."""

    def __init__(self, total: int, initial: int = 0):
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            # a thread lock, not tqdm's default multiprocessing one: a semaphore a rank that is stopped at once
            # (``startup.stop_at_once``) cannot release, which the resource tracker then reports as leaked
            tqdm.set_lock(threading.RLock())
            self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stdout, mininterval=0.5,
                            dynamic_ncols=True)

    def write(self, line: str) -> None:
        (self.bar.write if self.bar is not None else print)(line)

    def after_step(self, state, metrics: dict, out) -> None:
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", tps=f"{metrics['tps']:.0f}",
                                 step_s=f"{metrics['step_time_s']:.2f}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def end(self, state) -> None:  # the bar is done before the run's closing lines
        self.close()


class Evaluator(Hook):
    """Evaluation before the first step, every ``every`` steps (0: never in between) and after the run's
    last (``last``); ``evaluate(state) -> eval/* metrics`` runs on every rank (it may gather), ``report(steps
    done, metrics)`` logs them (the lead's sinks and bar)."""

    def __init__(self, evaluate: Callable[[object], dict], *, every: int, last: int,
                 report: Callable[[int, dict], None]):
        self.evaluate, self.every, self.last, self.report = evaluate, every, last, report

    def due(self, steps_done: int) -> bool:
        return steps_done == self.last or bool(self.every and steps_done % self.every == 0)

    def start(self, state) -> None:
        self.report(state.steps_done, self.evaluate(state))

    def after_step(self, state, metrics: dict, out) -> None:
        if self.due(state.steps_done):
            self.report(state.steps_done, self.evaluate(state))


class Checkpointer(Hook):
    """The checkpoint policy: every ``every`` steps (0: never) a numbered checkpoint, keeping the newest
    ``keep_last``; after the run's ``last`` step ``checkpoint-final``; a run stopped before it (an interrupt)
    writes the checkpoint of the steps done and says how to go on. ``save(name, state, keep_last) -> path``
    writes one (every rank calls it: a sharded run's ranks write their own shards). The final and the
    interrupt checkpoints' path is ``path`` afterwards."""

    def __init__(self, save: Callable[..., str | None], *, every: int, keep_last: int, last: int,
                 say: Callable[..., None] = print):
        self.save, self.every, self.keep_last, self.last, self.say = save, every, keep_last, last, say
        self.path: str | None = None

    def after_step(self, state, metrics: dict, out) -> None:
        n = state.steps_done
        if self.every and n % self.every == 0 and n < self.last:
            self.save(f"checkpoint-{n:06d}", state, self.keep_last)

    def end(self, state) -> None:
        n = state.steps_done
        if n >= self.last:
            self.path = self.save("checkpoint-final", state, None)
            return
        self.path = self.save(f"checkpoint-{n:06d}", state, None)
        if self.path is not None:
            self.say(f"interrupted after step {n - 1}: wrote {self.path}; continue with --resume auto (or --resume "
                     f"{self.path})", file=sys.stderr)


__all__ = ["Checkpointer", "Evaluator", "Hook", "OnStep", "Progress", "Sinks"]
