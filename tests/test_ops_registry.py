"""The ops registry: every CPU operator passes torch.library.opcheck (schema, fake implementation, autograd
registration, AOT dispatch); the torch reference runs wherever a fused entry is unavailable or declines;
the CUDA entries (plain torch, run here on CPU tensors) equal the references without host syncs; the
NPU entries reach torch_npu's functions with the documented arguments (a stand-in module: wiring only)."""

import sys
import types

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import moe_reference

from rlflow import ops
from rlflow.ops import PrefixLayout, moe, registry
from rlflow.ops.backends import cpu, cuda

needs_kernels = pytest.mark.skipif(not cpu.available(), reason="CPU kernels unavailable (RLFLOW_CPU_KERNELS=0 or no compiler)")


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _opcheck_cases():
    g = _g()
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    cos, sin = ops.rope_cos_sin(torch.arange(6), 16, 1e4, torch.float32)
    qkv = r(6, 4, 16)
    pvalid = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.uint8)
    rvalid = torch.tensor([[1, 1], [1, 0], [1, 1]], dtype=torch.uint8)
    row_start = torch.tensor([0, 2, 3])
    qk, v = r(12, 3, 8), r(12, 1, 8)
    o, lse = torch.ops.rlflow.prefix_attention(qk, v, 2, pvalid, rvalid, row_start)
    idx = torch.tensor([[0, 1], [1, 2], [2, 0]])
    order, tok, inv, offs = torch.ops.rlflow.moe_plan(idx, 3)
    logits = r(5, 4)
    w5, idx5, probs = torch.ops.rlflow.route(logits, 2, True)
    x, w = r(5, 16), r(16)
    _, rstd = torch.ops.rlflow.rmsnorm(x, w, 1e-6)
    norm = r(3, 16)
    _, _, rstd_qk = torch.ops.rlflow.qk_norm_rope(qkv, norm, cos, sin, 3, 1e-6)
    gu_t, dn_t = r(3, 16, 64), r(3, 32, 16)
    grad = lambda t: t.clone().requires_grad_(True)  # noqa: E731
    return {
        "swiglu_weighted": (grad(r(5, 32)), grad(torch.rand(5, generator=g))),
        "swiglu_weighted_backward": (r(5, 32), torch.rand(5, generator=g), r(5, 16)),
        "rmsnorm": (grad(x), grad(w), 1e-6),
        "rmsnorm_backward": (x, w, rstd, r(5, 16)),
        "qk_norm_rope": (grad(qkv), grad(norm), cos, sin, 3, 1e-6),
        "qk_norm_rope_backward": (qkv, norm, cos, sin, rstd_qk, r(6, 3, 16), r(6, 1, 16), 3),
        "prefix_attention": (grad(qk), grad(v), 2, pvalid, rvalid, row_start),
        "prefix_attention_backward": (qk, v, 2, pvalid, rvalid, row_start, o, lse, r(12, 2, 8)),
        "moe_small_experts": (r(3, 16), torch.rand(3, 2, generator=g), idx, gu_t, dn_t),
        "route": (grad(logits), 2, True),
        "route_backward": (probs, idx5, w5, r(5, 2), True),
        "moe_plan": (idx, 3),
        "gather_rows": (grad(r(3, 8)), tok, inv, 2),
        "combine_rows": (grad(r(6, 8)), tok, inv, 2),
        "counter_noise": (torch.tensor([3, -7, 1 << 62]), torch.tensor([0, 5, 2]), 40),
    }


OPS = ("swiglu_weighted", "swiglu_weighted_backward", "rmsnorm", "rmsnorm_backward", "qk_norm_rope",
       "qk_norm_rope_backward", "prefix_attention", "prefix_attention_backward", "moe_small_experts", "route",
       "route_backward", "moe_plan", "gather_rows", "combine_rows", "counter_noise")


@needs_kernels
@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    cases = _opcheck_cases()
    assert set(cases) == set(OPS)
    torch.library.opcheck(getattr(torch.ops.rlflow, name).default, cases[name])


