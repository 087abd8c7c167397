"""One RL step: ``step(state, prompts, ctx) -> (state, StepOut)``: the schedule that runs the graph's stages.

    rollout       the policy's weights into the engine's layout (allgather-swap), generation, the train
                  state back
    score         the reward of each response (every rank its share of the rows it holds)
    advantage     outcome advantages from the rewards (GRPO, RLOO, REINFORCE++), on the same ranks
    -- the rows cross to the train group through the dock --
    ref / old     the reference policy's log-probs of the sampled tokens (KL) and the trainer's (when the
                  update needs them)
    values, gae   PPO: the critic's values and GAE's per-token advantages
    update        the policy's optimizer steps (and the critic's)

The stages above the line are the step's rollout side, those below its train side (``train_side``). One
schedule runs them for every placement: colocated, both sides in turn on the same ranks; separate pools,
the rollout side on the rollout pool's ranks (``runtime/producer.py``) and the train side on the train
pool's, each step's rows through a dock slot and the rollout side's figures as one ``RolloutReport``
(``runtime/report.py``) through the link.

The graph (``runtime/graph.py``) declares each stage with its columns, where it runs and its function
(``runtime/work.py``); the schedule runs the rollout itself (the weights and the engine are the placement's)
and every other stage from the graph, in its order, on its side (``run_stages``, ``train_on``): a stage a
graph does not have (PPO's values, GAE and critic update in GRPO's) does not run. ``StepContext`` holds
what is fixed for a run (the model config, the reward, the sizes, this rank's seats, the sample flow,
the weight transition, the engine). The step returns this rank's raw figures (``StepOut``); the loop
combines them over the ranks once (``loop.reduce``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from rlflow import engines, optim
from rlflow.algos import critic as critics, stages
from rlflow.batch import PromptBatch, RolloutBatch
from rlflow.data import prompt_batch
from rlflow.envs.tools import load_tools
from rlflow.models.config import ModelConfig
from rlflow.models.execution import n_moe_layers
from rlflow.multiturn import MultiTurn, chat_render, plain_render
from rlflow.parallel.context import shard_params
from rlflow.runtime.flow import DockFlow, MemoryFlow, rollout_share, score_share, train_batch
from rlflow.runtime.graph import LOSS_MASK, ROUTES, ROWS, VERSIONS, Graph, graph_for
from rlflow.runtime.config import LoopConfig, check_features, placement_problems, share_problems
from rlflow.runtime import pools
from rlflow.runtime.placement import Disaggregated, Placement, Seats, seats
from rlflow.runtime.report import Figures, RolloutReport, row_counts
from rlflow.runtime.state import RunState
from rlflow.runtime.weights import Weights
from rlflow.runtime.work import Work, learning_rate

log = logging.getLogger("rlflow")


@dataclass(frozen=True)
class StepContext:
    cfg: ModelConfig
    tokenizer: object
    reward_fn: Callable
    config: LoopConfig
    device: torch.device
    seats: Seats
    graph: Graph
    flow: DockFlow | MemoryFlow
    dock_columns: list[str]  # what the train group takes from the dock (``dock_columns``)
    weights: Weights
    engine: engines.RolloutEngine | None  # engines.build (None on the train pool's ranks)
    update_config: stages.UpdateConfig  # the policy's mini- / micro-batches per data rank, in the train layout
    critic_update_config: stages.UpdateConfig  # the same in the critic's layout
    # separate pools: this rank's end of the link (``runtime.pools``: a train rank's TrainSide, a rollout rank's
    # RolloutSide)
    pool: pools.TrainSide | pools.RolloutSide | None = None
    multiturn: MultiTurn | None = None  # multi-turn rollouts (``LoopConfig.multiturn``), on a rollout rank

    def shards(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of whole tensors ``full`` (the initial weights) for its state: its shards of the
        layout it trains in (one process: all of them); none on a rollout pool's rank (the push brings them)."""
        if isinstance(self.pool, pools.RolloutSide):
            return {}
        where = self.seats
        lay = self.pool.plan.src if isinstance(self.pool, pools.TrainSide) else \
            None if where.placement is None else where.placement.train
        if lay is not None and (off := lay.mismatched_dtypes(full)):
            raise ValueError(f"StepContext.shards: {off[0]} is {full[off[0]].dtype}, its layout's "
                             f"{lay[off[0]].dtype} (and {len(off) - 1} more): make the layouts with the weights' dtype")
        return dict(full) if where.placement is None else shard_params(full, where.placement.train, where.rank)


