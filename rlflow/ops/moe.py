"""Mixture-of-experts routing and grouped expert computation.

Legend: N tokens, D model dim, E experts, K top-k, F expert hidden dim.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from rlflow.ops import registry


def route(x_ND: Tensor, gate_ED: Tensor, top_k: int, norm_topk_prob: bool, *,
          with_aux: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax top-k routing (Qwen3-MoE). Returns (weights_NK in x's dtype, experts_NK, aux_loss).

    p = softmax(x W_g^T) in float32; keep the top-k; renormalize them to sum 1 when ``norm_topk_prob``.
    aux_loss is the Switch-Transformer load-balancing loss  E * sum_e f_e * P_e, with f_e the fraction
    of (token, slot) assignments to expert e and P_e the mean router probability of e, over the N tokens
    given (the caller drops padding first; a zero scalar when ``with_aux`` is False).
    """
    logits_NE = F.linear(x_ND, gate_ED)
    fused = registry.run("route_logits", logits_NE.device, logits_NE, top_k, norm_topk_prob, with_aux)
    if fused is not None:
        return fused[0].to(x_ND.dtype), fused[1], x_ND.new_zeros((), dtype=torch.float32)
    return route_logits_reference(logits_NE, top_k, norm_topk_prob, with_aux, x_ND.dtype)