@needs_kernels
def test_operators_trace_on_the_meta_device():
    """The fake implementations give the ops' shapes without running a kernel (meta tensors)."""
    x, w = torch.empty(4, 7, 32, device="meta"), torch.empty(32, device="meta")
    y, rstd = torch.ops.rlflow.rmsnorm(x, w, 1e-6)
    assert y.shape == x.shape and rstd.shape == (28,) and y.device.type == "meta"
    assert ops.rmsnorm(x, w, 1e-6).shape == x.shape  # the op itself: no meta entry, the reference


def test_the_reference_runs_where_the_fused_entry_is_unavailable(monkeypatch):
    """No kernels (as with RLFLOW_CPU_KERNELS=0 or a failed build): every CPU entry declines, the ops give
    their references' results, and no kernel runs."""
    monkeypatch.setattr(cpu, "available", lambda: False)
    before = cpu.calls()
    g = _g(1)
    x, w = torch.randn(6, 16, generator=g), torch.randn(16, generator=g)
    assert registry.lookup("rmsnorm", "cpu")(x, w, 1e-6) is None
    assert torch.equal(ops.rmsnorm(x, w, 1e-6), registry.get_reference("rmsnorm")(x, w, 1e-6))
    xs, gate_up, down = torch.randn(9, 16, generator=g), torch.randn(4, 16, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    wk, idx = torch.softmax(torch.randn(9, 4, generator=g), -1).topk(2, -1)
    assert ops.prepare_experts(gate_up, down) is None
    assert torch.equal(ops.moe_experts(xs, wk, idx, gate_up, down), moe.moe_experts_reference(xs, wk, idx, gate_up, down))
    wr, ir, _ = ops.route(xs, torch.randn(4, 16, generator=g), 2, True, with_aux=False)
    assert wr.shape == (9, 2) and ir.shape == (9, 2)
    assert cpu.calls() == before


def test_unknown_device_kinds_have_no_fused_entries():
    assert registry.lookup("rmsnorm", "mps") is None
    with pytest.raises(ValueError):
        registry.fused("rmsnorm", "tpu")
    table = registry.table()
    assert table["moe_experts"].keys() == table["rmsnorm"].keys() == {"cpu", "cuda", "npu", "meta"}
    assert table["prefix_attention"].keys() == {"cpu", "cuda", "npu"}


def test_disabled_by_environment_the_suite_path():
    """RLFLOW_CPU_KERNELS=0 in a fresh process: the backend says why, and the ops still answer."""
    import subprocess
    import os
    env = dict(os.environ, RLFLOW_CPU_KERNELS="0")
    script = ("import torch\nfrom rlflow import ops\nfrom rlflow.ops.backends import cpu\n"
              "y = ops.rmsnorm(torch.ones(2, 16), torch.ones(16), 1e-6)\n"
              "print(cpu.available(), cpu.unavailable_reason, round(float(y.sum()), 3))")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "RLFLOW_CPU_KERNELS=0", "32.0"]


# ---- CUDA entries (plain torch) on CPU tensors ----

@pytest.mark.parametrize("mode", ["sort_and_index", "sort_and_index_chunked", "grouped_mm"])
@settings(max_examples=8)
@given(N=st.integers(1, 20), E=st.integers(1, 6), K=st.integers(1, 3), skew=st.booleans(), seed=st.integers(0, 99))
def test_cuda_moe_paths_equal_the_reference(mode, N, E, K, skew, seed):
    K = min(K, E)
    g = _g(seed)
    D, Fd = 8, 4
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    gate_up, down = torch.randn(E, 2 * Fd, D, generator=g).double(), torch.randn(E, D, Fd, generator=g).double()
    scores = torch.randn(N, E, generator=g)
    if skew:
        scores[:, :K] += 100
    w, idx = torch.softmax(scores, -1).topk(K, -1)
    w = w.double()
    if mode == "grouped_mm":  # torch's CPU grouped GEMM: float32
        x, w, gate_up, down = (t.float() for t in (x, w, gate_up, down))
    leaves = [t.clone().requires_grad_(True) for t in (x, w, gate_up, down)]
    chunk = E * 2 * Fd * x.element_size() * 3 if mode == "sort_and_index_chunked" else cuda.CHUNK_BYTES  # 3 tokens
    y = cuda.moe_experts_nosync(leaves[0], leaves[1], idx, leaves[2], leaves[3], grouped_mm=mode == "grouped_mm",
                                chunk_bytes=chunk)
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, w, gate_up, down)]
    ref = moe_reference(ref_leaves[0], ref_leaves[1], idx, ref_leaves[2], ref_leaves[3])
    tol = 1e-4 if mode == "grouped_mm" else 1e-10
    torch.testing.assert_close(y, ref, atol=tol, rtol=tol)
    gy = torch.randn(N, D, generator=g, dtype=x.dtype)
    for a, b in zip(torch.autograd.grad(y, leaves, gy), torch.autograd.grad(ref, ref_leaves, gy)):
        torch.testing.assert_close(a, b, atol=tol * 10, rtol=tol * 10)


