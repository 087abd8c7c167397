"""Device detection: npu (torch_npu importable and a device present), else cuda, else cpu.

``RLFLOW_DEVICE`` overrides (``cpu``, ``cuda``, ``npu``). ``backend()`` is the matching collective
backend: hccl on NPU, nccl on CUDA, gloo on CPU. Ops choose fused kernels through ``kind()`` only.
``keep_host_memory()`` is the CPU's counterpart of a caching allocator (see there).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


@functools.lru_cache(maxsize=None)
def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (Ascend CANN toolkit only)
    except ImportError:
        return False
    return bool(torch.npu.is_available())


def kind() -> str:
    """'npu', 'cuda' or 'cpu'."""
    forced = os.environ.get("RLFLOW_DEVICE")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"RLFLOW_DEVICE={forced!r}: expected one of {sorted(BACKENDS)}")
        if forced == "npu" and not _npu_available():
            raise RuntimeError("RLFLOW_DEVICE=npu but torch_npu is not importable or sees no NPU "
                               "(install the Ascend CANN toolkit and `pip install rlflow[npu]`)")
        if forced == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("RLFLOW_DEVICE=cuda but torch.cuda.is_available() is False")
        return forced
    if _npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def device(local_rank: int = 0) -> torch.device:
    k = kind()
    return torch.device("cpu") if k == "cpu" else torch.device(k, local_rank)


def backend() -> str:
    return BACKENDS[kind()]


def device_count() -> int:
    """Accelerators of this machine (0 on a CPU)."""
    k = kind()
    return torch.cuda.device_count() if k == "cuda" else torch.npu.device_count() if k == "npu" else 0


def backend_for(world: int) -> str:
    """The collective backend for ``world`` processes on this machine: the accelerator's (nccl, hccl) when it
    has a device for each process, else gloo on the CPU."""
    return backend() if kind() != "cpu" and device_count() >= world else "gloo"


def process_device() -> torch.device:
    """This process's device: with torch.distributed up, its accelerator under nccl or hccl (``LOCAL_RANK``
    modulo the devices it sees, as ``runtime.launch`` sets it: a Ray actor sees only its own) and the CPU
    under gloo; else the first device."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return device(0)
    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    return device(int(os.environ.get("LOCAL_RANK", 0)) % max(1, device_count()))


def synchronize() -> None:
    k = kind()
    if k == "cuda":
        torch.cuda.synchronize()
    elif k == "npu":
        torch.npu.synchronize()


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 * 2**20  # HEAP_MAX_SIZE / 2 on 64-bit: the most any 64-bit glibc accepts


@functools.lru_cache(maxsize=None)
def keep_host_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process instead of returning it to the OS; returns
    whether it applied (glibc's own malloc on Linux only: False on other systems, other C libraries, or
    with another allocator preloaded). Process-wide, idempotent.

    By default glibc serves blocks above an adaptive threshold (128 KiB to 32 MiB) with mmap and unmaps
    them on free, and trims the heap top, so a training step's activations come back every step as fresh
    pages that the kernel faults in and zeroes. On the e2e bench workload (qwen3-moe-tiny, 128 samples x
    44 tokens) that was 17k minor page faults (68 MB) per GRPO step and 11% of the update's time. With
    mmap only above 32 MiB, no trimming and a 64 MiB top pad, freed blocks are reused: about 5 faults
    per step. Blocks above 32 MiB are still mapped per allocation.
    CUDA and NPU memory has its own caching allocator; this only concerns host tensors."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):  # glibc only (musl and gcompat have no such symbol)
            return False
        mallopt = libc.mallopt
        process = ctypes.CDLL(None)  # the malloc this process calls: not glibc's with jemalloc/tcmalloc preloaded
        if ctypes.cast(process.malloc, ctypes.c_void_p).value != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
            return False
    except (OSError, AttributeError):
        return False
    done = [mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 64 * 2**20))]
    return all(done)
