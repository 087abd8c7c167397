"""One run's state, the one thing a step consumes and returns, a checkpoint saves and loads, and the
weight transition moves.

    policy, opt_state   this rank's shards of the policy (its train layout) and their AdamW state
    ref                 the frozen reference policy when KL is on (the run's initial weights), else None; a LoRA
                        run's is its base (``reference``): ``ref`` is then empty, nothing is copied
    critic              PPO's critic (its weights and AdamW state), else None
    steps_done          RL steps done: the next step's index (seeds, sample indices, the LR schedule)
    source              the prompt stream; its position is part of the state

``init`` makes one from tensors already in the rank's layout; ``start`` makes a rank's from the whole
initial weights, or from a checkpoint in any layout (``checkpoint.load``), as the recipe does.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from rlflow import optim
from rlflow.algos.critic import Critic
from rlflow.data import PromptSource
from rlflow.models import lora
from rlflow.models.config import ModelConfig
from rlflow.parallel.context import shard_params
from rlflow.runtime.checkpoint import Checkpoint, CheckpointError, restore_source
from rlflow.runtime.placement import Placement


@dataclass
class RunState:
    policy: dict[str, Tensor] | None
    opt_state: optim.AdamWState | None
    source: PromptSource
    ref: dict[str, Tensor] | None = None
    critic: Critic | None = None
    steps_done: int = 0


def init(policy: dict[str, Tensor], source: PromptSource, *, kl: bool = False, ref: dict[str, Tensor] | None = None,
         critic: Critic | None = None, opt_state: optim.AdamWState | None = None, steps_done: int = 0) -> RunState:
    """A run's state from this rank's tensors (the state holds its own dict of them: a transition empties
    it while the engine generates); fresh AdamW moments unless ``opt_state`` (LoRA: of the adapters only); with
    ``kl`` a frozen copy of ``ref`` (default: ``policy``) as the reference, or none when ``policy`` holds LoRA's
    adapters (the base is the reference: ``reference``)."""
    if ref is not None and not kl:
        raise ValueError("state.init: ref= is the reference policy of KL; pass kl=True with it")
    reference = None
    if kl:
        reference = {} if lora.has_adapters(policy) else \
            {k: v.detach().clone() for k, v in (policy if ref is None else ref).items()}
    opt_state = optim.init(lora.trainable(policy)) if opt_state is None else opt_state
    return RunState(policy=dict(policy), opt_state=opt_state,
                    source=source, ref=reference, critic=critic, steps_done=steps_done)


def reference(state: RunState) -> dict[str, Tensor] | None:
    """The reference policy's params of KL (None: no KL): the frozen copy, or a LoRA run's base (the policy's
    own tensors without the adapters)."""
    if state.ref is None:
        return None
    return state.ref or lora.base(state.policy)


def start(policy: dict[str, Tensor], source: PromptSource, cfg: ModelConfig, *, kl: bool, with_critic: bool,
          placement: Placement | None = None, rank: int = 0, ck: Checkpoint | None = None, seed: int = 0) -> RunState:
    """Rank ``rank``'s state of a run whose initial weights are ``policy`` (whole tensors; the reference when
    ``kl``), cut to its train layout (``placement`` None: one process). ``ck``: continue that checkpoint (its
    weights, AdamW state, critic, steps and prompt position; ``checkpoint.load`` gave this rank's shards
    when it was sharded; a LoRA run's, its adapters beside ``policy``'s base). ``with_critic``: PPO's critic, from
    ``ck`` or fresh from the policy (``Critic.from_policy``, ``seed``)."""
    mine = (lambda full: full) if placement is None else \
        (lambda full: shard_params(full, placement.train.only(full), rank))  # a part (a LoRA base, its AdamW state)
    ref = mine(policy) if kl and cfg.lora is None else None  # LoRA: the base is the reference
    if ck is None:
        state = init(mine(policy), source, kl=kl, ref=ref)
    else:
        if with_critic and ck.critic is None:
            raise CheckpointError("the checkpoint has no critic (a run without --adv-estimator gae); it cannot "
                                  "continue as a PPO run")
        restore_source(source, ck.source_state)
        critic = ck.critic if with_critic else None
        params = ck.params
        if cfg.lora is not None:  # a LoRA checkpoint holds the adapters: the frozen base is ``policy``'s
            base = lora.base(policy)
            params = {**(base if ck.sharded is None else mine(base)), **ck.params}
        state = init(params, source, kl=kl, ref=ref, opt_state=ck.opt_state, steps_done=ck.steps_done,
                     critic=critic)
        if placement is not None and ck.sharded is None:  # whole tensors: this rank's shards of them
            state.policy, state.opt_state = mine(state.policy), optim.map_state(state.opt_state, mine)
            if critic is not None:
                ours = lambda full: shard_params(full, placement.critic, rank)  # noqa: E731
                state.critic = Critic(params=ours(critic.params), opt_state=optim.map_state(critic.opt_state, ours))
    if with_critic and state.critic is None:  # the critic's shards are the policy's, with its value head
        state.critic = Critic.from_policy(state.policy, cfg, seed=seed)
    return state


__all__ = ["RunState", "init", "reference", "start"]
