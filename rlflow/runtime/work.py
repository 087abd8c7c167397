"""What each stage of the iteration computes: the functions the graph's stages carry (``runtime/graph.py``:
``Stage.fn``), run in the graph's order by the step's schedule (``runtime/step.py``) on the ranks ``Stage.runs_on``
names. A stage reads and writes the step's columns by their dock names (``Work.cols``); what the rollout side's
stages write crosses to the train side through the dock (or in memory), and the train side's last stages, those
that write nothing, are the updates.

Each function takes the step's ``Work`` on this rank and fills it in; none knows the placement (the rows are this
rank's, the sums over ranks are ``ctx.seats``'), so a new stage is a function here (or in the user's code) and an
entry of a graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlflow import optim
from rlflow.algos import corrections, critic as critics, estimators, stages
from rlflow.batch import RolloutBatch, TrainBatch
from rlflow.runtime.state import reference


@dataclass
class Work:
    """One step's work on this rank, as its stages see it: the context, this rank's rows, the columns by dock name
    (a rollout side's ``scored`` is a bool mask), the run's state (the train side's), the step's learning rate,
    the updates' metrics, and the ``TrainBatch`` the updates read (made once the stages before them wrote)."""
    ctx: object  # the step's StepContext
    rows: RolloutBatch
    cols: dict[str, torch.Tensor]
    state: object = None  # the RunState (train side)
    index: int = 0  # the step's number
    lr: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    train: TrainBatch | None = None


# ---- the rollout side: every rank its share of the rows the rollout group holds ----
def score(w: Work) -> None:
    """The rewards of the rows (NaN where a reward raised or returned nothing), and which rows a reward scored."""
    w.cols["rewards"], w.cols["scored"] = stages.score_rows(w.rows, w.ctx.tokenizer, w.ctx.reward_fn)


def advantage(w: Work) -> None:
    """One advantage per sample from its group's rewards (the outcome estimators: GRPO, RLOO, REINFORCE++)."""
    algo, ctx = w.ctx.config.grpo, w.ctx
    w.cols["advantages"] = estimators.advantages(algo.adv_estimator, w.cols["rewards"].to(ctx.device), w.rows.group_B,
                                                 scale=algo.scale_rewards, total=ctx.seats.world_sum,
                                                 scored_B=w.cols["scored"])


# ---- the train side: the train layout's ranks, each its data-parallel part ----
def _logprobs(w: Work, params: dict, replay: bool) -> torch.Tensor:
    ctx = w.ctx
    return stages.batched_logprobs(params, ctx.cfg, w.rows, micro_batch_size=ctx.update_config.micro_batch_size,
                                   temperature=ctx.config.grpo.temperature, ex=ctx.seats.train_ex, replay=replay)


def single_update(w: Work) -> bool:
    """One optimizer step per batch: the policy that sampled is the one updated, so the update detaches its own
    log-probs as the ratio's denominator (exact) instead of a forward of its own."""
    conf = w.ctx.config
    return conf.grpo.epochs == 1 and conf.mini_batch_size == conf.global_batch


def ref_logprob(w: Work) -> None:
    """The reference policy's log-probs (KL): none without a reference (LoRA's is the base: the adapters off)."""
    ref = reference(w.state)
    if ref is not None:
        w.cols["ref_logprobs"] = _logprobs(w, ref, replay=False)


def old_logprob(w: Work) -> None:
    """The sampling policy's log-probs, scored by the trainer: the ratio's denominator when a batch makes several
    optimizer steps, and what ``check_logprobs`` compares the engine's log-probs with."""
    conf, where = w.ctx.config, w.ctx.seats
    if single_update(w) and conf.check_logprobs is None:
        return
    old = _logprobs(w, w.state.policy, replay=conf.routing_replay == "on")
    if not single_update(w):
        w.cols["old_logprobs"] = old
    if conf.check_logprobs is not None:
        corrections.check_logprobs(w.rows.sample_logprobs_BTr, old, w.rows.loss_mask, w.rows.index_B,
                                   conf.check_logprobs, step=w.index, total=where.world_sum, gather=where.gather)


def values(w: Work) -> None:
    """PPO: the critic's values of the response tokens before its update."""
    ctx = w.ctx
    w.cols["values"] = critics.batched_values(w.state.critic.params, ctx.cfg, w.rows, ex=ctx.seats.train_ex,
                                              micro_batch_size=ctx.update_config.micro_batch_size)


def gae(w: Work) -> None:
    """PPO: GAE's per-token advantages and returns, from the outcome rewards and the critic's values."""
    algo, c = w.ctx.config.grpo, w.cols
    c["token_advantages"], c["returns"] = estimators.gae(c["rewards"], c["values"], w.rows.loss_mask,
                                                         gamma=algo.gae_gamma, lam=algo.gae_lambda,
                                                         total=w.ctx.seats.train_sum, scored_B=c["scored"])


def update(w: Work) -> None:
    """The policy's update: epochs x mini-batches of AdamW steps on the step's ``TrainBatch``."""
    ctx, conf, s = w.ctx, w.ctx.config, w.state
    s.policy, s.opt_state, upd = stages.update(
        s.policy, s.opt_state, w.train, ctx.cfg, conf.grpo, ctx.update_config, conf.optim, seed=conf.seed + w.index,
        lr=w.lr, old_is_current=single_update(w), max_len=sampled_budget(conf), ex=ctx.seats.train_ex)
    w.metrics.update(upd)


def critic_update(w: Work) -> None:
    """PPO: the critic's update on the same rows, its value loss clipped."""
    ctx, conf = w.ctx, w.ctx.config
    w.state.critic, vf = critics.update(w.state.critic, w.train, ctx.cfg, conf.critic, ctx.critic_update_config,
                                        epochs=conf.grpo.epochs, seed=conf.seed + w.index, ex=ctx.seats.train_ex)
    w.metrics.update(vf)


def sampled_budget(conf) -> int:
    """The most tokens a row's response can have sampled (``seq-mean-token-sum-norm``'s constant): a turn's
    budget, times the turns of a multi-turn episode."""
    return conf.sampling.max_new_tokens * (1 if conf.multiturn is None else conf.multiturn.max_turns)


def learning_rate(conf, index: int) -> float:
    """Step ``index``'s learning rate: the schedule's (``optim.lr_at``)."""
    return optim.lr_at(index, conf.steps, conf.optim.lr, conf.warmup_lr_steps, conf.lr_schedule, conf.min_lr_ratio)


__all__ = ["Work", "advantage", "critic_update", "gae", "learning_rate", "old_logprob", "ref_logprob",
           "sampled_budget", "score", "single_update", "update", "values"]
