"""What a run says: its first lines (the model, sizes, layouts, dock), its closing lines (reward first and last,
TPS, the transition's, the engine's push and the dock's figures), and the reward curve's picture."""

from __future__ import annotations

import time
from collections import Counter

from rlflow.recipe.flags import Recipe
from rlflow.models import lora
from rlflow.recipe.pieces import RunSpec, optim_config
from rlflow.runtime import hooks, loop
from rlflow.runtime.placement import Placement
from rlflow.runtime.weights import same_layout


def introduce(r: Recipe, spec: RunSpec, where: Placement | None, dock, world: int, say) -> None:
    """The run's first lines: the model, the sizes, the layouts and the dock, the TPS definition."""
    cfg, lcfg = spec.cfg, spec.config
    n = sum(p.numel() for p in lora.base(spec.params).values())
    moe = f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}" if cfg.num_experts else "dense"
    say(f"model: {r.model or r.preset} ({cfg.model_type}, {n / 1e6:.2f}M params, {moe}) on {spec.device} x {world}; "
        f"task: {r.dataset or r.task}")
    if cfg.lora is not None:
        lc, k = cfg.lora, sum(p.numel() for p in lora.adapters(spec.params).values())
        say(f"LoRA: rank {lc.rank}, alpha {lc.alpha:g} on {','.join(lc.targets)}: {k / 1e6:.3f}M trainable params "
            f"({100 * k / n:.2f}%), the model frozen; lr {optim_config(r).lr:g}")
    say(f"sizes: {r.prompts_per_step} prompts x {r.group_size} samples = {lcfg.global_batch} per step, "
        f"mini-batch {lcfg.mini_batch_size}, micro-batch {lcfg.micro_batch_size}")
    if where is not None:
        say(f"layouts: train {where.train.mesh}, rollout {where.rollout.mesh} on {world} ranks; transfer dock "
            f"{type(dock.transport).__name__.removesuffix('Transport').lower()} with {len(dock.warehouses)} "
            "warehouses")
    say(loop.TPS_DEFINITION)


class Report(hooks.Hook):
    """The run's closing lines once its ``last`` step is done: reward first and last, TPS, the weight
    transition's and the dock's figures; the wall time from the first hook's start (the first evaluation
    included) to the end of the steps (the final checkpoint not)."""

    def __init__(self, last: int, where: Placement | None, dock, world: int, say):
        self.last, self.where, self.dock, self.world, self.say = last, where, dock, world, say
        self.history: list[dict] = []

    def start(self, state) -> None:
        self.t0 = time.perf_counter()

    def after_step(self, state, metrics: dict, out) -> None:
        self.history.append(metrics)

    def end(self, state) -> None:
        if state.steps_done >= self.last and self.history:
            report(self.history, self.where, self.dock, self.world, time.perf_counter() - self.t0, self.say)


def report(history: list[dict], where: Placement | None, dock, world: int, wall: float, say) -> None:
    """The run's closing lines: reward first and last, TPS, the weight transition's, the engine's weight push
    and the dock's figures."""
    first = sum(m["reward_mean"] for m in history[:10]) / len(history[:10])
    last = sum(m["reward_mean"] for m in history[-10:]) / len(history[-10:])
    tps = sum(m["prompt_tokens"] + m["response_tokens"] for m in history) / sum(m["step_time_s"] for m in history)
    say(f"done: {len(history)} steps in {wall:.1f}s; mean reward first 10 steps {first:.3f} -> last 10 "
        f"{last:.3f} (+{last - first:.3f}); mean TPS {tps / world:.0f}")
    mean = lambda k: sum(m.get(k, 0.0) for m in history) / len(history)  # noqa: E731
    if where is not None and not same_layout(where.train, where.rollout):
        say(f"weights train -> rollout layout (allgather-swap): {mean('transition_out_s') * 1e3:.1f} ms per step, "
            f"{mean('transition_recv_bytes') / 2**20:.2f} MiB received by rank 0; back (swap-in): "
            f"{mean('transition_back_s') * 1e3:.1f} ms")
    if "engine_load_bytes" in history[0]:
        say(f"weights into the rollout engine (in place): {mean('engine_load_s') * 1e3:.1f} ms per step, "
            f"{mean('engine_load_bytes') / 2**20:.2f} MiB per rank")
    if "staleness" in history[0]:  # separate pools
        seen = Counter(int(m["staleness"]) for m in history)
        wall_steps = sum(m["step_time_s"] for m in history)
        rollout_busy = sum(m["rollout_time_s"] + m["score_time_s"] for m in history) / wall_steps
        say(f"separate pools: staleness (updates between a step's sampling weights and its update) "
            f"{', '.join(f'{k}: {n} steps' for k, n in sorted(seen.items()))}; rollout pool busy {rollout_busy:.0%} "
            f"(waited {sum(m['rollout_wait_s'] for m in history):.1f}s for weights), train pool busy "
            f"{1 - sum(m['train_wait_s'] for m in history) / wall_steps:.0%} (waited "
            f"{sum(m['train_wait_s'] for m in history):.1f}s for rows)")
        tokens = {k.split("/")[1]: sum(m[k] for m in history) for k in history[0] if k.startswith("stale_tokens/")}
        say(f"separate pools: sampled tokens by staleness (updates between the version that sampled a token and its "
            f"update) "
            f"{', '.join(f'{k}: {n / max(sum(tokens.values()), 1):.1%}' for k, n in tokens.items())}")
    if dock is not None:
        say(f"transfer dock: {len(dock.warehouses)} warehouses, busiest dock process moved "
            f"{sum(m.get('dock_busiest_bytes', 0.0) for m in history) / 2**20:.1f} MiB in all "
            f"({mean('dock_busiest_bytes') / 2**10:.1f} KiB per step)")


def plot_rewards(history: list[dict], path: str) -> bool:
    """The reward curve into ``path``; False, nothing written, where matplotlib is not installed (a bare
    accelerator machine may lack it, and the run's weights and metrics matter more than its picture)."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":  # installed but broken (a missing dependency of its own): say so
            raise
        return False
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
    return True
