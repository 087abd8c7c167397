"""rlflow.device.process_device: the device a rank computes on, whatever started it."""

import pytest
import torch
import torch.distributed as dist

from rlflow import device as rd


@pytest.mark.parametrize("backend, local_rank, count, want", [
    ("nccl", "1", 8, "cuda:1"),  # global rank 9 of two 8-GPU nodes under torchrun: its node's second GPU
    ("nccl", "0", 1, "cuda:0"),  # a Ray actor of rank 3: it sees its own GPU only (launch sets LOCAL_RANK 0)
    ("gloo", "1", 8, "cpu"),     # more ranks than devices: gloo, on the CPU
])
def test_a_rank_computes_on_its_local_device_not_at_its_global_rank(monkeypatch, backend, local_rank, count, want):
    """The recipe placed the model on ``device(rank)``: cuda:9 on the second node, cuda:3 in a Ray actor that sees
    one GPU. No accelerator here: torch.distributed and the device count are stood in for."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(rd, "kind", lambda: "cuda")
    monkeypatch.setattr(rd, "device_count", lambda: count)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert rd.process_device() == torch.device(want)


def test_without_a_process_group_the_first_device():
    assert not dist.is_initialized() and rd.process_device() == rd.device(0)
