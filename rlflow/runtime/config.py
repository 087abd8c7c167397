"""The sizes and knobs of a run's loop (``LoopConfig``), checked once here, where they are defined, and the
features the model or the train layout cannot run (``check_features``)."""

from __future__ import annotations

from dataclasses import dataclass

from rlflow import engines, optim
from rlflow.algos import critic as critics, grpo
from rlflow.models.config import ModelConfig
from rlflow.multiturn import MultiTurnConfig, check_budget
from rlflow.runtime.placement import rollout_problem
from rlflow.rollout import SamplingConfig

ROUTING_REPLAY = ("off", "measure", "on")


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    steps: int  # the run's RL steps: a state with steps_done of them has nothing left to do
    prompts_per_step: int
    grpo: grpo.GRPOConfig
    mini_batch_size: int  # samples per optimizer step; global batch = prompts_per_step * group_size
    micro_batch_size: int  # samples per forward/backward
    optim: optim.AdamWConfig
    sampling: SamplingConfig
    max_grad_norm: float = 1.0
    remat: bool = False  # the updates' backward recomputes each layer's activations (activation checkpointing)
    router_aux_coef: float = 0.0
    max_prompt_len: int | None = None
    warmup_lr_steps: int = 0  # linear LR warm-up over this many steps
    lr_schedule: str = "constant"  # after the warm-up: constant, cosine or linear decay (optim.lr_at)
    min_lr_ratio: float = 0.0  # the decay ends at optim.lr * this, on the run's last step
    compile_decode: bool = False  # rollout's decode step through torch.compile (see rollout.generate)
    rollout_engine: str = "builtin"  # engines.names(): rlflow's own, or vLLM in the rank's process
    # vLLM's gpu_memory_utilization (on a CPU a share of host memory); None: 0.5 on an accelerator, 0.2 on a CPU
    vllm_memory_utilization: float | None = None
    vllm_expert_parallel: bool = False  # vLLM's expert parallelism over a tp rollout layout's ranks
    seed: int = 0
    max_bad_steps: int = 3  # this many steps in a row with every update skipped (non-finite) or no row scored stop the run
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
    # separate device pools: a step's rows are generated with weights at most this many updates old (the
    # rollout pool waits for newer ones; nothing is dropped); 0: on-policy, the synchronous run's rows
    max_staleness: int = 0
    # separate device pools: a version that lands while a step generates is swapped in mid-generation, the rows
    # in flight continuing under it; each token records its version (the staleness bounds the oldest)
    partial_rollout: bool = False
    # multi-turn rollouts: each sample an episode of turns with an environment (``rlflow/multiturn.py``); None:
    # one response per sample
    multiturn: MultiTurnConfig | None = None

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
        if self.check_logprobs is not None and not self.check_logprobs >= 0:
            raise ValueError(f"check_logprobs={self.check_logprobs} must be >= 0")
        if (self.critic is None) == (self.grpo.adv_estimator == "gae"):
            raise ValueError(f"critic={self.critic}: adv_estimator={self.grpo.adv_estimator!r} "
                             + ("needs a CriticConfig (GAE reads a critic's values)" if self.critic is None else
                                "has no critic (only 'gae' trains one)"))
        if self.dock_timeout_s is not None and not self.dock_timeout_s > 0:
            raise ValueError(f"dock_timeout_s={self.dock_timeout_s} must be > 0 (None: no limit)")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness!r} must be an integer >= 0")
        if self.rollout_engine not in engines.names():
            raise ValueError(f"rollout_engine={self.rollout_engine!r}: expected one of {engines.names()}")
        for name, why in engines.option_problems(self.rollout_engine,
                                                 {"vllm_memory_utilization": self.vllm_memory_utilization,
                                                  "vllm_expert_parallel": self.vllm_expert_parallel})[:1]:
            raise ValueError(f"{name}={getattr(self, name)} {why}, not of {self.rollout_engine}")
        if self.vllm_memory_utilization is not None and not 0 < self.vllm_memory_utilization <= 1:
            raise ValueError(f"vllm_memory_utilization={self.vllm_memory_utilization} must be in (0, 1]")
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(f"routing_replay={self.routing_replay!r}: expected one of {ROUTING_REPLAY}")
        if self.partial_rollout and (self.multiturn is not None or self.routing_replay != "off"):
            raise ValueError("partial_rollout=True: swapping weights mid-generation is built for single-turn rows "
                             "without recorded routes (not with multiturn or routing_replay)")
        if self.multiturn is not None:
            check_budget(self.multiturn, self.sampling.max_new_tokens)
            if self.routing_replay != "off":
                raise ValueError(f"routing_replay={self.routing_replay!r}: the rollout's expert choices are not "
                                 "recorded across the turns of an environment's episodes (not built); use 'off'")
            if self.grpo.adv_estimator == "gae":
                raise ValueError("adv_estimator='gae': GAE over an environment's episodes, whose observations sit "
                                 "between the model's tokens, is not built; use an outcome estimator (grpo, rloo, "
                                 "reinforce++)")
        validate_sizes(steps=self.steps, prompts_per_step=self.prompts_per_step, group_size=self.grpo.group_size,
                       mini_batch_size=self.mini_batch_size, micro_batch_size=self.micro_batch_size)


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


