"""The kernels of the stood-in torch_npu (``dryrun.npu.FakeTorchNPU``) as ``torch.library`` ops of namespace
``rlflow_npu``: each one op in a trace, as on the device one kernel, its outputs shaped (and strided: an
element-wise kernel's output is laid out as its input, ``empty_like``) as torch_npu's meta registrations shape them
(a fake implementation: no kernel runs anywhere; called on real tensors they raise) and
its FLOPs counted by ``cost.FLOPS`` (attention and the grouped matmul; the rest move bytes), so that a fake NPU's
trace prices as the device's program."""

import functools
from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from rlflow.dryrun import cost

NS = "rlflow_npu"


def _op(name: str, fake):
    """Op ``rlflow_npu::name`` whose fake implementation is ``fake`` (its signature the op's schema)."""
    @functools.wraps(fake)  # its signature: the op's schema
    def real(*args, **kwargs):
        raise RuntimeError(f"{NS}::{name}: a stood-in NPU kernel, for fake tensors only (dryrun.npu)")
    op = torch.library.custom_op(f"{NS}::{name}", real, mutates_args=())
    op.register_fake(fake)
    return op


def _fusion_attention(q: Tensor, k: Tensor, v: Tensor, head_num: int, layout: str, mask: Optional[Tensor]
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """BNSD or BSND: the output (in the query's layout) and the softmax's max and sum per query ([B, N, S1, 8]
    float32 each)."""
    stats = (q.shape[0], head_num, q.shape[2 if layout == "BNSD" else 1], 8)
    return (torch.empty_like(q).contiguous(), q.new_empty(stats, dtype=torch.float32),
            q.new_empty(stats, dtype=torch.float32))


def _fusion_attention_grad(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, smax: Tensor, ssum: Tensor,
                           layout: str, mask: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _rms_norm(x: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor]:
    """The output and the reciprocal RMS (float32, the normalized dims kept as ones)."""
    lead = x.shape[:x.dim() - gamma.dim()]
    return torch.empty_like(x), x.new_empty((*lead, *[1] * gamma.dim()), dtype=torch.float32)


def _rms_norm_grad(dy: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(gamma)


def _rotary_mul(x: Tensor, r1: Tensor, r2: Tensor) -> Tensor:
    return torch.empty_like(x)


def _rotary_mul_grad(dy: Tensor, x: Tensor, r1: Tensor, r2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(r1), torch.empty_like(r2)


def _grouped_matmul(x: Tensor, weight: Tensor, group_list: Tensor, group_type: int) -> Tensor:
    """group_type 0: x's rows [M, K] in groups, weight [E, K, N] -> [M, N]; 2: the contraction in groups, x [K, M],
    weight [M, N] -> [G, K, N]."""
    if group_type == 0:
        return x.new_empty(x.shape[0], weight.shape[-1])
    return x.new_empty(group_list.numel(), x.shape[0], weight.shape[-1])


def _moe_init_routing(x: Tensor, row_idx: Tensor, expert_idx: Tensor, active_num: int
                      ) -> tuple[Tensor, Tensor, Tensor]:
    N, K = expert_idx.shape
    return (x.new_empty(min(N, active_num) * K, x.shape[-1]), x.new_empty(N * K, dtype=torch.int32),
            x.new_empty(N * K, dtype=torch.int32))


def _moe_finalize_routing(rows: Tensor, scales: Tensor, src_to_dst: Tensor, expert_for_row: Tensor) -> Tensor:
    return rows.new_empty(scales.shape[0], rows.shape[1])


fusion_attention = _op("fusion_attention", _fusion_attention)
fusion_attention_grad = _op("fusion_attention_grad", _fusion_attention_grad)
rms_norm = _op("rms_norm", _rms_norm)
rms_norm_grad = _op("rms_norm_grad", _rms_norm_grad)
rotary_mul = _op("rotary_mul", _rotary_mul)
rotary_mul_grad = _op("rotary_mul_grad", _rotary_mul_grad)
grouped_matmul = _op("grouped_matmul", _grouped_matmul)
moe_init_routing = _op("moe_init_routing", _moe_init_routing)
moe_finalize_routing = _op("moe_finalize_routing", _moe_finalize_routing)


def _bnsd(t: Tensor, layout: str) -> tuple[int, ...]:
    return tuple(t.shape) if layout == "BNSD" else (t.shape[0], t.shape[2], t.shape[1], t.shape[3])


def _heads(q: Tensor, k: Tensor, v: Tensor, layout: str):
    """The attention's BNSD shapes with the key and value heads as many as the query's (the kernel's work)."""
    (B, N, S1, d), (_, _, S2, _), (_, _, _, dv) = (_bnsd(t, layout) for t in (q, k, v))
    return (B, N, S1, d), (B, N, S2, d), (B, N, S2, dv)


def _attention_flops(args, out) -> tuple[int, str, int]:
    qs, ks, vs = _heads(*args[:3], args[4])
    return sdpa_flop_count(qs, ks, vs), *cost.mm_kernel(qs[2], qs[3], ks[2])


def _attention_grad_flops(args, out) -> tuple[int, str, int]:
    qs, ks, vs = _heads(*args[1:4], args[7])
    return sdpa_backward_flop_count((*qs[:3], vs[3]), qs, ks, vs), *cost.mm_kernel(qs[2], qs[3], ks[2])


def _grouped_flops(args, out) -> tuple[int, str, int]:
    x, w, group_list, group_type = args
    if group_type == 0:  # [M, K] in G groups times [G, K, N]
        M, K = x.shape
        return 2 * M * K * w.shape[-1], "grouped_mm", min(M // max(w.shape[0], 1), K, w.shape[-1])
    K, M = x.shape  # [K, M] times [M, N], M in G groups
    return 2 * K * M * w.shape[-1], "grouped_mm_k", min(K, M // max(group_list.numel(), 1), w.shape[-1])


cost.FLOPS.update({f"{NS}.fusion_attention": _attention_flops, f"{NS}.fusion_attention_grad": _attention_grad_flops,
                   f"{NS}.grouped_matmul": _grouped_flops})


__all__ = ["NS", "fusion_attention", "fusion_attention_grad", "grouped_matmul", "moe_finalize_routing",
           "moe_init_routing", "rms_norm", "rms_norm_grad", "rotary_mul", "rotary_mul_grad"]
