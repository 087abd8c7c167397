"""The RL iteration: rollout -> score -> (ref / old log-probs) -> advantages -> update (and with PPO's critic:
its values before GAE, its update after the policy's), on one process or on
every rank of a world (each stage in its layout, the rows through the dock, the weights moved between
the train and rollout layouts every step).

Sizes are stated once in ``LoopConfig`` and validated at start. Metrics per step go to a callback; the
throughput figure is the paper's Eq. (5), ``TPS_DEFINITION``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from rlflow import metrics, optim
from rlflow.algos import corrections, critic as critics, estimators, grpo, stages
from rlflow.data import PromptSource, prompt_batch
from rlflow.models.config import ModelConfig
from rlflow.rollout import SamplingConfig, generate
from rlflow.models.execution import LOCAL, n_moe_layers
from rlflow.parallel import dp
from rlflow.parallel.context import context
from rlflow.runtime.flow import DockFlow, MemoryFlow, rollout_share, score_share, train_batch
from rlflow.runtime.graph import ROUTES, graph_for
from rlflow.runtime.weights import Weights
from rlflow.sharding.dist import all_gather_rows, all_reduce, create_groups
from rlflow.sharding.layout import Layout
from rlflow.sharding.mesh import Mesh

log = logging.getLogger("rlflow")

TPS_DEFINITION = ("TPS = (prompt tokens + response tokens of all samples in the step) / "
                  "(devices x step wall time)   [MindSpeed RL, Eq. 5]")


def tps(prompt_tokens: int, response_tokens: int, devices: int, seconds: float) -> float:
    """Throughput as ``TPS_DEFINITION`` says (real tokens only: padding is not counted)."""
    return (prompt_tokens + response_tokens) / (devices * seconds)


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    steps: int
    prompts_per_step: int
    grpo: grpo.GRPOConfig
    mini_batch_size: int  # samples per optimizer step; global batch = prompts_per_step * group_size
    micro_batch_size: int  # samples per forward/backward
    optim: optim.AdamWConfig
    sampling: SamplingConfig
    max_grad_norm: float = 1.0
    router_aux_coef: float = 0.0
    max_prompt_len: int | None = None
    warmup_lr_steps: int = 0  # linear LR warm-up over this many steps
    lr_schedule: str = "constant"  # after the warm-up: constant, cosine or linear decay (optim.lr_at)
    min_lr_ratio: float = 0.0  # the decay ends at optim.lr * this, on the run's last step
    log_samples_every: int = 0  # hand rank 0's decoded scored rows to on_samples every N steps (0: never)
    compile_decode: bool = False  # rollout's decode step through torch.compile (see rollout.generate)
    seed: int = 0
    max_bad_steps: int = 3  # this many steps in a row whose updates were all skipped (non-finite) stop the run
    # MoE Rollout Routing Replay: "off"; "measure": the rollout's expert choices travel with the rows and
    # the update reports the share of (token, layer) pairs whose top-k differs; "on": the old log-probs and
    # the update route by them (R3; the reference policy routes freely)
    routing_replay: str = "off"
    # fail the run when the trainer's log-probs of the sampled tokens differ from the rollout's by more than
    # this mean |d| per token (a consistency gate; costs one no-grad forward per step when the old
    # log-probs are not computed anyway). None: off
    check_logprobs: float | None = None
    # PPO with a critic (grpo.adv_estimator "gae"): the critic's optimizer and value clip; None otherwise
    critic: critics.CriticConfig | None = None
    # seconds a rank waits in the dock for the step's rows (a lost or hung peer) before the run fails with
    # dock.DockTimeout; None: no limit
    dock_timeout_s: float | None = None

    @property
    def global_batch(self) -> int:
        return self.prompts_per_step * self.grpo.group_size

    def __post_init__(self):
        if self.sampling.temperature != self.grpo.temperature:
            raise ValueError(f"sampling.temperature={self.sampling.temperature} differs from grpo.temperature="
                             f"{self.grpo.temperature}: the loss would score samples under another distribution")
        if self.max_bad_steps < 1:
            raise ValueError(f"max_bad_steps={self.max_bad_steps} must be >= 1")
        if self.warmup_lr_steps < 0:
            raise ValueError(f"warmup_lr_steps={self.warmup_lr_steps} must be >= 0")
        if self.lr_schedule not in optim.LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} is not one of {', '.join(optim.LR_SCHEDULES)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.log_samples_every < 0:
            raise ValueError(f"log_samples_every={self.log_samples_every} must be >= 0")
        if self.check_logprobs is not None and not self.check_logprobs >= 0:
            raise ValueError(f"check_logprobs={self.check_logprobs} must be >= 0")
        if (self.critic is None) == (self.grpo.adv_estimator == "gae"):
            raise ValueError(f"critic={self.critic}: adv_estimator={self.grpo.adv_estimator!r} "
                             + ("needs a CriticConfig (GAE reads a critic's values)" if self.critic is None else
                                "has no critic (only 'gae' trains one)"))
        if self.dock_timeout_s is not None and not self.dock_timeout_s > 0:
            raise ValueError(f"dock_timeout_s={self.dock_timeout_s} must be > 0 (None: no limit)")
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(f"routing_replay={self.routing_replay!r}: expected one of {ROUTING_REPLAY}")
        validate_sizes(steps=self.steps, prompts_per_step=self.prompts_per_step, group_size=self.grpo.group_size,
                       mini_batch_size=self.mini_batch_size, micro_batch_size=self.micro_batch_size)


ROUTING_REPLAY = ("off", "measure", "on")
# the per-stage times of a step's metrics; each stage's TPS is the step's tokens over its time (Eq. 5)
STAGE_TIMES = ("rollout_time_s", "score_time_s", "logprob_time_s", "update_time_s")


def validate_sizes(*, steps: int, prompts_per_step: int, group_size: int, mini_batch_size: int,
                   micro_batch_size: int) -> None:
    """Every size positive and dividing where it has to; the error names the numbers."""
    for name, v in dict(steps=steps, prompts_per_step=prompts_per_step, group_size=group_size,
                        mini_batch_size=mini_batch_size, micro_batch_size=micro_batch_size).items():
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    gb = prompts_per_step * group_size
    if gb % mini_batch_size:
        raise ValueError(f"global batch {gb} (= prompts_per_step {prompts_per_step} x group_size {group_size}) "
                         f"is not divisible by mini_batch_size {mini_batch_size}")
    if mini_batch_size % micro_batch_size:
        raise ValueError(f"mini_batch_size {mini_batch_size} is not divisible by micro_batch_size {micro_batch_size}")


def check_positions(prompts, max_new_tokens: int, cfg: ModelConfig) -> None:
    """Refuse prompts whose tokens plus the response budget exceed the model's ``max_position_embeddings``
    (rope positions past it were trained on without a word)."""
    lengths = prompts.prompt_mask_BTp.sum(-1)
    over = (lengths + max_new_tokens > cfg.max_position_embeddings).nonzero()[:, 0]
    if len(over):
        i = int(over[0])
        raise ValueError(f"prompt {int(prompts.index_B[i])} has {int(lengths[i])} tokens; with max_new_tokens="
                         f"{max_new_tokens} that exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings} (truncate with max_prompt_len)")


@dataclass(frozen=True)
class Placement:
    """Where the stages run when the world has more than one rank: the rollout in ``rollout``, the old and
    reference log-probs and the update in ``train``; both layouts over the same ranks (colocated: the
    stages take turns on every device), scoring and advantages on every rank. The actor's weights move
    between the two layouts every step (``runtime/weights.py``). ``critic``: PPO's critic on the train
    layout's mesh (``models.sharding.layout(..., head="value")``); it stays there (values, GAE, its update
    read the update's rows)."""

    train: Layout
    rollout: Layout
    critic: Layout | None = None

    def __post_init__(self):
        if self.train.mesh.size != self.rollout.mesh.size:
            raise ValueError(f"Placement: the train layout's {self.train.mesh} and the rollout layout's "
                             f"{self.rollout.mesh} must span the same ranks (separate device pools are not built)")
        if self.critic is not None and self.critic.mesh != self.train.mesh:
            raise ValueError(f"Placement: the critic's layout ({self.critic.mesh}) must be on the train layout's mesh "
                             f"({self.train.mesh}): it reads the update's rows")
        if self.rollout.mesh.pp > 1:
            raise ValueError(f"Placement: rollout layout {self.rollout.mesh}: generation runs every layer on each "
                             "rank (no pp)")

    @property
    def world(self) -> int:
        return self.train.mesh.size


