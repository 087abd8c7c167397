"""CPU backend: fused float32 kernels (``cpu_kernels.c``) as torch operators ``rlflow::*``.

On a CPU the update of a small model is bound by the bytes its activations move through DRAM: each
unfused elementwise op is one more pass over MBs of them (docs/benchmarks.md). The kernels do in one
pass each, forward and backward, what took several torch ops:

- ``swiglu_weighted``: the MoE experts' ``silu(g) * u`` times each (token, expert) pair's routing weight;
- ``rmsnorm``: RMSNorm over the last dim;
- ``qk_norm_rope``: from the fused q/k/v projection, Qwen3's per-head q/k RMSNorm and the rotary
  embedding of q and k, and v split out;
- ``prefix_attention``: the attention of the packed shared-prompt sequence (``ops.PrefixLayout``);
- ``route`` and ``moe_plan`` / ``gather_rows`` / ``combine_rows``: softmax top-k routing, and the grouped
  expert path's sort of (token, slot) pairs by expert (a counting sort), gather and combine;
- ``moe_small_experts`` (inference: the rollout's decode): each token through its own top-k experts
  when a layer's experts are small enough to stay in cache. Also called inside the compiled decode step.

Build: ``cpu_ops.cpp`` (the operators' schemas, TORCH_LIBRARY, and their CPU implementations over the C
kernels, which it includes) is compiled with ``torch.utils.cpp_extension.load`` on first use into a
per-user cache (``$RLFLOW_CACHE_DIR``, default ``~/.cache/rlflow``), one build directory per source,
flags, compiler, CPU and torch version, and loaded with ``torch.ops.load_library``. The fake (meta)
implementations and the autograd formulas (``torch.library.register_autograd``; backward passes are
operators too) are registered here. OpenMP only when the process already has GNU OpenMP loaded (torch's
Linux CPU builds do), so the kernels share torch's threads. No compiler or ninja, a failed build,
another platform, or ``RLFLOW_CPU_KERNELS=0``: ``available()`` is False (the reason is logged once, as a
warning) and every entry returns None, so the ops run their torch references. While torch.compile traces
(the compiled decode step), ``moe_small_experts`` and ``qk_norm_rope`` run as extern kernels (inductor would
recompute the rotary tables' cos and sin for every head of every layer inside its fused kernels); the
other kernels are left to inductor's fusion of the torch ops.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from rlflow.ops import moe, registry

log = logging.getLogger(__name__)

_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCES = (os.path.join(_DIR, "cpu_ops.cpp"), os.path.join(_DIR, "cpu_kernels.c"))
WIDTH = 8  # floats per vector in the C source: row widths must be multiples of it
# the C++ side's counters, in its order (cpu_ops.cpp: enum Kernel)
KERNELS = ("swiglu_fwd", "swiglu_bwd", "rmsnorm_fwd", "rmsnorm_bwd", "qk_norm_rope_fwd", "qk_norm_rope_bwd",
           "prefix_attn_fwd", "prefix_attn_bwd", "moe_small_fwd", "moe_plan", "gather_sum", "router_fwd", "router_bwd",
           "counter_noise")
_lock = threading.Lock()
_state: bool | None = None  # None: not tried yet
unavailable_reason: str | None = None
ops = None  # torch.ops.rlflow once loaded


def _gomp_loaded() -> bool:
    """GNU OpenMP already mapped into this process (torch's)."""
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:
        return False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> str:
    return os.environ.get("RLFLOW_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "rlflow")


def _load() -> bool:
    global unavailable_reason, ops
    if os.environ.get("RLFLOW_CPU_KERNELS", "1") == "0":
        unavailable_reason = "RLFLOW_CPU_KERNELS=0"
        return False
    if platform.system() != "Linux":
        unavailable_reason = f"not built on {platform.system()}"
        return False
    from torch.utils import cpp_extension
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        unavailable_reason = "no C++ compiler (c++, g++, clang++ or $CXX)"
        return False
    if not cpp_extension.is_ninja_available():
        unavailable_reason = "ninja is not installed (apt install ninja-build, or pip install ninja)"
        return False
    omp = _gomp_loaded()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
        src = b"".join(open(p, "rb").read() for p in _SOURCES)
    except (OSError, subprocess.CalledProcessError) as e:
        unavailable_reason = str(e)
        return False
    machine = (platform.machine(), _cpu_flags(), torch.__version__)
    marker = os.path.join(cache_dir(), "cpu_ops_foreign_openmp")
    if omp and os.path.exists(marker):  # an earlier process found the compiler's OpenMP is not torch's
        omp = False
    errors = []
    # -march=native: the build directory's key includes the CPU flags, so a shared home dir across
    # different CPUs builds one library per CPU kind; a compiler that rejects it builds without
    for march in (["-march=native"], []):
        flags = ["-O3", *march] + (["-fopenmp"] if omp else [])
        # the sources' path is part of the key: build.ninja names it, so two checkouts sharing one build
        # directory would rewrite it and recompile on every run of the other
        key = hashlib.sha256(src + repr((flags, version, machine, cxx, _SOURCES)).encode()).hexdigest()[:16]
        build = os.path.join(cache_dir(), f"cpu_ops_{key}")
        try:
            os.makedirs(build, exist_ok=True)
            with _build_lock(build):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # cpp_extension's notes on the compiler's ABI/version
                    cpp_extension.load(name=f"rlflow_cpu_ops_{key}", sources=[_SOURCES[0]], extra_cflags=flags,
                                       extra_ldflags=["-fopenmp"] if omp else [], build_directory=build,
                                       is_python_module=False, verbose=False)
        except BuildLockTimeout as e:  # a live process has been building for too long: the torch path
            errors.append(str(e))
            break
        except Exception as e:  # a compile or link error: cpp_extension raises RuntimeError with the log
            errors.append(str(e))
            continue
        ops = torch.ops.rlflow
        if omp and _shares_torch_threads() is False:
            # results are right, but two thread pools compete: warn, and let later processes build without
            warnings.warn(f"rlflow: {cxx}'s OpenMP runtime is not torch's: the fused CPU kernels run their own "
                          "thread pool in this process; later processes build them without OpenMP")
            open(marker, "w").close()
        return True
    unavailable_reason = "the build failed: " + errors[-1][-800:]
    return False


BUILD_WAIT_S = 600.0  # how long a process waits for another one's build of the same kernels


class BuildLockTimeout(RuntimeError):
    pass


@contextlib.contextmanager
def _build_lock(build: str):
    """One builder per build directory, by an OS lock (``flock``) that dies with its holder. Holding it, a
    ``lock`` file of cpp_extension's (its FileBaton, which every later load waits on while it exists) can
    only have been left by a builder that was killed: it is removed, so a crashed build never hangs the next
    run. Waits ``BUILD_WAIT_S`` at most for a live builder (BuildLockTimeout)."""
    import fcntl  # POSIX: the kernels are built on Linux only

    with open(os.path.join(build, "rlflow.lock"), "w") as f:
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildLockTimeout(f"another process has been building the CPU kernels in {build} for "
                                           f"over {BUILD_WAIT_S:.0f} s") from None
                time.sleep(0.2)
        try:
            stale = os.path.join(build, "lock")
            if os.path.exists(stale):
                log.warning("rlflow: removing %s, left by a kernel build that was killed", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _shares_torch_threads() -> bool | None:
    """The library's OpenMP thread count follows torch.set_num_threads: one runtime, one thread pool. The
    probe count differs from both torch's and the library's current ones, so a foreign runtime cannot
    answer it by chance. None: the probe cannot tell, torch's own count did not change (vLLM's CPU worker
    makes torch.set_num_threads a no-op once it has bound its threads)."""
    n0 = torch.get_num_threads()
    probe = max(n0, ops._kernels_max_threads()) + 1
    try:
        torch.set_num_threads(probe)
        if torch.get_num_threads() != probe:
            return None
        return ops._kernels_max_threads() == probe
    finally:
        torch.set_num_threads(n0)


def available() -> bool:
    """The kernels are built and loaded (built on the first call; the reason why not is warned once)."""
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                ok = _load()
                if ok:
                    _register_python_parts()
                elif unavailable_reason != "RLFLOW_CPU_KERNELS=0":
                    warnings.warn(f"rlflow: fused CPU kernels unavailable, torch ops are used instead: "
                                  f"{unavailable_reason}")
                log.info("rlflow CPU kernels: %s", "loaded" if ok else f"unavailable ({unavailable_reason})")
                _state = ok
    return _state


def openmp() -> bool:
    return available() and bool(ops._kernels_openmp())


def calls() -> collections.Counter:
    """How often each C kernel ran in this process (counted in C++, so calls from compiled graphs too)."""
    if not available():
        return collections.Counter()
    return collections.Counter(dict(zip(KERNELS, ops._kernel_calls())))


def usable(*tensors: Tensor, traced: bool = False) -> bool:
    """The kernels can take these tensors: float32, CPU, contiguous, and not being traced by torch.compile
    unless ``traced`` (an entry inductor calls as an extern kernel, once the kernels are loaded: the
    loader itself is not traced)."""
    if torch.compiler.is_compiling() and not (traced and _state is not None):
        return False
    return (all(registry.computes_as(t) == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
            and available())


# ---- fake (meta) implementations and autograd formulas of the operators ----

def _register_python_parts() -> None:
    lib = "rlflow::"
    fake = torch.library.register_fake

    def new(t: Tensor, *shape, dtype=None):
        return torch.empty(shape, dtype=dtype or t.dtype, device=t.device)

    fake(lib + "counter_noise")(lambda keys, pos, vocab: new(keys, keys.shape[0], vocab, dtype=torch.float32))
    fake(lib + "swiglu_weighted")(lambda gu, w: new(gu, gu.shape[0], gu.shape[1] // 2))
    fake(lib + "swiglu_weighted_backward")(lambda gu, w, dout: (new(gu, *gu.shape), new(w, *w.shape)))
    fake(lib + "rmsnorm")(lambda x, w, eps: (new(x, *x.shape), new(x, x.numel() // x.shape[-1])))
    fake(lib + "rmsnorm_backward")(lambda x, w, rstd, dy: (new(x, *x.shape), new(w, x.shape[-1])))

    def qk_fake(qkv, norm, cos, sin, hk, eps):
        *lead, heads, d = qkv.shape
        n = qkv.numel() // (heads * d)
        return (new(qkv, *lead, hk, d), new(qkv, *lead, heads - hk, d),
                new(qkv, n if norm is not None else 0, hk if norm is not None else 0))
    fake(lib + "qk_norm_rope")(qk_fake)
    fake(lib + "qk_norm_rope_backward")(
        lambda qkv, norm, cos, sin, rstd, dqk, dv, hk: (new(qkv, *qkv.shape),
                                                        new(qkv, *(norm.shape if norm is not None else (0,)))))
    fake(lib + "prefix_attention")(
        lambda qk, v, n_q, pv, rv, rs: (new(qk, qk.shape[0], n_q, qk.shape[2]), new(qk, qk.shape[0], n_q)))
    fake(lib + "prefix_attention_backward")(
        lambda qk, v, n_q, pv, rv, rs, o, lse, do: (new(qk, *qk.shape), new(v, *v.shape)))
    fake(lib + "moe_small_experts")(lambda x, w, idx, gu, dn: new(x, *x.shape))
    fake(lib + "route")(lambda lg, k, norm: (new(lg, lg.shape[0], k), new(lg, lg.shape[0], k, dtype=torch.int64),
                                             new(lg, *lg.shape)))
    fake(lib + "route_backward")(lambda probs, idx, w, dw, norm: new(probs, *probs.shape))
    fake(lib + "moe_plan")(lambda idx, E: tuple(new(idx, idx.numel(), dtype=torch.int64) for _ in range(3))
                           + (new(idx, E, dtype=torch.int32),))
    fake(lib + "gather_rows")(lambda x, tok, inv, k: new(x, tok.shape[0], x.shape[1]))
    fake(lib + "combine_rows")(lambda ys, tok, inv, k: new(ys, inv.shape[0] // k, ys.shape[1]))

    # Backward formulas: one operator each (no graph of their own: a double backward raises, see
    # once_differentiable, instead of silently dropping terms). Each is registered for the operator
    # (torch.library.register_autograd: what torch.ops.rlflow.* callers, torch.compile and opcheck use)
    # and also wrapped in a plain autograd.Function for the eager entries below (``_call``).
    def autograd(qualname, backward, setup_context):
        torch.library.register_autograd(qualname, backward, setup_context=setup_context)
        _EAGER[qualname.split("::")[1]] = _eager_function(getattr(ops, qualname.split("::")[1]).default, backward,
                                                           setup_context)
    def save(*names):
        def setup(ctx, inputs, output):
            ctx.save_for_backward(*(inputs[i] if isinstance(i, int) else output[int(i[1:])] for i in names))
            ctx.args = tuple(None if isinstance(a, Tensor) else a for a in inputs)  # the non-tensor arguments
        return setup

    @once_differentiable
    def swiglu_bwd(ctx, dout):
        gu, w = ctx.saved_tensors
        return ops.swiglu_weighted_backward(gu, w, dout)
    autograd(lib + "swiglu_weighted", swiglu_bwd, setup_context=save(0, 1))

    @once_differentiable
    def rmsnorm_bwd(ctx, dy, _drstd):
        x, w, rstd = ctx.saved_tensors
        return (*ops.rmsnorm_backward(x, w, rstd, dy), None)
    autograd(lib + "rmsnorm", rmsnorm_bwd, setup_context=save(0, 1, "o1"))

    @once_differentiable
    def qk_bwd(ctx, dqk, dv, _drstd):
        qkv, norm, cos, sin, rstd = ctx.saved_tensors
        hk = ctx.args[4]
        dqkv, dnorm = ops.qk_norm_rope_backward(qkv, norm, cos, sin, rstd, dqk, dv, hk)
        return dqkv, (dnorm if norm is not None else None), None, None, None, None
    autograd(lib + "qk_norm_rope", qk_bwd, setup_context=save(0, 1, 2, 3, "o2"))

    @once_differentiable
    def prefix_bwd(ctx, do, _dlse):
        qk, v, pv, rv, rs, o, lse = ctx.saved_tensors
        dqk, dv = ops.prefix_attention_backward(qk, v, ctx.args[2], pv, rv, rs, o, lse, do)
        return dqk, dv, None, None, None, None
    autograd(lib + "prefix_attention", prefix_bwd, setup_context=save(0, 1, 3, 4, 5, "o0", "o1"))

    @once_differentiable
    def route_bwd(ctx, dw, _didx, _dprobs):
        probs, idx, w = ctx.saved_tensors
        return ops.route_backward(probs, idx, w, dw, ctx.args[2]), None, None
    autograd(lib + "route", route_bwd, setup_context=save("o2", "o1", "o0"))

    @once_differentiable
    def gather_bwd(ctx, dxs):  # each token's K rows summed
        tok, inv = ctx.saved_tensors
        return _call("combine_rows", dxs, tok, inv, ctx.args[3]), None, None, None
    autograd(lib + "gather_rows", gather_bwd, setup_context=save(1, 2))

    @once_differentiable
    def combine_bwd(ctx, dout):
        tok, inv = ctx.saved_tensors
        return dout.index_select(0, tok), None, None, None
    autograd(lib + "combine_rows", combine_bwd, setup_context=save(1, 2))


_EAGER: dict[str, type] = {}


def _eager_function(op, backward, setup_context) -> type:
    """The operator's registered formula as a plain autograd.Function whose forward calls the operator
    below autograd: the same formula with less Python per call than the generic autograd kernel of
    register_autograd (which fills in defaults and redispatches on every call)."""
    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            out = op(*args)
        setup_context(ctx, args, out)
        return out
    return type(f"Eager_{op._opname}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def _call(name: str, *args):
    """``torch.ops.rlflow.<name>(*args)``; in eager mode through ``_EAGER`` (with gradients) or straight to
    the CPU kernel below autograd (without), the same computation with less per-call overhead."""
    if torch.compiler.is_compiling():
        return getattr(ops, name)(*args)
    if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
        return _EAGER[name].apply(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return getattr(ops, name)(*args)


# ---- the entries: None where the kernels cannot take the arguments ----

def swiglu_weighted(gu_NF2: Tensor, w_N: Tensor) -> Tensor | None:
    """``silu(g) * u * w[:, None]`` with ``g, u = gu.chunk(2, -1)`` [N, F]."""
    if gu_NF2.dim() != 2 or gu_NF2.shape[1] % (2 * WIDTH) or w_N.shape != gu_NF2.shape[:1] or not usable(gu_NF2, w_N):
        return None
    return _call("swiglu_weighted", gu_NF2, w_N)


@registry.fused("rmsnorm", "cpu")
def rmsnorm(x: Tensor, w_D: Tensor, eps: float) -> Tensor | None:
    """RMSNorm of x over its last dim with weight [D]."""
    if x.dim() < 1 or w_D.dim() != 1 or w_D.shape[0] != x.shape[-1] or x.shape[-1] % WIDTH or not usable(x, w_D):
        return None
    return _call("rmsnorm", x, w_D, eps)[0]


@registry.fused("qk_norm_rope", "cpu")
def qk_norm_rope(qkv: Tensor, norm_Hd: Tensor | None, cos: Tensor, sin: Tensor, hk: int, eps: float
                 ) -> tuple[Tensor, Tensor] | None:
    """From q/k/v heads ``qkv`` [..., T, hk + hv, d] (q and k heads first): (qk [..., T, hk, d]: per-head
    RMSNorm with ``norm_Hd`` [hk, d] (None: no norm), then rotary with cos/sin [..., T, d]; v [..., T, hv, d]).
    No gradient to cos/sin is computed: they must not need one."""
    d = qkv.shape[-1]
    if (qkv.dim() < 3 or d % (2 * WIDTH) or d > 512 or cos.shape != qkv.shape[:-2] + (d,) or sin.shape != cos.shape
            or cos.requires_grad or sin.requires_grad
            or (norm_Hd is not None and norm_Hd.shape != (hk, d))
            or not usable(qkv, cos, sin, *(() if norm_Hd is None else (norm_Hd,)), traced=True)):
        return None
    qk, v, _ = _call("qk_norm_rope", qkv, norm_Hd, cos, sin, hk, eps)
    return qk, v


def prefix_plan(prompt_valid_PT: Tensor, resp_valid_BR: Tensor, counts_P: Tensor
                ) -> tuple[Tensor, Tensor, Tensor] | None:
    """What ``prefix_attention`` takes of the packed layout, once per forward: (prompt validity [P, Tp] and
    response validity [B, R] as uint8, row_start [P + 1]: the rows of prompt p are [row_start[p],
    row_start[p + 1])); None when the kernels are unavailable or ``counts_P`` is not a grouping of the B
    rows (negative, or not summing to B)."""
    (P, _), (B, _) = prompt_valid_PT.shape, resp_valid_BR.shape
    if counts_P.shape != (P,) or not available():
        return None
    row_start = torch.cat([counts_P.new_zeros(1), counts_P.cumsum(0)]).to(torch.int64).cpu()
    if int(row_start[-1]) != B or bool((counts_P < 0).any()):
        return None
    u8 = lambda t: t.to(torch.uint8).cpu().contiguous()  # noqa: E731
    return u8(prompt_valid_PT), u8(resp_valid_BR), row_start


def prefix_attention_kernel(qk_NHd: Tensor, v_NKd: Tensor, n_q: int, plan: tuple[Tensor, Tensor, Tensor]
                            ) -> Tensor | None:
    """``ops.prefix_attention`` in one kernel (forward and backward), on a ``prefix_plan``."""
    pvalid, rvalid, row_start = plan
    N, HK, d = qk_NHd.shape
    K = HK - n_q
    (P, Tp), (B, R) = pvalid.shape, rvalid.shape
    if d % WIDTH or K < 1 or n_q % K or v_NKd.shape != (N, K, d) or N != P * Tp + B * R or not usable(qk_NHd, v_NKd):
        return None
    return _call("prefix_attention", qk_NHd, v_NKd, n_q, pvalid, rvalid, row_start)[0]


@registry.fused("prefix_attention", "cpu")
def prefix_attention(qk_NHd: Tensor, v_NKd: Tensor, n_q: int, layout) -> Tensor | None:
    if not usable(qk_NHd, v_NKd):
        return None
    plan = layout.derived("cpu_kernel_plan", lambda: prefix_plan(layout.prompt_valid_PT, layout.resp_valid_BR,
                                                                  layout.counts_P))
    return None if plan is None else prefix_attention_kernel(qk_NHd, v_NKd, n_q, plan)


def moe_small_experts(x_ND: Tensor, w_NK: Tensor, idx_NK: Tensor, gate_up_t_EDF2: Tensor, down_t_EFD: Tensor
                      ) -> Tensor | None:
    """sum_k w_nk * down_e(silu(gate_e x_n) * up_e x_n), e = idx_nk, from the experts' weights transposed
    (``gate_up_t`` [E, D, 2F]: gate then up columns; ``down_t`` [E, F, D]), for inference (no gradient).
    Allowed inside torch.compile (an operator with a fake implementation)."""
    ts = (x_ND, w_NK, gate_up_t_EDF2, down_t_EFD)
    if (gate_up_t_EDF2.dim() != 3 or down_t_EFD.dim() != 3 or idx_NK.dim() != 2 or idx_NK.shape[1] < 1
            or (torch.compiler.is_compiling() and _state is None)):  # not loaded: do not trace the loader
        return None
    E, D, F2 = gate_up_t_EDF2.shape
    if (any(registry.computes_as(t) != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in ts)
            or idx_NK.dtype != torch.int64 or not idx_NK.is_contiguous() or registry.computes_as(idx_NK) != "cpu"
            or w_NK.shape != idx_NK.shape or idx_NK.shape[0] != x_ND.shape[0]
            or (torch.is_grad_enabled() and any(t.requires_grad for t in ts))
            or x_ND.dim() != 2 or x_ND.shape[1] != D or D % (2 * WIDTH) or F2 % (4 * WIDTH)
            or down_t_EFD.shape != (E, F2 // 2, D)
            or not available()):
        return None
    return _call("moe_small_experts", x_ND, w_NK, idx_NK, gate_up_t_EDF2, down_t_EFD)


@registry.fused("route_logits", "cpu")
def route(logits_NE: Tensor, k: int, norm: bool, with_aux: bool = False) -> tuple[Tensor, Tensor] | None:
    """(weights [N, k], experts [N, k]): softmax over the E logits in float32, the top k (largest first;
    equal probabilities go to the lower expert id, where torch.topk's order is unspecified), renormalized
    to sum 1 when ``norm``. Not with the aux loss (it needs every probability)."""
    if with_aux or logits_NE.dim() != 2 or not 1 <= k <= logits_NE.shape[1] or not usable(logits_NE):
        return None
    w, idx, _ = _call("route", logits_NE, k, norm)
    return w, idx


@registry.fused("counter_noise", "cpu")
def counter_noise(keys_B: Tensor, pos_B: Tensor, vocab: int) -> Tensor | None:
    """``rlflow.ops.counter_noise`` in one pass per row (the reference makes ~15 passes over [B, V] int64)."""
    if keys_B.dim() != 1 or registry.computes_as(keys_B) != "cpu" or not available():
        return None
    return _call("counter_noise", keys_B.long(), pos_B.long(), vocab)


def moe_plan(idx_NK: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """(order, tok, inv [N*K] int64, offs [E] int32): the (token, slot) pairs sorted by expert, stably
    (order[j]: the pair at sorted position j, tok[j] its token, inv[pair] its position), and the end of
    each expert's block; None when the kernels are unavailable (or idx is not a CPU int64 [N, K])."""
    if idx_NK.dim() != 2 or idx_NK.dtype != torch.int64 or registry.computes_as(idx_NK) != "cpu" or not available():
        return None
    return _call("moe_plan", idx_NK, n_experts)


def gather_rows(x_ND: Tensor, tok: Tensor, inv: Tensor, k: int) -> Tensor:
    """x[tok] ([N*K, D], rows sorted by expert, from ``moe_plan``), whose backward sums each token's K rows
    (no zero fill and index_add). x: float32 CPU, D a multiple of 8."""
    return _call("gather_rows", x_ND, tok, inv, k)


def combine_rows(ys: Tensor, tok: Tensor, inv: Tensor, k: int) -> Tensor:
    """[N, D]: row n = the sum of the K rows of ``ys`` (sorted by expert) that token n was routed to."""
    return _call("combine_rows", ys, tok, inv, k)


def moe_grouped_f32(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF):
    """The grouped expert path in float32 with the kernels: pairs sorted by a counting sort, the SwiGLU
    with the routing weight folded in ((w a) down = w (a down)), each token's rows summed; None where the
    kernels do not apply."""
    _, F2, D = gate_up_E2FD.shape
    if (not moe._grouped_mm_ok(x_ND, down_EDF) or D % WIDTH or F2 % (2 * WIDTH)
            or not usable(x_ND, w_NK, gate_up_E2FD, down_EDF)):
        return None
    K = idx_NK.shape[1]
    order, tok, inv, offs = moe_plan(idx_NK, gate_up_E2FD.shape[0])
    xs = gather_rows(x_ND, tok, inv, K)
    gu = F.grouped_mm(xs, gate_up_E2FD.transpose(1, 2), offs=offs)
    a = swiglu_weighted(gu, w_NK.reshape(-1).index_select(0, order))
    return combine_rows(F.grouped_mm(a, down_EDF.transpose(1, 2), offs=offs), tok, inv, K)


@registry.fused("moe_experts", "cpu")
def moe_experts(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF, prepared):
    """Few tokens on small experts: the small-experts kernel on ``prepared`` (inference), else the dense
    path with the SwiGLU kernel; otherwise the grouped path with the kernels (half precision on small
    experts computed in float32, as the reference does). None without the kernels."""
    if not available():
        return None
    N, K = idx_NK.shape
    E = gate_up_E2FD.shape[0]
    if N <= moe.DENSE_MAX_TOKENS and moe._small(gate_up_E2FD, down_EDF):
        y = None if prepared is None else moe_small_experts(x_ND, w_NK, idx_NK, *prepared)
        if y is not None:
            return y
        if N * K >= E:
            return moe._moe_dense(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF, swiglu=swiglu_weighted)
    return moe._moe_grouped(x_ND, w_NK, idx_NK, gate_up_E2FD, down_EDF, fused_f32=moe_grouped_f32)


@registry.fused("prepare_experts", "cpu")
def prepare_experts(gate_up_E2FD: Tensor, down_EDF: Tensor) -> tuple | None:
    """The small-experts kernel's transposed weights (gate_up [E, D, 2F], down [E, F, D]); None where it
    would not run (so nothing is copied for nothing)."""
    if not (gate_up_E2FD.dtype == torch.float32 and moe._small(gate_up_E2FD, down_EDF) and available()):
        return None
    return gate_up_E2FD.transpose(1, 2).contiguous(), down_EDF.transpose(1, 2).contiguous()