@dataclass
class StepOut:
    """This rank's figures of one step, before the loop combines them over the ranks (``report.combine``)."""
    figures: Figures  # counts (this rank's rows, the rollout's, the staleness histogram) and times (per stage,
    # the weight transition's and the engine's loads)
    update: dict[str, float]  # the update's metrics (global already)
    lr: float
    bad_rewards: int  # this rank's non-finite rewards
    rows: RolloutBatch  # the rows this rank scored (separate pools: trained), and their rewards (NaN: unscored),
    rewards: torch.Tensor  # for the samples sink


def context(cfg: ModelConfig, tokenizer, reward_fn, conf: LoopConfig, *, device: torch.device | str = "cpu",
            dock=None, placement: Placement | None = None, template=None) -> StepContext:
    """The fixed part of a run's steps on this rank. ``dock``: the transfer dock the rows cross from the
    rollout group to the train group through (``rlflow.dock.Dock``, its consumers ``graph_for(...).consumers``);
    None hands them over in memory (one process only). ``placement``: where the stages run on a world of
    several ranks (torch.distributed initialised; ``runtime.placement``); None: one process, unsharded. Sizes
    in ``conf`` are global.

    ``Disaggregated`` (separate device pools, ``runtime.pools``): this process is a rank its launcher put in
    one of the pools (``launch.spawn(..., pools=placement.pools)``); the context is that pool's (its own
    placement, its world) with this rank's end of the link (``pool``): a train rank steps, a rollout rank
    produces (``loop.train`` runs ``runtime.producer`` there).

    ``template``: the chat template (``tokenizer.ChatTemplate``) multi-turn rollouts render the environments'
    observations with (``conf.multiturn``); None: their text as it is."""
    pool, side = "colocated", None
    if isinstance(placement, Disaggregated):
        link = pools.joined()
        if link is None or link.pools != placement.pools:
            raise ValueError(f"step.context: a Disaggregated placement of {placement.world} ranks runs on the ranks "
                             f"its launcher split into its pools (launch.spawn(..., pools=placement.pools)); this "
                             f"process is {'no rank of separate pools' if link is None else f'a rank of {link.pools}'}")
        pool, both = link.pools.pool(link.rank), placement
        placement = both.own(pool)
    if pool != "colocated" and dock is None:
        raise ValueError("step.context: separate pools exchange their rows through a dock")
    rollout_mesh = both.rollout.mesh if pool != "colocated" else None if placement is None else placement.rollout.mesh
    for name, why in placement_problems(conf, rollout_mesh, pools=pool != "colocated")[:1]:
        raise ValueError(f"step.context: {name}={getattr(conf, name)!r}: {why}" if hasattr(conf, name) else
                         f"step.context: rollout layout {why}")
    graph = graph_for(conf.grpo.adv_estimator)
    check_features(cfg, 1 if placement is None else placement.train.mesh.pp, routing_replay=conf.routing_replay,
                   check_logprobs=conf.check_logprobs, adv_estimator=conf.grpo.adv_estimator)
    if conf.critic is not None and placement is not None and placement.critic is None and pool != "rollout":
        raise ValueError("step.context: a critic over several ranks needs its layout: the placement's critic=")
    if placement is not None and dock is None:
        raise ValueError("step.context: a placement over several ranks needs a dock (the stages' rows go through it)")
    where = seats(placement, cfg)
    train_mesh = where.mesh(graph["update"].runs_on)
    nd = train_mesh.data_parallel_size
    if placement is not None:
        for name, why in share_problems(conf, placement.world, train_mesh)[:1]:
            raise ValueError(f"{name} {getattr(conf, name)} {why}")
    routes = conf.routing_replay != "off"
    route_dims = (n_moe_layers(cfg), cfg.num_experts_per_tok) if routes else None
    flow = MemoryFlow() if dock is None else DockFlow(dock, where.rank, where.world, route_dims=route_dims,
                                                      timeout=conf.dock_timeout_s, clears=pool != "rollout")
    ucfg = stages.UpdateConfig(mini_batch_size=conf.mini_batch_size // nd, micro_batch_size=conf.micro_batch_size // nd,
                               max_grad_norm=conf.max_grad_norm, router_aux_coef=conf.router_aux_coef,
                               layout=where.train, routing_replay=conf.routing_replay, remat=conf.remat)
    # a multi-turn context grows by its turns and observations: up to the model's positions
    max_len = cfg.max_position_embeddings if conf.multiturn is not None else \
        (conf.max_prompt_len or cfg.max_position_embeddings) + conf.sampling.max_new_tokens
    engine = None if pool == "train" else engines.build(
        conf.rollout_engine, cfg, conf.sampling, ex=where.rollout_ex, options=engines.Options(
            compile_decode=conf.compile_decode, record_routes=routes, seed=conf.seed,
            max_model_len=min(max_len, cfg.max_position_embeddings), memory_utilization=conf.vllm_memory_utilization,
            expert_parallel=conf.vllm_expert_parallel))
    critic_ucfg = ucfg if placement is None else dataclasses.replace(ucfg, layout=placement.critic)
    multiturn = None
    if conf.multiturn is not None and pool != "train":
        tools = None if conf.multiturn.tools is None else load_tools(conf.multiturn.tools)
        render = plain_render(tokenizer.encode) if template is None else chat_render(template, tokenizer.encode)
        multiturn = MultiTurn(conf.multiturn, render=render, decode=tokenizer.decode, reward_fn=reward_fn,
                              max_new_tokens=conf.sampling.max_new_tokens, vocab_size=cfg.vocab_size,
                              max_positions=cfg.max_position_embeddings, eos_id=conf.sampling.eos_id, tools=tools)
    if pool != "colocated":  # last: the rollout side's receiver thread starts with it
        rank, size = link.pools.local(link.rank)
        side = pools.TrainSide(link, rank, both.push_plan()) if pool == "train" else pools.RolloutSide(
            link, rank, size, both.push_plan(), device=device, partial=conf.partial_rollout)
    return StepContext(cfg=cfg, tokenizer=tokenizer, reward_fn=reward_fn, config=conf, device=torch.device(device),
                       seats=where, graph=graph, flow=flow, engine=engine, update_config=ucfg,
                       dock_columns=dock_columns(graph, conf.routing_replay, multiturn=conf.multiturn is not None,
                                                 pools=pool != "colocated"),
                       weights=Weights(where.train, None if placement is None else
                                       engines.layout_of(engine, placement.rollout), where.rank),
                       critic_update_config=critic_ucfg, pool=side, multiturn=multiturn)


