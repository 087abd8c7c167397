"""PPO's critic: a value model of the policy's family, its values, its clipped value loss and its update.

The critic is the policy's decoder with a one-output head (``value_head.weight`` [1, D]) in place of the
LM head, initialised from the policy's weights (as verl and OpenRLHF do). Its value of response token t
is V(prompt, response[:t]): the state before the token is generated, read from the same hidden state
that predicts the token in the policy. ``estimators.gae`` turns the values and the outcome rewards into
per-token advantages and returns; the critic then regresses on the returns:

    v_clip = old_v + clip(v - old_v, -value_clip, value_clip)
    l_t    = 0.5 max((v_t - R_t)^2, (v_clip_t - R_t)^2)            (PPO's clipped value loss, verl's)
    loss   = sum(l * m) / n_tokens                                 (token mean over the mini-batch)

It has its own AdamW state and runs in the train layout (``value_head`` replicated like a norm); its
update is ``stages.descend``, the policy's optimizer loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlflow import optim
from rlflow.algos import grpo, stages
from rlflow.batch import RolloutBatch, TrainBatch
from rlflow.models import lora
from rlflow.models.config import ModelConfig
from rlflow.models.shapes import LM_HEAD, VALUE_HEAD
from rlflow.models.execution import LOCAL, Exec
from rlflow.models.logprobs import sequence_hidden
from rlflow.sharding.execute import to_device, to_host


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    optim: optim.AdamWConfig  # the critic's own AdamW (its learning rate constant)
    value_clip: float | None = 0.5  # new values within old +- this (verl's cliprange_value); None: unclipped

    def __post_init__(self):
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"CriticConfig.value_clip must be > 0 (or None), got {self.value_clip}")


@dataclass
class Critic:
    """The critic a run carries from step to step: its parameters (this rank's shards in a layout) and
    their AdamW state; ``update`` returns the next one (its tensors donated, as the policy's)."""

    params: dict[str, Tensor]
    opt_state: optim.AdamWState

    @classmethod
    def from_policy(cls, params: dict[str, Tensor], cfg: ModelConfig, *, seed: int = 0) -> "Critic":
        """A critic initialised from the policy's weights: the same decoder, the LM head dropped, a value head
        drawn from a normal of std 1 / (D + 1) (OpenRLHF's). ``params`` may be one rank's shards in a layout:
        the result is then the critic's shards in the same layout (``models.sharding.layout(..., head=
        "value")``: the same specs, the value head replicated, drawn alike on every rank). A LoRA policy's critic
        is its base's, every weight trained (the adapters are the policy's)."""
        p = {k: v.detach().clone() for k, v in lora.base(params).items() if k != LM_HEAD}
        ref = next(iter(p.values()))
        g = torch.Generator().manual_seed(seed)
        D = cfg.hidden_size
        p[VALUE_HEAD] = (torch.randn(1, D, generator=g) / (D + 1)).to(dtype=ref.dtype, device=ref.device)
        return cls(params=p, opt_state=optim.init(p))


def with_policy(policy: dict[str, Tensor], critic: Critic | None) -> dict[str, Tensor]:
    """The policy's weights and the critic's beside them, the critic's under ``critic.`` (most of its names are
    the policy's)."""
    return {**policy, **({} if critic is None else {"critic." + k: v for k, v in critic.params.items()})}


def swap(critic: Critic, device=None, *, arena=None) -> None:
    """Move ``critic``'s weights and AdamW state to ``device``, or (None) to host memory while the policy
    generates (pinned on an accelerator, in the transition's ``arena`` when given, as the policy's own train
    state goes). On the CPU both ways keep the same tensors."""
    move = (lambda t: to_host(t, arena)) if device is None else (lambda t: to_device(t, device))
    critic.params = {k: move(v) for k, v in critic.params.items()}
    critic.opt_state = optim.map_state(critic.opt_state, lambda d: {k: move(v) for k, v in d.items()})


def values(params, cfg: ModelConfig, batch: RolloutBatch, *, remat: bool = False, ex: Exec = LOCAL) -> Tensor:
    """V of the state before each response token [B, Tr], float32, 0 on padding (the critic routes its
    MoE layers freely: routing replay is the policy's)."""
    if not (ex.first and ex.last):
        raise ValueError("critic.values: the critic does not run in a pipeline (pp) layout")
    h, _ = sequence_hidden(params, cfg, batch, remat=remat, ex=ex)
    v = F.linear(h[:, batch.prompt_ids_BTp.shape[1] - 1:], params[VALUE_HEAD])[..., 0].float()
    return v * batch.loss_mask


@torch.no_grad()
def batched_values(params, cfg: ModelConfig, batch: RolloutBatch, *, micro_batch_size: int,
                   ex: Exec = LOCAL) -> Tensor:
    """``values`` over micro-batches without gradients (the values before the step's updates)."""
    return stages.per_token(batch, micro_batch_size, lambda mbs: [values(params, cfg, mb, ex=ex) for mb in mbs])


def value_loss(v_BT: Tensor, old_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor, *, value_clip: float | None,
               n_tokens: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped value loss of the module docstring; metrics: the loss, the share of tokens where the
    clipped term is the larger (``vf_clip_frac``) and the mean value."""
    l1 = (v_BT - returns_BT) ** 2
    if value_clip is None:
        l, clipped = l1, torch.zeros_like(l1, dtype=torch.bool)
    else:
        l2 = (old_BT + (v_BT - old_BT).clamp(-value_clip, value_clip) - returns_BT) ** 2
        l, clipped = torch.maximum(l1, l2), l2 > l1
    loss = 0.5 * grpo.aggregate(l, mask_BT, "token-mean", n_tokens=n_tokens)
    m = mask_BT.float()
    ntok = m.sum().clamp_min(1)
    return loss, {"vf_clip_frac": (clipped.float() * m).sum() / ntok, "value_mean": (v_BT.detach() * m).sum() / ntok}


def update(critic: Critic, batch: TrainBatch, cfg: ModelConfig, ccfg: CriticConfig, ucfg: stages.UpdateConfig, *,
           epochs: int = 1, seed: int = 0, ex: Exec = LOCAL) -> tuple[Critic, dict[str, float]]:
    """``epochs`` passes of the value loss over ``batch`` (its ``values_BTr`` the old values, ``returns_BTr``
    the targets) with the policy's mini- and micro-batches (``stages.descend``); rows a reward left unscored
    (``scored_B`` 0) take no part. Returns the updated critic (``critic``'s tensors are donated: updated in
    place, as the policy's in ``stages.update``) and the metrics (``critic_loss``, ``critic_grad_norm``, ...)."""
    if batch.returns_BTr is None:
        raise ValueError("critic.update: the batch has no returns_BTr (estimators.gae makes them)")
    sums: dict[str, float] = {}

    def grads_of(live, leaves, mbs, n_tokens, n_seqs, reduce):
        rows = sum(mb.size for mb in mbs)
        grads: list[Tensor | None] = [None] * len(leaves)
        cast: list[Tensor] = []
        for mb in mbs:
            mask = mb.loss_mask if mb.scored_B is None else mb.loss_mask & mb.scored_B.bool()[:, None]
            loss, met = value_loss(values(live, cfg, mb, remat=ucfg.remat, ex=ex), mb.values_BTr, mb.returns_BTr,
                                   mask, value_clip=ccfg.value_clip, n_tokens=n_tokens)
            stages.record(sums, loss, met, mb.size / rows)
            stages.accumulate(grads, loss, leaves, reduce if mb is mbs[-1] else None, cast)
        return grads

    params, opt_state, n_mb = stages.descend(critic.params, critic.opt_state, batch, ucfg, ccfg.optim, epochs=epochs,
                                             seed=seed, lr=None, grads_of=grads_of, sums=sums)
    return Critic(params=params, opt_state=opt_state), stages.finite_or_nan(
        {f"critic_{k}": v for k, v in stages.averaged(sums, n_mb, ucfg.layout).items()})


__all__ = ["Critic", "CriticConfig", "batched_values", "swap", "update", "value_loss", "values", "with_policy"]
