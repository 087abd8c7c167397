"""Device detection: npu (torch_npu importable and a device present), else cuda, else cpu.

``RLFLOW_DEVICE`` overrides (``cpu``, ``cuda``, ``npu``). ``backend()`` is the matching collective
backend: hccl on NPU, nccl on CUDA, gloo on CPU. Ops choose fused kernels through ``kind()`` only.
"""

from __future__ import annotations

import functools
import os

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


def synchronize() -> None:
    k = kind()
    if k == "cuda":
        torch.cuda.synchronize()
    elif k == "npu":
        torch.npu.synchronize()
