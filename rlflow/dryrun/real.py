"""The dry run's step on real tensors, to compare with it: ``real`` (``runtime.step.step`` on this process's device
and process group, random weights, a real dock: ``real_dock``), ``real_pools`` (separate pools), routed as the dry
run routes (``balanced_routing``), the process's host memory kept as the recipe's (``as_the_recipe``)."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager, nullcontext

import torch
from torch.utils._python_dispatch import _disable_current_modes

from rlflow.dryrun.run import StepCase, _reward, _Text, decode_marked, staged
from rlflow.dryrun.trace import Watch
from rlflow.dryrun.values import balanced
from rlflow.sharding.mesh import Mesh


@contextmanager
def real_dock(case: StepCase, warehouses: int = 2, steps: int = 1):
    """A transfer dock of processes for ``steps`` steps' rows of ``case`` (what ``real``'s ranks share when there
    are several; separate pools hold their staleness + 1), closed on the way out."""
    from rlflow.dock.proc_backend import proc_dock
    from rlflow.runtime.graph import GRPO
    dock = proc_dock(GRPO.schema, GRPO.consumers, capacity=case.prompts * case.group_size * steps,
                     warehouses=warehouses, group_size=case.group_size)
    try:
        yield dock
    finally:
        dock.close()


@contextmanager
def balanced_routing():
    """Within the block, a real run's MoE layers send their tokens where a dry run's go (``values.balanced``: token n's
    k-th slot to expert (n K + k) mod E), each slot weighed as the router weighed its own choice: what a real run
    costs under the dry run's routing, issuing no op of its own (a benchmark's forced load balancing, as
    Megatron-Core's ``moe_router_force_load_balancing``). A random-init router is far from balanced on a few
    correlated rows (docs/dryrun.md), and a grouped matmul's time follows its groups."""
    from rlflow.models import decoder
    plain = decoder.route, decoder.route_grouped
    made: dict = {}  # (N, K, E, device) -> the choices, made once (unseen by a watch: no op a step issues)

    def forced(fn):
        def run(x_ND, gate_ED, *args, **kwargs):
            w_NK, idx_NK, aux = fn(x_ND, gate_ED, *args, **kwargs)
            key = (*idx_NK.shape, gate_ED.shape[0], idx_NK.device)
            if key not in made:
                with _disable_current_modes():
                    made[key] = balanced(*key[:3]).to(idx_NK.device)
            return w_NK, made[key], aux
        return run

    decoder.route, decoder.route_grouped = forced(plain[0]), forced(plain[1])
    try:
        yield
    finally:
        decoder.route, decoder.route_grouped = plain


def as_the_recipe() -> None:
    """This process as the recipe's on a CPU (``recipe.pieces.load_model``): freed host memory kept for reuse
    (``device.keep_host_memory``), where glibc would hand it back and fault it in afresh every step. ``real`` and
    ``real_pools`` start with it; a bench measuring this machine's rates for them calls it first."""
    from rlflow import device
    device.keep_host_memory()


def real(case: StepCase, rank: int, dock, *, steps: int = 1, watch: Watch | None = None, seed: int = 0):
    """``steps`` real RL steps of ``case`` on this process's device and process group (rank ``rank`` of
    ``case.world``; CPU tensors, random weights, the real ``dock``), the schedule ``step`` dry-runs: to compare
    with it. ``watch``: the first step's stages marked in it as in ``step``, the train state handed in. Returns
    (the state, each step's ``StepOut``)."""
    from rlflow.models import decoder
    from rlflow.models.config import get_config
    from rlflow.parallel.context import shard_params
    from rlflow.runtime import state as runstate, step as steps_

    as_the_recipe()
    cfg = get_config(case.model)
    train = case.layouts()[0]
    ctx = steps_.context(cfg, _Text(), _reward, dataclasses.replace(case.loop_config(), steps=steps), dock=dock,
                         placement=case.placement())
    policy = shard_params(decoder.init_params(cfg, seed=seed, dtype=torch.bfloat16), train, rank)
    prompts, outs = case.prompt_batch(cfg.vocab_size), []
    if watch is not None:
        ctx = staged(ctx, watch)
    with watch or nullcontext(), decode_marked(watch) if watch is not None else nullcontext():
        mark = watch.stage if watch is not None else lambda name: None
        mark("state")
        state = runstate.init(policy, None, kl=case.kl)
        if watch is not None:
            watch.hold([*policy.values()])
        del policy
        mark("transition")
        state, out = steps_.step(state, prompts, ctx)
        mark("end")
    outs.append(out)
    for _ in range(steps - 1):
        state, out = steps_.step(state, prompts, ctx)
        outs.append(out)
    return state, outs


def real_pools(rank: int, world: int, case: StepCase, dock, *, steps: int, staleness: int = 1) -> list[dict]:
    """``steps`` real RL steps of ``case`` on separate pools of one process each (rank 0 generates and scores, rank
    1 trains; run under ``launch.spawn(..., pools=Pools(1, 2))``; CPU tensors, random weights, the real ``dock`` of
    ``staleness`` + 1 steps' rows, every prompt ``case.prompt_len`` real tokens): the train rank's metrics of each
    step (``loop.train``'s, both pools' stage times), the rollout rank's none."""
    from rlflow.data import Example, PromptSource
    from rlflow.models import decoder
    from rlflow.models.config import get_config
    from rlflow.models.sharding import layout
    from rlflow.runtime import loop, pools, state as runstate, step as steps_
    from rlflow.runtime.placement import Disaggregated

    as_the_recipe()
    cfg = get_config(case.model)
    one = layout(case.model, Mesh.parse("dp=1", 1), dtype=torch.bfloat16)
    conf = dataclasses.replace(case.loop_config(), steps=steps, max_staleness=staleness)
    source = PromptSource(examples=[Example("x" * case.prompt_len, "")], seed=0)
    ctx = steps_.context(cfg, _Text(), _reward, conf, dock=dock, placement=Disaggregated(rollout=one, train=one))
    try:
        if pools.joined().pools.pool(rank) == "rollout":
            loop.train(runstate.init({}, source), ctx)
            return []
        state = runstate.init(decoder.init_params(cfg, seed=0, dtype=torch.bfloat16), source, kl=case.kl)
        return loop.train(state, ctx)[1]
    finally:
        if ctx.engine is not None:
            ctx.engine.close()
