"""The CUDA backend's entries on CUDA tensors, through the registry as the model calls them, against the references
(marked cuda: skipped without a GPU, run by bench/gpu_check.sh); and bench/ops_cuda.py checking itself on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import moe_reference

from rlflow import ops
from rlflow.ops import registry

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.cuda
def test_rmsnorm_on_cuda_is_within_a_rounding_of_the_reference():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 2048, generator=g) * 3).cuda().bfloat16()
    w = (1 + torch.randn(2048, generator=g) / 4).cuda().bfloat16()
    torch.testing.assert_close(ops.rmsnorm(x, w, 1e-6).float(), registry.get_reference("rmsnorm")(x, w, 1e-6).float(),
                               rtol=2 ** -7, atol=2 ** -7 * 8)


@pytest.mark.cuda
@pytest.mark.parametrize("N", [8, 512])  # the dense path's few tokens; the grouped GEMM's many
def test_moe_experts_on_cuda_equal_the_reference_values_and_gradients(N):
    g = torch.Generator().manual_seed(1)
    E, K, D, Fd = 16, 4, 256, 128
    w, idx = torch.softmax(torch.randn(N, E, generator=g), -1).topk(K, -1)
    base = [torch.randn(N, D, generator=g), w, torch.randn(E, 2 * Fd, D, generator=g) / 16,
            torch.randn(E, D, Fd, generator=g) / 16]
    leaves = [t.cuda().bfloat16().requires_grad_(True) for t in base]
    y = ops.moe_experts(leaves[0], leaves[1], idx.cuda(), leaves[2], leaves[3])
    dy = torch.randn(N, D, generator=g)
    grads = torch.autograd.grad(y, leaves, dy.cuda().bfloat16())
    ref_leaves = [t.detach().double().cpu().requires_grad_(True) for t in leaves]
    ref = moe_reference(ref_leaves[0], ref_leaves[1], idx, ref_leaves[2], ref_leaves[3])
    scale = ref.abs().max().item()
    torch.testing.assert_close(y.double().cpu(), ref, atol=2e-2 * scale, rtol=2e-2)
    for a, b in zip(grads, torch.autograd.grad(ref, ref_leaves, dy.double())):
        torch.testing.assert_close(a.double().cpu(), b, atol=3e-2 * b.abs().max().item(), rtol=3e-2)


def test_the_ops_bench_checks_and_times_every_path_on_the_cpu():
    out = subprocess.run([sys.executable, "bench/ops_cuda.py", "--device", "cpu", "--dtype", "float32", "--preset",
                          "qwen3-moe-tiny", "--repeats", "1", "--train-tokens", "256"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for what in ("decode", "train"):
        assert set(got["experts"][what]["ms"]) == {"grouped_mm", "sort_and_index", "reference"}
        assert got["experts"][what]["over_grouped_mm"]["grouped_mm"] == 1.0
        assert got["rmsnorm"][what]["ms"]["fused"] > 0 and got["rmsnorm"][what]["ms"]["reference"] > 0
