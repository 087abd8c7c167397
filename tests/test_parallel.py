"""Model execution in a layout (rlflow.parallel) on real gloo processes: the tiny Qwen3-MoE's (and the tiny
DeepSeek-V3's and Llama's) GRPO loss (clipped surrogate + entropy bonus + router aux loss) and its gradients, gathered
from every rank's shards, equal one process's within 1e-5 in float32 (relative where they exceed 1), for TP,
EP, PP, DP and combinations of three axes.

One group of processes per world size runs all of that size's cases (process start dominates). The
reference runs in the test process with ``stages.response_logprobs`` and ``grpo.policy_loss`` on the same
row partition (data slice x micro-batch): the router aux loss is a mean over each micro-batch's tokens,
so it only matches when the reference sees the same micro-batches.
"""

from __future__ import annotations

import pytest
import torch

from rlflow.algos import grpo, stages
from rlflow.batch import TrainBatch, pad
from rlflow.models import decoder as qm, lora
from rlflow.models.config import get_config
from rlflow.models.lora import LoraConfig
from rlflow.models.shapes import param_shapes
from rlflow.runtime.launch import spawn

CFG = get_config("qwen3-moe-tiny")  # 4 heads, 2 kv heads, 8 experts (top 2), 4 layers, vocab 32
GCFG = grpo.GRPOConfig(group_size=2, entropy_coef=0.01)
AUX = 0.1  # router aux coefficient
B = 8
TOL = 1e-5

pytestmark = pytest.mark.slow

