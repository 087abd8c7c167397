"""Rollout Routing Replay (R3) for the MoE families (Qwen3-MoE softmax routing, DeepSeek-V3 sigmoid group-limited
routing): the rollout records every computed token's experts; the training forward routes by them (the
weights still from the current router, so it keeps its gradient) or only counts how many differ; the
records travel through the transfer dock with the rows; the recipe runs with it."""

import dataclasses
import json

import pytest
import torch
from helpers import random_prompts, recipe_module

from rlflow.algos import stages
from rlflow.batch import PromptBatch
from rlflow.dock import Dock
from rlflow.models import decoder as qm
from rlflow.models.config import get_config
from rlflow.ops import replay_routes, route, route_grouped
from rlflow.rollout import SamplingConfig, generate
from rlflow.runtime.flow import DockFlow
from rlflow.runtime.graph import GRPO
from rlflow.sharding.mesh import Mesh

MODELS = ["qwen3-moe-tiny", "deepseek-tiny"]


def rollout(model: str, seed: int = 1):
    cfg = get_config(model)
    params = qm.init_params(cfg, seed=seed, std=0.3)
    prompts = random_prompts(cfg.vocab_size, 5, torch.Generator().manual_seed(2))
    ro = generate(params, cfg, prompts, SamplingConfig(max_new_tokens=6, eos_id=5, temperature=1.0), group_size=2,
                  seed=3, max_batch=4, record_routes=True)  # 10 rows over 4 slots: refills
    return cfg, params, ro


def perturbed_router(params, scale=0.3):
    g = torch.Generator().manual_seed(9)
    return {k: v + scale * torch.randn(v.shape, generator=g) if k.endswith("gate.weight") else v
            for k, v in params.items()}


@pytest.mark.parametrize("model", MODELS)
def test_the_rollout_records_every_token_it_computed_and_training_routes_them_alike(model):
    cfg, params, ro = rollout(model)
    M, K = qm.n_moe_layers(cfg), cfg.num_experts_per_tok
    assert ro.prompt_routes_BTpMK.shape[2:] == ro.response_routes_BTrMK.shape[2:] == (M, K)
    # set on every real prompt token, and on every response token but the last (never fed back)
    assert torch.equal((ro.prompt_routes_BTpMK >= 0).all(-1).all(-1), ro.prompt_mask_BTp)
    n = ro.response_mask_BTr.sum(-1, keepdim=True)
    assert torch.equal((ro.response_routes_BTrMK >= 0).all(-1).all(-1),
                       torch.arange(ro.response_mask_BTr.shape[1])[None] < n - 1)
    # the training forward on the same weights (float32) routes every token as the decode steps did
    st = {}
    stages.response_logprobs(params, cfg, ro, replay=False, routing_stats=st)
    assert int(st["compared"]) == int(ro.prompt_mask_BTp.sum() + (n - 1).sum()) * M
    assert int(st["router_flipped"]) == 0 and int(st["flipped"]) == 0


@pytest.mark.parametrize("model", MODELS)
def test_replay_routes_every_token_to_the_rollouts_experts_after_the_router_moved(model):
    cfg, params, ro = rollout(model)
    moved = perturbed_router(params)
    free, replayed = {}, {}
    lp_free, _, _ = stages.response_logprobs(moved, cfg, ro, replay=False, routing_stats=free)
    lp_rep, _, _ = stages.response_logprobs(moved, cfg, ro, replay=True, routing_stats=replayed)
    share = float(free["flipped"]) / float(free["compared"])
    assert share > 0.2, share  # without replay many tokens go elsewhere
    assert int(replayed["flipped"]) == 0  # with it none does
    assert int(replayed["router_flipped"]) > 0  # the router's own (disagreeing) choice is still measured
    assert float((lp_free - lp_rep).abs().max()) > 1e-3
    # the experts the replayed forward used are the recorded ones, token by token
    routes = torch.cat([ro.prompt_routes_BTpMK, ro.response_routes_BTrMK], 1)[:, :-1]
    routing = qm.Routing(rollout=routes, replay=True, record=True)
    ids = torch.cat([ro.prompt_ids_BTp, ro.response_ids_BTr], 1)[:, :-1]
    valid = torch.cat([ro.prompt_mask_BTp, ro.response_mask_BTr], 1)[:, :-1]
    qm.forward(moved, cfg, ids, qm.positions_from_valid(valid), valid_BT=valid, routing=routing)
    rec = (routes >= 0).all(-1)
    assert torch.equal(routing.chosen.sort(-1)[0][rec], routes.sort(-1)[0][rec])