def share_problems(conf: "LoopConfig", world: int, train_mesh) -> list[tuple[str, str]]:
    """(field, why) for the sizes ``world`` ranks cannot share: each of the train layout's data-parallel ranks
    (``train_mesh``) takes an equal part of the prompts, the mini- and the micro-batches, and every rank scores
    an equal share of the groups."""
    nd = train_mesh.data_parallel_size
    out = [(name, f"is not divisible by the train layout's {nd} data-parallel ranks ({train_mesh})")
           for name in ("prompts_per_step", "mini_batch_size", "micro_batch_size") if getattr(conf, name) % nd]
    if conf.prompts_per_step % world:
        out.append(("prompts_per_step", f"is not divisible by the {world} ranks (each scores an equal share of the "
                                        "groups)"))
    return out


def decodes_in_lockstep(rollout_mesh) -> bool:
    """A rollout layout whose ranks split the model (tp or ep > 1): they take every decode step together."""
    return rollout_mesh.tp > 1 or rollout_mesh.ep > 1


def placement_problems(conf: "LoopConfig", rollout_mesh, *, pools: bool) -> list[tuple[str, str]]:
    """(field, why) for the loop's settings a placement cannot run with: ``rollout_mesh`` its rollout layout's mesh
    (None: one process), ``pools`` separate device pools. ``step.context`` raises the first; the recipe names
    each field's flag before any rank starts."""
    out = [] if pools else [(name, "needs separate pools (colocated steps are synchronous)")
                            for name in ("max_staleness", "partial_rollout") if getattr(conf, name)]
    if rollout_mesh is not None and (why := rollout_problem(rollout_mesh)) is not None:
        out.append(("rollout_layout", why))
    lockstep = rollout_mesh is not None and decodes_in_lockstep(rollout_mesh)
    if lockstep and conf.multiturn is not None:
        out.append(("multiturn", f"rollout layout {rollout_mesh}: multi-turn rollouts drive each rank's engine on its "
                                 "own episodes, and a layout with tp or ep > 1 generates in lockstep across ranks: "
                                 "use dp only"))
    if lockstep and pools and conf.partial_rollout:
        out.append(("partial_rollout", f"rollout layout {rollout_mesh}: its ranks decode in lockstep and would have "
                                       "to swap weights at the same step (not built): use dp only"))
    return out


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


__all__ = ["LoopConfig", "ROUTING_REPLAY", "check_features", "decodes_in_lockstep", "placement_problems",
           "share_problems", "validate_sizes"]