# (name, mesh sizes, rule overrides, micro-batches per data rank, schedule, remat, config overrides)
DENSE_BIAS = dict(mlp_only_layers=(1,), attention_bias=True)  # a dense MLP layer, Qwen2's q/k/v biases
DEEPSEEK = dict(preset="deepseek-tiny")  # MLA, sigmoid group-limited routing, shared experts, a dense first layer
DEEPSEEK_Q = dict(preset="deepseek-tiny", q_lora_rank=None)  # MLA with a direct q_proj
LLAMA = dict(preset="llama-tiny")  # dense, no bias, no qk norm
LLAMA_TIED = dict(preset="llama-tiny", tie_word_embeddings=True)  # SmolLM2's tied head
# LoRA: the adapters' gradients alone (the base frozen, as the update runs it); A of a column-parallel weight and
# B of a row-parallel one are replicated over tp and summed over it; attention only on the MoE model, every
# projection of Llama; B drawn non-zero so that both factors take a gradient
LORA = dict(lora=LoraConfig(4, 8.0, targets=lora.ATTENTION + (lora.HEAD,)))  # the head: vocab-parallel with tp
LORA_LLAMA = dict(preset="llama-tiny", lora=LoraConfig(4, 8.0, targets=lora.ADAPTABLE, dropout=0.0))
LORA_LLAMA_TIED = dict(preset="llama-tiny", tie_word_embeddings=True, lora=LoraConfig(2, 4.0))
CASES = {
    2: [
        ("tp2", dict(tp=2), {}, 1, "1f1b", False, {}),
        ("ep2", dict(ep=2), {}, 2, "1f1b", False, {}),
        ("pp2-1f1b", dict(pp=2), {}, 4, "1f1b", False, {}),
        ("pp2-gpipe", dict(pp=2), {}, 3, "gpipe", False, {}),
        ("dp2", dict(dp=2), {}, 2, "1f1b", False, {}),
        ("tp2-remat", dict(tp=2), {}, 2, "1f1b", True, {}),
        ("tp2-dense-bias", dict(tp=2), {}, 1, "1f1b", False, DENSE_BIAS),
        # replicated variants: all experts on every ep rank (summed over dp x ep); whole vocab and experts on tp
        ("ep2-experts-replicated", dict(ep=2), {"experts": None}, 1, "1f1b", False, {}),
        ("tp2-vocab-experts-replicated", dict(tp=2), {"vocab": None, "expert_mlp": None}, 1, "1f1b", False, {}),
        ("deepseek-tp2", dict(tp=2), {}, 1, "1f1b", False, DEEPSEEK),
        ("deepseek-ep2", dict(ep=2), {}, 2, "1f1b", False, DEEPSEEK),
        ("deepseek-pp2", dict(pp=2), {}, 2, "1f1b", False, DEEPSEEK),
        ("deepseek-tp2-no-q-lora", dict(tp=2), {}, 1, "1f1b", False, DEEPSEEK_Q),
        ("llama-tp2", dict(tp=2), {}, 1, "1f1b", False, LLAMA),
        ("llama-pp2", dict(pp=2), {}, 2, "1f1b", False, LLAMA),
        ("llama-tied-tp2", dict(tp=2), {}, 1, "1f1b", False, LLAMA_TIED),
        # the head on the last stage borrows the first stage's embedding; its gradient goes back
        ("llama-tied-pp2", dict(pp=2), {}, 2, "1f1b", False, LLAMA_TIED),
        ("lora-tp2", dict(tp=2), {}, 1, "1f1b", False, LORA),
        ("lora-ep2", dict(ep=2), {}, 2, "1f1b", False, LORA),
        ("lora-pp2", dict(pp=2), {}, 2, "1f1b", False, LORA),
        ("lora-llama-tp2", dict(tp=2), {}, 1, "1f1b", False, LORA_LLAMA),
        ("lora-llama-tied-pp2", dict(pp=2), {}, 2, "1f1b", False, LORA_LLAMA_TIED),
    ],
    4: [
        ("tp4-kv-replicated", dict(tp=4), {"kv_heads": None}, 1, "1f1b", False, {}),
        ("ep4", dict(ep=4), {}, 1, "1f1b", False, {}),
        ("pp4-1f1b", dict(pp=4), {}, 4, "1f1b", False, {}),
        ("dp4", dict(dp=4), {}, 1, "1f1b", False, {}),
        ("dp2-ep2", dict(dp=2, ep=2), {}, 1, "1f1b", False, {}),
        ("pp2-tp2", dict(pp=2, tp=2), {}, 2, "1f1b", False, {}),
        ("ep2-tp2", dict(ep=2, tp=2), {}, 1, "1f1b", False, {}),
        ("deepseek-ep2-tp2", dict(ep=2, tp=2), {}, 1, "1f1b", False, DEEPSEEK),
        ("llama-tied-pp4", dict(pp=4), {}, 4, "gpipe", False, LLAMA_TIED),
        ("lora-tp4-kv-replicated", dict(tp=4), {"kv_heads": None}, 1, "1f1b", False, LORA),
        ("lora-llama-pp2-tp2", dict(pp=2, tp=2), {}, 2, "1f1b", False, LORA_LLAMA),
    ],
    8: [
        ("pp2-ep2-tp2", dict(pp=2, ep=2, tp=2), {}, 2, "1f1b", False, {}),
        ("pp2-dp2-tp2", dict(pp=2, dp=2, tp=2), {}, 2, "gpipe", False, {}),
        ("pp2-ep2-tp2-dense-bias", dict(pp=2, ep=2, tp=2), {}, 1, "1f1b", False, DENSE_BIAS),
        ("dp2-ep2-tp2", dict(dp=2, ep=2, tp=2), {}, 1, "1f1b", False, {}),
        ("llama-tied-pp2-dp2-tp2", dict(pp=2, dp=2, tp=2), {}, 2, "1f1b", False, LLAMA_TIED),
    ],
}


def config(kw: dict):
    kw = dict(kw)
    return get_config(kw.pop("preset", "qwen3-moe-tiny")).replace(**kw)


