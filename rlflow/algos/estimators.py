"""Outcome advantage estimators beside GRPO: pure functions of the rewards and the group ids.

Legend: B samples, G samples per group (a prompt's), r_i the reward of sample i, g(i) its group.

    grpo                    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)        (grpo.group_advantages;
                            A_i =  r_i - mean_g(r) with scale=False: Dr.GRPO)
    rloo                    A_i =  r_i - mean_{j in g(i), j != i}(r_j)       (leave-one-out baseline;
                                 = G / (G - 1) (r_i - mean_g(r)))              Ahmadian et al. 2024)
    reinforce++             A_i = (r_i - mean_B(r)) / (std_B(r) + eps)        (batch-normalized; Hu 2025)
    reinforce++-baseline    A_i = (c_i - mean_B(c)) / (std_B(c) + eps),  c_i = r_i - mean_g(r)
    gae                     per token, from a critic's values V_t (``gae``; PPO, Schulman et al. 2016)

The ``reinforce++`` statistics are over the whole batch: with data parallelism every rank holds a share
of it, and ``total`` (a function summing a float64 tensor over the data ranks) makes them global.
A group whose rewards are all equal gets exactly 0 from every group-based estimator.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from rlflow.algos.grpo import ADV_EPS, group_advantages

ADV_ESTIMATORS = ("grpo", "rloo", "reinforce++", "reinforce++-baseline", "gae")
OUTCOME_ESTIMATORS = ADV_ESTIMATORS[:-1]  # one advantage per sample, from the rewards alone


def _same(t: Tensor) -> Tensor:
    return t


def rloo(rewards_B: Tensor, group_B: Tensor) -> Tensor:
    """Leave-one-out baseline: r_i minus the mean of the other samples of its group (groups of >= 2)."""
    _, inv, counts = torch.unique(group_B, return_inverse=True, return_counts=True)
    if bool((counts < 2).any()):
        raise ValueError(f"rloo: every group needs >= 2 samples, got group sizes {sorted(set(counts.tolist()))}")
    n = counts[inv].to(torch.float32)
    return group_advantages(rewards_B, group_B, scale=False) * n / (n - 1)


def batch_whiten(x_B: Tensor, total: Callable[[Tensor], Tensor] = _same, eps: float = ADV_EPS) -> Tensor:
    """(x - mean) / (std + eps) over the whole batch (``total`` sums over data ranks); unbiased std."""
    s = total(torch.stack([x_B.double().sum(), x_B.double().square().sum(),
                           torch.tensor(float(x_B.numel()), dtype=torch.float64, device=x_B.device)]))
    n = float(s[2])
    mean = s[0] / n
    var = (s[1] / n - mean * mean).clamp_min(0) * n / max(n - 1.0, 1.0)
    if float(var) == 0.0:  # every reward equal: no signal (and the float rounding of the mean is no signal)
        return torch.zeros_like(x_B, dtype=torch.float32)
    return ((x_B.double() - mean) / (var.sqrt() + eps)).float()


def advantages(name: str, rewards_B: Tensor, group_B: Tensor, *, scale: bool = True,
               total: Callable[[Tensor], Tensor] = _same, scored_B: Tensor | None = None) -> Tensor:
    """The advantages of estimator ``name`` (see the module docstring), float32 [B]; ``scale`` is GRPO's
    std division (False: Dr.GRPO). ``scored_B`` (bool): the rows a reward scored; the others get 0 and
    take no part in any baseline (group means and stds, the batch whitening; RLOO needs two scored
    samples in a group, else its scored one gets 0 too). None: every row."""
    if scored_B is not None and not bool(scored_B.all()):
        keep = scored_B.to(rewards_B.device)
        if name == "rloo":  # a leave-one-out baseline needs another scored sample in the group
            _, inv, counts = torch.unique(group_B[keep], return_inverse=True, return_counts=True)
            keep = keep.clone()
            keep[keep.nonzero()[:, 0][counts[inv] < 2]] = False
        out = torch.zeros(rewards_B.shape, dtype=torch.float32, device=rewards_B.device)
        idx = keep.nonzero()[:, 0]
        out[idx] = advantages(name, rewards_B[idx], group_B[idx.to(group_B.device)], scale=scale, total=total)
        return out
    if name == "grpo":
        return group_advantages(rewards_B, group_B, scale=scale)
    if name == "rloo":
        return rloo(rewards_B, group_B)
    if name == "reinforce++":
        return batch_whiten(rewards_B.float(), total)
    if name == "reinforce++-baseline":
        return batch_whiten(group_advantages(rewards_B, group_B, scale=False), total)
    if name == "gae":
        raise ValueError("advantage estimator 'gae' is per token and needs a critic's values: use estimators.gae")
    raise ValueError(f"advantage estimator {name!r}: expected one of {ADV_ESTIMATORS}")


def gae(rewards_B: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float = 1.0, lam: float = 1.0,
        total: Callable[[Tensor], Tensor] = _same, whiten: bool = True,
        scored_B: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over right-padded responses (Schulman et al. 2016), an outcome
    reward on each response's last token:

        r_t     = r_i at t = L_i - 1 (the last real token), 0 before it
        delta_t = r_t + gamma V_{t+1} - V_t              (V_{L_i} = 0: the episode ends)
        A_t     = delta_t + gamma lam A_{t+1}            (A_{L_i} = 0)
        R_t     = A_t + V_t                              (the critic's regression target)

    Returns (advantages [B, T], returns [B, T]), float32, 0 on padding. ``whiten``: the advantages
    (not the returns) are then whitened over every real token of the batch (``batch_whiten``; ``total``
    sums over the data ranks), as verl and OpenRLHF do. ``scored_B``: the rows a reward scored; the others
    get 0 everywhere and take no part in the whitening (None: every row)."""
    if scored_B is not None:
        mask_BT = mask_BT & scored_B.bool().to(mask_BT.device)[:, None]
    m = mask_BT.to(torch.float32)
    v = values_BT.float() * m
    last = (m.sum(-1).long() - 1).clamp_min(0)
    r = torch.zeros_like(v).scatter_(1, last[:, None], rewards_B.float()[:, None].to(v.device)) * m
    adv = torch.zeros_like(v)
    nxt_v = nxt_a = torch.zeros_like(v[:, 0])
    for t in reversed(range(v.shape[1])):  # padding (after the last token) keeps next = 0
        delta = r[:, t] + gamma * nxt_v - v[:, t]
        adv[:, t] = (delta + gamma * lam * nxt_a) * m[:, t]
        nxt_v, nxt_a = v[:, t], adv[:, t]
    returns = adv + v
    if whiten:
        real = mask_BT.bool()
        adv = torch.zeros_like(adv).masked_scatter_(real, batch_whiten(adv[real], total))
    return adv, returns


__all__ = ["ADV_ESTIMATORS", "OUTCOME_ESTIMATORS", "advantages", "batch_whiten", "gae", "rloo"]