def test_cuda_moe_sort_and_index_has_no_host_sync():
    """Traced whole by dynamo (fullgraph): no .tolist(), .item() or data-dependent shape on the way."""
    g = _g(3)
    x, gate_up, down = torch.randn(12, 16, generator=g), torch.randn(4, 16, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    w, idx = torch.softmax(torch.randn(12, 4, generator=g), -1).topk(2, -1)
    f = torch.compile(lambda *a: cuda.moe_experts_nosync(*a, grouped_mm=False), backend="eager", fullgraph=True)
    torch.testing.assert_close(f(x, w, idx, gate_up, down), moe_reference(x, w, idx, gate_up, down), atol=1e-4, rtol=1e-4)


class _Ops(TorchDispatchMode):
    """The ops dispatched within it, by name."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
def test_cuda_rmsnorm_is_torchs_fused_kernel_within_a_rounding_of_the_reference(dtype, rtol):
    """Values and gradients (the fused kernel rounds once, the reference twice: a unit of the last place in
    bfloat16; CPU tensors: torch decomposes the kernel here, as it computes); a weight over [heads, d] is declined
    (it normalizes the last dim alone)."""
    g = _g(11)
    x, w = (torch.randn(3, 5, 64, generator=g) * 3).to(dtype), (1 + torch.randn(64, generator=g) / 4).to(dtype)
    dy = torch.randn(3, 5, 64, generator=g).to(dtype)

    def run(f):
        leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
        y = f(*leaves, 1e-6)
        return [y, *torch.autograd.grad(y, leaves, dy)]

    (y, gx, gw), ref = run(cuda.rmsnorm), run(registry.get_reference("rmsnorm"))
    for a, b in zip((y, gx, gw), ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol * (4 if a is gw else 1),
                                   atol=rtol * b.float().abs().max().item() * (4 if a is gw else 1))
    assert cuda.rmsnorm(x.view(3, 5, 4, 16), w.view(4, 16), 1e-6) is None


def test_a_dry_runs_decode_step_runs_the_fused_rmsnorm():
    """Under inference mode (a decode step); with autograd, torch's CPU build decomposes the kernel (into the
    reference's ops: the dry update is priced as the reference's)."""
    x = torch.empty(8, 64, device="meta", dtype=torch.bfloat16)
    w = torch.empty(64, device="meta", dtype=torch.bfloat16)
    with _Ops() as mode, torch.inference_mode():
        ops.rmsnorm(x, w, 1e-6)
    assert "aten._fused_rms_norm.default" in mode.seen and "aten.rsqrt.default" not in mode.seen, mode.seen


@pytest.mark.parametrize("dtype, kernel", [(torch.bfloat16, "aten._grouped_mm.default"),
                                           (torch.float32, "aten.bmm.default")])
def test_a_dry_runs_experts_take_the_cuda_entrys_kernels_not_one_per_expert(dtype, kernel):
    """Meta tensors posing as an accelerator (a dry run's default) run CUDA's expert path, forward and backward:
    one grouped GEMM per projection in bfloat16, the sort-and-index batched matmuls otherwise; as many ops for
    32 experts as for 4, where the reference's loop issues a few per expert."""
    def issued(E):
        N, K, D, Fd = 512, 2, 64, 32  # 512 tokens: not the dense path of few tokens
        leaf = lambda *s: torch.empty(*s, device="meta", dtype=dtype, requires_grad=True)  # noqa: E731
        x, gate_up, down = leaf(N, D), leaf(E, 2 * Fd, D), leaf(E, D, Fd)
        w, idx = torch.empty(N, K, device="meta", dtype=dtype), torch.empty(N, K, device="meta", dtype=torch.long)
        with _Ops() as mode:
            ops.moe_experts(x, w, idx, gate_up, down).sum().backward()
        assert gate_up.grad.shape == gate_up.shape and down.grad.shape == down.shape
        return mode.seen

    few, many = issued(4), issued(32)
    assert len(few) == len(many) and kernel in few, (len(few), len(many), sorted(set(few)))


@settings(max_examples=15)
@given(counts=st.lists(st.integers(0, 4), min_size=1, max_size=4).filter(lambda c: sum(c) > 0),
       Tp=st.integers(1, 7), R=st.integers(1, 6), heads=st.sampled_from([(1, 1), (4, 2), (6, 3), (4, 1)]),
       seed=st.integers(0, 99))
def test_shared_prompt_attention_without_copies_equals_the_reference(counts, Tp, R, heads, seed):
    """The CUDA/NPU prefix_attention entry (the prompt's keys scored once per prompt, never repeated per
    row) against the two-SDPA reference in float64, values and gradients, on every token."""
    H, K = heads
    g = _g(seed)
    P, B, d = len(counts), sum(counts), 8
    counts_P = torch.tensor(counts)
    pvalid = torch.arange(Tp)[None] >= torch.randint(0, Tp + 1, (P, 1), generator=g)
    rvalid = torch.arange(R)[None] < torch.randint(0, R + 1, (B, 1), generator=g)
    N = P * Tp + B * R
    qk, v = torch.randn(N, H + K, d, generator=g).double(), torch.randn(N, K, d, generator=g).double()
    dout = torch.randn(N, H, d, generator=g).double()
    entry = registry.lookup("prefix_attention", "cuda")
    assert entry is registry.lookup("prefix_attention", "npu")

    def run(f):
        leaves = [qk.clone().requires_grad_(True), v.clone().requires_grad_(True)]
        out = f(*leaves, H, PrefixLayout(pvalid, rvalid, counts_P))
        return [out, *torch.autograd.grad(out, leaves, dout)]

    for a, b in zip(run(entry), run(registry.get_reference("prefix_attention"))):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


# ---- NPU entries: wiring against a stand-in torch_npu ----

class _FakeNPU(types.ModuleType):
    """Records (function, args, kwargs); returns tensors of the documented shapes."""

    def __init__(self):
        super().__init__("torch_npu")
        self.calls = []

    def _rec(self, name, args, kwargs):
        self.calls.append((name, args, kwargs))

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        self._rec("npu_rms_norm", (x, gamma), {"epsilon": epsilon})
        return torch.zeros_like(x), torch.zeros(x.shape[:-1])

    def npu_rotary_mul(self, x, r1, r2):
        self._rec("npu_rotary_mul", (x, r1, r2), {})
        return torch.zeros_like(x)

    def npu_fusion_attention(self, q, k, v, head_num, input_layout, **kw):
        self._rec("npu_fusion_attention", (q, k, v, head_num, input_layout), kw)
        return (torch.zeros_like(q), None, None, None, 0, 0, 0)

    def npu_moe_gating_top_k_softmax(self, x, finished=None, k=1):
        self._rec("npu_moe_gating_top_k_softmax", (x, finished), {"k": k})
        y, i = torch.softmax(x.float(), -1).topk(k, -1)
        return y, i.int(), torch.zeros_like(i, dtype=torch.int32)

    def npu_moe_init_routing(self, x, row_idx, expert_idx, active_num):
        self._rec("npu_moe_init_routing", (x, row_idx, expert_idx, active_num), {})
        M = expert_idx.numel()
        return x.new_zeros(M, x.shape[1]), torch.zeros(M, dtype=torch.int32), torch.zeros(M, dtype=torch.int32)

    def npu_grouped_matmul(self, x, weight, **kw):
        """What the documentation says of one x and one weight, groups by cumulative ends (``group_list``):
        group_type 0, x's rows in groups, each times its weight [K, N] (split_item 2: one [M, N]); group_type 2,
        the contraction in groups, x [K, M] and weight [M, N] (split_item 3: one [G, K, N])."""
        self._rec("npu_grouped_matmul", (x, weight), kw)
        (a,), (b,), ends = x, weight, kw["group_list"].tolist()
        starts = [0, *ends[:-1]]
        if kw["group_type"] == 0 and kw["split_item"] == 2:
            return [torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))])]
        assert kw["group_type"] == 2 and kw["split_item"] == 3, kw
        return [torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])]

    def npu_moe_finalize_routing(self, rows, skip1, skip2, bias, scales, src_to_dst, expert_for_row):
        self._rec("npu_moe_finalize_routing", (rows, skip1, skip2, bias, scales, src_to_dst, expert_for_row), {})
        return rows.new_zeros(scales.shape[0], rows.shape[1])