def make_batch(seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, CFG.vocab_size, (int(n),), generator=g) for n in torch.randint(2, 7, (B,), generator=g)]
    resps = [torch.randint(3, CFG.vocab_size, (int(n),), generator=g) for n in torch.randint(1, 9, (B,), generator=g)]
    p_ids, p_mask = pad(prompts, 0, left=True)
    r_ids, r_mask = pad(resps, 0)
    idx = torch.arange(B)
    base = dict(prompt_ids_BTp=p_ids, prompt_mask_BTp=p_mask, index_B=idx, group_B=idx // 2, response_ids_BTr=r_ids,
                response_mask_BTr=r_mask, sample_logprobs_BTr=torch.zeros(r_ids.shape), rewards_B=torch.zeros(B))
    params = params_full()
    lp, _, _ = stages.response_logprobs(params, CFG, TrainBatch(**base, advantages_B=torch.zeros(B),
                                                               old_logprobs_BTr=torch.zeros(r_ids.shape)))
    old = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * r_mask  # ratios on both sides of the clip
    return TrainBatch(**base, advantages_B=torch.randn(B, generator=g), old_logprobs_BTr=old.detach())


def params_full(cfg=CFG) -> qm.Params:
    p = qm.init_params(cfg, seed=1, std=0.2)
    g = torch.Generator().manual_seed(2)
    p = {k: (torch.randn(v.shape, generator=g) * 0.2 if k.endswith("bias") else v) for k, v in p.items()}
    if cfg.lora is not None:
        ad = lora.init(cfg, param_shapes(cfg), seed=3)
        p.update({k: torch.randn(v.shape, generator=g) * 0.2 if k.endswith(lora.B) else v for k, v in ad.items()})
    return p


def trained(cfg, name: str) -> bool:
    """Whether the update takes a gradient of ``name``: the adapters of a LoRA model, else every parameter."""
    return cfg.lora is None or lora.is_adapter(name)


def partition(n_data: int, n_micro: int) -> list[list[torch.Tensor]]:
    """Rows of data rank d, micro-batch m: contiguous slices of the batch."""
    per = B // n_data
    return [list(torch.arange(d * per, (d + 1) * per).chunk(n_micro)) for d in range(n_data)]


def loss_fn(n_tokens: float):
    def f(lp, ent, mb):
        return grpo.policy_loss(lp, mb.old_logprobs_BTr, mb.advantages_B, mb.response_mask_BTr, GCFG,
                                entropy_BT=ent, n_tokens=n_tokens)[0]
    return f


def reference(batch: TrainBatch, n_data: int, n_micro: int, cfg=CFG):
    """Loss and gradients of one process over the same row partition."""
    full = params_full(cfg)
    leaves = {k: v.requires_grad_(trained(cfg, k)) for k, v in full.items()}
    f = loss_fn(float(batch.response_mask_BTr.sum()))
    total = 0.0
    for rows_d in partition(n_data, n_micro):
        for rows in rows_d:
            mb = batch.select(rows)
            lp, ent, aux = stages.response_logprobs(leaves, cfg, mb, with_entropy=True)
            loss = f(lp, ent, mb) + AUX * aux * (mb.size / B)
            loss.backward()
            total += float(loss.detach())
    # DeepSeek's e_score_correction_bias only selects experts: no gradient reaches it
    return total, {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in leaves.items()
                   if trained(cfg, k)}


def worker(rank: int, world: int, cases: list, batch: TrainBatch) -> dict:
    from rlflow.models import sharding as msh
    from rlflow.device import process_device
    from rlflow.parallel import context, dp, train
    from rlflow.sharding.mesh import Mesh

    dev = process_device()  # the CPU under gloo; the rank's accelerator under nccl / hccl
    batch = batch.to(dev)
    out = {}
    f = loss_fn(float(batch.response_mask_BTr.sum()))
    for name, sizes, rules, n_micro, sched, remat, cfg_kw in cases:
        cfg = config(cfg_kw)
        mesh = Mesh(**sizes)
        layout = msh.layout(cfg, mesh, rules, dtype=torch.float32)
        ctx = context.context(layout, cfg)
        local = {n: t.to(dev).requires_grad_(trained(cfg, n))
                 for n, t in context.shard_params(params_full(cfg), layout, rank).items()}
        rows = partition(mesh.data_parallel_size, n_micro)[mesh.data_parallel_index(rank)]
        mbs = [batch.select(r.to(dev)) for r in rows]
        loss, grads = train.forward_backward(local, ctx, mbs, f, aux_weights=[AUX * mb.size / B for mb in mbs],
                                             schedule=sched, with_entropy=True, remat=remat)
        reduced = dp.all_reduce_grads(grads, layout)
        cpu = lambda ts: {n: t.cpu() for n, t in ts.items()}  # noqa: E731
        res = {"loss": float(train.total_loss(loss, ctx)), "grads": cpu(reduced),
               "norm": float(dp.grad_norm(reduced, layout)), "rows": rows}
        with torch.no_grad():
            fwd = train.forward_only({n: t.detach() for n, t in local.items()}, ctx, mbs, with_entropy=True)
        res["logprobs"] = [(lp.cpu(), ent.cpu()) for lp, ent in fwd]
        if mesh.data_parallel_size > 1:  # sharded optimizer state: reduce-scatter gives slices of the same sums
            res["rs"] = [(s.names, s.start, s.flat.cpu()) for s in dp.reduce_scatter_grads(grads, layout)]
        out[name] = res
    return out