def step(state: RunState, prompts: PromptBatch, ctx: StepContext) -> tuple[RunState, StepOut]:
    """One RL step of ``state`` on the step's ``prompts`` (every rank the same ones); returns the next state
    (``state`` is donated: its tensors are updated in place) and this rank's figures.

    The schedule, by placement: colocated, this rank runs the step's rollout side (the weights into the
    rollout layout, generation, ``score_and_put``) and then its train side (``train_side``); on a train rank of
    separate pools (``ctx.pool``), the train side alone, on the rows the rollout pool produced with weights at
    most ``max_staleness`` versions old (its rollout side is ``runtime/producer.py``), then the new version
    pushed. Either way the rollout side's figures arrive as one ``RolloutReport``."""
    conf, index, flow = ctx.config, state.steps_done, ctx.flow
    G, pool = conf.grpo.group_size, ctx.pool
    if isinstance(pool, pools.RolloutSide):
        raise ValueError("step: this rank is in the rollout pool of separate pools: it produces (loop.train runs "
                         "runtime.producer), the train pool steps")
    if pool is None:
        rollout_clock = Clock()
        flow.begin(prompts, G)
        ctx.engine.load(ctx.weights.to_rollout(state, into=engines.targets(ctx.engine)))
        rollout = generate(prompts, index, ctx)
        ctx.weights.to_train(state, ctx.engine.release(), ctx.device)
        rollout_clock.lap("rollout_time_s")
        report, rows, rewards = score_and_put(rollout, index, ctx, rollout_clock)
        report.figures.times.update({**ctx.weights.figures(), **ctx.engine.figures()})
        clock = Clock()
        state, upd, lr, _, _, stale = train_side(state, ctx, clock)
    else:
        clock = Clock()
        if pool.version is None:  # the first version: the weights the run starts from
            pool.push(state.policy, index)
        flow.begin(prompts, G, slot=index % (conf.max_staleness + 1))
        state, upd, lr, rows, c, stale = train_side(state, ctx, clock)
        if state.steps_done < conf.steps:  # the last version trains nothing more
            pool.push(state.policy, state.steps_done)
        clock.lap("push_time_s")
        rewards = c["rewards"]  # the update reads them too (every graph's)
        report = pool.figures(index)  # the rollout ranks' (the lead's; None on the other train ranks)
        if report is not None:
            report.figures.times["staleness"] = float(index - report.version)
    own = Figures({"nonfinite_params": _nonfinite(state), **stale}, clock.laps)
    figures = own if report is None else report.figures + own
    return state, StepOut(figures=figures, update=upd, lr=lr, bad_rewards=0 if report is None else report.bad_rewards,
                          rows=rows, rewards=rewards)