def train(params, cfg: ModelConfig, tokenizer, source: PromptSource, reward_fn, lcfg: LoopConfig, *,
          on_step: Callable[[dict], None] | None = None, device: torch.device | str = "cpu",
          dock=None, placement: Placement | None = None, opt_state: optim.AdamWState | None = None,
          first_step: int | None = None, ref_params=None, after_step: Callable | None = None,
          should_stop: Callable[[], bool] | None = None,
          on_samples: Callable[[int, list[dict]], None] | None = None, critic: critics.Critic | None = None):
    """Run ``lcfg.steps`` GRPO steps; returns (params, opt_state, list of per-step metrics).

    ``dock``: a transfer dock (``rlflow.dock.Dock``, its consumers ``graph_for(...).consumers``) that the
    rollout group's rows reach the train group through (``runtime/flow.py``); None hands batches from stage
    to stage in memory (one process only).
    ``placement``: the train and rollout layouts of a world of several ranks (torch.distributed
    initialised; every rank calls ``train`` with its shards of the train layout as ``params``, and of
    ``ref_params``); None: one process, unsharded. Sizes in ``lcfg`` are global; metrics are global.
    ``opt_state``: the optimizer state to continue from (what an earlier call returned); None starts
    fresh (zero moments). The LR warm-up (``lcfg.warmup_lr_steps``) counts the optimizer steps already
    in it, so a continued run does not warm up again; the LR schedule (``optim.lr_at``) spans those steps
    and this call's.
    ``first_step``: the run's index of this call's first GRPO step (a resumed run: the steps done), so
    that seeds, sample indices, the metrics' ``step`` and the LR warm-up continue as in an
    uninterrupted run. ``ref_params``: the reference policy when KL is on (default: ``params`` as given;
    a resumed run passes the run's initial weights). ``after_step(steps_done, params, opt_state)`` runs
    after each step (checkpoints). ``should_stop()``: checked after each step (on every rank; any rank
    asking stops all); True ends the call early, after that step. ``on_samples(step, rows)``: every
    ``lcfg.log_samples_every`` steps, on rank 0, its scored rows decoded (``metrics.sample_rows``).
    ``critic``: PPO's critic (``lcfg.grpo.adv_estimator == "gae"``; e.g. ``Critic.from_policy(params, cfg)``,
    this rank's shards with a placement), updated after the policy every step: its ``params`` and
    ``opt_state`` are replaced (donated) by each update, so the caller's object holds the latest.
    """
    gcfg = lcfg.grpo
    world = 1 if placement is None else placement.world
    check_features(cfg, 1 if placement is None else placement.train.mesh.pp, routing_replay=lcfg.routing_replay,
                   check_logprobs=lcfg.check_logprobs, adv_estimator=gcfg.adv_estimator)
    if (critic is None) != (lcfg.critic is None):
        raise ValueError("train: adv_estimator='gae' needs critic= (e.g. critic.Critic.from_policy(params, cfg))"
                         if critic is None else f"train: critic= given but adv_estimator={gcfg.adv_estimator!r}")
    if critic is not None and placement is not None and placement.critic is None:
        raise ValueError("train: a critic over several ranks needs its layout: Placement(critic=...)")
    routes = lcfg.routing_replay != "off"
    route_dims = (n_moe_layers(cfg), cfg.num_experts_per_tok) if routes else None
    if placement is None:
        rank, tctx, rctx, weights = 0, LOCAL, LOCAL, None
        train_mesh = rollout_mesh = every = Mesh()
        flow = MemoryFlow() if dock is None else DockFlow(dock, route_dims=route_dims, timeout=lcfg.dock_timeout_s)
        train_sum = lambda t: t  # noqa: E731
    else:
        if dock is None:
            raise ValueError("train: a placement over several ranks needs a dock (the stages' rows go through it)")
        rank = torch.distributed.get_rank()
        create_groups([placement.train.mesh, placement.rollout.mesh])
        tctx, rctx = context(placement.train, cfg), context(placement.rollout, cfg)
        weights = Weights(placement.train, placement.rollout, rank)
        train_mesh, rollout_mesh, every = placement.train.mesh, placement.rollout.mesh, Mesh(dp=world)
        flow = DockFlow(dock, rank, world, route_dims=route_dims, timeout=lcfg.dock_timeout_s)
        train_sum = lambda t: dp.batch_sum(t, placement.train)  # noqa: E731  (over the train layout's data ranks)
        for name, v in dict(prompts_per_step=lcfg.prompts_per_step, mini_batch_size=lcfg.mini_batch_size,
                            micro_batch_size=lcfg.micro_batch_size).items():
            if v % train_mesh.data_parallel_size:
                raise ValueError(f"{name} {v} is not divisible by the train layout's "
                                 f"{train_mesh.data_parallel_size} data-parallel ranks ({train_mesh})")
        if lcfg.prompts_per_step % world:
            raise ValueError(f"prompts_per_step {lcfg.prompts_per_step} is not divisible by the {world} ranks "
                             "(each scores an equal share of the groups)")
    nd = train_mesh.data_parallel_size
    mesh_of = {"rollout": rollout_mesh, "every": every, "train": train_mesh}  # where the stages run
    graph = graph_for(gcfg.adv_estimator)
    on = lambda stage: mesh_of[graph[stage].runs_on]  # noqa: E731
    world_sum = all_reduce if world > 1 else (lambda t: t)
    opt_state = optim.init(params) if opt_state is None else opt_state
    start = opt_state.step  # one optimizer step per GRPO step when warming up (the recipe's case)
    lr_total = (start if first_step is None else first_step) + lcfg.steps  # the LR schedule's length
    if gcfg.kl_coef:
        ref_params = {k: v.detach().clone() for k, v in (params if ref_params is None else ref_params).items()}
    else:
        ref_params = None
    base = 0 if first_step is None else first_step
    ucfg = stages.UpdateConfig(mini_batch_size=lcfg.mini_batch_size // nd, micro_batch_size=lcfg.micro_batch_size // nd,
                               max_grad_norm=lcfg.max_grad_norm, router_aux_coef=lcfg.router_aux_coef,
                               layout=None if placement is None else placement.train,
                               routing_replay=lcfg.routing_replay)
    cucfg = ucfg if placement is None else dataclasses.replace(ucfg, layout=placement.critic)  # the critic's
    moving = weights is not None and not weights.identity  # the train state is swapped out for each rollout
    single_update = gcfg.epochs == 1 and lcfg.mini_batch_size == lcfg.global_batch
    history = []
    bad_streak = 0
    for local in range(lcfg.steps):
        step = base + local  # the run's step index
        t0 = time.perf_counter()
        examples = source.take(lcfg.prompts_per_step)  # the same stream on every rank
        prompts = prompt_batch(examples, tokenizer, first_index=step * lcfg.prompts_per_step,
                               max_prompt_len=lcfg.max_prompt_len).to(device)
        check_positions(prompts, lcfg.sampling.max_new_tokens, cfg)
        flow.begin(prompts, gcfg.group_size)
        mine = rollout_share(prompts, on("rollout"), rank)
        roll_params = params if weights is None else weights.to_rollout(params, opt_state)
        if moving and critic is not None:  # the critic's train state leaves the device with the policy's
            critics.swap(critic, "cpu")
        rollout = generate(roll_params, cfg, mine, lcfg.sampling, group_size=gcfg.group_size,
                           seed=lcfg.seed * 1_000_003 + step, compile_decode=lcfg.compile_decode,
                           record_routes=routes, ex=rctx)
        if moving:
            params, opt_state = weights.to_train(roll_params)
            if critic is not None:
                critics.swap(critic, device)
        del roll_params
        t_roll = time.perf_counter()
        # scoring and advantages on the rollout group's ranks, each its share of the rows it holds; then the
        # rows go to the train group through the dock
        rows = score_share(rollout, on("rollout"), rank, gcfg.group_size)
        scores, scored = stages.score_rows(rows, tokenizer, reward_fn)
        if on_samples is not None and rank == 0 and lcfg.log_samples_every and step % lcfg.log_samples_every == 0:
            on_samples(step, metrics.sample_rows(rows, tokenizer, scores.masked_fill(~scored, float("nan"))))
        bad = (~torch.isfinite(scores)).nonzero()[:, 0]
        if len(bad):  # their groups' advantages, hence the gradient, are non-finite: the update is skipped
            log.warning("step %d: non-finite rewards %s at sample indices %s; the update is skipped", step,
                        scores[bad][:8].tolist(), rows.index_B[bad.to(rows.index_B.device)][:8].tolist())
        r_sum, r_sq, n_scored = float(scores.sum()), float((scores ** 2).sum()), int(scored.sum())  # unscored: 0
        n_prompt, n_resp = int(rows.prompt_mask_BTp.sum()), int(rows.response_mask_BTr.sum())  # this rank's share
        # (GAE needs the critic's values: it runs in the train layout, below)
        if critic is None:
            adv = estimators.advantages(gcfg.adv_estimator, scores.to(device), rows.group_B, scale=gcfg.scale_rewards,
                                        total=world_sum, scored_B=scored)
            flow.put_rows(rows, rewards=scores.to(device), advantages=adv)
        else:
            flow.put_rows(rows, rewards=scores.to(device), scored=scored.to(torch.uint8).to(device))
        cols = ["rewards"] + (["advantages"] if critic is None else ["scored"]) + (list(ROUTES) if routes else [])
        t_score = time.perf_counter()
        rows, c = flow.get("train", cols, on("update"), rank)
        # With one optimizer step per batch the policy that sampled is the policy being updated, so the
        # ratio's denominator is the current log-prob, detached (update() does that); otherwise recompute.
        # The old / ref log-prob stages run in the train layout on the update's rows and hand them over in
        # memory (with pp the last stage has them).
        for col, w in (("old_logprobs", None if single_update else params), ("ref_logprobs", ref_params)):
            if w is not None:
                c[col] = stages.batched_logprobs(w, cfg, rows, micro_batch_size=ucfg.micro_batch_size,
                                                 temperature=gcfg.temperature, ex=tctx,
                                                 replay=col == "old_logprobs" and lcfg.routing_replay == "on")
        if critic is not None:  # PPO: the critic's values, then GAE on the same rows
            c["values"] = critics.batched_values(critic.params, cfg, rows, micro_batch_size=ucfg.micro_batch_size,
                                                 ex=tctx)
            c["token_advantages"], c["returns"] = estimators.gae(
                c["rewards"], c["values"], rows.response_mask_BTr, gamma=gcfg.gae_gamma, lam=gcfg.gae_lambda,
                total=train_sum, scored_B=c["scored"])
        if lcfg.check_logprobs is not None:
            old = c.get("old_logprobs")
            if old is None:  # one optimizer step: the update would recompute them; the gate needs them first
                old = stages.batched_logprobs(params, cfg, rows, micro_batch_size=ucfg.micro_batch_size,
                                              temperature=gcfg.temperature, ex=tctx,
                                              replay=lcfg.routing_replay == "on")
            corrections.check_logprobs(rows.sample_logprobs_BTr, old, rows.response_mask_BTr, rows.index_B,
                                       lcfg.check_logprobs, step=step, total=world_sum,
                                       gather=_gather if world > 1 else (lambda rows: [rows]))
        batch = train_batch(rows, c)
        t_lp = time.perf_counter()
        done_steps = step if first_step is not None else local + start  # GRPO steps before this one
        lr = optim.lr_at(done_steps, lr_total, lcfg.optim.lr, lcfg.warmup_lr_steps, lcfg.lr_schedule,
                         lcfg.min_lr_ratio)
        params, opt_state, upd = stages.update(params, opt_state, batch, cfg, gcfg, ucfg, lcfg.optim,
                                               seed=lcfg.seed + step, lr=lr, old_is_current=single_update,
                                               max_len=lcfg.sampling.max_new_tokens, ex=tctx)
        if critic is not None:
            upd.update(critics.update(critic, batch, cfg, lcfg.critic, cucfg, epochs=gcfg.epochs,
                                      seed=lcfg.seed + step, ex=tctx))
        flow.end()  # before the closing all-gather below: no rank puts step s + 1's rows before the clear
        t1 = time.perf_counter()
        # per stage: the rollout (with the weight transitions), scoring and advantages, the update's rows with
        # their old / ref log-probs (and the critic's values), the update(s)
        stage_s = {"rollout_time_s": t_roll - t0, "score_time_s": t_score - t_roll, "logprob_time_s": t_lp - t_score,
                   "update_time_s": t1 - t_lp}
        if weights is not None:
            stage_s.update(weights.figures())
        stop = should_stop is not None and local + 1 < lcfg.steps and bool(should_stop())
        if world > 1:  # global figures, in one collective: sums over the ranks, the slowest rank's times, any stop
            sums = [n_prompt, n_resp, r_sum, r_sq, n_scored]
            ranks = all_gather_rows(torch.tensor([*sums, float(stop), t1 - t0, *stage_s.values()],
                                                 dtype=torch.float64))
            tot, slow = ranks[:, :len(sums)].sum(0), ranks[:, len(sums) + 1:].max(0).values
            n_prompt, n_resp, r_sum, r_sq, n_scored = int(tot[0]), int(tot[1]), float(tot[2]), float(tot[3]), int(tot[4])
            stop = bool(ranks[:, len(sums)].max() > 0)
            t1 = t0 + float(slow[0])
            stage_s = dict(zip(stage_s, slow[1:].tolist()))
        wall = t1 - t0
        n = lcfg.global_batch
        ns = max(n_scored, 1)  # the reward statistics are over the scored samples
        mean = r_sum / ns
        std = (max(r_sq / ns - mean * mean, 0.0) * ns / max(ns - 1, 1)) ** 0.5  # unbiased, as torch.std
        m = {"step": step, "reward_mean": mean, "reward_std": std, "unscored": n - n_scored,
             "tps": tps(n_prompt, n_resp, world, wall), "step_time_s": wall,  # one device per rank
             **stage_s, **{f"{k.removesuffix('_time_s')}_tps": tps(n_prompt, n_resp, world, stage_s[k])
                           for k in STAGE_TIMES}, "lr": lr,
             "response_len_mean": n_resp / n, "prompt_tokens": n_prompt, "response_tokens": n_resp,
             **{k: v for k, v in upd.items()}}
        if isinstance(flow, DockFlow):
            m["dock_busiest_bytes"] = flow.busiest_bytes() if rank == 0 else 0.0
        m["bad_rewards"] = int(len(bad))  # this rank's
        history.append(m)
        if on_step is not None:
            on_step(m)
        if after_step is not None:
            after_step(step + 1, params, opt_state)
        bad_streak = bad_streak + 1 if upd["update_skipped"] == 1.0 else 0
        if bad_streak >= lcfg.max_bad_steps:
            raise NonFiniteError(f"steps {step - bad_streak + 1}..{step}: {bad_streak} steps in a row had every "
                                 f"update skipped for non-finite rewards, losses or gradients (max_bad_steps="
                                 f"{lcfg.max_bad_steps}); the parameters are those before step "
                                 f"{step - bad_streak + 1}")
        if stop:
            break
    return params, opt_state, history


