"""The NPU's program on fake tensors of the ``npu`` device type, on a machine with neither an NPU nor torch_npu.

The dry step (``run.step``) runs meta tensors posing as an accelerator (``ops.registry.posing``): the CUDA
backend's kernels in shapes. The NPU backend (``ops/backends/npu.py``) takes other paths: torch_npu's fused
operators, the experts' routing operators in inference, its own autograd function around the grouped matmul.
Here the model runs as an NPU would run it: its tensors are ``FakeTensorMode``'s (shapes, dtypes and a device,
no storage) on a device of type ``npu`` (torch's PrivateUse1 key renamed, as torch_npu renames it, with torch's
device guard of Python: a CPU build of torch has no CUDA guard, and autograd aborts the process on a fake
``cuda`` tensor), the registry picks the NPU entries as for a real NPU tensor, and ``FakeTorchNPU`` stands in
for torch_npu: each operator rlflow calls, one kernel of ``npu_kernels`` (its outputs shaped as torch_npu's own
meta registrations shape them, its FLOPs counted), differentiable where torch_npu's are, saving for its backward
what torch_npu's saves. A tensor left on the CPU in the model's way fails here as on the device (FakeTensorMode
refuses to mix devices). ``model_program`` runs the model alone; ``run.step`` the whole step with
``StepCase(device="npu")``; both within ``program``.

``fake_device`` renames the process's PrivateUse1 device for the rest of its life (torch allows it once): a run
on it takes a process of its own (tests spawn one; ``bench/dryrun.py --device npu`` is one).
"""

from __future__ import annotations

import sys
import time
import types
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch

from rlflow.dryrun import npu_kernels as kernels
from rlflow.dryrun.cost import _tensors

NPU = "npu"  # the device type the fake device registers
_made = False


def fake_device() -> None:
    """This process's PrivateUse1 device named ``npu``, with torch's Python device guard (once per process, before
    its first backward: autograd sizes its per-device queues once, and a device named later has none)."""
    global _made
    if _made:
        return
    name = torch._C._get_privateuse1_backend_name()
    real = sys.modules.get("torch_npu")
    if name != "privateuseone" or (real is not None and not isinstance(real, FakeTorchNPU)):
        raise RuntimeError(f"dryrun.npu: this process's PrivateUse1 device is {name!r} already (torch_npu "
                           "imported?): a fake npu device needs a process of its own")
    from torch.utils.backend_registration import _DummyBackendModule, _setup_privateuseone_for_python_backend

    class Backend(_DummyBackendModule):
        """``torch.npu``: a device no kernel runs on (not "available": rlflow's device choice stays the CPU's, and
        FakeTensorMode computes no constant on it), nothing to wait for, a random state nothing draws from (what
        activation checkpointing saves and restores around a recomputation), autocast's dtypes."""

        def is_available(self) -> bool:
            return False

        def synchronize(self, device=None) -> None:
            pass

        def device(self, index):
            return nullcontext()

        def get_rng_state(self, device=None) -> torch.Tensor:
            return torch.zeros(16, dtype=torch.uint8)

        def set_rng_state(self, state, device=None) -> None:
            pass

        def get_amp_supported_dtype(self) -> list:  # autocast's question (checkpointing asks it)
            return [torch.float16, torch.bfloat16]

    _setup_privateuseone_for_python_backend(rename=NPU, backend_module=Backend())
    _made = True


class _Attention(torch.autograd.Function):
    """``npu_fusion_attention`` (BNSD or BSND): its backward (``npu_fusion_attention_grad``) reads the inputs, the output
    and the softmax's max and sum."""

    @staticmethod
    def forward(ctx, q, k, v, head_num: int, layout: str, mask):
        out, smax, ssum = kernels.fusion_attention(q, k, v, head_num, layout, mask)
        ctx.layout = layout
        ctx.save_for_backward(q, k, v, out, smax, ssum, mask)
        ctx.mark_non_differentiable(smax, ssum)
        return out, smax, ssum

    @staticmethod
    def backward(ctx, dout, *_):
        *saved, mask = ctx.saved_tensors
        return (*kernels.fusion_attention_grad(dout, *saved, ctx.layout, mask), None, None, None)


class _RmsNorm(torch.autograd.Function):
    """``npu_rms_norm``: its backward reads the input, the weight and the reciprocal RMS."""

    @staticmethod
    def forward(ctx, x, gamma):
        y, rstd = kernels.rms_norm(x, gamma)
        ctx.save_for_backward(x, gamma, rstd)
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    def backward(ctx, dy, _):
        return kernels.rms_norm_grad(dy, *ctx.saved_tensors)