def train_side(state: RunState, ctx: StepContext, clock: "Clock"):
    """The train group's part of step ``state.steps_done``: its rows from the dock, the stages that read them
    (``train_on``), the dock's rows released. Separate pools' rows are checked against the staleness bound
    before they are trained on. Returns (the state, the update's metrics, the learning rate, the rows, their
    dock columns, this rank's staleness histogram: separate pools' ``stale_tokens``, else {})."""
    conf, where, index = ctx.config, ctx.seats, state.steps_done
    group = ctx.graph["update"].runs_on
    mesh = where.mesh(group)
    batch, c = ctx.flow.get(group, ctx.dock_columns, mesh, where.rank)
    stale = {}
    if ctx.pool is not None:
        clock.lap("train_wait_s")
        # each data-parallel part's rows counted once (the tp and pp ranks of a part take the same rows)
        first = mesh is None or all(v == 0 for a, v in mesh.coords(where.rank).items() if a not in ("dp", "ep"))
        stale = stale_tokens(batch, index, conf.max_staleness, count=first)
    state, upd, lr = train_on(state, batch, c, ctx, clock)
    # before the loop's closing collective: no rank puts the next step's rows before the clear (separate pools:
    # the slot is free for step index + max_staleness + 1, whose weights the push after this allows)
    ctx.flow.end()
    clock.lap("update_time_s")
    state.steps_done += 1
    return state, upd, lr, batch, c, stale


def generate(prompts: PromptBatch, index: int, ctx: StepContext, *, version: int | None = None,
             newer=None) -> RolloutBatch:
    """Step ``index``'s rollout of this rank's share of ``prompts`` with the weights the engine holds: one
    response per sample, or with ``ctx.multiturn`` one episode. ``version`` (separate pools): the weights'
    version, recorded per token (``versions_BTr``); ``newer``: partial rollout (``rollout.generate``)."""
    mine = rollout_share(prompts, ctx.seats.mesh(ctx.graph["rollout"].runs_on), ctx.seats.rank)
    G, seed = ctx.config.grpo.group_size, ctx.config.seed * 1_000_003 + index
    if ctx.multiturn is not None:
        if newer is not None:
            raise ValueError("step.generate: partial rollout of multi-turn episodes is not built yet")
        rows = ctx.multiturn.rollout(ctx.engine, mine, group_size=G, seed=seed)
    elif newer is None:
        rows = ctx.engine.generate(mine, group_size=G, seed=seed)
    else:  # the engine records each token's version
        rows = ctx.engine.generate(mine, group_size=G, seed=seed, version=version, newer=newer)
    if version is not None and rows.versions_BTr is None:  # one version sampled the whole step
        rows = rows.replace(versions_BTr=torch.full_like(rows.response_ids_BTr, version))
    return rows


def prompts_at(source, index: int, ctx: StepContext) -> PromptBatch:
    """Step ``index``'s prompts, the next ``prompts_per_step`` of ``source``, on the rank's device."""
    conf = ctx.config
    return prompt_batch(source.take(conf.prompts_per_step), ctx.tokenizer, first_index=index * conf.prompts_per_step,
                        max_prompt_len=conf.max_prompt_len).to(ctx.device)


