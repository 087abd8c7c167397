"""Generation in a layout (TP, EP, TP x EP, kv heads replicated over tp; Qwen3-MoE and DeepSeek-V3's MLA
with its latent cache) on gloo processes, through the one model and the one rollout engine: every rank
samples exactly the tokens that one process samples for the same prompts, seed and ``max_batch``, with
the same sampling log-probs (within 1e-5, relative to their largest magnitude), greedy and sampled, with
EOS and refilled slots (``max_batch`` below the rows), and the experts' ranks stepping in lockstep while
their rows finish at different times."""

from __future__ import annotations

import pytest
import torch
from helpers import random_prompts

from rlflow.models import decoder as qm
from rlflow.models.config import get_config
from rlflow.rollout import SamplingConfig, generate
from rlflow.runtime.launch import spawn

CFG = get_config("qwen3-moe-tiny")  # 4 heads, 2 kv heads, 8 experts (top 2), 4 layers, vocab 32
P_PER_DATA_RANK, G, MAX_BATCH = 3, 2, 4  # 6 rows over 4 slots: refills
SAMPLING = {"greedy": SamplingConfig(max_new_tokens=8, eos_id=5, temperature=0.0),
            "sampled": SamplingConfig(max_new_tokens=8, eos_id=5, temperature=1.0, top_k=20)}
pytestmark = pytest.mark.slow

# name -> (mesh sizes, rule overrides, model)
CASES = {
    2: {"tp2": (dict(tp=2), {}, "qwen3-moe-tiny"), "ep2": (dict(ep=2), {}, "qwen3-moe-tiny"),
        "deepseek-tp2": (dict(tp=2), {}, "deepseek-tiny"), "llama-tp2": (dict(tp=2), {}, "llama-tiny")},
    4: {"ep2-tp2": (dict(ep=2, tp=2), {}, "qwen3-moe-tiny"),
        "tp4-kv-replicated": (dict(tp=4), {"kv_heads": None}, "qwen3-moe-tiny"),
        "deepseek-ep2-tp2": (dict(ep=2, tp=2), {}, "deepseek-tiny")},
}


def params_full(model="qwen3-moe-tiny"):
    return qm.init_params(get_config(model), seed=3, std=0.3)  # large std: peaked logits, so EOS comes early


def prompts_of(data_index: int, n_data: int):
    """Data rank d's prompts: one seeded draw of n_data * P prompts, rows [d P, (d + 1) P); different rank
    shares have different lengths, so ep ranks finish at different steps."""
    batch = random_prompts(CFG.vocab_size, n_data * P_PER_DATA_RANK, torch.Generator().manual_seed(11))
    return batch.select(torch.arange(data_index * P_PER_DATA_RANK, (data_index + 1) * P_PER_DATA_RANK))


def worker(rank: int, world: int, cases: dict) -> dict:
    from rlflow.device import process_device
    from rlflow.models import sharding as msh
    from rlflow.parallel import context
    from rlflow.sharding.mesh import Mesh

    dev = process_device()  # the CPU under gloo; the rank's accelerator under nccl / hccl
    out = {}
    for name, (sizes, rules, model) in cases.items():
        cfg = get_config(model)
        mesh = Mesh(**sizes)
        layout = msh.layout(cfg, mesh, rules, dtype=torch.float32)
        ex = context.context(layout, cfg)
        local = {n: t.to(dev) for n, t in context.shard_params(params_full(model), layout, rank).items()}
        d = mesh.data_parallel_index(rank)
        for mode, scfg in SAMPLING.items():
            ro = generate(local, cfg, prompts_of(d, mesh.data_parallel_size).to(dev), scfg, group_size=G, seed=100 + d,
                          max_batch=MAX_BATCH, ex=ex)
            out[name, mode] = (model, d, mesh.data_parallel_size, ro.response_ids_BTr.cpu(), ro.response_mask_BTr.cpu(),
                               ro.sample_logprobs_BTr.cpu())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_generation_in_a_layout_samples_the_tokens_of_one_process(world):
    results = spawn(worker, world, CASES[world])  # rlflow.device's backend: gloo on a CPU
    fails, refs, lengths = [], {}, set()
    for rank, res in enumerate(results):
        for (name, mode), (model, d, n_data, ids, mask, lp) in res.items():
            key = (model, d, n_data, mode)
            if key not in refs:
                refs[key] = generate(params_full(model), get_config(model), prompts_of(d, n_data), SAMPLING[mode],
                                     group_size=G, seed=100 + d, max_batch=MAX_BATCH)
            ref = refs[key]
            lengths.update(ref.response_mask_BTr.sum(-1).tolist())
            if not (torch.equal(ids, ref.response_ids_BTr) and torch.equal(mask, ref.response_mask_BTr)):
                fails.append(f"{name} {mode} rank {rank}: tokens differ from one process")
                continue
            dlp = float((lp - ref.sample_logprobs_BTr).abs().max())
            # float32 sums in another order: the error grows with the log-probs' size (rows of -10 and below)
            if dlp > 1e-5 * max(1.0, float(ref.sample_logprobs_BTr.abs().max())):
                fails.append(f"{name} {mode} rank {rank}: sampling log-probs differ by {dlp:.2e}")
    assert not fails, "\n".join(fails)
    # the cases exercised what they claim: rows ending at EOS before the budget, and rows reaching it
    assert min(lengths) < SAMPLING["greedy"].max_new_tokens and max(lengths) == SAMPLING["greedy"].max_new_tokens, lengths
