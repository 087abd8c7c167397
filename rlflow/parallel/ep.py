"""Expert parallelism: all-to-all token dispatch to the ranks holding the experts, grouped expert compute
with ``rlflow.ops.moe``, all-to-all combine, routing weights applied at the source.

Legend: N tokens of this rank, K top-k, D model dim, E experts, El = E / ep local experts, R rows
(token, slot) pairs received, F expert hidden dim, Fl = F / tp.

Who holds what: ep rank j holds experts [j El, (j+1) El) (spec ``P("ep", ...)`` on the ``experts`` dim);
every ep rank has its own tokens (the batch is split over ``("dp", "ep")``), routes them with the
replicated gate, and sends each (token, slot) pair to the rank owning its expert.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlflow.ops import moe_experts
from rlflow.parallel.collectives import all_to_all, all_to_all_rows, exchange_counts, group_size


def moe(x_ND: Tensor, w_NK: Tensor, idx_NK: Tensor, gate_up_El2FD: Tensor, down_EDF: Tensor, num_experts: int,
        group) -> Tensor:
    """sum_k w_nk expert_{idx_nk}(x_n) with the experts sharded over ``group`` (the ``ep`` group).

    x, w, idx: this rank's tokens (rows). Returns [N, D] rows in x's order. With the experts' hidden dim
    sharded over tp (``gate_up`` [El, 2 Fl, D], ``down`` [El, D, Fl]) the result is partial over tp; the
    caller enters with ``copy_to`` on x and w and leaves with ``reduce_from``.

    1. sort the N K pairs by expert (hence by owning rank), count pairs per rank, exchange the counts;
    2. all_to_all the pairs' inputs [N K, D] -> [R, D] and their local expert ids (no grad);
    3. ``moe_experts`` on the R rows, one slot each with weight 1 (grouped by expert);
    4. all_to_all the outputs back (the reverse splits), weight by w, sum each token's K slots.
    Backward: each all_to_all's backward is the reverse all_to_all of the gradient."""
    n = group_size(group)
    if n == 1:
        return moe_experts(x_ND, w_NK, idx_NK, gate_up_El2FD, down_EDF)
    N, K = idx_NK.shape
    El = num_experts // n
    if El * n != num_experts or gate_up_El2FD.shape[0] != El:
        raise ValueError(f"ep.moe: {num_experts} experts over ep={n} ranks must give {num_experts // n} "
                         f"local experts; got a local shard of {gate_up_El2FD.shape[0]}")
    flat = idx_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    dest = flat[order] // El
    # counted with index_add_: CUDA's bincount reads its input's maximum on the host
    send = torch.zeros(n, dtype=torch.int64, device=dest.device).index_add_(0, dest, torch.ones_like(dest))
    recv = exchange_counts(send, group)
    s_splits, r_splits = torch.stack([send, recv]).tolist()  # the splits all_to_all needs, in one read
    x_RD = all_to_all(x_ND[tok], r_splits, s_splits, group)
    e_R = all_to_all_rows(flat[order] - dest * El, r_splits, s_splits, group)
    y_RD = moe_experts(x_RD, x_RD.new_ones(x_RD.shape[0], 1), e_R[:, None], gate_up_El2FD, down_EDF)
    y = all_to_all(y_RD, s_splits, r_splits, group) * w_NK.reshape(-1)[order, None]
    return torch.zeros_like(x_ND).index_add(0, tok, y)


__all__ = ["moe"]