def score_and_put(rollout: RolloutBatch, index: int, ctx: StepContext, clock: "Clock"):
    """Score and advantages: each rank its share of the rows its rollout group holds, then into the dock
    (``flow.put_rows``). ``clock``: the rollout side's, its laps so far the rollout's. Returns (the step's
    ``RolloutReport``: its times are the clock's laps, the scoring's the last; the rows this rank scored; their
    rewards, NaN where unscored)."""
    where = ctx.seats
    rows = score_share(rollout, where.mesh(ctx.graph["rollout"].runs_on), where.rank, ctx.config.grpo.group_size)
    w = run_stages(Work(ctx, rows, {}, index=index), ctx.graph, "every")
    rewards, scored = w.cols["rewards"], w.cols["scored"]
    bad = (~torch.isfinite(rewards)).nonzero()[:, 0]
    if len(bad):  # their groups' advantages, hence the gradient, are non-finite: the update is skipped
        log.warning("step %d: non-finite rewards %s at sample indices %s; the update is skipped", index,
                    rewards[bad][:8].tolist(), rows.index_B[bad.to(rows.index_B.device)][:8].tolist())
    # what the rollout side's stages wrote, in their columns' dtypes (``scored``: a bool mask here, uint8 there)
    dtypes = {c.name: c.dtype for c, _ in ctx.graph.columns}
    written = dict.fromkeys(c for st in ctx.graph.stages if st.runs_on == "every" for c in st.writes)
    ctx.flow.put_rows(rows, **{c: w.cols[c].to(device=ctx.device, dtype=dtypes[c]) for c in written})
    clock.lap("score_time_s")
    own = Figures() if ctx.multiturn is None else Figures(*ctx.multiturn.figures())  # the episodes' counts, times
    report = RolloutReport(index, Figures(row_counts(rows, rewards, scored), dict(clock.laps)) + own,
                           bad_rewards=int(len(bad)), rows=rows.size)
    return report, rows, rewards.masked_fill(~scored, float("nan"))


def _nonfinite(state: RunState) -> float:
    # finite gradients can still make a weight non-finite (an overflow): the loop stops before any hook saves it
    return float(len(optim.nonfinite(critics.with_policy(state.policy, state.critic))))


def train_on(state: RunState, batch: RolloutBatch, c: dict, ctx: StepContext, clock: "Clock"):
    """The train group's stages on its rows ``batch`` and dock columns ``c``, in the graph's order: those that
    write the columns the updates read (log-probs, values, GAE), then the updates (the stages that write
    nothing), on the ``TrainBatch`` the first ones made. Returns (the state, the updates' metrics, the learning
    rate)."""
    w = Work(ctx, batch, c, state=state, index=state.steps_done, lr=learning_rate(ctx.config, state.steps_done))
    for st in ctx.graph.stages:
        if st.runs_on != "train" or st.fn is None:
            continue
        if not st.writes and w.train is None:  # the first update: what the stages before wrote is complete
            w.train = train_batch(batch, c)
            clock.lap("logprob_time_s")
        st.fn(w)
    return w.state, w.metrics, w.lr


def run_stages(w: Work, graph: Graph, runs_on: str) -> Work:
    """The stages of ``graph`` that run on ``runs_on`` and carry a function, in its order, on ``w``."""
    for st in graph.stages:
        if st.runs_on == runs_on and st.fn is not None:
            st.fn(w)
    return w


def stale_tokens(batch: RolloutBatch, index: int, max_staleness: int, count: bool = True) -> dict[str, float]:
    """The histogram of this rank's sampled tokens of step ``index`` by staleness (updates between the version
    that sampled a token and the one it is trained with: ``stale_tokens/s``, s = 0..max_staleness; summed over
    the ranks; zeros where not ``count``). A token beyond the bound is a broken rule, not a figure: it raises."""
    stale = index - batch.versions_BTr[batch.loss_mask]
    if len(stale) and not 0 <= int(stale.min()) <= int(stale.max()) <= max_staleness:
        raise RuntimeError(f"separate pools: step {index} holds tokens {int(stale.min())} to {int(stale.max())} "
                           f"versions old; the bound is {max_staleness}")
    counts = torch.bincount(stale, minlength=max_staleness + 1).tolist()
    return {f"stale_tokens/{s}": float(n) if count else 0.0 for s, n in enumerate(counts)}


def dock_columns(graph: Graph, routing_replay: str, multiturn: bool = False, pools: bool = False) -> list[str]:
    """The columns the train group takes from the dock: what its stages read that the rollout group's wrote
    (the rows themselves, ``graph.ROWS``, always come), the rollout's expert routes with routing replay,
    multi-turn rows' loss mask and, with separate pools, each token's version."""
    written = {c for s in graph.stages if s.runs_on != "train" for c in s.writes}
    read = [c for s in graph.stages if s.runs_on == "train" for c in s.reads if c in written]
    routes = list(ROUTES) if routing_replay != "off" else []
    return ([c for c in dict.fromkeys(read) if c not in ROWS] + routes + ([LOSS_MASK] if multiturn else [])
            + ([VERSIONS] if pools else []))


class Clock:
    """Wall time per stage: each ``lap`` records the seconds since the previous one."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name], self._t = now - self._t, now


__all__ = ["StepContext", "StepOut", "context", "prompts_at", "score_and_put", "step", "train_side"]
