"""The fused float32 CPU kernels (rlflow/ops/backends/cpu_kernels.c, as torch operators) equal the torch ops they replace, values and
gradients, computed in float64 as the reference; the callers fall back to torch ops where the kernels
cannot take the tensors; and the model's forward + backward with the kernels equals it without them."""

import collections
import functools
import os
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.utils import cpp_extension

from rlflow.ops import PrefixLayout, apply_rope, moe, prefix_attention, qk_norm_rope, rmsnorm, rope_cos_sin
from rlflow.ops.backends import cpu as cpu_kernels
from rlflow.ops.norm import rmsnorm as norm_module_rmsnorm

# Skipped only where the kernels cannot be built at all; where they can, a failed build fails
# test_the_kernels_build instead of turning every test here into a skip.
CAN_BUILD = (platform.system() == "Linux" and os.environ.get("RLFLOW_CPU_KERNELS", "1") != "0"
             and bool(os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++"))
             and cpp_extension.is_ninja_available())
pytestmark = pytest.mark.skipif(not CAN_BUILD,
                                reason="RLFLOW_CPU_KERNELS=0, no C++ compiler or ninja, or not Linux: torch ops run")


def test_the_kernels_build():
    assert cpu_kernels.available()


class _Calls:
    """The C kernels run since this was made (by name; counted by the operators in C++, so calls from a
    compiled graph count too)."""

    def __init__(self, monkeypatch=None):
        self.start = cpu_kernels.calls()

    @property
    def n(self) -> collections.Counter:
        return cpu_kernels.calls() - self.start


def _close(a, b, tol=2e-5):
    a, b = a.detach().double(), b.detach().double()
    err = float((a - b).abs().max()) if a.numel() else 0.0
    assert err <= tol * max(1.0, float(b.abs().max())) if b.numel() else True, err


def _grads(f, inputs, dout):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = f(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    douts = dout if isinstance(dout, tuple) else (dout,)
    gs = torch.autograd.grad(outs, leaves, [d.to(o.dtype) for o, d in zip(outs, douts)], allow_unused=True)
    return outs, gs


def _experts(g, N, E, D, Fd):
    """x [N, D], gate_up [E, 2F, D], down [E, D, F] from the generator g."""
    return torch.randn(N, D, generator=g), torch.randn(E, 2 * Fd, D, generator=g), torch.randn(E, D, Fd, generator=g)


def _ref_swiglu(gu, w):
    g, u = gu.chunk(2, -1)
    return F.silu(g) * u * w[:, None]


@settings(max_examples=20)
@given(n=st.integers(1, 70), f8=st.integers(1, 4), scale=st.sampled_from([0.1, 3.0, 60.0]), seed=st.integers(0, 99))
def test_swiglu_weighted_equals_torch(n, f8, scale, seed):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(n, 16 * f8, generator=g) * scale  # large |g|: exp's clamping (silu(-60) ~ 0, silu(60) = 60)
    w = torch.rand(n, generator=g)
    dout = torch.randn(n, 8 * f8, generator=g)
    (ours,), g_ours = _grads(cpu_kernels.swiglu_weighted, (gu, w), dout)
    (ref,), g_ref = _grads(_ref_swiglu, (gu.double(), w.double()), dout)
    _close(ours, ref)
    for a, b in zip(g_ours, g_ref):
        _close(a, b)


@settings(max_examples=20)
@given(lead=st.sampled_from([(5,), (3, 7), (1,), (2, 1, 4), (301,), (3, 130)]), d8=st.integers(1, 17),
       seed=st.integers(0, 99),
       eps=st.sampled_from([1e-6, 1e-2]))
def test_rmsnorm_equals_torch(lead, d8, seed, eps):
    g = torch.Generator().manual_seed(seed)
    d = 8 * d8
    x = torch.randn(*lead, d, generator=g) * 2
    w = torch.randn(d, generator=g)
    dout = torch.randn(*lead, d, generator=g)
    (ours,), g_ours = _grads(lambda a, b: cpu_kernels.rmsnorm(a, b, eps), (x, w), dout)
    (ref,), g_ref = _grads(lambda a, b: norm_module_rmsnorm(a, b, eps), (x.double(), w.double()), dout)
    _close(ours, ref)
    for a, b in zip(g_ours, g_ref):
        _close(a, b)


def _ref_qk_norm_rope(qkv, norm, cos, sin, hk, eps):
    qk, v = qkv.split([hk, qkv.shape[-2] - hk], -2)
    if norm is not None:
        qk = norm_module_rmsnorm(qk, norm, eps)
    return apply_rope(qk, cos, sin), v


@pytest.mark.parametrize("with_norm", [True, False])
@settings(max_examples=12)
@given(lead=st.sampled_from([(9,), (3, 5), (1, 1), (200,)]), heads=st.sampled_from([(2, 1), (4, 2), (6, 2)]),
       d=st.sampled_from([16, 32, 64]), seed=st.integers(0, 99))
def test_qk_norm_rope_equals_torch(with_norm, lead, heads, d, seed):
    H, K = heads
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(*lead, H + 2 * K, d, generator=g)
    norm = torch.randn(H + K, d, generator=g) if with_norm else None
    pos = torch.randint(0, 300, lead[:-1] + (lead[-1],), generator=g)
    cos, sin = rope_cos_sin(pos, d, 10000.0, torch.float32)
    dqk, dv = torch.randn(*lead, H + K, d, generator=g), torch.randn(*lead, K, d, generator=g)
    inputs = (qkv,) + ((norm,) if with_norm else ())
    if with_norm:
        ours, g_ours = _grads(lambda a, b: cpu_kernels.qk_norm_rope(a, b, cos, sin, H + K, 1e-6), inputs, (dqk, dv))
        ref, g_ref = _grads(lambda a, b: _ref_qk_norm_rope(a, b, cos.double(), sin.double(), H + K, 1e-6),
                            tuple(t.double() for t in inputs), (dqk, dv))
    else:
        ours, g_ours = _grads(lambda a: cpu_kernels.qk_norm_rope(a, None, cos, sin, H + K, 1e-6), inputs, (dqk, dv))
        ref, g_ref = _grads(lambda a: _ref_qk_norm_rope(a, None, cos.double(), sin.double(), H + K, 1e-6),
                            tuple(t.double() for t in inputs), (dqk, dv))
    for a, b in zip(ours, ref):
        _close(a, b)
    for a, b in zip(g_ours, g_ref):
        _close(a, b)


@settings(max_examples=15)
@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=4).filter(lambda c: sum(c) > 0),
       Tp=st.integers(1, 12), R=st.integers(1, 24), heads=st.sampled_from([(1, 1), (4, 2), (6, 3), (4, 1), (4, 4)]),
       d=st.sampled_from([8, 16, 24, 32, 64]), seed=st.integers(0, 99))