class _RotaryMul(torch.autograd.Function):
    """``npu_rotary_mul``: its backward (``npu_rotary_mul_backward``) reads the input and both tables."""

    @staticmethod
    def forward(ctx, x, r1, r2):
        ctx.save_for_backward(x, r1, r2)
        return kernels.rotary_mul(x, r1, r2)

    @staticmethod
    def backward(ctx, dy):
        grads = kernels.rotary_mul_grad(dy, *ctx.saved_tensors)
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))


class FakeTorchNPU(types.ModuleType):
    """torch_npu's operators that rlflow's NPU backend calls, on fake tensors (module docstring); ``calls`` counts
    each by name. An operator refuses tensors off the npu device, as the device's kernel does."""

    def __init__(self):
        super().__init__("torch_npu")
        self.calls: Counter = Counter()

    def _called(self, name: str, *args) -> None:
        self.calls[name] += 1
        off = [str(t.device) for t in _tensors(args) if t.device.type != NPU]
        if off:
            raise RuntimeError(f"torch_npu.{name}: tensors on {off}, expected every tensor on the npu device")

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        self._called("npu_rms_norm", x, gamma)
        return _RmsNorm.apply(x, gamma)

    def npu_rotary_mul(self, x, r1, r2):
        self._called("npu_rotary_mul", x, r1, r2)
        return _RotaryMul.apply(x, r1, r2)

    def npu_fusion_attention(self, q, k, v, head_num, input_layout, *, atten_mask=None, **_):
        self._called("npu_fusion_attention", q, k, v, atten_mask)
        if input_layout not in ("BNSD", "BSND"):
            raise NotImplementedError(f"FakeTorchNPU.npu_fusion_attention: input_layout {input_layout!r} (rlflow "
                                      "passes BNSD or BSND)")
        out, smax, ssum = _Attention.apply(q, k, v, head_num, input_layout, atten_mask)
        return out, smax, ssum, q.new_empty(0), 0, 0, 0

    def npu_moe_gating_top_k_softmax(self, x, finished=None, k=1):
        """The experts chosen by a top-k over the softmax, as torch computes it: in a dry step the values mode
        chooses them as the meta run's (``values.Choices``), and the experts' split sizes follow."""
        self._called("npu_moe_gating_top_k_softmax", x, finished)
        y, idx = torch.softmax(x, -1).topk(k, -1)
        return y, idx.to(torch.int32), x.new_empty(idx.shape, dtype=torch.int32)

    def npu_moe_init_routing(self, x, row_idx, expert_idx, active_num):
        self._called("npu_moe_init_routing", x, row_idx, expert_idx)
        return kernels.moe_init_routing(x, row_idx, expert_idx, active_num)

    def npu_grouped_matmul(self, x, weight, *, group_list, split_item, group_type, **_):
        """One x and one weight: group_type 0 (x's rows in groups, weight [E, K, N]) -> [[M, N]]; group_type 2 (the
        contraction in groups, x [K, M], weight [M, N]) -> [[G, K, N]]."""
        self._called("npu_grouped_matmul", x, weight, group_list)
        (a,), (b,) = x, weight
        if (group_type, split_item) in ((0, 2), (2, 3)):
            return [kernels.grouped_matmul(a, b, group_list, group_type)]
        raise NotImplementedError(f"FakeTorchNPU.npu_grouped_matmul: group_type {group_type}, split_item "
                                  f"{split_item}")

    def npu_moe_finalize_routing(self, rows, skip1, skip2, bias, scales, src_to_dst, expert_for_row):
        self._called("npu_moe_finalize_routing", rows, skip1, skip2, bias, scales, src_to_dst, expert_for_row)
        if skip1 is not None or skip2 is not None or bias is not None:
            raise NotImplementedError("FakeTorchNPU.npu_moe_finalize_routing: skip1, skip2 and bias (rlflow passes "
                                      "None)")
        return kernels.moe_finalize_routing(rows, scales, src_to_dst, expert_for_row)


