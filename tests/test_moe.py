"""The expert computation's three paths (dense, grouped GEMM, per-expert loop) equal a per-token reference,
values and gradients, for any routing (including experts no token reaches)."""

import pytest
import torch
from helpers import moe_reference
from hypothesis import given, settings, strategies as st

from rlflow.ops import moe


@pytest.mark.parametrize("path", ["dense", "grouped_mm", "loop"])
@settings(max_examples=15, deadline=None)
@given(N=st.integers(1, 12), E=st.integers(1, 6), K=st.integers(1, 3), skew=st.booleans(), seed=st.integers(0, 99))
def test_expert_paths_equal_the_per_tokenmoe_reference(path, N, E, K, skew, seed):
    K = min(K, E)
    g = torch.Generator().manual_seed(seed)
    D, Fd = 8, 4  # rows of 32 and 16 bytes: grouped_mm's alignment
    x = torch.randn(N, D, generator=g, dtype=torch.float32)
    gate_up, down = torch.randn(E, 2 * Fd, D, generator=g), torch.randn(E, D, Fd, generator=g)
    scores = torch.randn(N, E, generator=g)
    if skew:  # every token prefers the same experts: the others get no tokens
        scores[:, :K] += 100
    w, idx = torch.softmax(scores, -1).topk(K, -1)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, gate_up, down)]
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, w, gate_up, down)]
    if path == "dense":
        y = moe._moe_dense(leaves[0], leaves[1], idx, leaves[2], leaves[3])
    else:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(moe, "_grouped_mm_ok", lambda *_: path == "grouped_mm")
            y = moe._moe_grouped(leaves[0], leaves[1], idx, leaves[2], leaves[3])
    ref = moe_reference(ref_leaves[0], ref_leaves[1], idx, ref_leaves[2], ref_leaves[3])
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    gy = torch.randn(N, D, generator=g)
    for a, b in zip(torch.autograd.grad(y, leaves, gy), torch.autograd.grad(ref, ref_leaves, gy)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", ["grouped_mm", "loop"])
def test_no_token_at_all_is_an_empty_block_with_zero_gradients(path):
    """An ep rank whose experts no token chose (few tokens, a decode step) runs its experts on nothing: an empty
    output, and zero gradients for its experts (not an error, nor a missing gradient)."""
    D, Fd, E, K = 8, 4, 4, 2
    gate_up, down = torch.randn(E, 2 * Fd, D, requires_grad=True), torch.randn(E, D, Fd, requires_grad=True)
    x, w = torch.randn(0, D, requires_grad=True), torch.ones(0, K)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "_grouped_mm_ok", lambda *_: path == "grouped_mm")
        y = moe.moe_experts_reference(x, w, torch.zeros(0, K, dtype=torch.long), gate_up, down)
    assert y.shape == (0, D)
    y.sum().backward()
    assert torch.equal(gate_up.grad, torch.zeros_like(gate_up)) and torch.equal(down.grad, torch.zeros_like(down))


def test_grouped_gemm_only_where_its_alignment_holds():
    x = torch.randn(4, 8)
    assert moe._grouped_mm_ok(x, torch.randn(2, 8, 4))
    assert not moe._grouped_mm_ok(x[:, :5], torch.randn(2, 5, 3))  # 20- and 12-byte rows: the loop
    assert not moe._grouped_mm_ok(x.double(), torch.randn(2, 8, 4).double())


def test_half_precision_experts_on_cpu_run_in_float32():
    """bf16/fp16 on the CPU, small experts: the grouped path computes in float32 (oneDNN would compile a
    half-precision kernel for each batch's new per-expert shapes) and returns the input dtype; gradients
    keep theirs. Large experts stay in half precision (converting them would cost more)."""
    g = torch.Generator().manual_seed(0)
    N, E, K, D, Fd = 40, 4, 2, 16, 8
    for dtype in (torch.bfloat16, torch.float16):
        x, gate_up, down = (torch.randn(*s, generator=g).to(dtype) for s in ((N, D), (E, 2 * Fd, D), (E, D, Fd)))
        w, idx = torch.softmax(torch.randn(N, E, generator=g), -1).topk(K, -1)
        leaves = [t.clone().requires_grad_(True) for t in (x, w.to(dtype), gate_up, down)]
        y = moe._moe_grouped(*leaves[:2], idx, *leaves[2:])
        assert y.dtype == dtype
        want = moe._moe_grouped(x.float(), w.to(dtype).float(), idx, gate_up.float(), down.float()).to(dtype)
        assert torch.equal(y, want)
        grads = torch.autograd.grad(y.float().square().sum(), leaves)
        assert [t.dtype for t in grads] == [dtype] * 4
        assert all(bool(t.abs().sum() > 0) for t in grads)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "DENSE_MAX_EXPERT_BYTES", 0)  # as if the experts were large
        y = moe._moe_grouped(x, w.to(dtype), idx, gate_up, down)
        assert not torch.equal(y, want)  # computed in half precision: other rounding


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_compile(dtype):
    """The compiled decode step reaches the grouped path with few slots (N*K < E) or many (N > 256):
    under torch.compile it must trace (torch's grouped GEMM is traceable for bfloat16 only) and agree
    with eager."""
    g = torch.Generator().manual_seed(0)
    N, E, K, D, Fd = 2, 8, 2, 16, 8
    x, gate_up, down = (torch.randn(*s, generator=g).to(dtype) for s in ((N, D), (E, 2 * Fd, D), (E, D, Fd)))
    w, idx = torch.softmax(torch.randn(N, E, generator=g), -1).topk(K, -1)
    w = w.to(dtype)
    want = moe.moe_experts(x, w, idx, gate_up, down)
    got = torch.compile(moe.moe_experts, dynamic=False)(x, w, idx, gate_up, down)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