def test_prefix_attention_equals_torch(counts, Tp, R, heads, d, seed):
    """The packed shared-prompt attention kernel against the two-SDPA reference in float64, on every token
    (padding too: the same every-token-sees-itself rule; prompts and rows of padding only, prompts without
    rows), values and gradients."""
    H, K = heads
    g = torch.Generator().manual_seed(seed)
    P, B = len(counts), sum(counts)
    counts_P = torch.tensor(counts)
    pvalid = torch.arange(Tp)[None] >= torch.randint(0, Tp + 1, (P, 1), generator=g)  # left-padded
    rvalid = torch.arange(R)[None] < torch.randint(0, R + 1, (B, 1), generator=g)  # right-padded
    N = P * Tp + B * R
    qk, v = torch.randn(N, H + K, d, generator=g), torch.randn(N, K, d, generator=g)
    dout = torch.randn(N, H, d, generator=g)
    plan = cpu_kernels.prefix_plan(pvalid, rvalid, counts_P)
    assert cpu_kernels.prefix_attention_kernel(qk, v, H, plan) is not None
    (ours,), g_ours = _grads(lambda a, b: cpu_kernels.prefix_attention_kernel(a, b, H, plan), (qk, v), dout)
    layout = PrefixLayout(pvalid, rvalid, counts_P)  # float64: the torch path
    (ref,), g_ref = _grads(lambda a, b: prefix_attention(a, b, H, layout), (qk.double(), v.double()), dout)
    _close(ours, ref)
    for a, b in zip(g_ours, g_ref):
        _close(a, b)