@pytest.fixture
def fake_npu(monkeypatch):
    fake = _FakeNPU()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


def test_npu_entries_call_torch_npu_with_the_documented_arguments(fake_npu):
    g = _g(5)
    entry = lambda name: registry.lookup(name, "npu")  # noqa: E731  (the registry's pick for an npu tensor)
    x, w = torch.randn(3, 5, 16, generator=g), torch.randn(16, generator=g)
    entry("rmsnorm")(x, w, 1e-5)
    name, (a, b), kw = fake_npu.calls[-1]
    assert name == "npu_rms_norm" and a is x and b is w and kw == {"epsilon": 1e-5}

    qk = torch.randn(2, 5, 3, 16, generator=g)  # [B, T, heads, d]
    cos, sin = ops.rope_cos_sin(torch.arange(5).expand(2, 5), 16, 1e4, torch.float32)
    entry("apply_rope")(qk, cos, sin)
    name, (a, r1, r2), _ = fake_npu.calls[-1]
    assert name == "npu_rotary_mul" and a.shape == (2, 5, 3, 16) and r1.shape == r2.shape == (2, 5, 1, 16)
    torch.testing.assert_close(r2[..., 0, :8], -sin[..., :8])  # the plain sin: rotate-half's sign unfolded
    torch.testing.assert_close(r2[..., 0, 8:], sin[..., 8:])

    q, k, v = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    mask = ops.causal_padding_mask(torch.ones(2, 5, dtype=torch.bool), 0, 5)
    entry("attention")(q, k, v, mask, is_causal=True)
    name, (a, b, c, heads, layout), kw = fake_npu.calls[-1]
    assert name == "npu_fusion_attention" and (a, b, c) == (q, k, v) and heads == 4 and layout == "BNSD"
    assert torch.equal(kw["atten_mask"], ~mask) and kw["scale"] == 16 ** -0.5
    entry("attention")(q, k, v, None, is_causal=True)
    assert torch.equal(fake_npu.calls[-1][2]["atten_mask"], torch.ones(5, 5, dtype=torch.bool).triu(1))

    logits = torch.randn(6, 4, generator=g)
    with torch.no_grad():
        wk, idx = entry("route_logits")(logits, 2, True, False)
    name, (a, finished), kw = fake_npu.calls[-1]
    assert name == "npu_moe_gating_top_k_softmax" and finished is None and kw == {"k": 2}
    assert idx.dtype == torch.int64 and torch.allclose(wk.sum(-1), torch.ones(6))
    assert entry("route_logits")(logits, 2, True, True) is None  # the aux loss needs every probability

    N, E, D, Fd = 6, 4, 16, 8
    xs, gate_up, down = torch.randn(N, D, generator=g), torch.randn(E, 2 * Fd, D, generator=g), torch.randn(E, D, Fd, generator=g)
    assert entry("prepare_experts") is None  # nothing to prepare: the weights go as transposed views
    fake_npu.calls.clear()
    with torch.inference_mode():
        entry("moe_experts")(xs, wk, idx, gate_up, down, None)
    assert [c[0] for c in fake_npu.calls] == ["npu_moe_init_routing", "npu_grouped_matmul", "npu_grouped_matmul",
                                              "npu_moe_finalize_routing"]
    (_, (a, row_idx, eidx, active), _), (_, (x1, w1), kw1), (_, (x2, w2), _), (_, fin, _) = fake_npu.calls
    assert a is xs and active == N and eidx.dtype == torch.int32 and torch.equal(eidx, idx.int())
    assert torch.equal(row_idx, torch.arange(N * 2, dtype=torch.int32).view(2, N).t())  # the documented layout
    assert w1[0].shape == (E, D, 2 * Fd) and w2[0].shape == (E, Fd, D) and x2[0].shape == (N * 2, Fd)
    assert w1[0].data_ptr() == gate_up.data_ptr() and w2[0].data_ptr() == down.data_ptr()  # views: no copy
    assert torch.equal(kw1["group_list"], torch.bincount(idx.reshape(-1), minlength=E).cumsum(0))
    assert kw1["split_item"] == 2 and kw1["group_type"] == 0
    assert fin[1] is None and fin[2] is None and fin[3] is None and torch.equal(fin[4], wk) and torch.equal(fin[6], idx.int())
    assert entry("moe_experts")(xs, wk, idx, gate_up.requires_grad_(True), down, None) is None  # float32


