"""rlflow.device.keep_host_memory: freed host tensors are reused instead of being faulted in afresh."""

import subprocess
import sys

import pytest

STEP = """
import resource, sys, torch
from rlflow import device
if sys.argv[1] == "keep" and not device.keep_host_memory():
    print("unavailable")
    sys.exit()
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


def _faults_per_step(mode: str) -> str:
    """Run in a fresh process: the settings are process-wide and must not leak into the test session."""
    out = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_keep_host_memory_stops_refaulting_freed_activations():
    kept = _faults_per_step("keep")
    if kept == "unavailable":
        pytest.skip("not glibc's malloc (another C library or a preloaded allocator)")
    default = float(_faults_per_step("default"))
    if default < 1000:  # e.g. malloc on huge pages: nothing to fix on this host
        pytest.skip(f"the default allocator re-faults only {default:.0f} pages per step here")
    # 64 MiB freed per step: glibc trims or unmaps it, so each step faults thousands of fresh pages back in
    assert float(kept) < default / 4, (kept, default)
