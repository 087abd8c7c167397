"""The run: take the step's prompts -> ``step`` -> reduce its figures over the ranks once -> hooks, until the
state has done ``LoopConfig.steps`` steps (``runtime/step.py`` is one step; ``runtime/hooks.py`` what runs
around the steps).

Metrics are global: sums over the ranks, the slowest rank's times. The throughput figure is the paper's
Eq. (5), ``TPS_DEFINITION``.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from rlflow.batch import PromptBatch
from rlflow.data import check_positions
from rlflow.runtime.config import LoopConfig  # noqa: F401  (re-exported: the loop's configuration)
from rlflow.runtime.flow import DockFlow
from rlflow.runtime.hooks import Hook
from rlflow.runtime.pools import RolloutSide, TrainSide
from rlflow.runtime.producer import produce
from rlflow.runtime.report import Figures, combine
from rlflow.runtime.state import RunState
from rlflow.runtime.step import StepContext, StepOut, prompts_at, step

TPS_DEFINITION = ("TPS = (prompt tokens + response tokens of all samples in the step) / "
                  "(devices x step wall time)   [MindSpeed RL, Eq. 5]")
# the per-stage times of a step's metrics; each stage's TPS is the step's tokens over its time (Eq. 5)
STAGE_TIMES = ("rollout_time_s", "score_time_s", "logprob_time_s", "update_time_s")
_DERIVED = ("reward_sum", "reward_sq", "scored")  # counts the metrics hold as the reward statistics


class NonFiniteError(RuntimeError):
    """Training stopped: too many consecutive steps whose updates were non-finite."""


def tps(prompt_tokens: int, response_tokens: int, devices: int, seconds: float) -> float:
    """Throughput as ``TPS_DEFINITION`` says (real tokens only: padding is not counted)."""
    return (prompt_tokens + response_tokens) / (devices * seconds)


def train(state: RunState, ctx: StepContext, *, hooks: Sequence[Hook] = (),
          should_stop: Callable[[], bool] | None = None) -> tuple[RunState, list[dict]]:
    """Step ``state`` until it has done ``ctx.config.steps`` steps; returns (the state, each step's metrics).
    ``should_stop()`` is asked after each step on every rank (any rank asking stops all, after that step).
    A resumed state (``steps_done > 0``) continues as the uninterrupted run would: seeds, sample indices,
    the metrics' ``step`` and the LR schedule follow ``steps_done``.

    On a rank of separate pools' rollout pool (``ctx.pool`` a ``pools.RolloutSide``) the steps are produced
    (``runtime/producer.py``: generated, scored and put into the dock from ``state.source``) until the train pool
    stops; that pool holds the run's state, metrics and hooks: here the state comes back as it was, with no
    metrics, and the hooks are only closed. A train pool's rank tells the rollout pool to stop once its steps are
    over (``pools.TrainSide.stop``)."""
    conf = ctx.config
    if isinstance(ctx.pool, RolloutSide):
        try:
            produce(state.source, ctx)
        finally:
            _close(hooks)
        return state, []
    try:
        _check(state, conf)
        state, history = _steps(state, ctx, hooks, should_stop)
        if isinstance(ctx.pool, TrainSide):  # separate pools: the rollout pool stops with the train pool's last step
            ctx.pool.stop()
        for h in hooks:
            h.end(state)
    finally:
        _close(hooks)
    return state, history


def _check(state: RunState, conf: LoopConfig) -> None:
    if (state.critic is None) != (conf.critic is None):
        raise ValueError("train: adv_estimator='gae' needs the state's critic (e.g. critic.Critic.from_policy(params, "
                         "cfg))" if state.critic is None else
                         f"train: the state has a critic but adv_estimator={conf.grpo.adv_estimator!r}")
    if (state.ref is None) == bool(conf.grpo.kl_coef):
        raise ValueError(f"train: kl_coef={conf.grpo.kl_coef} " + (
            "needs the state's reference policy (state.init(..., kl=True))" if state.ref is None else
            "is 0 but the state carries a reference policy"))


def _steps(state: RunState, ctx: StepContext, hooks: Sequence[Hook], should_stop) -> tuple[RunState, list[dict]]:
    """The steps, each reduced once and handed to the hooks: the state after them, and their metrics."""
    conf, history, bad_streak = ctx.config, [], 0
    for h in hooks:
        h.start(state)
    began = time.perf_counter()
    while state.steps_done < conf.steps:
        t0 = time.perf_counter()
        state, out = step(state, take_prompts(state, ctx), ctx)
        wall = time.perf_counter() - t0
        stop = should_stop is not None and state.steps_done < conf.steps and bool(should_stop())
        m, stop = reduce(out, ctx, wall, stop, index=state.steps_done - 1)
        m["elapsed_s"] = time.perf_counter() - began  # this rank's clock: what the run's throughput is over
        if m["nonfinite_params"]:  # before any hook could save them
            raise NonFiniteError(f"step {m['step']}: its update made {int(m['nonfinite_params'])} parameter tensors "
                                 f"non-finite with finite gradients (an overflow); nothing of step {m['step']} is "
                                 f"saved: the last checkpoint holds the parameters from before it")
        history.append(m)
        for h in hooks:
            h.after_step(state, m, out)
        # a step with nothing to learn from: every update skipped, or no row scored (every episode ended
        # unscored: its environment raised, timed out or answered malformed; or the reward returned None)
        unscored = m["unscored"] >= conf.global_batch
        bad_streak = bad_streak + 1 if m["update_skipped"] == 1.0 or unscored else 0
        if bad_streak >= conf.max_bad_steps:
            first = m["step"] - bad_streak + 1
            why = ("no row scored (every episode ended unscored: see the env/errors, env/timeouts and "
                   "env/malformed counts and the warnings above; or the reward returned None for every row)"
                   if unscored else "every update skipped for non-finite rewards, losses or gradients")
            raise NonFiniteError(f"steps {first}..{m['step']}: {bad_streak} steps in a row had {why} (max_bad_steps="
                                 f"{conf.max_bad_steps}); the parameters are those before step {first}")
        if stop:
            break
    return state, history


def _close(hooks: Sequence[Hook]) -> None:
    """Every hook's ``close``, even when one raises (the first error is raised after the others closed)."""
    failed = None
    for h in hooks:
        try:
            h.close()
        except Exception as e:  # noqa: BLE001 -- the others still close
            failed = failed or e
    if failed is not None:
        raise failed


def take_prompts(state: RunState, ctx: StepContext) -> PromptBatch:
    """The next step's prompts from the state's stream (the same on every rank), on the rank's device."""
    prompts = prompts_at(state.source, state.steps_done, ctx)
    check_positions(prompts, ctx.config.sampling.max_new_tokens, ctx.cfg)
    return prompts


def reduce(out: StepOut, ctx: StepContext, wall: float, stop: bool, *, index: int) -> tuple[dict, bool]:
    """Step ``index``'s global metrics from every rank's ``out`` (one gather: their figures combined by
    ``report.combine``, counts summed and times the slowest rank's; whether any rank asks to stop), and that stop."""
    world, figures = ctx.seats.world, Figures(times={"step_time_s": wall}) + out.figures
    if world > 1:
        ranks = ctx.seats.gather((figures, stop))
        figures, stop = combine([f for f, _ in ranks]), any(s for _, s in ranks)
    counts, times = figures.counts, dict(figures.times)
    devices = world if ctx.pool is None else ctx.pool.link.pools.world  # separate pools: both pools' devices
    n, n_scored = ctx.config.global_batch, int(counts["scored"])
    n_prompt, n_resp, wall = int(counts["prompt_tokens"]), int(counts["response_tokens"]), times.pop("step_time_s")
    ns = max(n_scored, 1)  # the reward statistics are over the scored samples
    mean = counts["reward_sum"] / ns
    std = (max(counts["reward_sq"] / ns - mean * mean, 0.0) * ns / max(ns - 1, 1)) ** 0.5  # unbiased, as torch.std
    m = {"step": index, "reward_mean": mean, "reward_std": std, "unscored": n - n_scored,
         "tps": tps(n_prompt, n_resp, devices, wall), "step_time_s": wall,  # one device per rank
         **times, **{f"{k.removesuffix('_time_s')}_tps": tps(n_prompt, n_resp, devices, times[k]) for k in STAGE_TIMES
                     if times[k] > 0},
         "lr": out.lr, "response_len_mean": n_resp / n, "prompt_tokens": n_prompt, "response_tokens": n_resp,
         "nonfinite_params": counts["nonfinite_params"],
         **out.update}
    # the other counts as they are (multi-turn rollouts' env/*, separate pools' stale_tokens/*)
    m.update({k: v for k, v in counts.items() if k not in m and k not in _DERIVED})
    if "env/episodes" in counts:
        m["env/turns_mean"] = counts["env/turns"] / max(counts["env/episodes"], 1.0)
    if isinstance(ctx.flow, DockFlow):
        m["dock_busiest_bytes"] = ctx.flow.busiest_bytes() if ctx.seats.rank == 0 else 0.0
    m["bad_rewards"] = out.bad_rewards  # this rank's
    return m, stop


__all__ = ["LoopConfig", "NonFiniteError", "STAGE_TIMES", "TPS_DEFINITION", "reduce", "take_prompts", "tps", "train"]