@pytest.mark.parametrize("skew", [False, True])
def test_the_npu_experts_train_through_the_grouped_matmul_and_its_two_backward_calls(fake_npu, skew):
    """Under autograd (bfloat16), the NPU's ``moe_experts`` runs torch's sort and ``npu_grouped_matmul``
    forward, and two more per projection backward, with the documented arguments; values and gradients are
    the reference's, with the stand-in computing what the documentation says (``skew``: experts no token chose)."""
    g = _g(7)
    N, E, K, D, Fd = 10, 4, 2, 16, 8
    scores = torch.randn(N, E, generator=g)
    if skew:
        scores[:, :K] += 100
    w, idx = torch.softmax(scores, -1).topk(K, -1)
    base = [torch.randn(N, D, generator=g), w, torch.randn(E, 2 * Fd, D, generator=g) / 4,
            torch.randn(E, D, Fd, generator=g) / 4]
    leaves = [t.bfloat16().requires_grad_(True) for t in base]
    y = registry.lookup("moe_experts", "npu")(leaves[0], leaves[1], idx, leaves[2], leaves[3], None)
    dy = torch.randn(N, D, generator=g)
    grads = torch.autograd.grad(y, leaves, dy.bfloat16())
    calls = [(c[0], c[2]["group_type"], c[2]["split_item"]) for c in fake_npu.calls]
    gmm = ("npu_grouped_matmul", 0, 2)
    assert calls == [gmm, gmm, gmm, ("npu_grouped_matmul", 2, 3), gmm, ("npu_grouped_matmul", 2, 3)], calls
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = moe_reference(ref_leaves[0], ref_leaves[1], idx, ref_leaves[2], ref_leaves[3])
    torch.testing.assert_close(y.double(), ref, atol=3e-2, rtol=3e-2)
    for a, b in zip(grads, torch.autograd.grad(ref, ref_leaves, dy.double())):
        torch.testing.assert_close(a.double(), b, atol=5e-2, rtol=5e-2)


