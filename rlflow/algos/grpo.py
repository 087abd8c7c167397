"""GRPO as pure functions: its config, KL estimators, the clipped policy loss with its registry of ratio
forms, loss aggregation (the advantages are ``estimators``').

Legend: B samples, T response tokens (right-padded), mask_BT True on real response tokens.
Variants are knobs of ``GRPOConfig``: Dr.GRPO (``scale_rewards=False``, ``loss_agg="seq-mean-token-sum-norm"``),
DAPO (``clip_high > clip_low``, ``loss_agg="token-mean"``), dual clip (``dual_clip=c``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from rlflow.algos import corrections, estimators

KL_CLAMP = 10.0  # low_var_kl is clamped to [-KL_CLAMP, KL_CLAMP]
# log-ratios enter exp() clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] (verl's bound): beyond float32's
# range exp() overflows and the gradient turns NaN even where the loss itself is finite
LOG_RATIO_CLAMP = 20.0
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# name -> log-ratio form, in registration order (the built-in ones below, then a user's); POLICY_LOSSES
# is rebuilt by every registration
_POLICY_LOSS_REGISTRY: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {}
POLICY_LOSSES: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    group_size: int = 8  # G samples per prompt
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2  # DAPO's clip-higher: e.g. 0.28
    dual_clip: float | None = None  # c > 1: for A < 0 the loss is capped at -A * c (dual-clip PPO)
    kl_coef: float = 0.0  # beta: weight of KL(pi || pi_ref) in the loss; 0 skips the reference model
    kl_estimator: str = "low_var_kl"
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    scale_rewards: bool = True  # False: Dr.GRPO advantages r - mean (no std division)
    epochs: int = 1  # passes over the step's samples
    temperature: float = 1.0  # sampling temperature; log-probs are recomputed at the same temperature
    policy_loss: str = "ppo"  # token-level ratios (PPO/GRPO), or GSPO's sequence-level ratio
    adv_estimator: str = "grpo"  # estimators.ADV_ESTIMATORS
    gae_gamma: float = 1.0  # GAE's discount (adv_estimator="gae"; verl's default)
    gae_lambda: float = 1.0  # GAE's lambda: 1 is the Monte-Carlo return minus the value
    rollout_is: str = "none"  # importance-sample the rollout/trainer mismatch per token or sequence (corrections)
    rollout_is_cap: float = 2.0  # c: truncate weights at c, or mask those outside [1/c, c]
    rollout_is_mode: str = "truncate"

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(f"GRPOConfig.group_size must be >= 2 (advantages compare samples), got {self.group_size}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"GRPOConfig.clip_low/clip_high out of range: {self.clip_low}, {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"GRPOConfig.dual_clip must be > 1, got {self.dual_clip}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"GRPOConfig.kl_estimator={self.kl_estimator!r}: expected one of {KL_ESTIMATORS}")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"GRPOConfig.loss_agg={self.loss_agg!r}: expected one of {LOSS_AGGS}")
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"GRPOConfig.temperature must be finite and > 0 (log-probs divide by it), got "
                             f"{self.temperature}")
        for name in ("kl_coef", "entropy_coef"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"GRPOConfig.{name} must be finite, got {getattr(self, name)}")
        for name, v, ok in (("adv_estimator", self.adv_estimator, estimators.ADV_ESTIMATORS),
                            ("rollout_is", self.rollout_is, corrections.IS_LEVELS),
                            ("rollout_is_mode", self.rollout_is_mode, corrections.IS_MODES)):
            if v not in ok:
                raise ValueError(f"GRPOConfig.{name}={v!r}: expected one of {ok}")
        if not self.rollout_is_cap > 1:
            raise ValueError(f"GRPOConfig.rollout_is_cap must be > 1, got {self.rollout_is_cap}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"GRPOConfig.policy_loss={self.policy_loss!r}: expected one of {POLICY_LOSSES}")
        for name in ("gae_gamma", "gae_lambda"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"GRPOConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.policy_loss == "gspo" and self.adv_estimator == "gae":
            raise ValueError("GRPOConfig.policy_loss='gspo' with adv_estimator='gae': GSPO's sequence ratio takes one "
                             "advantage per sequence, and GAE's per-token ones would be averaged over each response "
                             "(their signal on the deciding token diluted); use 'gspo-token', GSPO's form for "
                             "token-level advantages")
        if self.epochs < 1:
            raise ValueError(f"GRPOConfig.epochs must be >= 1, got {self.epochs}")


def kl_penalty(logp_BT: Tensor, ref_logp_BT: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3), d = log pi_ref - log pi:

        k1 = -d            k2 = d^2 / 2            k3 = exp(d) - d - 1  (>= 0, unbiased, low variance;
                                                   d clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP])
        low_var_kl = clamp(k3, -KL_CLAMP, KL_CLAMP)
    """
    d = ref_logp_BT - logp_BT
    if estimator in ("k3", "low_var_kl"):
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # exp(d) below: finite gradients
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator in ("k3", "low_var_kl"):
        k3 = torch.exp(d) - d - 1
        return k3.clamp(-KL_CLAMP, KL_CLAMP) if estimator == "low_var_kl" else k3
    raise ValueError(f"kl estimator {estimator!r}: expected one of {KL_ESTIMATORS}")