def _check(world: int):
    from rlflow.models import sharding as msh
    from rlflow.sharding.reference import full_from_shards, shard_tensor
    from rlflow.sharding.mesh import Mesh

    batch = make_batch()
    results = spawn(worker, world, CASES[world], batch)  # rlflow.device's backend: gloo on a CPU
    refs, report, fails = {}, [], []
    for name, sizes, rules, n_micro, _, _, cfg_kw in CASES[world]:
        cfg = config(cfg_kw)
        mesh = Mesh(**sizes)
        layout = msh.layout(cfg, mesh, rules, dtype=torch.float32)
        key = (mesh.data_parallel_size, n_micro, tuple(sorted(cfg_kw.items())))
        if key not in refs:
            refs[key] = reference(batch, *key[:2], cfg)
        ref_loss, ref_grads = refs[key]
        got = full_from_shards([r[name]["grads"] for r in results], layout.only(ref_grads))
        dl = max(abs(r[name]["loss"] - ref_loss) for r in results) / max(1.0, abs(ref_loss))
        # loss and gradients relative to their size when above 1 (the DeepSeek cases' ratios, far outside the
        # clip, give a loss of ~16 and gradients of ~1e2, whose float32 rounding is ~1e-5)
        scale = max(1.0, max(float(g.abs().max()) for g in ref_grads.values()))
        dg = max(float((got[k] - ref_grads[k]).abs().max()) for k in ref_grads) / scale
        ref_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()])))
        dn = max(abs(r[name]["norm"] - ref_norm) for r in results)
        dlp = 0.0
        for r, res in enumerate(results):
            for rows, (lp, ent) in zip(res[name]["rows"], res[name]["logprobs"]):
                with torch.no_grad():
                    rlp, rent, _ = stages.response_logprobs(params_full(cfg), cfg, batch.select(rows),
                                                            with_entropy=True)
                dlp = max(dlp, float((lp - rlp).abs().max()), float((ent - rent).abs().max()))
        report.append(f"{name}: loss {ref_loss:.6f} |dloss| / max(1, |loss|) {dl:.2e} "
                      f"max|dgrad| / max(1, max|grad|) {dg:.2e} grad norm {ref_norm:.4f} "
                      f"|dnorm| {dn:.2e} forward-only max|dlogp|,|dent| {dlp:.2e}")
        if max(dl, dg, dn / max(1.0, ref_norm), dlp) > TOL:  # the norm: relative (a sum of ~1e5 squares)
            fails.append(report[-1])
        for r, res in enumerate(results):
            for names, start, flat in res[name].get("rs", ()):
                want = torch.cat([shard_tensor(ref_grads[n], layout, n, r).reshape(-1) for n in names])
                want = torch.cat([want, want.new_zeros(flat.numel())])[start:start + flat.numel()]
                d = float((flat - want).abs().max()) / scale
                if d > TOL:
                    fails.append(f"{name}: reduce-scattered grads on rank {r} differ by {d:.2e} (relative)")
    print("\n".join(report))
    assert not fails, "\n".join(fails)
    assert all(float(g.abs().max()) > 0 for g in refs[next(iter(refs))][1].values()), "a gradient is all zero"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_layouts_match_one_process(world):
    _check(world)