@registry.reference("route_logits")
def route_logits_reference(logits_NE: Tensor, top_k: int, norm_topk_prob: bool, with_aux: bool,
                           dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``route`` from the router logits [N, E]; the weights in ``dtype``."""
    probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
    w_NK, idx_NK = torch.topk(probs_NE, top_k, dim=-1)
    if norm_topk_prob:
        w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
    if not with_aux:
        return w_NK.to(dtype), idx_NK, logits_NE.new_zeros((), dtype=torch.float32)
    E = logits_NE.shape[1]
    with torch.no_grad():
        onehot_NE = torch.zeros_like(probs_NE).scatter_(1, idx_NK, 1.0)
    f_E = onehot_NE.mean(0) / top_k
    p_E = probs_NE.mean(0)
    aux = E * (f_E * p_E).sum()
    return w_NK.to(dtype), idx_NK, aux


def route_grouped(x_ND: Tensor, gate_ED: Tensor, bias_E: Tensor, top_k: int, n_group: int, topk_group: int,
                  norm_topk_prob: bool, scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    """DeepSeek-V3's routing (``noaux_tc``). Returns (weights_NK in x's dtype, experts_NK, a zero aux loss).

    s = sigmoid(x W_g^T) in float32. The selection uses s + bias (the load-balancing bias, trained by
    no gradient): the E experts form ``n_group`` groups, a group scores the sum of its two best, the
    ``topk_group`` best groups are kept and the top-k experts chosen among theirs. The weights are the
    unbiased s of the chosen experts, renormalized when ``norm_topk_prob``, times ``scaling``. Balance
    comes from the bias, not from a loss: the aux loss is zero.
    """
    N, E = x_ND.shape[0], gate_ED.shape[0]
    s_NE = F.linear(x_ND.float(), gate_ED.float()).sigmoid()
    with torch.no_grad():
        choice = s_NE + bias_E.float()
        if n_group > 1:
            group_NG = choice.view(N, n_group, E // n_group).topk(2, dim=-1)[0].sum(-1)
            keep_NG = torch.zeros_like(group_NG, dtype=torch.bool).scatter_(
                1, group_NG.topk(topk_group, dim=-1)[1], True)
            choice = choice.masked_fill(~keep_NG.repeat_interleave(E // n_group, 1), float("-inf"))
        idx_NK = choice.topk(top_k, dim=-1)[1]
    w_NK = s_NE.gather(1, idx_NK)
    if norm_topk_prob:
        w_NK = w_NK / (w_NK.sum(-1, keepdim=True) + 1e-20)
    return (w_NK * scaling).to(x_ND.dtype), idx_NK, x_ND.new_zeros((), dtype=torch.float32)


def replay_routes(x_ND: Tensor, gate_ED: Tensor, idx_NK: Tensor, replay_NK: Tensor, *, sigmoid: bool,
                  norm_topk_prob: bool, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """Rollout Routing Replay (R3): each token whose ``replay_NK`` row is set (>= 0) goes to those experts
    instead of its own top-k ``idx_NK``; every token's weights are the current router's probabilities
    (softmax, or DeepSeek's sigmoid) gathered at its experts, normalized as ``route`` / ``route_grouped``
    normalize them, so the router keeps its gradient. Returns (weights_NK in x's dtype, experts_NK)."""
    idx = torch.where(replay_NK >= 0, replay_NK.long(), idx_NK)
    logits = F.linear(x_ND.float(), gate_ED.float())
    p_NE = logits.sigmoid() if sigmoid else torch.softmax(logits, dim=-1)
    w = p_NE.gather(1, idx)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
    return (w * scaling).to(x_ND.dtype), idx


# Few tokens (decode) on small experts: every expert runs on every token in a few large kernels and the
# top-k weights (zero elsewhere) combine them. E/K times the FLOPs of routing, but no host sync and no
# per-expert launches, which is what bounds a decode step of small experts. Only when N*K >= E (all
# experts are read anyway) and a layer's experts are small; otherwise experts run on their own tokens.
DENSE_MAX_TOKENS = 256
DENSE_MAX_EXPERT_BYTES = 16 * 2**20


def moe_experts(x_ND: Tensor, w_NK: Tensor, idx_NK: Tensor, gate_up_E2FD: Tensor, down_EDF: Tensor, *,
                prepared: tuple | None = None) -> Tensor:
    """sum_k w_nk * down_e(silu(gate_e x_n) * up_e x_n) with e = idx_nk.

    Many tokens, or large experts: the N*K (token, slot) pairs are sorted by expert so each expert runs
    one matmul over a contiguous block of its tokens (one grouped GEMM for all experts where torch has
    it, see ``_grouped_mm_ok``; else a loop over experts). Few tokens on small experts
    (see DENSE_MAX_TOKENS), when N*K >= E: all experts on all tokens, weighted by the sparse routing
    weights. A device's fused entry may do better (the CPU's: each token through its own experts in one
    kernel, given ``prepared``: what ``prepare_experts`` returned for these weights).
    """
    fused = registry.run("moe_experts", x_ND.device, x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF, prepared)
    return fused if fused is not None else moe_experts_reference(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF)


@registry.reference("moe_experts")
def moe_experts_reference(x_ND: Tensor, w_NK: Tensor, idx_NK: Tensor, gate_up_E2FD: Tensor, down_EDF: Tensor
                          ) -> Tensor:
    if dense_fits(idx_NK, gate_up_E2FD, down_EDF):
        return _moe_dense(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF)
    return _moe_grouped(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF)


def dense_fits(idx_NK: Tensor, gate_up_E2FD: Tensor, down_EDF: Tensor) -> bool:
    """Few tokens on small experts, with every expert read anyway (N*K >= E): the dense path (no host sync)."""
    N, K = idx_NK.shape
    return N <= DENSE_MAX_TOKENS and _small(gate_up_E2FD, down_EDF) and N * K >= gate_up_E2FD.shape[0]


def prepare_experts(gate_up_E2FD: Tensor, down_EDF: Tensor) -> tuple | None:
    """What the inference path of ``moe_experts(prepared=...)`` wants of a layer's expert weights, computed
    once per rollout (``decoder.fuse_for_inference``) and opaque to the caller; None where no
    inference kernel would use it, so nothing is copied for nothing (the device's ``prepare_experts``
    entry decides: today the CPU small-experts kernel's transposed weights)."""
    return registry.run("prepare_experts", gate_up_E2FD.device, gate_up_E2FD, down_EDF)


def _small(gate_up_E2FD: Tensor, down_EDF: Tensor) -> bool:
    """A layer's experts within ``DENSE_MAX_EXPERT_BYTES``."""
    return (gate_up_E2FD.numel() + down_EDF.numel()) * gate_up_E2FD.element_size() <= DENSE_MAX_EXPERT_BYTES


def _moe_dense(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF, swiglu=None):
    """All experts on all tokens; ``swiglu(gu [M, 2F], w [M])``, a fused ``silu(g) * u * w`` (None where it
    does not apply), from a backend."""
    E, F2, D = gate_up_E2FD.shape
    N = x_ND.shape[0]
    gu = F.linear(x_ND, gate_up_E2FD.reshape(E * F2, D))  # [N, E * 2F]
    w_NE = torch.zeros(N, E, dtype=w_NK.dtype, device=w_NK.device).scatter_(1, idx_NK, w_NK)
    a_NEF = None if swiglu is None else swiglu(gu.view(N * E, F2), w_NE.view(-1))
    if a_NEF is None:
        g, u = gu.view(N, E, F2).chunk(2, dim=-1)  # [N, E, F]
        a_NEF = F.silu(g) * u * w_NE[:, :, None]  # routing weight 0 for experts a token does not use
    a_NEF = a_NEF.view(N, E, F2 // 2)
    return torch.bmm(a_NEF.transpose(0, 1), down_EDF.transpose(1, 2)).sum(0)  # [E, N, D] summed over E


def _grouped_mm_ok(x: Tensor, down_EDF: Tensor) -> bool:
    """torch's grouped GEMM (jagged groups by device-side offsets) on the CPU, with rows of D and F elements
    a multiple of 16 bytes (its kernel's constraint). CUDA's (and a dry run's) is the CUDA backend's entry's
    choice, the NPU's its own kernel; the loop runs where no entry applies."""
    _, D, Fd = down_EDF.shape
    return (hasattr(F, "grouped_mm") and registry.computes_as(x) == "cpu"  # public from torch 2.10
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            # under torch.compile (the compiled decode step): its shape check admits bfloat16 only
            and (x.dtype == torch.bfloat16 or not torch.compiler.is_compiling())
            and (D * x.element_size()) % 16 == 0 and (Fd * x.element_size()) % 16 == 0)


def _moe_grouped(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF, fused_f32=None):
    """Experts on their own tokens; ``fused_f32`` (from a backend): the same in float32 with fused
    kernels, or None where they do not apply."""
    if (registry.computes_as(x_ND) == "cpu" and x_ND.dtype in (torch.bfloat16, torch.float16)
            and not torch.compiler.is_compiling() and _small(gate_up_E2FD, down_EDF)):
        # On the CPU, oneDNN compiles a half-precision GEMM kernel for every new shape (~5 ms each), and
        # the experts' token counts, hence the per-expert GEMM shapes, change with every batch: the
        # bf16 update of the e2e workload (tiny experts) took 400-450 ms per step against 140 ms with
        # the experts in float32 (MKL, no per-shape compilation). Only for small experts, whose
        # conversion is cheap and whose GEMMs are short next to a compilation; not in a torch.compile
        # graph (static shapes, and its grouped GEMM wants bfloat16).
        return _moe_grouped(x_ND.float(), w_NK.float(), idx_NK, gate_up_E2FD.float(), down_EDF.float(),
                            fused_f32).to(x_ND.dtype)
    y = None if fused_f32 is None else fused_f32(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF)
    if y is not None:
        return y
    N, K = idx_NK.shape
    E = gate_up_E2FD.shape[0]
    flat = idx_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    xs = x_ND.index_select(0, tok)  # [N*K, D], grouped by expert (backward: index_add, not index_put)
    counts = torch.bincount(flat, minlength=E)
    w_sorted = w_NK.reshape(-1).index_select(0, order)
    if _grouped_mm_ok(x_ND, down_EDF):  # one kernel per projection over all experts, no host sync
        offs = counts.cumsum(0).to(torch.int32)
        g, u = F.grouped_mm(xs, gate_up_E2FD.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        ys = F.grouped_mm(F.silu(g) * u, down_EDF.transpose(1, 2), offs=offs)
    else:
        counts = counts.tolist()
        outs = []
        for e, xe in enumerate(torch.split(xs, counts)):  # split, not slices: its backward is one cat
            if counts[e] or (e == E - 1 and not outs):  # no token at all (an ep rank whose experts none chose):
                g, u = F.linear(xe, gate_up_E2FD[e]).chunk(2, dim=-1)  # an empty block, zero gradients
                outs.append(F.linear(F.silu(g) * u, down_EDF[e]))
        ys = torch.cat(outs)
    return torch.zeros_like(x_ND).index_add_(0, tok, ys * w_sorted[:, None])