def aggregate(loss_BT: Tensor, mask_BT: Tensor, mode: str, *, n_tokens: float | None = None,
              n_seqs: float | None = None, max_len: int | None = None) -> Tensor:
    """Reduce per-token losses to a scalar. ``n_tokens`` / ``n_seqs`` are the normalizers of the whole
    mini-batch when this call sees one micro-batch of it (gradient accumulation stays exact).

        token-mean:               sum(l * m) / n_tokens
        seq-mean-token-mean:      sum_b [ sum_t(l * m) / sum_t(m) ] / n_seqs
        seq-mean-token-sum-norm:  sum(l * m) / (n_seqs * max_len)        (Dr.GRPO)
    """
    m = mask_BT.to(loss_BT.dtype)
    if mode == "token-mean":
        return (loss_BT * m).sum() / (m.sum().clamp_min(1) if n_tokens is None else max(n_tokens, 1))
    n_seqs = loss_BT.shape[0] if n_seqs is None else n_seqs
    if mode == "seq-mean-token-mean":
        per_seq = (loss_BT * m).sum(-1) / m.sum(-1).clamp_min(1)
        return per_seq.sum() / max(n_seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        return (loss_BT * m).sum() / (max(n_seqs, 1) * (max_len or loss_BT.shape[1]))
    raise ValueError(f"loss_agg {mode!r}: expected one of {LOSS_AGGS}")


def register_policy_loss(name: str):
    """Decorator: ``fn(logp_BT, old_logp_BT, m_BT) -> log_rho_BT`` becomes the policy loss ``name`` of
    ``GRPOConfig.policy_loss``: the log importance ratio of each token (``m_BT``: the float mask) that ``policy_loss``
    clamps, exponentiates and clips, as verl's ``register_policy_loss`` (there the whole loss; here the
    ratio's form, the clipping, KL, entropy and aggregation being ``GRPOConfig``'s). ``POLICY_LOSSES`` is
    rebuilt (names imported from here before keep the old tuple)."""
    def deco(fn):
        global POLICY_LOSSES
        if name in _POLICY_LOSS_REGISTRY:
            raise ValueError(f"register_policy_loss: policy loss {name!r} is already registered")
        _POLICY_LOSS_REGISTRY[name] = fn
        POLICY_LOSSES = tuple(_POLICY_LOSS_REGISTRY)
        return fn
    return deco


@register_policy_loss("ppo")
def _ppo(logp_BT: Tensor, old_logp_BT: Tensor, m_BT: Tensor) -> Tensor:
    """Per token: logp - old_logp."""
    return logp_BT - old_logp_BT


def _seq_log_ratio(logp_BT: Tensor, old_logp_BT: Tensor, m_BT: Tensor) -> Tensor:
    """mean_t(logp - old_logp) over each sequence's real tokens [B, 1]."""
    return ((logp_BT - old_logp_BT) * m_BT).sum(-1, keepdim=True) / m_BT.sum(-1, keepdim=True).clamp_min(1)


@register_policy_loss("gspo")
def _gspo(logp_BT: Tensor, old_logp_BT: Tensor, m_BT: Tensor) -> Tensor:
    """Per sequence: the sequence's mean log-ratio on each of its tokens."""
    return _seq_log_ratio(logp_BT, old_logp_BT, m_BT).expand_as(logp_BT)


@register_policy_loss("gspo-token")
def _gspo_token(logp_BT: Tensor, old_logp_BT: Tensor, m_BT: Tensor) -> Tensor:
    """The sequence's value, each token's gradient."""
    return _seq_log_ratio(logp_BT, old_logp_BT, m_BT).detach() + logp_BT - logp_BT.detach()


def policy_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv: Tensor, mask_BT: Tensor, cfg: GRPOConfig, *,
                ref_logp_BT: Tensor | None = None, entropy_BT: Tensor | None = None,
                n_tokens: float | None = None, n_seqs: float | None = None,
                max_len: int | None = None, is_weights_BT: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate with optional dual clip, KL and entropy terms, per token then aggregated:

        rho = exp(clamp(log_rho, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), with log_rho (``register_policy_loss``)
              = logp - old_logp                               (ppo: per token)
              = mean_t(logp - old_logp)                       (gspo: per sequence; GSPO, Zheng et al. 2025)
              = sg[mean_t(logp - old_logp)] + logp - sg[logp] (gspo-token: the sequence's value, the
                                                               gradient of each token)
        pg  = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high))
        pg  = min(pg, -A c)  where A < 0                 (dual clip, c = cfg.dual_clip)
        pg  = w pg                                       (rollout importance weights w, ``corrections``)
        l   = pg + kl_coef * KL(pi || pi_ref) - entropy_coef * H(pi)
    A is ``adv``: one advantage per sample [B] (outcome estimators) or per token [B, T] (GAE).
    mean_t is over the sequence's real tokens. GSPO's ratios are near 1 (clip ranges ~3e-4 to 4e-4 in
    the paper) and it is aggregated per sequence (``loss_agg="seq-mean-token-mean"``).
    """
    if adv.shape not in (logp_BT.shape[:1], logp_BT.shape):
        raise ValueError(f"policy_loss: advantages of shape {tuple(adv.shape)}; expected [B] {tuple(logp_BT.shape[:1])} "
                         f"or [B, T] {tuple(logp_BT.shape)}")
    A = (adv if adv.dim() == 2 else adv[:, None]).to(logp_BT.dtype)
    if cfg.policy_loss not in _POLICY_LOSS_REGISTRY:
        raise ValueError(f"policy_loss {cfg.policy_loss!r}: expected one of {POLICY_LOSSES}")
    m = mask_BT.float()
    log_rho = _POLICY_LOSS_REGISTRY[cfg.policy_loss](logp_BT, old_logp_BT, m)
    ratio = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    pg1 = -A * ratio
    pg2 = -A * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = torch.maximum(pg1, pg2)
    if cfg.dual_clip is not None:
        pg = torch.where(A < 0, torch.minimum(pg, -A * cfg.dual_clip), pg)
    if is_weights_BT is not None:
        pg = pg * is_weights_BT.detach()
    loss = pg
    ntok = m.sum().clamp_min(1)
    metrics = {"clip_frac": ((pg2 > pg1).float() * m).sum() / ntok,
               "ratio_mean": (ratio.detach() * m).sum() / ntok}
    if cfg.kl_coef:
        if ref_logp_BT is None:
            raise ValueError("policy_loss: kl_coef != 0 needs ref_logp_BT")
        kl = kl_penalty(logp_BT, ref_logp_BT, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = (kl.detach() * m).sum() / ntok
    if cfg.entropy_coef:
        if entropy_BT is None:
            raise ValueError("policy_loss: entropy_coef != 0 needs entropy_BT")
        loss = loss - cfg.entropy_coef * entropy_BT
    if entropy_BT is not None:
        metrics["entropy"] = (entropy_BT.detach() * m).sum() / ntok
    out = aggregate(loss, mask_BT, cfg.loss_agg, n_tokens=n_tokens, n_seqs=n_seqs, max_len=max_len)
    return out, {k: v.detach() for k, v in metrics.items()}