def test_prefix_attention_with_more_query_heads_per_kv_head_than_a_backward_tile():
    """33 query heads on one kv head: a tile of the backward is one token's heads, more than its usual size."""
    test_prefix_attention_equals_torch.hypothesis.inner_test(counts=[2, 1], Tp=3, R=4, heads=(33, 1), d=8, seed=0)


@settings(max_examples=20)
@given(N=st.integers(1, 40), E=st.integers(1, 9), K=st.integers(1, 3),
       dims=st.sampled_from([(16, 16), (48, 32), (64, 64)]),
       skew=st.booleans(), seed=st.integers(0, 99))
def test_moe_small_experts_equals_the_reference(N, E, K, dims, skew, seed):
    """Routed experts for inference against the per-expert loop in float64: any routing (experts with no
    token, one expert with them all: partial tiles), from the weights ``prepare_experts`` gives."""
    K = min(K, E)
    D, Fd = dims
    g = torch.Generator().manual_seed(seed)
    x, gate_up, down = _experts(g, N, E, D, Fd)
    scores = torch.randn(N, E, generator=g)
    if skew:
        scores[:, :K] += 100
    w, idx = torch.softmax(scores, -1).topk(K, -1)
    t = moe.prepare_experts(gate_up, down)
    with torch.inference_mode():
        ours = cpu_kernels.moe_small_experts(x, w, idx, *t)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "_grouped_mm_ok", lambda *_: False)
        ref = moe._moe_grouped(x.double(), w.double(), idx, gate_up.double(), down.double())
    _close(ours, ref, 1e-5)


def test_qk_norm_rope_is_an_extern_kernel_of_a_compiled_decode_graph():
    """Inside torch.compile the q/k norm and rotary run as the operator (inductor would otherwise recompute
    the rotary tables' cos and sin for every head of every layer in its fused kernels), with the torch
    reference's values."""
    calls = _Calls()
    g = torch.Generator().manual_seed(0)
    B, H, K, d = 16, 4, 2, 32
    qkv, norm = torch.randn(B, 1, H + 2 * K, d, generator=g), torch.rand(H + K, d, generator=g) + 0.5
    pos = torch.randint(0, 100, (B, 1), generator=g)

    def step(qkv, norm, pos):
        cos, sin = rope_cos_sin(pos, d, 10000.0, torch.float32)
        return qk_norm_rope(qkv, norm, cos, sin, H + K, 1e-6)
    f = torch.compile(step, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        got = f(qkv, norm, pos)
        assert calls.n["qk_norm_rope_fwd"] == 1
        cos, sin = rope_cos_sin(pos, d, 10000.0, torch.float32)
        ref = _ref_qk_norm_rope(qkv.double(), norm.double(), cos.double(), sin.double(), H + K, 1e-6)
    for a, b in zip(got, ref):
        _close(a, b)


def test_moe_small_experts_in_a_compiled_graph_and_only_without_gradients(monkeypatch):
    calls = _Calls(monkeypatch)
    g = torch.Generator().manual_seed(0)
    N, E, K, D, Fd = 24, 8, 2, 64, 64
    x, gate_up, down = _experts(g, N, E, D, Fd)
    w, idx = torch.softmax(torch.randn(N, E, generator=g), -1).topk(K, -1)
    t = moe.prepare_experts(gate_up, down)
    f = torch.compile(lambda *a: moe.moe_experts(*a, prepared=t), fullgraph=True, dynamic=False)
    with torch.inference_mode():
        y = f(x, w, idx, gate_up, down)
        assert calls.n["moe_small_fwd"] >= 1  # the custom op ran inside the compiled graph
        _close(y, cpu_kernels.moe_small_experts(x, w, idx, *t), 1e-6)
        for bad in (8, -1):
            with pytest.raises(ValueError, match="expert ids must be in"):
                cpu_kernels.moe_small_experts(x, w, torch.full_like(idx, bad), *t)
        assert cpu_kernels.moe_small_experts(x, w[:, :0], idx[:, :0], *t) is None  # no slots
    assert cpu_kernels.moe_small_experts(x.requires_grad_(True), w, idx, *t) is None  # training takes the grouped path
    assert moe.prepare_experts(gate_up.double(), down.double()) is None


@pytest.mark.parametrize("norm", [True, False])
@settings(max_examples=15)
@given(N=st.integers(1, 50), E=st.integers(1, 12), k=st.integers(1, 4), seed=st.integers(0, 99))
def test_route_equals_torch(norm, N, E, k, seed):
    """Softmax top-k routing: the same experts in the same order as torch.topk, weights and the logits'
    gradient against float64."""
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g) * 3
    dw = torch.randn(N, k, generator=g)

    def ref(lg):
        w, idx = torch.softmax(lg, -1).topk(k, -1)
        return (w / w.sum(-1, keepdim=True) if norm else w), idx

    w_ours, idx_ours = cpu_kernels.route(logits, k, norm)
    _, idx_ref = ref(logits)
    assert torch.equal(idx_ours, idx_ref)
    (w1,), g_ours = _grads(lambda lg: cpu_kernels.route(lg, k, norm)[0], (logits,), dw)
    (w2,), g_ref = _grads(lambda lg: ref(lg)[0], (logits.double(),), dw)
    _close(w1, w2)
    _close(g_ours[0], g_ref[0])


