"""The CUDA backend's entries (``ops/backends/cuda.py``) against the paths they replace, timed in the same run on
one layer of a model's shapes: the experts (torch's grouped GEMM; the sort-and-index path; the reference's loop over
the experts, one GEMM each after a host sync) and RMSNorm (torch's fused kernel; the reference's six), forward
alone (decode: ``--tokens`` a replica's rows) and forward + backward (training: ``--train-tokens``).

Figures: the median of ``--repeats`` calls in milliseconds (the device synchronized around each), and each path's
time over the CUDA entry's (the ratio > 1: the entry is faster). Every path's output is checked against the
reference's first. On a CPU (``--device cpu``, float32: torch's CPU grouped GEMM) it only checks itself.

    python bench/ops_cuda.py                                   # Qwen3-30B-A3B's layer, bfloat16, on CUDA
    python bench/ops_cuda.py --device cpu --dtype float32 --preset qwen3-moe-tiny --repeats 3
"""

from __future__ import annotations

import argparse
import json

import torch

from rlflow.models.config import get_config
from rlflow.ops import moe, registry
from rlflow.ops.backends import cuda

from prefix_attention import median_ms  # bench/'s timing of a call

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _synced(fn, device: torch.device):
    """``fn`` that returns once the device's work is done (``median_ms`` times it from the host)."""
    if device.type != "cuda":
        return fn
    return lambda: (fn(), torch.cuda.synchronize(device))[0]


def _experts(cfg, N: int, dtype, device, g) -> tuple:
    E, K, D, Fd = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    x = torch.randn(N, D, generator=g).to(device, dtype)
    w, idx = torch.softmax(torch.randn(N, E, generator=g), -1).topk(K, -1)
    gate_up = (torch.randn(E, 2 * Fd, D, generator=g) / D ** 0.5).to(device, dtype)
    down = (torch.randn(E, D, Fd, generator=g) / Fd ** 0.5).to(device, dtype)
    return x, w.to(device, dtype), idx.to(device), gate_up, down


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-moe-30b-a3b", help="the model whose layer's shapes are timed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--tokens", type=int, default=256, help="a decode step's rows (forward alone)")
    ap.add_argument("--train-tokens", type=int, default=8192, help="a micro-batch's tokens (forward + backward)")
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (try --device cpu --dtype float32)")
    for name, v in (("--tokens", a.tokens), ("--train-tokens", a.train_tokens), ("--repeats", a.repeats)):
        if v < 1:
            raise SystemExit(f"{name} {v}: at least 1")
    cfg = get_config(a.preset)
    if not cfg.num_experts:
        raise SystemExit(f"--preset {a.preset}: a dense model (no experts to time)")
    g = torch.Generator().manual_seed(0)
    grouped = device.type == "cpu" or cuda.grouped_mm_ok(torch.empty(0, device=device, dtype=dtype),
                                                         torch.empty(1, cfg.hidden_size, cfg.moe_intermediate_size,
                                                                     device=device, dtype=dtype))
    # the reference's grouped path: on CUDA a loop over the experts after a host sync (on a CPU its grouped GEMM)
    paths = {"sort_and_index": lambda *t: cuda.moe_experts_nosync(*t, grouped_mm=False),
             "reference": lambda *t: moe._moe_grouped(*t)}
    if grouped:
        paths = {"grouped_mm": lambda *t: cuda.moe_experts_nosync(*t, grouped_mm=True), **paths}
    out: dict = {"bench": "ops_cuda", "device": str(device), "dtype": a.dtype, "preset": a.preset,
                 "experts": {}, "rmsnorm": {}}
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    for what, N in (("decode", a.tokens), ("train", a.train_tokens)):
        x, w, idx, gate_up, down = _experts(cfg, N, dtype, device, g)
        leaves = [t.requires_grad_(what == "train") for t in (x, w, gate_up, down)]
        ref = paths["reference"](leaves[0], leaves[1], idx, leaves[2], leaves[3]).detach()
        times = {}
        for name, f in paths.items():
            def call(f=f):
                y = f(leaves[0], leaves[1], idx, leaves[2], leaves[3])
                if what == "train":
                    y.sum().backward()
                return y
            torch.testing.assert_close(call().detach(), ref, **tol)
            times[name] = median_ms(_synced(call, device), a.repeats)
        first = next(iter(times))
        out["experts"][what] = {"tokens": N, "ms": times, f"over_{first}": {k: v / times[first]
                                                                             for k, v in times.items()}}
    for what, N in (("decode", a.tokens), ("train", a.train_tokens)):
        x = torch.randn(N, cfg.hidden_size, generator=g).to(device, dtype).requires_grad_(what == "train")
        wn = (1 + torch.randn(cfg.hidden_size, generator=g) / 4).to(device, dtype).requires_grad_(what == "train")
        fns = {"fused": lambda: cuda.rmsnorm(x, wn, 1e-6), "reference": lambda: registry.get_reference("rmsnorm")(
            x, wn, 1e-6)}
        times = {}
        for name, f in fns.items():
            def call(f=f):
                y = f()
                if what == "train":
                    y.sum().backward()
                return y
            torch.testing.assert_close(call().detach(), fns["reference"]().detach(), **tol)
            times[name] = median_ms(_synced(call, device), a.repeats)
        out["rmsnorm"][what] = {"tokens": N, "ms": times, "reference_over_fused": times["reference"] / times["fused"]}
    for part in ("experts", "rmsnorm"):
        for what, r in out[part].items():
            print(f"{part} {what} ({r['tokens']} tokens, {a.dtype} on {device}): "
                  + ", ".join(f"{k} {v:.3f} ms" for k, v in r["ms"].items()))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
