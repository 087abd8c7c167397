"""What a step costs, from its trace: each stage's ops (``RankTrace.stage_ops``: per aten op its FLOPs, the bytes
it reads and writes and the fresh memory it makes; per collective its bytes) priced at a device's rates
(``Rates``).

An op costs its issue (``op_s``: rlflow's Python, torch's dispatch, a launch) and its work: the longer of its FLOPs
at the matmul rate and its bytes at the memory rate (a roofline per op: decode's matmuls are bound by the
weights' bytes, training's by FLOPs), plus the first touch of the fresh memory it makes (a CPU's page faults). On
a CPU the host does the work, so issue and work add up; on an accelerator's queue (``Rates.queued``) an op
costs the longer of the two. A collective costs ``link_s`` and its bytes at the link's rate. Rates depend on an
op's size (a small matmul does not reach the peak, a small copy stays in cache): each is a table over sizes,
interpolated in log-log. ``dryrun.calibrate.measure`` fills the tables on the device at hand with micro-benchmarks;
``DATASHEETS`` holds accelerators' published figures.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

_ATTENTION = {p for p in flop_registry if "attention" in str(p)}
# ops that move no data: their cost is the dispatch alone, and for those making memory (``_EMPTIES``) its first
# touch: on a CPU the page faults of a block fresh from the kernel come at its first write (a copy into it), whichever
# op writes first
_EMPTIES = {"aten.empty", "aten.empty_strided", "aten.empty_like", "aten.new_empty", "aten.new_empty_strided"}
_SHAPE_ONLY = {*_EMPTIES, "aten.lift_fresh", "aten._local_scalar_dense", "aten.sym_size", "aten.sym_stride",
               "aten.is_same_size", "aten.set_", "aten.resize_", "aten.record_stream"}

# in-place writes of indexed rows, by the position of their source: they touch the rows written (their source's
# bytes, read again where they accumulate), not the whole destination (a decode step's KV cache)
_INDEXED_WRITES = {"aten.index_put_": (2, False), "aten.index_copy_": (3, False), "aten.index_add_": (3, True),
                   "aten.scatter_": (3, False), "aten.scatter_add_": (3, True)}


@dataclass(frozen=True)
class OpCost:
    """One op as issued: its name (``aten.mm``, ``c10d.allgather_``), the dtype of its first output, its FLOPs
    (matmuls and attention; 0 otherwise), the bytes it reads and writes (a collective: the bytes it hands over),
    of those the bytes of outputs it makes (not written in place: fresh memory), and for a matmul its kernel
    (``MATMULS``) and its smallest dimension (of a group's: a grouped matmul's rows or contraction per group),
    what its rate depends on."""
    op: str
    dtype: str
    flops: int
    bytes: int
    fresh: int = 0
    kernel: str = ""
    small: int = 0


# ops of other libraries whose FLOPs torch does not count: name -> fn(args, out) -> (FLOPs, ``MATMULS`` kernel,
# smallest dimension) (``dryrun.npu_kernels``' stood-in NPU kernels register theirs)
FLOPS: dict = {}

HOST_COPY = "host.copy"  # a dry run's copy between the device and the host (a swap): its bytes over ``Rates.host``

# by the dimension that is smallest: a matmul's (or a batched one's) rows, contraction or columns; grouped ones'
# rows per group, or contraction per group (the weights' gradient)
MATMULS = ("mm", "mm_k", "mm_n", "grouped_mm", "grouped_mm_k")


def mm_kernel(m: int, k: int, n: int) -> tuple[str, int]:
    """A matmul's kernel (``MATMULS``) and smallest dimension from its rows, contraction and columns."""
    small = min(m, k, n)
    return ("mm" if small == m else "mm_k" if small == k else "mm_n"), small


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for a in x:
            yield from _tensors(a)