@settings(max_examples=15)
@given(N=st.integers(1, 40), E=st.integers(1, 9), K=st.integers(1, 3), skew=st.booleans(), seed=st.integers(0, 99))
def test_moe_plan_gather_and_combine(N, E, K, skew, seed):
    """The counting sort equals torch's stable argsort; gather_rows / combine_rows and their gradients equal
    index_select / index_add."""
    K = min(K, E)
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(N, E, generator=g)
    if skew:
        scores[:, :K] += 100
    idx = scores.topk(K, -1).indices
    order, tok, inv, offs = cpu_kernels.moe_plan(idx, E)
    ref_order = torch.argsort(idx.reshape(-1), stable=True)
    assert torch.equal(order, ref_order) and torch.equal(tok, ref_order // K)
    assert torch.equal(inv[order], torch.arange(N * K))
    assert torch.equal(offs, torch.bincount(idx.reshape(-1), minlength=E).cumsum(0).to(torch.int32))
    for bad_E, bad_idx in ((int(idx.max()), idx), (E, idx - 1 - idx.max())):  # an id >= E; ids < 0
        with pytest.raises(ValueError, match="expert ids must be in"):
            cpu_kernels.moe_plan(bad_idx, bad_E)
    x, ys = torch.randn(N, 16, generator=g), torch.randn(N * K, 16, generator=g)
    d1, d2 = torch.randn(N * K, 16, generator=g), torch.randn(N, 16, generator=g)
    (a,), ga = _grads(lambda t: cpu_kernels.gather_rows(t, tok, inv, K), (x,), d1)
    (b,), gb = _grads(lambda t: t.index_select(0, tok), (x.double(),), d1)
    _close(a, b)
    _close(ga[0], gb[0])
    (a,), ga = _grads(lambda t: cpu_kernels.combine_rows(t, tok, inv, K), (ys,), d2)
    (b,), gb = _grads(lambda t: torch.zeros(N, 16, dtype=t.dtype).index_add(0, tok, t), (ys.double(),), d2)
    _close(a, b)
    _close(ga[0], gb[0])


def test_only_grads_of_used_outputs():
    """A backward that reaches only q/k (v unused) or only v: the missing gradient counts as zero."""
    qkv = torch.randn(6, 4, 16, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(6), 16, 10000.0, torch.float32)
    qk, v = cpu_kernels.qk_norm_rope(qkv, None, cos, sin, 3, 1e-6)
    (gv,) = torch.autograd.grad(v.sum(), qkv)
    assert torch.equal(gv[:, :3], torch.zeros(6, 3, 16)) and torch.equal(gv[:, 3:], torch.ones(6, 1, 16))


def test_callers_fall_back_where_the_kernels_do_not_apply():
    x = torch.randn(6, 12)  # 12: not a multiple of 8
    assert cpu_kernels.rmsnorm(x, torch.ones(12), 1e-6) is None
    _close(rmsnorm(x, torch.ones(12), 1e-6), norm_module_rmsnorm(x.double(), torch.ones(12).double(), 1e-6))
    assert cpu_kernels.rmsnorm(torch.randn(8, 16).t(), torch.ones(8), 1e-6) is None  # not contiguous
    assert cpu_kernels.rmsnorm(torch.randn(4, 16, dtype=torch.float64), torch.ones(16, dtype=torch.float64),
                               1e-6) is None
    assert cpu_kernels.swiglu_weighted(torch.randn(4, 24), torch.rand(4)) is None  # F = 12
    qkv = torch.randn(5, 4, 8)  # head dim 8: halves of 4
    cos, sin = rope_cos_sin(torch.arange(5), 8, 10000.0, torch.float32)
    assert cpu_kernels.qk_norm_rope(qkv, None, cos, sin, 3, 1e-6) is None
    for d in (512, 528):  # the kernel's per-head scratch holds 512 floats
        big = torch.randn(3, 2, d)
        c, s_ = rope_cos_sin(torch.arange(3), d, 10000.0, torch.float32)
        assert (cpu_kernels.qk_norm_rope(big, None, c, s_, 1, 1e-6) is None) == (d > 512)
    one = lambda *shape: torch.ones(*shape, dtype=torch.bool)  # noqa: E731
    # negative group counts: no plan, so the torch path runs (and raises)
    assert cpu_kernels.prefix_plan(one(2, 1), one(5, 1), torch.tensor([6, -1])) is None
    qk, v = qk_norm_rope(qkv, None, cos, sin, 3, 1e-6)  # the ops-level function still answers
    _close(qk, apply_rope(qkv[:, :3], cos, sin))
    assert torch.equal(v, qkv[:, 3:])


@pytest.mark.parametrize("path", ["dense", "grouped_mm"])
def test_expert_paths_with_the_kernel_equal_the_reference(path, monkeypatch):
    """The MoE paths that use ``swiglu_weighted`` (F a multiple of 8), values and gradients against float64."""
    g = torch.Generator().manual_seed(0)
    N, E, K, D, Fd = 37, 5, 2, 16, 8
    x, gate_up, down = _experts(g, N, E, D, Fd)
    w, idx = torch.softmax(torch.randn(N, E, generator=g), -1).topk(K, -1)
    if path == "dense":
        f = functools.partial(moe._moe_dense, swiglu=cpu_kernels.swiglu_weighted)
    else:
        f = functools.partial(moe._moe_grouped, fused_f32=cpu_kernels.moe_grouped_f32)
    assert path == "dense" or cpu_kernels.moe_grouped_f32(x, w, idx, gate_up, down) is not None  # the kernels' path
    dout = torch.randn(N, D, generator=g)
    calls = _Calls(monkeypatch)
    (ours,), g_ours = _grads(lambda *a: f(a[0], a[1], idx, a[2], a[3]), (x, w, gate_up, down), dout)
    assert calls.n["swiglu_fwd"] and calls.n["swiglu_bwd"]
    monkeypatch.undo()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "_grouped_mm_ok", lambda *_: False)  # the per-expert loop in float64: torch ops only
        (ref,), g_ref = _grads(lambda *a: moe._moe_grouped(a[0], a[1], idx, a[2], a[3]),
                               tuple(t.double() for t in (x, w, gate_up, down)), dout)
    _close(ours, ref, 1e-4)
    for a, b in zip(g_ours, g_ref):
        _close(a, b, 1e-4)