@contextmanager
def program():
    """Within the block, ``torch_npu`` is a ``FakeTorchNPU`` (yielded) and tensors are fake, the ``npu`` device
    this process's fake one (``fake_device``); a real tensor an op takes is made fake (a CPU tensor copied to the
    device)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    fake_device()
    before, fake = sys.modules.get("torch_npu"), FakeTorchNPU()
    sys.modules["torch_npu"] = fake
    elementwise = FakeTensor.tolist

    def tolist(t):
        """One copy to the host, as a device's ``tolist`` is (a fake tensor's reads it element by element: an op
        each in a trace); the copy is a real CPU tensor where a dry run's values mode knows its value."""
        host = t.cpu()
        return elementwise(host) if isinstance(host, FakeTensor) else host.tolist()
    FakeTensor.tolist = tolist
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield fake
    finally:
        FakeTensor.tolist = elementwise
        if before is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = before


def model_program(model: str, *, rows: int = 2, tokens: int = 64, decode_steps: int = 2,
                  dtype: torch.dtype = torch.bfloat16) -> dict:
    """``model``'s forward and backward on ``rows`` x ``tokens`` (every token real), then a prefill of the same
    rows into a KV cache and ``decode_steps`` decode steps in inference mode, as one NPU runs them (the whole model
    on it), on fake tensors (module docstring). Returns the torch_npu operators each phase called (``calls``), the
    peak of live npu bytes in each (``peak_bytes``, ``trace.Watch``; the weights' own: ``weight_bytes``), the
    weights left without a gradient (``without_grad``) and those whose gradient is not of their shape, dtype and
    device (``bad_grads``), the device of the decoded tokens and the seconds it took here."""
    from rlflow.dryrun.trace import RankTrace, Watch
    from rlflow.models import decoder
    from rlflow.models.config import get_config
    from rlflow.models.sharding import layout
    from rlflow.sharding.mesh import Mesh

    t0 = time.perf_counter()
    cfg = get_config(model)
    mesh = Mesh.parse("dp=1", 1)
    out: dict = {"model": model, "calls": {}, "peak_bytes": {}}
    with program() as npu:
        dev = torch.device(NPU)
        params = {p.name: torch.empty(p.local_shape(mesh), dtype=dtype, device=dev).requires_grad_()
                  for p in layout(model, mesh, dtype=dtype).params}
        out["weight_bytes"] = sum(p.numel() * p.element_size() for p in params.values())
        ids = torch.zeros(rows, tokens, dtype=torch.long, device=dev)
        pos = torch.arange(tokens, device=dev).expand(rows, tokens)
        trace = RankTrace(0)
        with Watch(trace, device=NPU) as watch:
            watch.hold(list(params.values()))
            watch.stage("train")
            h, aux, _ = decoder.forward(params, cfg, ids, pos)
            (decoder.logits(params, cfg, h).float().logsumexp(-1).mean() + aux).backward()
            del h, aux
            out["calls"]["train"] = dict(npu.calls)
            npu.calls.clear()
            out["without_grad"] = sorted(n for n, p in params.items() if p.grad is None)
            out["bad_grads"] = sorted(n for n, p in params.items() if p.grad is not None and (
                p.grad.shape != p.shape or p.grad.dtype != p.dtype or p.grad.device != p.device))
            for p in params.values():
                p.grad = None
            watch.stage("generate")
            with torch.inference_mode():
                cache = decoder.KVCache.allocate(cfg, rows, tokens + decode_steps, dtype=dtype, device=dev)
                h, _, cache = decoder.forward(params, cfg, ids, pos, cache=cache, with_aux=False)
                tok = decoder.logits(params, cfg, h[:, -1:]).argmax(-1)
                for _ in range(decode_steps):
                    h, _, cache = decoder.forward(params, cfg, tok, cache.lengths_B[:, None], cache=cache,
                                                  with_aux=False)
                    tok = decoder.logits(params, cfg, h).argmax(-1)
                out["decoded_device"] = str(tok.device)
            out["calls"]["generate"] = dict(npu.calls)
        out["peak_bytes"] = dict(trace.stage_peaks)
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    import argparse
    import json
    ap = argparse.ArgumentParser(description="Models' forward, backward and generation as one NPU runs them, on "
                                             "fake npu tensors (rlflow/dryrun/npu.py): one JSON object per model")
    ap.add_argument("models", nargs="*", default=["qwen3-moe-30b-a3b", "qwen2.5-32b", "deepseek-r1-671b"])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--decode-steps", type=int, default=2)
    args = ap.parse_args()
    for flag in ("rows", "tokens", "decode_steps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected at least 1")
    for model in args.models:
        print(json.dumps(model_program(model, rows=args.rows, tokens=args.tokens, decode_steps=args.decode_steps)))


__all__ = ["FakeTorchNPU", "fake_device", "main", "model_program", "program"]


if __name__ == "__main__":
    main()
