"""Fused float32 CPU kernels (``cpu_kernels.c``) for the training step, and the autograd functions over them.

On a CPU the update of a small model is bound by the bytes its activations move through DRAM: each
unfused elementwise op is one more pass over MBs of them (docs/benchmarks.md). Three kernels do in one
pass each, forward and backward, what took several torch ops:

- ``swiglu_weighted``: the MoE experts' ``silu(g) * u`` times each (token, expert) pair's routing weight;
- ``rmsnorm``: RMSNorm over the last dim;
- ``qk_norm_rope``: from the fused q/k/v projection, Qwen3's per-head q/k RMSNorm and the rotary
  embedding of q and k, and v split out;
- ``prefix_attention``: the attention of the packed shared-prompt sequence (``models/prefix.py``), which
  otherwise takes two SDPA calls, the prompt keys repeated for each row, and concatenations;
- ``route`` and ``moe_plan`` / ``gather_rows`` / ``combine_rows``: softmax top-k routing, and the
  grouped expert path's sort of (token, slot) pairs by expert (a counting sort), gather and combine
  (sums of each token's rows instead of zero-filled index_add);
- ``moe_small_experts`` (inference: the rollout's decode): each token through its own top-k experts
  when a layer's experts are small enough to stay in cache, instead of every expert on every token. A
  torch custom op, so the compiled decode step calls it too.

The C source is compiled on first use with the system C compiler (``cc``, or ``$CC``) into a per-user
cache (``$RLFLOW_CACHE_DIR``, default ``~/.cache/rlflow``), keyed by the source, flags and compiler, and
loaded with ctypes. OpenMP is used only when the process already has GNU OpenMP loaded (torch's Linux
CPU builds do), so the kernels share torch's threads instead of starting a second pool. No compiler, a
failed build, another platform, or ``RLFLOW_CPU_KERNELS=0``: ``available()`` is False and the callers
(``ops/moe.py``, ``ops/norm.py``, ``models/qwen3_moe.py``) keep their torch ops, which stay the
reference the kernels are tested against (tests/test_cpu_kernels.py). Not used inside torch.compile
(an opaque call; the custom op ``moe_small_experts`` is) and never for other dtypes or devices.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.c")
WIDTH = 8  # floats per vector in the C source: row widths must be multiples of it
_lock = threading.Lock()
_lib: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable


def _gomp_loaded() -> bool:
    """GNU OpenMP already mapped into this process (torch's)."""
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:
        return False


def _build(cc: str, flags: list[str], out: str) -> None:
    tmp = tempfile.mkdtemp(prefix="rlflow_kernels_", dir=os.path.dirname(out))
    try:
        so = os.path.join(tmp, "k.so")
        subprocess.run([cc, *flags, "-shared", "-fPIC", _SRC, "-o", so], check=True, capture_output=True, text=True)
        os.replace(so, out)  # atomic: concurrent processes may race to build the same file
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load() -> ctypes.CDLL | bool:
    if os.environ.get("RLFLOW_CPU_KERNELS", "1") == "0":
        return False
    if platform.system() != "Linux":
        return False
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return False
    omp = _gomp_loaded()
    base = ["-O3", "-std=gnu11"] + (["-fopenmp"] if omp else [])
    cache = os.environ.get("RLFLOW_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "rlflow")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
        with open(_SRC, "rb") as f:
            src = f.read()
        machine = (platform.machine(), _cpu_flags())
    except (OSError, subprocess.CalledProcessError) as e:
        warnings.warn(f"rlflow: fused CPU kernels unavailable (torch ops are used instead): {e}")
        return False
    errors = []
    # -march=native: the cache key includes the machine's CPU flags, so a shared home dir across
    # different CPUs builds one file per CPU kind
    extra = [["-march=native"], []]  # a compiler that rejects -march=native builds without it
    while extra:
        flags = base + extra[0]
        try:
            key = hashlib.sha256(src + repr((flags, version, machine)).encode()).hexdigest()[:16]
            os.makedirs(cache, exist_ok=True)
            path = os.path.join(cache, f"cpu_kernels_{key}.so")
            if not os.path.exists(path):
                _build(cc, flags, path)
            lib = ctypes.CDLL(path)
            if bool(lib.rlflow_kernels_openmp()) != omp:
                raise OSError(f"{path}: built {'with' if not omp else 'without'} OpenMP, expected the opposite")
            if omp and not _shares_torch_threads(lib):  # a second OpenMP runtime: build again without OpenMP
                warnings.warn(f"rlflow: {cc}'s OpenMP runtime is not torch's; the fused CPU kernels are built "
                              "without OpenMP (one thread each)")
                omp, base = False, [f for f in base if f != "-fopenmp"]
                continue
            _declare(lib)
            return lib
        except (OSError, subprocess.CalledProcessError) as e:
            errors.append(getattr(e, "stderr", None) or str(e))
            extra.pop(0)
    warnings.warn("rlflow: fused CPU kernels unavailable (torch ops are used instead): " + errors[-1][-500:])
    return False


def _shares_torch_threads(lib: ctypes.CDLL) -> bool:
    """The library's OpenMP thread count follows torch.set_num_threads: one runtime, one thread pool. The
    probe count differs from both torch's and the library's current ones, so a foreign runtime cannot
    answer it by chance."""
    lib.rlflow_kernels_max_threads.restype = ctypes.c_int
    n0 = torch.get_num_threads()
    probe = max(n0, lib.rlflow_kernels_max_threads()) + 1
    try:
        torch.set_num_threads(probe)
        return lib.rlflow_kernels_max_threads() == probe
    finally:
        torch.set_num_threads(n0)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _declare(lib: ctypes.CDLL) -> None:
    P, I, Fl, Int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    sig = {
        "swiglu_fwd": [P, P, I, I, P],
        "swiglu_bwd": [P, P, P, I, I, P, P],
        "rmsnorm_fwd": [P, P, I, I, Fl, P, P],
        "rmsnorm_bwd": [P, P, P, P, I, I, Int, P, P],
        "qk_norm_rope_fwd": [P, P, P, P, I, I, I, I, Fl, P, P, P],
        "qk_norm_rope_bwd": [P, P, P, P, P, P, P, I, I, I, I, Int, P, P],
        "prefix_attn_fwd": [P, P, P, P, P, I, I, I, I, I, I, P, P],
        "prefix_attn_bwd": [P, P, P, P, P, I, I, I, I, I, I, P, P, P, P, P],
        "moe_small_fwd": [P, P, P, P, P, I, I, I, I, I, P],
        "moe_plan": [P, I, I, I, P, P, P, P],
        "gather_sum": [P, P, I, I, I, P],
        "router_fwd": [P, I, I, I, Int, P, P, P],
        "router_bwd": [P, P, P, P, I, I, I, Int, P],
    }
    status = {"moe_plan", "moe_small_fwd"}  # return 0, or -1 for an expert id out of range
    for name, args in sig.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, (ctypes.c_int if name in status else None)


def _library() -> ctypes.CDLL | None:
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _load()
    return _lib or None


def available() -> bool:
    """The kernels are built and loaded (built on the first call)."""
    return _library() is not None


def usable(*tensors: Tensor) -> bool:
    """The kernels can take these tensors: float32, CPU, contiguous, not being traced by torch.compile."""
    return (not torch.compiler.is_compiling()
            and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
            and available())


def _ptr(t: Tensor | None):
    return None if t is None else t.data_ptr()


def _threads() -> int:
    return max(1, torch.get_num_threads())


class _SwiGLUWeighted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu_NF2: Tensor, w_N: Tensor) -> Tensor:
        n, f2 = gu_NF2.shape
        out = gu_NF2.new_empty(n, f2 // 2)
        _library().swiglu_fwd(gu_NF2.data_ptr(), w_N.data_ptr(), n, f2 // 2, out.data_ptr())
        ctx.save_for_backward(gu_NF2, w_N)
        return out

    @staticmethod
    @once_differentiable  # the backward is a C call: no graph for a double backward
    def backward(ctx, dout: Tensor):
        gu, w = ctx.saved_tensors
        n, f2 = gu.shape
        dout = dout.contiguous()
        dgu, dw = torch.empty_like(gu), torch.empty_like(w)
        _library().swiglu_bwd(gu.data_ptr(), w.data_ptr(), dout.data_ptr(), n, f2 // 2, dgu.data_ptr(), dw.data_ptr())
        return dgu, dw


def swiglu_weighted(gu_NF2: Tensor, w_N: Tensor) -> Tensor | None:
    """``silu(g) * u * w[:, None]`` with ``g, u = gu.chunk(2, -1)`` [N, F]; None when the kernels cannot
    take these tensors (the caller computes it with torch ops)."""
    if gu_NF2.dim() != 2 or gu_NF2.shape[1] % (2 * WIDTH) or not usable(gu_NF2, w_N) or w_N.shape != gu_NF2.shape[:1]:
        return None
    return _SwiGLUWeighted.apply(gu_NF2, w_N)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, eps: float) -> Tensor:
        d = x.shape[-1]
        n = x.numel() // d
        y = torch.empty_like(x)
        rstd = x.new_empty(n)
        _library().rmsnorm_fwd(x.data_ptr(), w.data_ptr(), n, d, eps, y.data_ptr(), rstd.data_ptr())
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    @once_differentiable  # the backward is a C call: no graph for a double backward
    def backward(ctx, dy: Tensor):
        x, w, rstd = ctx.saved_tensors
        d = x.shape[-1]
        n = x.numel() // d
        dy = dy.contiguous()
        nt = _threads()
        dx, part = torch.empty_like(x), x.new_zeros(nt, d)
        _library().rmsnorm_bwd(x.data_ptr(), w.data_ptr(), rstd.data_ptr(), dy.data_ptr(), n, d, nt, dx.data_ptr(),
                               part.data_ptr())
        return dx, part.sum(0), None


def rmsnorm(x: Tensor, w_D: Tensor, eps: float) -> Tensor | None:
    """RMSNorm of x over its last dim with weight [D]; None when the kernels cannot take these tensors."""
    if x.dim() < 1 or w_D.dim() != 1 or w_D.shape[0] != x.shape[-1] or x.shape[-1] % WIDTH or not usable(x, w_D):
        return None
    return _RMSNorm.apply(x, w_D, eps)


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: Tensor, norm: Tensor | None, cos: Tensor, sin: Tensor, hk: int, eps: float):
        *lead, heads, d = qkv.shape
        hv = heads - hk
        n = qkv.numel() // (heads * d)
        qk = qkv.new_empty(*lead, hk, d)
        v = qkv.new_empty(*lead, hv, d)
        rstd = qkv.new_empty(n, hk) if norm is not None else None
        _library().qk_norm_rope_fwd(qkv.data_ptr(), _ptr(norm), cos.data_ptr(), sin.data_ptr(), n, hk, hv, d, eps,
                                    qk.data_ptr(), v.data_ptr(), _ptr(rstd))
        ctx.hk = hk
        ctx.has_norm = norm is not None
        ctx.save_for_backward(qkv, norm, cos, sin, rstd)
        return qk, v

    @staticmethod
    @once_differentiable  # the backward is a C call: no graph for a double backward
    def backward(ctx, dqk: Tensor | None, dv: Tensor | None):
        qkv, norm, cos, sin, rstd = ctx.saved_tensors
        *lead, heads, d = qkv.shape
        hk = ctx.hk
        hv = heads - hk
        n = qkv.numel() // (heads * d)
        dqk = qkv.new_zeros(*lead, hk, d) if dqk is None else dqk.contiguous()
        dv = qkv.new_zeros(*lead, hv, d) if dv is None else dv.contiguous()
        nt = _threads()
        dqkv = torch.empty_like(qkv)
        part = qkv.new_zeros(nt, hk, d) if ctx.has_norm else None
        _library().qk_norm_rope_bwd(qkv.data_ptr(), _ptr(norm), cos.data_ptr(), sin.data_ptr(), _ptr(rstd),
                                    dqk.data_ptr(), dv.data_ptr(), n, hk, hv, d, nt, dqkv.data_ptr(), _ptr(part))
        return dqkv, (part.sum(0) if ctx.has_norm else None), None, None, None, None


def qk_norm_rope(qkv: Tensor, norm_Hd: Tensor | None, cos: Tensor, sin: Tensor, hk: int, eps: float
                 ) -> tuple[Tensor, Tensor] | None:
    """From q/k/v heads ``qkv`` [..., T, hk + hv, d] (q and k heads first): (qk [..., T, hk, d]: per-head
    RMSNorm with ``norm_Hd`` [hk, d] (None: no norm), then rotary with cos/sin [..., T, d]; v [..., T, hv, d]).
    None when the kernels cannot take these tensors (no gradient to cos/sin is computed: they must not
    need one)."""
    d = qkv.shape[-1]
    if (qkv.dim() < 3 or d % (2 * WIDTH) or d > 512 or cos.shape != qkv.shape[:-2] + (d,) or sin.shape != cos.shape
            or cos.requires_grad or sin.requires_grad
            or (norm_Hd is not None and norm_Hd.shape != (hk, d))
            or not usable(qkv, cos, sin, *(() if norm_Hd is None else (norm_Hd,)))):
        return None
    return _QKNormRope.apply(qkv, norm_Hd, cos, sin, hk, eps)


class _PrefixAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qk: Tensor, v: Tensor, n_q: int, pvalid: Tensor, rvalid: Tensor, row_start: Tensor) -> Tensor:
        N, HK, d = qk.shape
        (P, Tp), (_, R) = pvalid.shape, rvalid.shape
        o = qk.new_empty(N, n_q, d)
        lse = qk.new_empty(N, n_q)
        _library().prefix_attn_fwd(qk.data_ptr(), v.data_ptr(), pvalid.data_ptr(), rvalid.data_ptr(),
                                   row_start.data_ptr(), P, Tp, R, n_q, HK - n_q, d, o.data_ptr(), lse.data_ptr())
        ctx.n_q = n_q
        ctx.save_for_backward(qk, v, pvalid, rvalid, row_start, o, lse)
        return o

    @staticmethod
    @once_differentiable  # the backward is a C call: no graph for a double backward
    def backward(ctx, do: Tensor):
        qk, v, pvalid, rvalid, row_start, o, lse = ctx.saved_tensors
        N, HK, d = qk.shape
        (P, Tp), (_, R) = pvalid.shape, rvalid.shape
        do = do.contiguous()
        dqk, dv = torch.empty_like(qk), torch.empty_like(v)
        _library().prefix_attn_bwd(qk.data_ptr(), v.data_ptr(), pvalid.data_ptr(), rvalid.data_ptr(),
                                   row_start.data_ptr(), P, Tp, R, ctx.n_q, HK - ctx.n_q, d, o.data_ptr(),
                                   lse.data_ptr(), do.data_ptr(), dqk.data_ptr(), dv.data_ptr())
        return dqk, dv, None, None, None, None


def prefix_plan(prompt_valid_PT: Tensor, resp_valid_BR: Tensor, counts_P: Tensor
                ) -> tuple[Tensor, Tensor, Tensor] | None:
    """What ``prefix_attention`` takes of the packed layout (``ops.attention.PrefixLayout``), once per
    forward: (prompt validity [P, Tp] and response validity [B, R] as uint8, row_start [P + 1]: the rows of
    prompt p are [row_start[p], row_start[p + 1])); None when the kernels are unavailable or ``counts_P``
    is not a grouping of the B rows (negative, or not summing to B)."""
    (P, _), (B, _) = prompt_valid_PT.shape, resp_valid_BR.shape
    if counts_P.shape != (P,) or not available():
        return None
    row_start = torch.cat([counts_P.new_zeros(1), counts_P.cumsum(0)]).to(torch.int64).cpu()
    if int(row_start[-1]) != B or bool((counts_P < 0).any()):
        return None
    u8 = lambda t: t.to(torch.uint8).cpu().contiguous()  # noqa: E731
    return u8(prompt_valid_PT), u8(resp_valid_BR), row_start


def prefix_attention(qk_NHd: Tensor, v_NKd: Tensor, n_q: int, plan: tuple[Tensor, Tensor, Tensor]) -> Tensor | None:
    """``ops.attention.prefix_attention`` in one kernel (forward and backward), on a ``prefix_plan``; None
    when the kernels cannot take these tensors."""
    pvalid, rvalid, row_start = plan
    N, HK, d = qk_NHd.shape
    K = HK - n_q
    (P, Tp), (B, R) = pvalid.shape, rvalid.shape
    if d % WIDTH or K < 1 or n_q % K or v_NKd.shape != (N, K, d) or N != P * Tp + B * R or not usable(qk_NHd, v_NKd):
        return None
    return _PrefixAttention.apply(qk_NHd, v_NKd, n_q, pvalid, rvalid, row_start)


@torch.library.custom_op("rlflow::moe_small_experts", mutates_args=())
def _moe_small_op(x_ND: Tensor, w_NK: Tensor, idx_NK: Tensor, gate_up_t_EDF2: Tensor, down_t_EFD: Tensor) -> Tensor:
    # contiguous already (moe_small_experts checks, and a compiled graph keeps the traced strides): these are
    # no-ops then, kept so that a layout the graph chose otherwise still computes the right thing
    x_ND, w_NK, idx_NK = x_ND.contiguous(), w_NK.contiguous(), idx_NK.contiguous()
    gate_up_t_EDF2, down_t_EFD = gate_up_t_EDF2.contiguous(), down_t_EFD.contiguous()
    out = torch.empty_like(x_ND)
    (N, K), (E, D, F2) = idx_NK.shape, gate_up_t_EDF2.shape
    if _library().moe_small_fwd(x_ND.data_ptr(), idx_NK.data_ptr(), w_NK.data_ptr(), gate_up_t_EDF2.data_ptr(),
                                down_t_EFD.data_ptr(), N, K, E, D, F2 // 2, out.data_ptr()):
        raise ValueError(f"moe_small_experts: expert ids must be in [0, {E}), got {idx_NK.min().item()}.."
                         f"{idx_NK.max().item()}")
    return out


@_moe_small_op.register_fake
def _(x_ND, w_NK, idx_NK, gate_up_t_EDF2, down_t_EFD):
    return torch.empty_like(x_ND)


def moe_small_experts(x_ND: Tensor, w_NK: Tensor, idx_NK: Tensor, gate_up_t_EDF2: Tensor, down_t_EFD: Tensor
                      ) -> Tensor | None:
    """sum_k w_nk * down_e(silu(gate_e x_n) * up_e x_n), e = idx_nk, from the experts' weights transposed
    (``gate_up_t`` [E, D, 2F]: gate then up columns; ``down_t`` [E, F, D]), for inference (no gradient).
    None when the kernels cannot take these tensors. Allowed inside torch.compile (a custom op)."""
    ts = (x_ND, w_NK, gate_up_t_EDF2, down_t_EFD)
    if (gate_up_t_EDF2.dim() != 3 or down_t_EFD.dim() != 3 or idx_NK.dim() != 2 or idx_NK.shape[1] < 1
            or (torch.compiler.is_compiling() and _lib is None)):  # not loaded: do not trace the loader
        return None
    E, D, F2 = gate_up_t_EDF2.shape
    if (any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in ts)
            or idx_NK.dtype != torch.int64 or not idx_NK.is_contiguous() or idx_NK.device.type != "cpu"
            or w_NK.shape != idx_NK.shape or idx_NK.shape[0] != x_ND.shape[0]
            or (torch.is_grad_enabled() and any(t.requires_grad for t in ts))
            or x_ND.dim() != 2 or x_ND.shape[1] != D or D % (2 * WIDTH) or F2 % (4 * WIDTH)
            or down_t_EFD.shape != (E, F2 // 2, D)
            or not available()):
        return None
    return _moe_small_op(x_ND, w_NK, idx_NK, gate_up_t_EDF2, down_t_EFD)


class _Router(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, k: int, norm: bool):
        n, E = logits.shape
        w, idx, probs = logits.new_empty(n, k), torch.empty(n, k, dtype=torch.int64), torch.empty_like(logits)
        _library().router_fwd(logits.data_ptr(), n, E, k, int(norm), w.data_ptr(), idx.data_ptr(), probs.data_ptr())
        ctx.norm = norm
        ctx.save_for_backward(probs, idx, w)
        ctx.mark_non_differentiable(idx)
        return w, idx

    @staticmethod
    @once_differentiable  # the backward is a C call: no graph for a double backward
    def backward(ctx, dw: Tensor, _didx):
        probs, idx, w = ctx.saved_tensors
        n, E = probs.shape
        dw = dw.contiguous()
        dl = torch.empty_like(probs)
        _library().router_bwd(probs.data_ptr(), idx.data_ptr(), w.data_ptr(), dw.data_ptr(), n, E, idx.shape[1],
                              int(ctx.norm), dl.data_ptr())
        return dl, None, None


def route(logits_NE: Tensor, k: int, norm: bool) -> tuple[Tensor, Tensor] | None:
    """(weights [N, k], experts [N, k]): softmax over the E logits in float32, the top k (largest first;
    equal probabilities go to the lower expert id, where torch.topk's order is unspecified), renormalized
    to sum 1 when ``norm``; None when the kernels cannot take the logits."""
    if logits_NE.dim() != 2 or not 1 <= k <= logits_NE.shape[1] or not usable(logits_NE):
        return None
    return _Router.apply(logits_NE, k, norm)


def moe_plan(idx_NK: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """(order, tok, inv [N*K] int64, offs [E] int32): the (token, slot) pairs sorted by expert, stably
    (order[j]: the pair at sorted position j, tok[j] its token, inv[pair] its position), and the end of
    each expert's block; None when the kernels are unavailable (or idx is not a CPU int64 [N, K])."""
    if idx_NK.dim() != 2 or idx_NK.dtype != torch.int64 or idx_NK.device.type != "cpu" or not available():
        return None
    idx = idx_NK.contiguous()
    M = idx.numel()
    order, tok, inv = (torch.empty(M, dtype=torch.int64) for _ in range(3))
    offs = torch.empty(n_experts, dtype=torch.int32)
    if _library().moe_plan(idx.data_ptr(), idx.shape[0], idx.shape[1], n_experts, order.data_ptr(), tok.data_ptr(),
                           inv.data_ptr(), offs.data_ptr()):
        raise ValueError(f"moe_plan: expert ids must be in [0, {n_experts}), got {idx.min().item()}.."
                         f"{idx.max().item()}")
    return order, tok, inv, offs


def _gather_sum(src: Tensor, inv: Tensor, k: int) -> Tensor:
    src = src.contiguous()
    out = src.new_empty(inv.numel() // k, src.shape[1])
    _library().gather_sum(src.data_ptr(), inv.data_ptr(), out.shape[0], k, src.shape[1], out.data_ptr())
    return out


class _GatherRows(torch.autograd.Function):  # x [N, D] -> xs [N*K, D] = x[tok]; backward: each token's K rows summed
    @staticmethod
    def forward(ctx, x, tok, inv, k):
        ctx.save_for_backward(inv)
        ctx.k = k
        return x.index_select(0, tok)

    @staticmethod
    @once_differentiable  # the backward is a C call: no graph for a double backward
    def backward(ctx, dxs):
        (inv,) = ctx.saved_tensors
        return _gather_sum(dxs, inv, ctx.k), None, None, None


class _CombineRows(torch.autograd.Function):  # ys [N*K, D] -> out [N, D]: each token's K rows summed
    @staticmethod
    def forward(ctx, ys, tok, inv, k):
        ctx.save_for_backward(tok)
        return _gather_sum(ys, inv, k)

    @staticmethod
    @once_differentiable  # the backward is a C call: no graph for a double backward
    def backward(ctx, dout):
        (tok,) = ctx.saved_tensors
        return dout.index_select(0, tok), None, None, None


def gather_rows(x_ND: Tensor, tok: Tensor, inv: Tensor, k: int) -> Tensor:
    """x[tok] ([N*K, D], rows sorted by expert, from ``moe_plan``), whose backward sums each token's K rows
    (no zero fill and index_add). x: float32 CPU, D a multiple of 8."""
    return _GatherRows.apply(x_ND, tok, inv, k)


def combine_rows(ys: Tensor, tok: Tensor, inv: Tensor, k: int) -> Tensor:
    """[N, D]: row n = the sum of the K rows of ``ys`` (sorted by expert) that token n was routed to."""
    return _CombineRows.apply(ys, tok, inv, k)