def test_model_forward_backward_with_and_without_kernels():
    """The tiny preset's shared-prompt forward + backward (what the update runs) in float32, with the kernels
    and with torch ops, against float64: the kernels' rounding is of the same order as the torch ops'."""
    from rlflow.models import prefix
    from rlflow.models.config import get_config
    from rlflow.models.decoder import init_params

    cfg = get_config("qwen3-moe-tiny")
    params = init_params(cfg, seed=1, std=0.2)
    g = torch.Generator().manual_seed(0)
    P, Tp, G, R = 4, 8, 8, 10  # 352 tokens: the grouped expert path (more than DENSE_MAX_TOKENS)
    prompt = torch.randint(3, cfg.vocab_size, (P, Tp), generator=g)
    pvalid = torch.ones(P, Tp, dtype=torch.bool)
    pvalid[0, :2] = False
    resp = torch.randint(3, cfg.vocab_size, (P * G, R), generator=g)
    rvalid = torch.ones(P * G, R, dtype=torch.bool)
    rvalid[1, 3:] = False
    counts = torch.full((P,), G)

    def run(dtype):
        leaves = {k: v.to(dtype).requires_grad_(True) for k, v in params.items()}
        last, h = prefix.forward(leaves, cfg, prompt, pvalid, counts, resp, rvalid)
        loss = (last.square().sum() + (h * rvalid[..., None]).square().sum())
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)  # lm_head: unused
        return [last, h] + [torch.zeros(()) if gr is None else gr for gr in grads]

    with pytest.MonkeyPatch.context() as mp:
        calls = _Calls(mp)
        with_k = run(torch.float32)
    ran = {k for k, v in calls.n.items() if v}
    assert {"rmsnorm_fwd", "rmsnorm_bwd", "qk_norm_rope_fwd", "qk_norm_rope_bwd", "prefix_attn_fwd",
            "prefix_attn_bwd", "router_fwd", "router_bwd", "moe_plan", "gather_sum", "swiglu_fwd",
            "swiglu_bwd"} <= ran, ran
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernels, "usable", lambda *_, **__: False)
        without = run(torch.float32)
    ref = run(torch.float64)
    for a, b, r in zip(with_k, without, ref):
        scale = max(1.0, float(r.abs().max()))
        err_k, err_t = float((a.double() - r).abs().max()) / scale, float((b.double() - r).abs().max()) / scale
        assert err_k <= 4 * err_t + 1e-6, (err_k, err_t)  # rounding of the same order


