"""The shared-prompt training forward gives the plain forward's log-probs, entropies and gradients."""

import torch
from helpers import random_prompts

from rlflow.models import logprobs
from rlflow.models import decoder as model
from rlflow.models.config import get_config
from rlflow.ops.backends import cpu as cpu_kernels
from rlflow.rollout import SamplingConfig, generate


def _rollout(cfg, seed=0, P=3, G=4):
    g = torch.Generator().manual_seed(seed)
    prompts = random_prompts(cfg.vocab_size, P, g)
    params = model.init_params(cfg, seed=seed, std=0.2)
    ro = generate(params, cfg, prompts, SamplingConfig(max_new_tokens=7, eos_id=5), group_size=G, seed=seed)
    return params, ro.select(torch.randperm(ro.size, generator=g))  # groups not adjacent


def _grads(params, cfg, batch, **kw):
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    lp, ent, _ = logprobs.response_logprobs(leaves, cfg, batch, with_entropy=True, **kw)
    m = batch.response_mask_BTr
    w = torch.linspace(0.5, 1.5, m.numel()).view(m.shape)  # a loss that weights every token differently
    loss = (lp * w * m).sum() + 0.1 * (ent * m).sum()
    return lp, ent, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def _grads_as_close_to_float64(params, cfg, batch, g_s, g_p):
    """The shared path's gradients g_s are as exact as the plain path's g_p: both held against float64, the
    shared one's error at most 4x the plain one's (or a float32 rounding floor). A per-element tolerance
    between the two float32 paths fails on some CPUs: the gradients are sums of many terms, some near zero
    in tensors of scale ~40, and the summation order differs."""
    _, _, g_d = _grads({k: v.double() for k, v in params.items()}, cfg, batch, with_aux=False, remat=True)
    for k in g_p:
        err_s, err_p = (float((g[k].double() - g_d[k]).abs().max()) for g in (g_s, g_p))
        floor = 1e-6 * max(1.0, float(g_d[k].abs().max()))
        assert err_s <= 4 * max(err_p, floor), (k, err_s, err_p)


def test_shared_prompt_forward_equals_plain_forward(monkeypatch):
    # torch ops on both paths, so they differ by rounding only: the fused CPU kernels (float32, both paths)
    # are checked against float64 and against these ops, on the shared path too, in tests/test_cpu_kernels.py
    monkeypatch.setattr(cpu_kernels, "usable", lambda *_, **__: False)
    moe = get_config("qwen3-moe-tiny")
    dense_qwen2 = moe.replace(model_type="qwen2", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                              attention_bias=True, qk_norm=False)
    for cfg in (moe, dense_qwen2):
        params, batch = _rollout(cfg)
        assert logprobs._prompt_groups(batch) is not None
        lp_s, ent_s, g_s = _grads(params, cfg, batch, with_aux=False)  # shared path
        lp_p, ent_p, g_p = _grads(params, cfg, batch, with_aux=False, remat=True)  # plain path (remat)
        m = batch.response_mask_BTr
        torch.testing.assert_close(lp_s[m], lp_p[m], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ent_s[m], ent_p[m], atol=2e-5, rtol=1e-5)
        assert (lp_s[~m] == 0).all()
        _grads_as_close_to_float64(params, cfg, batch, g_s, g_p)


def test_rows_with_different_prompts_in_one_group_use_the_plain_forward():
    cfg = get_config("qwen3-moe-tiny")
    _, batch = _rollout(cfg, seed=1)
    bad = batch.replace(group_B=torch.zeros_like(batch.group_B))  # one "group" over different prompts
    assert logprobs._prompt_groups(bad) is None


def test_shared_prompt_forward_with_unequal_groups_short_responses_and_only_real_tokens_routed(monkeypatch):
    """Groups of different sizes (rows dropped), two-token responses (one response state to run), and the
    MoE routes exactly the real tokens of the packed sequence: each prompt's once, the responses' own."""
    cfg = get_config("qwen3-moe-tiny")
    routed = []
    real_route = model.route

    def counting_route(x_ND, *a, **k):
        routed.append(x_ND.shape[0])
        return real_route(x_ND, *a, **k)

    for seed, new_tokens in ((2, 2), (3, 6)):
        g = torch.Generator().manual_seed(seed)
        params = model.init_params(cfg, seed=seed, std=0.2)
        ro = generate(params, cfg, random_prompts(cfg.vocab_size, 4, g), SamplingConfig(max_new_tokens=new_tokens,
                      eos_id=5), group_size=4, seed=seed)
        keep = torch.tensor([0, 4, 5, 6, 7, 9, 10, 12])  # groups of 1, 4, 2 and 1 rows
        batch = ro.select(keep[torch.randperm(len(keep), generator=g)])
        assert logprobs._prompt_groups(batch) is not None
        monkeypatch.setattr(model, "route", counting_route)
        routed.clear()
        lp_s, ent_s, g_s = _grads(params, cfg, batch, with_aux=False)
        monkeypatch.setattr(model, "route", real_route)
        first_rows = [int((batch.group_B == p).nonzero()[0]) for p in batch.group_B.unique()]
        n_real = int(batch.prompt_mask_BTp[first_rows].sum()) + int(batch.response_mask_BTr[:, :-1].sum())
        assert routed == [n_real] * cfg.num_hidden_layers, (routed, n_real)
        lp_p, ent_p, g_p = _grads(params, cfg, batch, with_aux=False, remat=True)  # plain path
        m = batch.response_mask_BTr
        torch.testing.assert_close(lp_s[m], lp_p[m], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ent_s[m], ent_p[m], atol=2e-5, rtol=1e-5)
        _grads_as_close_to_float64(params, cfg, batch, g_s, g_p)
