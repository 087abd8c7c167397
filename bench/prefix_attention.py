"""The CPU prefix-attention kernel (``ops/backends/cpu_kernels.c``) at the GRPO update's packed shape, forward
and backward, against the torch path (two SDPA calls over the same packed layout) in the same run.

Shape (defaults: the e2e toy benchmark's update): P prompts of Tp tokens, B rows of R response tokens, H query
heads over K kv heads of head_dim d, float32. Figures: the median of ``--repeats`` calls, milliseconds.

    .venv/bin/python bench/prefix_attention.py --head-dim 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rlflow.ops import PrefixLayout
from rlflow.ops.attention import prefix_attention_reference
from rlflow.ops.backends import cpu


def median_ms(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--response-len", type=int, default=31)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args(argv)
    if not cpu.available():
        raise SystemExit(f"the CPU kernels are not available: {cpu.unavailable_reason}")
    P, Tp, B, R, H, K, d = a.prompts, a.prompt_len, a.rows, a.response_len, a.heads, a.kv_heads, a.head_dim
    g = torch.Generator().manual_seed(0)
    pv = torch.ones(P, Tp, dtype=torch.bool)
    pv[:, :3] = False  # left padding
    rv = torch.ones(B, R, dtype=torch.bool)
    rv[::3, R - 6:] = False  # some rows end early
    counts = torch.full((P,), B // P)
    plan = cpu.prefix_plan(pv, rv, counts)
    N = P * Tp + B * R
    qk, v = torch.randn(N, H + K, d, generator=g), torch.randn(N, K, d, generator=g)
    o, lse = cpu.ops.prefix_attention(qk, v, H, *plan)
    do = torch.randn(o.shape, generator=g)
    fwd = median_ms(lambda: cpu.ops.prefix_attention(qk, v, H, *plan), a.repeats)
    bwd = median_ms(lambda: cpu.ops.prefix_attention_backward(qk, v, H, *plan, o, lse, do), a.repeats)
    layout = PrefixLayout(pv, rv, counts)
    qk_g, v_g = qk.clone().requires_grad_(True), v.clone().requires_grad_(True)

    def torch_fwd_bwd():
        out = prefix_attention_reference(qk_g, v_g, H, layout)
        out.backward(do)
    ref = median_ms(torch_fwd_bwd, max(3, a.repeats // 5))
    res = dict(shape=dict(P=P, Tp=Tp, B=B, R=R, H=H, K=K, d=d), kernel_fwd_ms=round(fwd, 3), kernel_bwd_ms=round(bwd, 3),
               torch_fwd_bwd_ms=round(ref, 3), ratio=round(ref / (fwd + bwd), 2), threads=torch.get_num_threads())
    print(f"prefix attention, d={d}: kernel forward {fwd:.3f} ms, backward {bwd:.3f} ms; torch path forward + "
          f"backward {ref:.3f} ms: kernel {res['ratio']}x faster (median of {a.repeats} calls, "
          f"{torch.get_num_threads()} threads)")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