def _computing_fusion(calls):
    """A stand-in ``npu_fusion_attention`` computing what the documentation says (BNSD or BSND; True in
    ``atten_mask``: may NOT attend), recording (layout, q, k, v) of each call."""
    def fusion(q, k, v, head_num, layout, *, atten_mask=None, scale=1.0, keep_prob=1.0):
        calls.append((layout, q, k, v))
        if layout == "BSND":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        rep = head_num // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None if atten_mask is None else ~atten_mask, scale=scale)
        return (out.transpose(1, 2).contiguous() if layout == "BSND" else out,)
    return fusion


def test_the_npu_attention_takes_projections_as_they_lie(monkeypatch):
    """Queries, keys and values that are views of [B, S, N, d] projections (each token's heads side by side, rows
    of a fused projection) go to the kernel as BSND, uncopied, and its output comes back a view in the layout the
    output projection reads: the reference's attention and gradients; a KV cache's [B, N, S, d] keys go as BNSD."""
    calls = []
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_fusion_attention=_computing_fusion(calls)))
    g = _g(12)
    qkv = torch.randn(2, 5, 4 + 2 + 2, 16, generator=g, requires_grad=True)  # a fused projection's rows
    q, k, v = (t.transpose(1, 2) for t in qkv.split([4, 2, 2], dim=2))
    mask = ops.causal_padding_mask(torch.tensor([[True] * 5, [False, True, True, True, True]]), 0, 5)
    out = registry.lookup("attention", "npu")(q, k, v, mask, scale=0.3)
    ref = registry.get_reference("attention")(q, k, v, mask, scale=0.3)
    (layout, a, b, c), = calls
    assert layout == "BSND" and [t.data_ptr() for t in (a, b, c)] == [t.data_ptr() for t in (q, k, v)]
    assert out.shape == (2, 4, 5, 16) and out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out, ref)
    dy = torch.randn(out.shape, generator=g)
    torch.testing.assert_close(torch.autograd.grad(out, qkv, dy)[0], torch.autograd.grad(ref, qkv, dy)[0])
    cache = torch.randn(2, 2, 7, 16, generator=g)  # [B, K, S, d]
    registry.lookup("attention", "npu")(q[:, :, -1:], cache, cache, None)
    assert calls[-1][0] == "BNSD"