def test_disabled_by_environment():
    env = dict(os.environ, RLFLOW_CPU_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", "from rlflow.ops.backends import cpu; print(cpu.available())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not cpu_kernels.available(), reason=cpu_kernels.unavailable_reason or "")
def test_a_build_killed_midway_does_not_hang_the_next_run(tmp_path):
    """A process killed while cpp_extension built the kernels left its ``lock`` file, and every later run
    waited on it forever (with no message). The build lock is an OS lock that dies with its holder; holding
    it, the next run removes the stale file and loads the kernels."""
    cache = tmp_path / "cache"
    for d in os.listdir(cpu_kernels.cache_dir()):  # this machine's builds (a copy: the next load is quick)
        if d.startswith("cpu_ops_") and os.path.isdir(os.path.join(cpu_kernels.cache_dir(), d)):
            shutil.copytree(os.path.join(cpu_kernels.cache_dir(), d), cache / d)
            (cache / d / "lock").write_text("")  # what a killed builder leaves
    assert any(cache.iterdir())
    env = dict(os.environ, RLFLOW_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-c", "from rlflow.ops.backends import cpu; print(cpu.available())"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]
    assert "left by a kernel build that was killed" in out.stderr


def _double_backward_cases():
    g = torch.Generator().manual_seed(0)
    cos, sin = rope_cos_sin(torch.arange(6), 16, 10000.0, torch.float32)
    counts, pvalid, rvalid = torch.tensor([2]), torch.ones(1, 3, dtype=torch.bool), torch.ones(2, 2, dtype=torch.bool)
    idx = torch.tensor([[0, 1], [1, 2], [2, 0]])
    _, tok, inv, _ = cpu_kernels.moe_plan(idx, 3)
    return {
        "rmsnorm": (lambda x: cpu_kernels.rmsnorm(x, torch.ones(16), 1e-6), (6, 16)),
        "swiglu": (lambda x: cpu_kernels.swiglu_weighted(x, torch.rand(6, generator=g)), (6, 16)),
        "qk_norm_rope": (lambda x: cpu_kernels.qk_norm_rope(x, torch.ones(3, 16), cos, sin, 3, 1e-6)[0], (6, 4, 16)),
        "prefix_attention": (lambda x: cpu_kernels.prefix_attention_kernel(x, torch.randn(7, 1, 8, generator=g), 1,
                                                                    cpu_kernels.prefix_plan(pvalid, rvalid, counts)),
                             (7, 2, 8)),
        "route": (lambda x: cpu_kernels.route(x, 2, True)[0], (6, 4)),
        "gather_rows": (lambda x: cpu_kernels.gather_rows(x, tok, inv, 2), (3, 8)),
        "combine_rows": (lambda x: cpu_kernels.combine_rows(x, tok, inv, 2), (6, 8)),
    }


# listed here, not taken from _double_backward_cases(): building the cases needs the kernels, and collection
# must not (RLFLOW_CPU_KERNELS=0 skips these tests)
_DOUBLE_BACKWARD = ("rmsnorm", "swiglu", "qk_norm_rope", "prefix_attention", "route", "gather_rows", "combine_rows")


@pytest.mark.parametrize("name", _DOUBLE_BACKWARD)
def test_double_backward_raises_instead_of_dropping_terms(name):
    cases = _double_backward_cases()
    assert set(cases) == set(_DOUBLE_BACKWARD)
    f, shape = cases[name]
    x = torch.randn(*shape, requires_grad=True)
    (gx,) = torch.autograd.grad(f(x).square().sum() + x.pow(3).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        gx.sum().backward()


_THREADS_SCRIPT = textwrap.dedent("""
    import torch
    from rlflow.ops import rope_cos_sin
    from rlflow.ops.backends import cpu as cpu_kernels
    from rlflow.ops.norm import rmsnorm
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(300, 64, generator=g), torch.randn(64, generator=g), torch.randn(300, 64, generator=g)
    qkv, nw = torch.randn(300, 8, 16, generator=g), torch.randn(6, 16, generator=g)
    cos, sin = rope_cos_sin(torch.arange(300), 16, 1e4, torch.float32)
    dqk, dv = torch.randn(300, 6, 16, generator=g), torch.randn(300, 2, 16, generator=g)

    def grads(norm, qk_fn, dtype):
        a, b, c, n = (t.to(dtype).requires_grad_(True) for t in (x, w, qkv, nw))
        out = torch.autograd.grad([norm(a, b)], [a, b], [dy.to(dtype)])
        qk, v = qk_fn(c, n)
        return out + torch.autograd.grad([qk, v], [c, n], [dqk.to(dtype), dv.to(dtype)])

    ours = grads(lambda a, b: cpu_kernels.rmsnorm(a, b, 1e-6),
                 lambda c, n: cpu_kernels.qk_norm_rope(c, n, cos, sin, 6, 1e-6), torch.float32)
    def ref_qk(c, n):
        from rlflow.ops import apply_rope
        qk, v = c.split([6, 2], -2)
        return apply_rope(rmsnorm(qk, n, 1e-6), cos.double(), sin.double()), v
    ref = grads(lambda a, b: rmsnorm(a, b, 1e-6), ref_qk, torch.float64)
    print(max(float((a.double() - b).abs().max() / max(1.0, float(b.abs().max()))) for a, b in zip(ours, ref)),
          int(cpu_kernels.openmp()))
""")


@pytest.mark.parametrize("case", ["thread limit 1", "built without OpenMP"])
def test_backward_row_split_follows_the_threads_actually_running(case, tmp_path):
    """The weight-gradient kernels split rows by the OpenMP team that actually runs, not by torch's thread
    count: with the team capped at one thread, or with a build without OpenMP, every row is still done."""
    if case == "thread limit 1" and not cpu_kernels.openmp():
        pytest.skip("the kernels are built without OpenMP here (torch loads no GNU OpenMP)")
    env = dict(os.environ)  # the default cache: each build (with and without OpenMP) is made once per machine
    script = _THREADS_SCRIPT
    if case == "thread limit 1":
        env["OMP_THREAD_LIMIT"] = "1"
    else:
        script = "from rlflow.ops.backends import cpu\ncpu._gomp_loaded = lambda: False\n" + script
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    err, omp = out.stdout.split()
    assert float(err) < 1e-5, out.stdout
    assert omp == ("0" if case == "built without OpenMP" else "1")
