"""Advantage estimators: the outcome ones (pure functions of the rewards and the group ids, one advantage
per sample, in a registry that a user's estimator joins with ``register_adv_est``) and GAE (per token,
from a critic's values).

Legend: B samples, G samples per group (a prompt's), r_i the reward of sample i, g(i) its group.

    grpo                    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)        (group_advantages;
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

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

ADV_EPS = 1e-6  # added to the group std: (r - mean) / (std + ADV_EPS)


@dataclass(frozen=True)
class _Outcome:
    fn: Callable[..., Tensor]  # fn(rewards_B, group_B, *, scale, total) -> float32 [B]
    min_group: int  # the fewest scored samples a group needs for its samples to get a nonzero advantage


# name -> outcome estimator, in registration order (the built-in ones below, then a user's); the names'
# tuples are rebuilt by every registration
_ADV_REGISTRY: dict[str, _Outcome] = {}
OUTCOME_ESTIMATORS: tuple[str, ...] = ()  # one advantage per sample, from the rewards alone
ADV_ESTIMATORS: tuple[str, ...] = ("gae",)  # the outcome estimators, then "gae" (per token, needs a critic)


def register_adv_est(name: str, *, min_group: int = 1):
    """Decorator: ``fn(rewards_B, group_B, *, scale, total) -> float32 advantages [B]`` becomes the outcome
    estimator ``name`` of ``advantages`` (and of ``GRPOConfig.adv_estimator``), as verl's
    ``register_adv_est``. ``scale``: GRPO's std division flag, ``total``: the sum over the data ranks (see
    the module docstring); an estimator ignores what it does not need. ``min_group``: under a reward that
    leaves rows unscored, the samples of a group with fewer scored ones get 0 (a leave-one-out baseline
    needs 2). ``ADV_ESTIMATORS`` and ``OUTCOME_ESTIMATORS`` are rebuilt (names imported from here before
    keep the old tuples)."""
    def deco(fn):
        global ADV_ESTIMATORS, OUTCOME_ESTIMATORS
        if name == "gae" or name in _ADV_REGISTRY:
            raise ValueError(f"register_adv_est: advantage estimator {name!r} is already registered")
        _ADV_REGISTRY[name] = _Outcome(fn, min_group)
        OUTCOME_ESTIMATORS = tuple(_ADV_REGISTRY)
        ADV_ESTIMATORS = OUTCOME_ESTIMATORS + ("gae",)
        return fn
    return deco


def _same(t: Tensor) -> Tensor:
    return t


def group_advantages(rewards_B: Tensor, group_B: Tensor, *, scale: bool = True, eps: float = ADV_EPS) -> Tensor:
    """GRPO outcome advantages, one per sample, normalized within its group g:

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)      (scale=True; std is the unbiased sample std)
        A_i =  r_i - mean_g(r)                          (scale=False: Dr.GRPO)

    A group whose rewards are all equal gets advantages of exactly 0 (in floating point the mean need
    not equal the common value, and dividing its rounding error by std + eps would amplify it). The
    statistics are computed in float64, as ``batch_whiten``'s: in float32 the squares of a spread past
    ~1.8e19 overflow and every advantage of the group came out 0. Returns float32.
    """
    _, inv = torch.unique(group_B, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    r = rewards_B.double()
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inv, r) / count
    hi = torch.full((n_groups,), float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amax")
    lo = torch.full((n_groups,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amin")
    centered = torch.where((hi == lo)[inv], torch.zeros_like(r), r - mean[inv])
    if not scale:
        return centered.float()
    var = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inv, centered**2)
    std = (var / (count - 1).clamp_min(1)).sqrt()
    return (centered / (std[inv] + eps)).float()


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


@register_adv_est("grpo")
def _grpo(rewards_B: Tensor, group_B: Tensor, *, scale: bool, total) -> Tensor:
    return group_advantages(rewards_B, group_B, scale=scale)


@register_adv_est("rloo", min_group=2)
def _rloo(rewards_B: Tensor, group_B: Tensor, *, scale: bool, total) -> Tensor:
    return rloo(rewards_B, group_B)


@register_adv_est("reinforce++")
def _reinforce_pp(rewards_B: Tensor, group_B: Tensor, *, scale: bool, total) -> Tensor:
    return batch_whiten(rewards_B.float(), total)


@register_adv_est("reinforce++-baseline")
def _reinforce_pp_baseline(rewards_B: Tensor, group_B: Tensor, *, scale: bool, total) -> Tensor:
    return batch_whiten(group_advantages(rewards_B, group_B, scale=False), total)


def advantages(name: str, rewards_B: Tensor, group_B: Tensor, *, scale: bool = True,
               total: Callable[[Tensor], Tensor] = _same, scored_B: Tensor | None = None) -> Tensor:
    """The advantages of estimator ``name`` (see the module docstring), float32 [B]; ``scale`` is GRPO's
    std division (False: Dr.GRPO). ``scored_B`` (bool): the rows a reward scored; the others get 0 and
    take no part in any baseline (group means and stds, the batch whitening; RLOO needs two scored
    samples in a group, else its scored one gets 0 too: ``register_adv_est``'s ``min_group``). None: every
    row."""
    if name == "gae":
        raise ValueError("advantage estimator 'gae' is per token and needs a critic's values: use estimators.gae")
    if name not in _ADV_REGISTRY:
        raise ValueError(f"advantage estimator {name!r}: expected one of {ADV_ESTIMATORS}")
    est = _ADV_REGISTRY[name]
    if scored_B is not None and not bool(scored_B.all()):
        keep = scored_B.to(rewards_B.device)
        if est.min_group > 1:  # e.g. a leave-one-out baseline needs another scored sample in the group
            _, inv, counts = torch.unique(group_B[keep], return_inverse=True, return_counts=True)
            keep = keep.clone()
            keep[keep.nonzero()[:, 0][counts[inv] < est.min_group]] = False
        out = torch.zeros(rewards_B.shape, dtype=torch.float32, device=rewards_B.device)
        idx = keep.nonzero()[:, 0]
        out[idx] = advantages(name, rewards_B[idx], group_B[idx.to(group_B.device)], scale=scale, total=total)
        return out
    return est.fn(rewards_B, group_B, scale=scale, total=total)


def discounted_reverse_cumsum(x_BT: Tensor, c: float) -> Tensor:
    """y_t = sum_{k >= t} c^(k - t) x_k along the last axis by doubling (y_t += c^s y_{t+s} for s = 1, 2, 4, ...):
    log2(T) elementwise steps instead of a Python step per token, and no matmul, whose rounding may depend on
    the inputs' alignment (a resumed run must compute what the uninterrupted one did, bit for bit)."""
    y, s, cs = x_BT, 1, c
    while s < x_BT.shape[-1]:
        y = y + cs * torch.cat([y[..., s:], torch.zeros_like(y[..., :s])], -1)
        s, cs = 2 * s, cs * cs
    return y


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
    v_next = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], 1)  # 0 past the last token (padding is 0)
    delta = (r + gamma * v_next - v) * m
    adv = discounted_reverse_cumsum(delta, gamma * lam) * m
    returns = adv + v
    if whiten:
        real = mask_BT.bool()
        adv = torch.zeros_like(adv).masked_scatter_(real, batch_whiten(adv[real], total))
    return adv, returns


__all__ = ["ADV_EPS", "ADV_ESTIMATORS", "OUTCOME_ESTIMATORS", "advantages", "batch_whiten", "gae", "group_advantages",
           "register_adv_est", "rloo"]