@pytest.mark.parametrize("K", [4, 1])
def test_the_npu_attention_takes_mlas_narrower_values_padded_to_the_queries_width(monkeypatch, K):
    """DeepSeek's values (128 wide against 192 for its queries; ``K``: MLA's absorbed decode attends one latent
    head) reach the fused kernel padded with zeros and come back sliced: the reference's attention and its
    gradients, with a stand-in computing what the documentation says (True in ``atten_mask``: may NOT attend)."""
    calls = []
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_fusion_attention=_computing_fusion(calls)))
    g = _g(11)
    q, k, v = (torch.randn(2, h, 5, w, generator=g, requires_grad=True) for h, w in ((4, 24), (K, 24), (K, 16)))
    mask = ops.causal_padding_mask(torch.tensor([[True] * 5, [False, True, True, True, True]]), 0, 5)
    out = registry.lookup("attention", "npu")(q, k, v, mask, scale=0.3)
    ref = registry.get_reference("attention")(q, k, v, mask, scale=0.3)
    assert [c[3].shape[-1] for c in calls] == [24] and out.shape == (2, 4, 5, 16)
    torch.testing.assert_close(out, ref)
    dy = torch.randn(out.shape, generator=g)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dy), torch.autograd.grad(ref, (q, k, v), dy)):
        torch.testing.assert_close(a, b)


def test_npu_entries_decline_without_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError
    x, w = torch.randn(2, 16), torch.randn(16)
    assert registry.lookup("rmsnorm", "npu")(x, w, 1e-6) is None


@needs_kernels
def test_counter_noise_kernel_matches_the_reference_and_is_batch_invariant():
    """The CPU kernel computes the reference's integers (so the same draws up to float32 log rounding), and a
    row's noise depends only on its key, position and the token id: a sub-batch draws the same values."""
    keys = ops.counter_keys(11, torch.arange(37) * 977)
    pos = torch.randint(0, 50, (37,), generator=_g(2))
    got = ops.counter_noise(keys, pos, 129)
    ref = registry.get_reference("counter_noise")(keys, pos, 129)
    assert got.shape == (37, 129) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6)
    assert torch.equal(ops.counter_noise(keys[5:9], pos[5:9], 129), got[5:9])
    u = torch.exp(-got)  # Exp(1) -> U(0, 1)
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(got.mean()) - 1.0) < 0.03
    a, b = ops.counter_noise(keys, pos, 2048), ops.counter_noise(keys, pos + 1, 2048)  # the next position: fresh
    assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.03  # draws (6 sigma)
