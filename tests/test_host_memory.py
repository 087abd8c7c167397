"""rlflow.device.keep_host_memory: freed host tensors are reused instead of being faulted in afresh."""

import subprocess
import sys

import pytest

from rlflow import device

STEP = """
import resource, sys, torch
from rlflow import device
if sys.argv[1] == "keep":
    assert device.keep_host_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a training step's activations: many 1 MiB tensors alive together, all freed at its end
    x = [torch.ones(2**18) for _ in range(64)]
    del x
step()
f0 = faults()
for _ in range(10):
    step()
print((faults() - f0) / 10)
"""


def _faults_per_step(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_keep_host_memory_stops_refaulting_freed_activations():
    if not device.keep_host_memory():
        pytest.skip("not glibc: mallopt unavailable")
    default, kept = _faults_per_step("default"), _faults_per_step("keep")
    # 64 MiB freed per step: glibc trims or unmaps it, so each step faults thousands of fresh pages back in
    assert default > 1000, default
    assert kept < default / 4, (kept, default)