def op_cost(func, args, kwargs, out) -> OpCost | None:
    """The cost of one dispatched op; None for a view (it moves nothing and is not dispatched to a device) and a
    metadata query (``prim.device``: a fake tensor's device asked through the dispatch)."""
    if func.is_view or func.namespace == "prim":
        return None
    name = str(func._overloadpacket)
    outs = list(_tensors(out))
    dtype = str(outs[0].dtype).removeprefix("torch.") if outs else ""
    if func.namespace == "c10d":
        return OpCost(name, dtype, 0, sum(t.numel() * t.element_size() for t in _tensors((args, kwargs))))
    if name in _SHAPE_ONLY:
        return OpCost(name, dtype, 0, 0, sum(t.numel() * t.element_size() for t in outs) if name in _EMPTIES else 0)
    flops, kernel, small = 0, "", 0
    if name in FLOPS:
        flops, kernel, small = FLOPS[name](args, out)
    elif name == "aten._grouped_mm":  # (a, b, offs, ..): each of a's rows times one group's [K, N]; torch counts none
        a, b = args[0], args[1]
        flops = 2 * a.numel() * b.shape[-1]
        if b.dim() == 3:  # a [M, K] rows in groups, b [G, K, N]
            kernel, small = "grouped_mm", min(a.shape[-2] // max(b.shape[0], 1), *b.shape[1:])
        else:  # a [M, K], b [K, N], the contraction in groups: [G, M, N]
            kernel, small = "grouped_mm_k", min(a.shape[0], a.shape[1] // max(args[2].numel(), 1), b.shape[1])
    elif name in ("aten.linear", "aten.matmul"):  # whole under inference mode (undecomposed): torch counts none
        flops = 2 * outs[0].numel() * args[0].shape[-1]
        rows = outs[0].numel() // outs[0].shape[-1] if name == "aten.linear" else outs[0].shape[-2]  # matmul: batched
        kernel, small = mm_kernel(rows if outs[0].dim() > 1 else 1, args[0].shape[-1], outs[0].shape[-1])
    elif name in ("aten._scaled_dot_product_flash_attention_for_cpu", "aten.scaled_dot_product_attention"):
        # (q, k, v, ..): the CPU's kernel, and SDPA whole under inference mode; torch counts neither
        flops = sdpa_flop_count(*(a.shape for a in args[:3]))
        kernel, small = mm_kernel(args[0].shape[-2], args[0].shape[-1], args[1].shape[-2])
    elif name == "aten._scaled_dot_product_flash_attention_for_cpu_backward":  # (grad_out, q, k, v, ..)
        flops = sdpa_backward_flop_count(*(a.shape for a in args[:4]))
        kernel, small = mm_kernel(args[1].shape[-2], args[1].shape[-1], args[2].shape[-2])
    elif func._overloadpacket in flop_registry:
        flops = int(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
        mats = [t for t in _tensors(args) if t.dim() >= 2][-2:] if name.startswith(("aten.mm", "aten.bmm", "aten.addmm",
                                                                                  "aten.baddbmm")) else []
        if len(mats) == 2:  # (a, b), (bias, a, b): a [.., M, K], b [.., K, N]
            kernel, small = mm_kernel(mats[0].shape[-2], mats[0].shape[-1], mats[1].shape[-1])
        elif func._overloadpacket in _ATTENTION:  # (q, k, ..) or (grad_out, q, k, ..): [B, H, T, d], [B, H, S, d]
            q, k = [t for t in _tensors(args) if t.dim() == 4][-3 if "backward" in name else 0:][:2]
            kernel, small = mm_kernel(q.shape[-2], q.shape[-1], k.shape[-2])
    ins = {id(t): t for t in _tensors((args, tuple(kwargs.values())))}  # each read once; each output written
    nbytes = sum(t.numel() * t.element_size() for t in [*ins.values(), *outs])
    src = _INDEXED_WRITES.get(name)
    if src is not None and len(args) > src[0] and isinstance(args[src[0]], torch.Tensor):
        dest, rows = args[0], args[src[0]].numel() * args[0].element_size()
        adds = src[1] or (name == "aten.index_put_" and len(args) > 3 and bool(args[3]))  # accumulate=True
        nbytes += rows * (2 if adds else 1) - 2 * dest.numel() * dest.element_size()
    fresh = sum(t.numel() * t.element_size() for t in outs if id(t) not in ins)
    return OpCost(name, dtype, flops, nbytes, fresh, kernel if flops else "", small if flops else 0)


def count(stage_ops: dict, stage: str, func, args, kwargs, out) -> OpCost | None:
    """Adds one op to ``stage_ops[stage]`` (a ``Counter`` of ``OpCost``); its cost (None: a view)."""
    c = op_cost(func, args, kwargs, out)
    if c is not None:
        stage_ops.setdefault(stage, Counter())[c] += 1
    return c


@dataclass(frozen=True)
class Rates:
    """A device's rates. ``matmul["mm:bfloat16"]`` (a matmul's kernel, ``MATMULS``, and dtype), ``memory`` and
    ``fresh``: (size, rate) pairs, size ascending (a matmul's smallest dimension and FLOP/s; bytes an op moves and
    bytes/s; bytes of new outputs and the rate memory is first touched at: a CPU's page faults, none on an
    accelerator's caching allocator, and none at or below ``fresh_from`` bytes), interpolated in log-log and flat
    beyond the ends."""
    name: str
    matmul: dict[str, tuple[tuple[float, float], ...]]
    memory: tuple[tuple[float, float], ...]
    fresh: tuple[tuple[float, float], ...]
    op_s: float  # the host's seconds to issue an op of rlflow's code: its Python, torch's dispatch, a launch
    link: float  # bytes/s a collective moves
    link_s: float  # seconds a collective costs beyond its bytes
    queued: bool = False  # the device runs ops while the host issues the next (an accelerator's stream): an op
    # costs the longer of its issue and its work; on a CPU the host does the work, and the two add up
    kernel_s: float = 0.0  # the least time the device spends on a kernel (an accelerator's launch)
    host: float = math.inf  # bytes/s between the device and the host (a swap; a CPU's own memory: free)
    fresh_from: float = 0.0  # bytes of new outputs above which their memory is fresh (a CPU's mmap threshold:
    # smaller blocks are freed memory reused)

    def seconds(self, op: OpCost) -> float:
        return self.issued(self.work(op))

    def issued(self, work: float) -> float:
        """An op's seconds from its device work: with its issue added, or on a queue the longer of the two."""
        return max(self.op_s, work) if self.queued else self.op_s + work

    def work(self, op: OpCost) -> float:
        """The device's time on ``op``, its issue left out."""
        if op.op.startswith("c10d."):
            return self.link_s + op.bytes / self.link
        if op.op == HOST_COPY:
            return op.bytes / self.host
        t = op.bytes / _rate(self.memory, op.bytes) if op.bytes else 0.0
        if self.fresh and op.fresh > self.fresh_from:
            t += op.fresh / _rate(self.fresh, op.fresh)
        if op.op in _SHAPE_ONLY:  # no kernel
            return t
        if op.flops:
            kernel = op.kernel or "mm"  # other counted ops: as matmuls at their peak
            table = self.matmul.get(f"{kernel}:{op.dtype}") or self.matmul[f"{kernel}:float32"]
            t = max(t, op.flops / _rate(table, op.small or table[-1][0]))
        return max(t, self.kernel_s)


def _rate(table, size: float) -> float:
    sizes = [s for s, _ in table]
    i = bisect.bisect_left(sizes, size)
    if i == 0:
        return table[0][1]
    if i == len(table):
        return table[-1][1]
    (s0, r0), (s1, r1) = table[i - 1], table[i]
    w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))


@dataclass(frozen=True)
class StageCost:
    """One stage's totals and its predicted seconds at some rates: ``seconds`` the sum of its ops' (``Rates.seconds``),
    ``issue_s`` and ``work_s`` the host's issue and the device's work summed apart. On a queue the stage takes
    between ``max(issue_s, work_s)`` (the host always ahead, or the device never waiting) and ``seconds`` (every op
    waited for): which, the order of its ops and the host's reads of device values decide."""
    ops: int
    flops: int
    bytes: int
    collective_bytes: int
    seconds: float
    issue_s: float = 0.0
    work_s: float = 0.0

    def scaled(self, k: float) -> "StageCost":
        """The stage run ``k`` times over (a decode step's cost times the steps of a whole response)."""
        return StageCost(round(self.ops * k), round(self.flops * k), round(self.bytes * k),
                         round(self.collective_bytes * k), self.seconds * k, self.issue_s * k, self.work_s * k)


def predict(stage_ops: dict, rates: Rates) -> dict[str, StageCost]:
    """Each stage's totals and time at ``rates``."""
    out = {}
    for stage, ops in stage_ops.items():
        coll = sum(n * c.bytes for c, n in ops.items() if c.op.startswith("c10d."))
        work = {c: rates.work(c) for c in ops}
        out[stage] = StageCost(sum(ops.values()), sum(n * c.flops for c, n in ops.items()),
                               sum(n * c.bytes for c, n in ops.items()) - coll, coll,
                               sum(n * rates.issued(work[c]) for c, n in ops.items()), sum(ops.values()) * rates.op_s,
                               sum(n * work[c] for c, n in ops.items()))
    return out


PIPELINED = ("ref_logprob", "old_logprob", "update")  # the stages a pipeline runs over micro-batches


def whole_step(trace, rates: Rates, *, response_len: int, n_micro: int = 1, pp: int = 1) -> dict[str, StageCost]:
    """A rank's stages (``trace``: a dry step's ``RankTrace``) at ``rates`` as a whole step runs them: the decode
    steps it executed (``trace.decode_steps``) scaled to a response of ``response_len`` tokens (the first is the
    prefill's), and with ``pp`` pipeline stages over ``n_micro`` micro-batches, the pipelined stages stretched by
    the bubble, (n_micro + pp - 1) / n_micro (a stage idles while the first micro-batches reach it and the last
    leave). The dry step runs its decode steps at the response's middle (``run.decode_marked``'s ``advance``):
    their attention spans the whole response's mean."""
    out = predict(trace.stage_ops, rates)
    if "decode" in out and trace.decode_steps:
        out["decode"] = out["decode"].scaled((response_len - 1) / trace.decode_steps)
    for stage in PIPELINED:
        if stage in out and pp > 1:
            out[stage] = out[stage].scaled((n_micro + pp - 1) / n_micro)
    return out


def slowest(traces, rates: Rates, **step) -> dict[str, StageCost]:
    """Each stage of a step whose ranks' traces are ``traces`` (one per shape class) at ``rates``: the slowest rank's
    (``whole_step``'s, with ``step``'s arguments), as a stage ends when its slowest rank's does."""
    costs = [whole_step(t, rates, **step) for t in traces]
    return {s: max((c[s] for c in costs if s in c), key=lambda x: x.seconds)
            for s in dict.fromkeys(s for c in costs for s in c)}


def bounds(stages: dict[str, StageCost]) -> tuple[float, float, float]:
    """A step of ``stages`` on a queue: between the longer of each stage's summed issue and work (the host always
    ahead) and the sum of each op's longer one (every op waited for), and the first with the decode steps at their
    device work alone (a captured graph's, the host's issue gone)."""
    lo = sum(max(c.issue_s, c.work_s) for c in stages.values())
    hi = sum(c.seconds for c in stages.values())
    dec = stages.get("decode")
    return lo, hi, lo if dec is None else lo - max(dec.issue_s, dec.work_s) + dec.work_s


@dataclass(frozen=True)
class Datasheet:
    """An accelerator's published figures (per device) and the shares of them a run is assumed to reach: the
    inputs of a prediction for hardware this project has not run on, printed with it."""
    name: str
    memory: float  # bytes of device memory
    bf16_flops: float  # dense matmul peak, FLOP/s
    fp32_flops: float
    hbm: float  # memory bandwidth, bytes/s
    link: float  # bytes/s a device's collective moves (the links within its node or pod)
    host: float  # bytes/s between the device and the host (the swap of the train state)
    link_s: float = 10e-6  # a collective's latency
    kernel_s: float = 2e-6  # the least time a kernel takes
    mfu: float = 0.6  # the share of the peak a large matmul reaches
    hbm_eff: float = 0.8  # the share of the bandwidth a streaming op reaches
    tile: int = 64  # a matmul's smallest dimension below which its tiles are partly idle (its rate in proportion)

    def rates(self, op_s: float) -> Rates:
        """Its ``Rates`` with the host issuing an op in ``op_s`` (rlflow's Python and torch's dispatch: measured on
        a host, ``issue_seconds``)."""
        def mm(peak):
            return ((1.0, peak * self.mfu / self.tile), (float(self.tile), peak * self.mfu))
        matmul = {f"{k}:{d}": mm(self.bf16_flops if d == "bfloat16" else self.fp32_flops)
                  for k in MATMULS for d in ("bfloat16", "float32")}
        return Rates(self.name, matmul, ((1.0, self.hbm * self.hbm_eff),), (), op_s, self.link, self.link_s,
                     queued=True, kernel_s=self.kernel_s, host=self.host)


# vendors' figures as published, not checked on a device (none has been lent to this project)
DATASHEETS = {
    # NVIDIA H200 SXM: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32 (no TF32: torch's default), 4.8 TB/s HBM3e, 141 GB;
    # NVLink 4 at 450 GB/s each way; PCIe 5 x16 to the host (64 GB/s)
    "h200": Datasheet("NVIDIA H200", 141e9, 989e12, 67e12, 4.8e12, 450e9 * 0.8, 64e9 * 0.8),
    # Ascend 910B (Atlas 800T A2 class): about 313 TFLOP/s bf16, 1.6 TB/s HBM, 64 GB; HCCS 8-way mesh at 196 GB/s
    # each way; PCIe 4 x16 to the host (32 GB/s); fp32 matmuls assumed at a quarter of bf16
    "910b": Datasheet("Ascend 910B", 64e9, 313e12, 313e12 / 4, 1.6e12, 196e9 * 0.8, 32e9 * 0.8),
}


__all__ = ["DATASHEETS", "FLOPS", "HOST_COPY", "Datasheet", "OpCost", "Rates", "StageCost", "count", "op_cost",
           "bounds", "mm_kernel", "predict", "slowest", "whole_step"]