def check_features(cfg: ModelConfig, train_pp: int, *, routing_replay: str, check_logprobs: float | None,
                   adv_estimator: str = "grpo") -> None:
    """``ValueError`` for a ``LoopConfig`` feature the model or the train layout (``train_pp`` stages) cannot run
    (``train`` checks it; a launcher can before any rank starts)."""
    if routing_replay != "off" and not cfg.is_moe:
        raise ValueError(f"routing_replay={routing_replay!r} needs an MoE model; {cfg.model_type} has no routed "
                         "experts")
    if routing_replay == "measure" and train_pp > 1:
        raise ValueError("routing_replay='measure' compares in the update's forward, which a pp layout runs in "
                         "its schedule: use 'on', or a layout without pp")
    if check_logprobs is not None and train_pp > 1:
        raise ValueError("check_logprobs compares on every train rank; a pp layout has the log-probs on its last "
                         "stage only: use a layout without pp")
    if adv_estimator == "gae" and train_pp > 1:
        raise ValueError("adv_estimator='gae': the critic does not run in a pp layout (its value head would sit on "
                         "the last stage); use a train layout without pp")


def _gather(obj) -> list:
    """Every rank's ``obj``."""
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


class NonFiniteError(RuntimeError):
    """Training stopped: too many consecutive steps whose updates were non-finite."""

