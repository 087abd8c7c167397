"""The NPU's program on fake ``npu`` tensors (``rlflow/dryrun/npu.py``): the model trains and generates through
the NPU backend's entries (torch_npu's operators, stood in for) on a device of type npu, at the tiny presets and
at Qwen3-30B-A3B's full size, every weight's gradient as on the CPU. Each run in a process of its own: the fake
device renames the process's PrivateUse1 key for good."""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from rlflow.models import decoder
from rlflow.models.config import get_config


def _programs(cases) -> list[dict]:
    from rlflow.dryrun.npu import model_program
    return [model_program(model, **kw) for model, kw in cases]


def _spawned(fn, *args):
    """``fn(*args)`` in a process of its own (the fake device renames its PrivateUse1 key)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result(timeout=600)


def _without_grad_on_the_cpu(model: str) -> list[str]:
    """The weights a real forward and backward on the CPU leaves without a gradient (DeepSeek's routing bias)."""
    cfg = get_config(model)
    params = {k: v.requires_grad_() for k, v in decoder.init_params(cfg, dtype=torch.float32).items()}
    ids, pos = torch.zeros(2, 8, dtype=torch.long), torch.arange(8).expand(2, 8)
    h, aux, _ = decoder.forward(params, cfg, ids, pos)
    (decoder.logits(params, cfg, h).sum() + aux).backward()
    return sorted(k for k, v in params.items() if v.grad is None)


@pytest.fixture(scope="module")
def programs():
    cases = [("qwen3-moe-tiny", {}), ("deepseek-tiny", {}), ("llama-tiny", {}),
             ("qwen3-moe-30b-a3b", dict(rows=1, tokens=4096, decode_steps=1))]
    return dict(zip([m for m, _ in cases], _spawned(_programs, cases)))


def test_a_moe_model_trains_and_generates_through_the_npu_entries(programs):
    """Every layer's norms, rotary, attention and grouped matmuls (two forward, four backward) on the NPU's
    operators in training; in generation its routing operators too, once per layer and forward."""
    out, cfg = programs["qwen3-moe-tiny"], get_config("qwen3-moe-tiny")
    L, forwards = cfg.num_hidden_layers, 1 + 2  # the prefill and two decode steps
    train, gen = out["calls"]["train"], out["calls"]["generate"]
    assert train["npu_fusion_attention"] == train["npu_rotary_mul"] == L
    assert train["npu_grouped_matmul"] == 6 * L and train["npu_rms_norm"] > 2 * L
    assert gen["npu_fusion_attention"] == gen["npu_moe_init_routing"] == gen["npu_moe_finalize_routing"] == L * forwards
    assert gen["npu_moe_gating_top_k_softmax"] == L * forwards and gen["npu_grouped_matmul"] == 2 * L * forwards
    assert out["decoded_device"] == "npu:0"
    assert out["bad_grads"] == [] and out["without_grad"] == _without_grad_on_the_cpu("qwen3-moe-tiny") == []


@pytest.mark.parametrize("model", ["deepseek-tiny", "llama-tiny"])
def test_every_weight_has_the_gradient_the_cpu_gives_it(programs, model):
    """MLA (DeepSeek: its narrower values padded into the fused attention, its routing bias untrained) and a
    dense model; every layer's attention the NPU's, in training and in each forward of generation."""
    out, L = programs[model], get_config(model).num_hidden_layers
    assert out["bad_grads"] == [] and out["without_grad"] == _without_grad_on_the_cpu(model)
    calls = out["calls"]
    assert calls["train"]["npu_fusion_attention"] == L and calls["generate"]["npu_fusion_attention"] == 3 * L
    assert out["decoded_device"] == "npu:0"


def test_qwen3_30b_a3b_runs_at_full_size_and_its_training_peak_holds_weights_gradients_and_activations(programs):
    out, cfg = programs["qwen3-moe-30b-a3b"], get_config("qwen3-moe-30b-a3b")
    assert out["calls"]["train"]["npu_grouped_matmul"] == 6 * cfg.num_hidden_layers
    assert out["bad_grads"] == [] and out["without_grad"] == []
    weights = out["weight_bytes"]
    assert 60e9 < weights < 62e9  # 30.5 B parameters in bfloat16
    assert 2 * weights < out["peak_bytes"]["train"] < 2 * weights + 20e9  # one row of 4096 tokens' activations
    assert weights < out["peak_bytes"]["generate"] < weights + 10e9  # its KV cache and one forward's


STEP = dict(model="qwen3-moe-tiny", world=4, train="tp=2,ep=2", rollout="tp=2", prompts=4, group_size=2,
            prompt_len=16, response_len=32, micro_batch=2, remat=True)


def _npu_steps(ranks) -> list:
    from rlflow import dryrun
    return [dryrun.step(dryrun.StepCase(**STEP, device="npu"), r) for r in ranks]


def test_the_step_on_a_fake_npu_runs_the_npu_program_and_issues_the_meta_steps_collectives():
    """The whole step (transition, generation, the dock, log-probs, the update with checkpointing) on a fake NPU's
    tensors: every rank's collectives those of the meta step (which the real step on gloo issues:
    tests/test_dryrun.py), all-to-all splits included (the fake gating's choices are the values mode's), its
    attention the NPU's (no SDPA kernel in its trace, as in the meta one), each NPU kernel one op with its FLOPs."""
    from rlflow import dryrun
    npu = _spawned(_npu_steps, range(STEP["world"]))
    meta = [dryrun.step(dryrun.StepCase(**STEP), r) for r in range(STEP["world"])]
    assert dryrun.mismatched(npu) == []
    for a, b in zip(npu, meta):
        assert a.collectives == b.collectives and any(c.op == "alltoall_base_" for c in a.collectives)
        assert a.unknown_reads == b.unknown_reads  # the same host reads, one a tolist (not one an element)

    def ops(trace):
        return {c.op for stage in trace.stage_ops.values() for c in stage}
    sdpa = "aten._scaled_dot_product_efficient_attention"
    assert sdpa in ops(meta[0]) and sdpa not in ops(npu[0])
    # the trace prices as the device's program: the transition's ops the meta step's (a fake tensor's metadata
    # queries and element-wise host reads not counted), the NPU's kernels one op each with their FLOPs
    assert npu[0].stage_ops["transition"] == meta[0].stage_ops["transition"]
    flops = {c.op: c.flops for c in npu[0].stage_ops["update"] if c.op.startswith("rlflow_npu.")}
    assert flops["rlflow_npu.fusion_attention_grad"] > flops["rlflow_npu.fusion_attention"] > 0
    assert flops["rlflow_npu.grouped_matmul"] > 0 and flops["rlflow_npu.rms_norm"] == 0
    assert npu[0].stage_peaks.keys() == meta[0].stage_peaks.keys() and npu[0].peak_stage == "update"
