"""Training-inference consistency: how far the rollout's sampling log-probs are from the trainer's, and
importance-sampling corrections of that mismatch. Pure functions; weights carry no gradient.

Legend: B samples, T response tokens (right-padded), mask_BT True on real tokens. ``sample_lp``: the
log-probs the rollout engine sampled with (pi_rollout); ``old_lp``: the trainer's log-probs of the same
tokens under the same weights (pi_old); d = old_lp - sample_lp, ideally 0 (differs through precision,
kernels, or a separate inference engine).

Metrics (``mismatch``), over real tokens:
    logp_diff_mean = mean |d|          logp_diff_max = max |d|
    ratio_mean = mean exp(d)           out_of_band = share of tokens with exp(d) outside [1/c, c]

Rollout importance sampling (the policy-gradient term of each token is multiplied by w):
    token level:     w_t = exp(d_t)
    sequence level:  w_i = exp(sum_t d_it)          (the same weight on every token of sequence i)
    truncate (TIS):  w <- min(w, c)                 (Yao et al. 2025, "Your efficient RL framework
                                                     secretly brings you off-policy RL training")
    mask (MIS):      w <- w if 1/c <= w <= c else 0 (tokens / sequences outside the band dropped)

The consistency gate (``check_logprobs``): a run fails when mean |d| over all the step's real tokens
exceeds a tolerance, with a report of the worst rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

IS_LEVELS = ("none", "token", "seq")
IS_MODES = ("truncate", "mask")
LOG_W_CLAMP = 20.0  # log-weights enter exp() clamped: finite weights even for far-off samples


def mismatch(sample_lp_BT: Tensor, old_lp_BT: Tensor, mask_BT: Tensor, cap: float = 2.0) -> dict[str, Tensor]:
    """The mismatch metrics above (float32 scalars, no gradient; ratio 1 and the rest 0 without tokens).
    Masked sums, not a selection of the real tokens: no host sync."""
    with torch.no_grad():
        if mask_BT.numel() == 0:
            z = torch.zeros((), device=mask_BT.device)
            return {"logp_diff_mean": z, "logp_diff_max": z, "ratio_mean": z + 1, "out_of_band": z}
        m = mask_BT.to(torch.float32)
        n = m.sum().clamp_min(1)
        d = torch.where(mask_BT.bool(), old_lp_BT.float() - sample_lp_BT.float(), 0.0)  # padding's NaN stays out
        r = d.clamp(-LOG_W_CLAMP, LOG_W_CLAMP).exp()
        return {"logp_diff_mean": d.abs().sum() / n, "logp_diff_max": d.abs().max(),
                "ratio_mean": ((r - 1) * m).sum() / n + 1,
                "out_of_band": (((r < 1 / cap) | (r > cap)).float() * m).sum() / n}


def is_weights(sample_lp_BT: Tensor, old_lp_BT: Tensor, mask_BT: Tensor, *, level: str, cap: float,
               mode: str = "truncate") -> Tensor | None:
    """Importance weights [B, T] (0 on padding; detached) of the rollout/trainer mismatch, or None for
    ``level="none"``."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout IS level {level!r}: expected one of {IS_LEVELS}")
    if mode not in IS_MODES:
        raise ValueError(f"rollout IS mode {mode!r}: expected one of {IS_MODES}")
    if not cap > 1:
        raise ValueError(f"rollout IS cap must be > 1, got {cap}")
    if level == "none":
        return None
    with torch.no_grad():
        m = mask_BT.to(torch.float32)
        d = (old_lp_BT.float() - sample_lp_BT.float()) * m
        if level == "seq":
            d = d.sum(-1, keepdim=True).expand_as(d)
        w = d.clamp(-LOG_W_CLAMP, LOG_W_CLAMP).exp()
        if mode == "truncate":
            w = w.clamp_max(cap)
        else:
            w = torch.where((w >= 1 / cap) & (w <= cap), w, torch.zeros_like(w))
        return w * m


__all__ = ["IS_LEVELS", "IS_MODES", "is_weights", "mismatch"]


class LogprobMismatchError(RuntimeError):
    """The rollout's log-probs and the trainer's differ by more than the gate's tolerance."""


def check_logprobs(sample_lp_BT: Tensor, old_lp_BT: Tensor, mask_BT: Tensor, index_B: Tensor, tol: float, *,
                   step: int, total=lambda t: t, gather=lambda rows: [rows], worst: int = 5) -> float:
    """mean |d| over the real tokens of every rank's rows (``total``: the sum over ranks); above ``tol``,
    ``LogprobMismatchError`` on every rank with the ``worst`` rows by mean |d| (``gather``: every rank's
    candidates; a row held by several ranks, e.g. tp peers, appears once). Returns the mean."""
    with torch.no_grad():
        m = mask_BT.bool()
        d = ((old_lp_BT.float() - sample_lp_BT.float()).abs() * m).cpu()
        n = m.sum(-1).cpu()
        sums = total(torch.tensor([float(d.sum()), float(n.sum())], dtype=torch.float64))
        mean = float(sums[0] / sums[1].clamp_min(1))
        if mean <= tol:
            return mean
        row_mean = d.sum(-1) / n.clamp_min(1)
        top = row_mean.argsort(descending=True)[:worst].tolist()
        mine = [(float(row_mean[b]), int(index_B[b]), int(n[b]), float(d[b].max()), int(d[b].argmax())) for b in top]
        rows = sorted({r[1]: r for part in gather(mine) for r in part}.values(), reverse=True)[:worst]
    lines = [f"  sample {i}: mean |d| {mu:.3g} over {k} tokens, max {mx:.3g} at token {t}" for mu, i, k, mx, t in rows]
    raise LogprobMismatchError(
        f"step {step}: the trainer's log-probs differ from the rollout's by mean |d| = {mean:.3g} per token, above "
        f"--check-logprobs {tol:g} (d = trainer - rollout log-prob of the sampled token); worst rows:\n"
        + "\n".join(lines))