@pytest.mark.parametrize("model", MODELS)
def test_the_router_keeps_its_gradient_under_replay(model):
    cfg, params, ro = rollout(model)
    leaves = {k: v.clone().requires_grad_(True) for k, v in perturbed_router(params).items()}
    lp, _, _ = stages.response_logprobs(leaves, cfg, ro, replay=True)
    (lp * ro.response_mask_BTr).sum().backward()
    gates = [k for k in leaves if k.endswith("gate.weight")]
    assert gates and all(float(leaves[k].grad.abs().max()) > 0 for k in gates)


@pytest.mark.parametrize("sigmoid", [False, True])
def test_replayed_weights_are_the_routers_probabilities_at_the_replayed_experts(sigmoid):
    g = torch.Generator().manual_seed(0)
    x, gate = torch.randn(7, 16, generator=g), torch.randn(8, 16, generator=g)
    if sigmoid:
        w, idx, _ = route_grouped(x, gate, torch.zeros(8), 2, 2, 1, True, 2.5)
    else:
        w, idx, _ = route(x, gate, 2, True, with_aux=False)
    replay = torch.randint(0, 8, (7, 2), generator=g)
    replay[:, 1] = (replay[:, 0] + 1) % 8  # two distinct experts per token
    replay[3] = -1  # no record: the token keeps its own routing
    w2, idx2 = replay_routes(x, gate, idx, replay, sigmoid=sigmoid, norm_topk_prob=True, scaling=2.5 if sigmoid else 1.0)
    assert torch.equal(idx2[3], idx[3]) and torch.allclose(w2[3], w[3], atol=1e-6)
    logits = x @ gate.T
    p = logits.sigmoid() if sigmoid else logits.softmax(-1)
    for n in (0, 1, 2, 4, 5, 6):
        assert torch.equal(idx2[n], replay[n])
        want = p[n, replay[n]] / p[n, replay[n]].sum() * (2.5 if sigmoid else 1.0)
        assert torch.allclose(w2[n], want, atol=1e-6)


def test_the_routes_travel_through_the_dock_with_their_rows():
    cfg, _, ro = rollout("deepseek-tiny")
    G, P = 2, ro.size // 2
    dock = Dock.local(GRPO.schema, GRPO.consumers, capacity=ro.size, warehouses=2, group_size=G)
    flow = DockFlow(dock, route_dims=(qm.n_moe_layers(cfg), cfg.num_experts_per_tok))
    first = ro.select(torch.arange(0, ro.size, G))
    flow.begin(PromptBatch(prompt_ids_BTp=first.prompt_ids_BTp, prompt_mask_BTp=first.prompt_mask_BTp,
                           index_B=torch.arange(P), group_B=torch.arange(P), answers=("x",) * P), G)
    flow.put_rows(ro.replace(answers=("x",) * ro.size))
    got, _ = flow.get("train", ["response_routes", "prompt_routes"], Mesh(), 0)
    order = torch.argsort(got.index_B)
    got = got.select(order)
    Tp, Tr = got.prompt_ids_BTp.shape[1], got.response_ids_BTr.shape[1]
    assert torch.equal(got.prompt_routes_BTpMK, ro.prompt_routes_BTpMK[:, -Tp:])
    assert torch.equal(got.response_routes_BTrMK, ro.response_routes_BTrMK[:, :Tr])


def test_the_recipe_refuses_replay_for_a_dense_model_before_any_rank_starts(capsys):
    with pytest.raises(SystemExit, match="error: routing_replay='on' needs an MoE model; qwen2 has no routed experts"):
        recipe_module().main(["--preset", "qwen2.5-tiny", "--routing-replay", "on", "--steps", "1"])


def test_routing_replay_is_refused_for_a_dense_model_and_an_unknown_mode():
    recipe = recipe_module()
    lcfg = recipe.build(recipe.parse_args(["--world", "1", "--steps", "1"])).config
    with pytest.raises(ValueError, match="routing_replay='sometimes': expected one of"):
        dataclasses.replace(lcfg, routing_replay="sometimes")
    with pytest.raises(ValueError, match="record_routes needs an MoE model"):
        generate({}, get_config("qwen2.5-7b"), random_prompts(32, 1, torch.Generator()),
                 SamplingConfig(max_new_tokens=1, eos_id=0), record_routes=True)


@pytest.mark.parametrize("mode", ["measure", "on"])
def test_the_recipe_reports_the_flip_shares(mode, tmp_path):
    """Two optimizer steps per GRPO step: the second mini-batch meets a router that has moved since the rollout."""
    out = tmp_path / "run"
    recipe_module().main(["--world", "1", "--steps", "4", "--prompts-per-step", "4", "--group-size", "4",
                          "--mini-batch-size", "8", "--routing-replay", mode, "--lr", "3e-3", "--out", str(out)])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    router = [r["routing_router_flip_frac"] for r in rows]
    used = [r["routing_flip_frac"] for r in rows]
    assert max(router) > 0
    assert used == (router if mode == "measure" else [0.0] * len(rows))
