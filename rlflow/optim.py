"""Functional AdamW: ``(params, grads, state, cfg) -> (params, state)``.

Like a JAX optimizer with donated buffers, the update writes into ``params`` and the moment buffers in
place (no second copy of the model) and returns them. Weight decay is decoupled (Loshchilov & Hutter)
and skips 1-D parameters (norms, biases). Parameters below float32 (bf16, fp16) get a float32 master
copy in the state: the update is applied to the master and rounded into the parameter, so steps
smaller than the parameter's precision are not lost.

    m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
    p = p - lr * ( m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd * p )
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        # not finite: every weight NaN after the first step, with a finite gradient norm (nothing would skip it)
        if not 0 < self.lr < math.inf:
            raise ValueError(f"AdamWConfig.lr must be finite and > 0, got {self.lr}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"AdamWConfig.weight_decay must be finite and >= 0, got {self.weight_decay}")
        if not 0 < self.eps < math.inf:
            raise ValueError(f"AdamWConfig.eps must be finite and > 0, got {self.eps}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"AdamWConfig.betas must be in [0, 1), got {self.betas}")


@dataclass
class AdamWState:
    step: int
    m: dict[str, Tensor]  # first moment, float32
    v: dict[str, Tensor]  # second moment, float32
    master: dict[str, Tensor] = field(default_factory=dict)  # float32 copies of low-precision params


def map_state(state: AdamWState, fn) -> AdamWState:
    """``state`` with ``fn`` applied to each of its tensor dicts (e.g. the shards of a layout, or their gathering)."""
    return AdamWState(step=state.step, m=fn(state.m), v=fn(state.v), master=fn(state.master) if state.master else {})


def init(params: dict[str, Tensor]) -> AdamWState:
    return AdamWState(step=0, m={k: torch.zeros_like(p, dtype=torch.float32) for k, p in params.items()},
                      v={k: torch.zeros_like(p, dtype=torch.float32) for k, p in params.items()},
                      master={k: p.detach().float().clone() for k, p in params.items() if p.dtype != torch.float32})


def global_norm(grads: dict[str, Tensor]) -> Tensor:
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm([g.float() for g in grads.values()])))


def clip_by_global_norm(grads: dict[str, Tensor], max_norm: float, *,
                        norm: Tensor | None = None) -> tuple[dict[str, Tensor], Tensor]:
    """Scale grads in place so their global L2 norm is at most max_norm; returns (grads, norm before
    clipping). In place: a copy of every gradient would be one more model-sized buffer. ``norm``: the
    global norm when the caller computes it otherwise (sharded gradients, ``parallel/dp.py``)."""
    norm = global_norm(grads) if norm is None else norm
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    distinct = list({id(t): t for t in grads.values()}.values())  # a shared tensor is scaled once
    torch._foreach_mul_(distinct, scale)
    return grads, norm


def step(params: dict[str, Tensor], grads: dict[str, Tensor], state: AdamWState, cfg: AdamWConfig,
         *, lr: float | None = None) -> tuple[dict[str, Tensor], AdamWState]:
    """One AdamW step over the parameters that have a gradient (the others are left as they are).

    torch's fused AdamW kernel (``torch._fused_adamw_``, the one ``torch.optim.AdamW(fused=True)`` runs)
    updates the float32 weights (the master where there is one) and both moments in one pass, in place,
    with no model-sized temporaries; matrices and 1-D parameters go in two calls (decay or not)."""
    keys = [k for k in params if k in grads and grads[k] is not None]
    if not keys:
        return params, state
    lr = cfg.lr if lr is None else lr
    b1, b2 = cfg.betas
    t = state.step + 1
    with torch.no_grad():
        for decay in (True, False):
            ks = [k for k in keys if (params[k].dim() > 1) == decay]
            if not ks:
                continue
            p = [state.master.get(k, params[k]) for k in ks]  # float32 (the master where there is one)
            g = [_like(grads[k].float(), x) for k, x in zip(ks, p)]
            steps = [torch.tensor(float(t), device=x.device) for x in p[:1]] * len(p)  # read-only, shared
            torch._fused_adamw_(p, g, [state.m[k] for k in ks], [state.v[k] for k in ks], [], steps, lr=lr,
                                beta1=b1, beta2=b2, weight_decay=cfg.weight_decay if decay else 0.0, eps=cfg.eps,
                                amsgrad=False, maximize=False)
        low = [k for k in keys if k in state.master]
        if low:
            torch._foreach_copy_([params[k] for k in low], [state.master[k] for k in low])
    return params, AdamWState(step=t, m=state.m, v=state.v, master=state.master)


def nonfinite(tensors: dict[str, Tensor]) -> list[str]:
    """The names of the tensors holding a NaN or an infinity (one pass over all of them, one host read)."""
    names = [k for k, t in tensors.items() if t.numel()]
    if not names:
        return []
    norms = torch._foreach_norm([tensors[k] for k in names])
    by_dtype: dict = {}
    for i, n in enumerate(norms):
        by_dtype.setdefault(n.dtype, []).append(i)
    order = [i for ix in by_dtype.values() for i in ix]
    ok = torch.cat([torch.isfinite(torch.stack([norms[i] for i in ix])) for ix in by_dtype.values()]).tolist()
    return [names[i] for i, good in zip(order, ok) if not good]


def _like(g: Tensor, p: Tensor) -> Tensor:
    """g in p's memory layout. The fused kernel walks the tensors as flat buffers: on torch 2.13's CPU a
    gradient whose strides differ from the weight's (grouped GEMM's weight gradients are transposed)
    silently updates the wrong elements, ``torch.optim.AdamW(fused=True)`` included."""
    return g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)


LR_SCHEDULES = ("constant", "cosine", "linear")


def lr_at(step: int, total: int, base_lr: float, warmup: int = 0, schedule: str = "constant",
          min_ratio: float = 0.0) -> float:
    """The learning rate of the run's step ``step`` (0-based) of ``total``: a pure function of the step, so a
    resumed run continues the schedule where it stopped.

    With eta = base_lr, W = warmup, T = total, rho = min_ratio:

        s < W:   eta * (s + 1) / W                                  (linear warm-up, eta at s = W - 1)
        s >= W:  p = clamp((s - W) / max(T - 1 - W, 1), 0, 1)       (decay progress: 0 at s = W, 1 at s = T - 1)
                 constant  eta
                 linear    eta * (rho + (1 - rho) * (1 - p))
                 cosine    eta * (rho + (1 - rho) * (1 + cos(pi * p)) / 2)

    so the last step runs at rho * eta (with rho = 0 its update is zero) and steps past T stay there."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min lr ratio {min_ratio} must be in [0, 1]")
    if step < warmup:
        return base_lr * ((step + 1) / warmup)
    if schedule == "constant":
        return base_lr
    p = min(max((step - warmup) / max(total - 1 - warmup, 1), 0.0), 1.0)
    decay = 1.0 - p if schedule == "linear" else (1.0 + math.cos(math.pi * p)) / 2
    return base_lr * (min_ratio + (1.0 - min_ratio) * decay)
