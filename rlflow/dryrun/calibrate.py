"""The rates of the device at hand (``cost.Rates``), by micro-benchmark: what issuing an op of rlflow's code costs
(``issue_seconds``), matmuls by kernel, dtype and smallest dimension from cold caches, copies into memory in use and
into fresh memory, and the link of the process group (``link_seconds``): ``measure``."""

from __future__ import annotations

import math
import mmap
import time

import torch

from rlflow.device import MMAP_THRESHOLD, process_device
from rlflow.dryrun.cost import MATMULS, Rates
from rlflow.dryrun.trace import RankTrace, Watch


def _timed(fn, min_s: float = 0.05, flush=None) -> float:
    """Seconds one call of ``fn`` takes: the best of 3 batches of calls lasting at least ``min_s`` each. With
    ``flush`` (run before each call, untimed): from cold caches, the median of 3 to 50 calls. In a process group
    every member times its calls at once, as many as the slowest needs (``_anyone``): a step's ranks run the same
    kernels at once, contending for the memory and the caches they share."""
    fn()
    if flush is not None:
        times = []
        while True:
            flush()
            if not _anyone(len(times) < 3 or (sum(times) < min_s and len(times) < 50)):
                break
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    n, best = 1, math.inf
    while True:
        _anyone(True)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if not _anyone(dt < min_s):
            break
        n *= 2
    for _ in range(3):
        _anyone(True)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def _into_fresh(x: torch.Tensor) -> None:
    """``x`` (a CPU tensor, flat) copied into memory fresh from the kernel and handed back: an anonymous mapping,
    as glibc maps a block above its threshold (a clone could reuse a free chunk of the heap, without a fault)."""
    m = mmap.mmap(-1, x.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    torch.frombuffer(m, dtype=x.dtype).copy_(x)
    del m  # unmapped with the tensor that held it


def _anyone(want: bool) -> bool:
    """Whether any member of the default process group wants ``want`` (one process: its own): the members agree
    on a loop's next turn, and leave this call at once."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return want
    flag = torch.tensor([int(want)], device=process_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def issue_seconds(device: torch.device | str = "cpu", model: str = "qwen3-moe-tiny") -> float:
    """Seconds per op of rlflow's own code at a size where the work is nothing: ``model``'s forward and backward
    on one row of two tokens, its time over its ops (Python, torch's dispatch and autograd per op)."""
    from rlflow.models import decoder
    from rlflow.models.config import get_config
    cfg, device = get_config(model), torch.device(device)
    params = {k: v.to(device).requires_grad_() for k, v in decoder.init_params(cfg, dtype=torch.bfloat16).items()}
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    pos = torch.arange(2, device=device)[None]

    def fwd_bwd():
        h, aux, _ = decoder.forward(params, cfg, ids, pos)
        (decoder.logits(params, cfg, h).float().sum() + aux).backward()

    trace = RankTrace(0)
    with Watch(trace, device=device.type):  # its ops counted as a step's are (``cost.count``)
        fwd_bwd()
    return _timed(fwd_bwd) / sum(n for ops in trace.stage_ops.values() for n in ops.values())


def measure(device: str = "cpu", *, model: str = "qwen3-moe-tiny", dtypes=("bfloat16", "float32")) -> Rates:
    """The rates of ``device`` by micro-benchmark: the issue cost of an op of rlflow's code (``issue_seconds``), per
    dtype and ``MATMULS`` kernel matmuls whose smallest dimension is 1 to 1024 (from cold caches; grouped ones in
    ``model``'s experts' shapes), copies of 4 KiB to 256 MiB into memory in use and into fresh memory, and in a
    process group of two or more its link (``link_seconds``). A rate is the work over the time less a bare op's
    call. Every rank of the group calls it at once: its collectives and its contention for the memory are a
    step's."""
    from rlflow.models.config import get_config
    dev, cfg = torch.device(device), get_config(model)
    op_s = issue_seconds(dev)  # the tiny model's: at two tokens its work is nothing (a 0.5B model's head is not)
    one = torch.ones(1, device=dev)
    call_s = _timed(lambda: torch.add(one, one))  # a bare op's call from Python: the kernels' timings less it
    # a model's working set is far beyond the caches: each matmul timed from cold ones (64 MiB written between)
    junk = torch.zeros(16 << 20, device=dev)
    flush = lambda: junk.sum()  # noqa: E731  (read: no dirty lines left to write back during the timed call)
    randn = lambda *shape: torch.randn(*shape, device=dev, dtype=dt)  # noqa: E731
    matmul = {}
    for name in dtypes:
        dt, n = getattr(torch, name), 1024
        mm, mm_k, mm_n, grouped, grouped_k = [], [], [], [], []
        for s in (1, 4, 16, 64, 256, 1024):  # the smallest dimension (rows, contraction, columns); the others n
            # as a model lays them out: a layer's weight [out, in] transposed (few rows: decode; few columns: a
            # router), the activations transposed against the output's gradient (a weight's gradient)
            for table, (a, b) in ((mm, (randn(s, n), randn(n, n).t())), (mm_k, (randn(s, n).t(), randn(s, n))),
                                  (mm_n, (randn(n, n), randn(s, n).t()))):
                t = _timed(lambda: torch.mm(a, b), flush=flush)
                table.append((float(s), 2.0 * s * n * n / max(t - call_s, 1e-9)))
        # the model's experts (16 of 512 x 512 for a dense one): s rows each through both projections, and (their
        # weights' gradients) s rows of contraction each; a rate is the two's FLOPs over their time
        g, shapes = (cfg.num_experts, ((cfg.hidden_size, 2 * cfg.moe_intermediate_size),
                                       (cfg.moe_intermediate_size, cfg.hidden_size))) if cfg.is_moe \
            else (16, ((512, 512), (512, 512)))
        for s in (1, 4, 16, 64, 256):
            offs = torch.arange(s, g * s + 1, s, device=dev, dtype=torch.int32)
            for table, pair in ((grouped, lambda k, o: (randn(g * s, k), randn(g, o, k).transpose(1, 2))),
                                (grouped_k, lambda k, o: (randn(g * s, o).t(), randn(g * s, k)))):
                t = sum(_timed(lambda: torch._grouped_mm(*ab, offs), flush=flush)
                        for ab in [pair(k, o) for k, o in shapes]) - 2 * call_s
                table.append((float(s), sum(2.0 * g * s * k * o for k, o in shapes) / max(t, 1e-9)))
        matmul.update({f"{k}:{name}": tuple(v) for k, v in zip(MATMULS, (mm, mm_k, mm_n, grouped, grouped_k))})
    memory, fresh = [], []
    # on a CPU glibc maps a block above its mmap threshold afresh at each allocation (at most 32 MiB; exactly that
    # in a process keeping its memory, ``device.keep_host_memory``, as the recipe's): smaller ones reuse freed memory
    fresh_from = float(MMAP_THRESHOLD) if dev.type == "cpu" else math.inf
    for kib in (4, 64, 1024, 16384, 65536, 262144):
        x = torch.ones(kib * 256, device=dev)
        y = torch.ones_like(x)
        t = _timed(lambda: y.copy_(x))
        memory.append((2.0 * x.nbytes, 2.0 * x.nbytes / max(t - call_s, 1e-9)))
        # the copy into fresh memory: its time beyond the copy's is the first touch of its output
        if x.nbytes > fresh_from:
            fresh.append((float(x.nbytes), x.nbytes / max(_timed(lambda: _into_fresh(x)) - t, 1e-9)))
    link, link_s = link_seconds(dev)
    return Rates(f"measured on {device}", matmul, tuple(memory), tuple(fresh), op_s, link=link, link_s=link_s,
                 fresh_from=fresh_from)


def link_seconds(device: torch.device | str = "cpu", small: int = 1 << 10, large: int = 64 << 20
                 ) -> tuple[float, float]:
    """(bytes/s, seconds beyond its bytes) of the default process group's all-reduce of tensors on ``device``: the
    latency from one of ``small`` bytes, the rate from one of ``large`` (a collective's bytes as ``op_cost`` counts
    them: the tensor it hands over). Every member calls it at once. One process: (inf, 0), collectives are free."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return math.inf, 0.0
    a, b = (torch.zeros(n // 4, device=device) for n in (small, large))
    t_small = _timed(lambda: dist.all_reduce(a))
    t_large = _timed(lambda: dist.all_reduce(b))
    return large / max(t_large - t_small, 1e-9), t_small


__all__ = ["issue_seconds", "link_seconds", "measure"]
