"""DeepSeek-V3 against transformers' ``DeepseekV3ForCausalLM`` as the outside oracle: the same logits (1e-4 in
float32) over MLA with and without ``q_lora_rank``, YaRN, group-limited routing settings, dense first layers,
left padding; checkpoints both ways; the latent KV cache and the absorbed decode against recomputing; the
config values rlflow does not implement refused by name. Layouts: tests/test_parallel.py and
tests/test_generate_layouts.py run the same model in TP, EP, PP and TP x EP."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from rlflow.models import decoder, deepseek, hf
from rlflow.models.config import ModelConfig, get_config
from rlflow.rollout import SamplingConfig, generate
from helpers import random_prompts, recipe_module

TOL = 1e-4
V = 97
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, mscale=0.8,
            mscale_all_dim=0.6, beta_fast=32, beta_slow=1)
CONFIGS = {
    "q-lora": {},
    "no-q-lora": dict(q_lora_rank=None),
    "yarn": dict(rope_parameters=YARN),
    "groups-4-keep-2-top-3": dict(n_group=4, topk_group=2, num_experts_per_tok=3),
    "no-groups-no-norm": dict(n_group=1, topk_group=1, norm_topk_prob=False),
    "all-moe": dict(first_k_dense_replace=0, n_shared_experts=2),
    "rope-not-interleaved": dict(rope_interleave=False),
    # the latent norms (q_a_layernorm, kv_a_layernorm) keep eps 1e-6 whatever rms_norm_eps says, as
    # transformers and DeepSeek's code do (with the model's eps the logits were 1.42 off)
    "rms-norm-eps-1e-2": dict(rms_norm_eps=1e-2),
    # no shared experts: transformers writes them zero-width (they were refused as unexpected tensors)
    "no-shared-experts": dict(n_shared_experts=0),
}


def hf_model(**kw) -> DeepseekV3ForCausalLM:
    base = dict(vocab_size=V, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=128, rope_theta=10000.0)
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(DeepseekV3Config(**{**base, **kw})).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms away from 1, a non-zero selection bias: every parameter matters
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return m


def inputs(B=3, T=11):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :4] = False  # left padding
    valid[2, :1] = False
    return ids, valid, decoder.positions_from_valid(valid)


def ours(params, cfg, ids, valid, pos):
    with torch.no_grad():
        return decoder.logits(params, cfg, decoder.forward(params, cfg, ids, pos, valid_BT=valid)[0])


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_transformers_checkpoint_gives_the_same_logits(kind, tmp_path):
    m = hf_model(**CONFIGS[kind])
    m.save_pretrained(tmp_path)
    cfg, params = hf.load(str(tmp_path))
    assert cfg.mla and cfg.scoring_func == "sigmoid"
    ids, valid, pos = inputs()
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=valid.long(), position_ids=pos).logits
    diff = (ours(params, cfg, ids, valid, pos) - ref)[valid].abs().max().item()
    assert diff <= TOL, f"{kind}: max |logits - transformers| = {diff}"
    if kind == "yarn":  # the scaling is really on: the logits without it are far off
        plain = ours(params, cfg.replace(rope_scaling=None), ids, valid, pos)
        assert (plain - ref)[valid].abs().max().item() > 100 * TOL


def test_rlflow_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path):
    tiny = get_config("deepseek-tiny")
    yarn = ModelConfig.from_hf({**tiny.to_hf(), "rope_parameters": YARN}).rope_scaling
    cfg = tiny.replace(vocab_size=V, rope_scaling=yarn)
    params = decoder.init_params(cfg, seed=0, std=0.2)
    g = torch.Generator().manual_seed(5)
    params = {k: torch.randn(v.shape, generator=g) * 0.1 if k.endswith("e_score_correction_bias") else v
              for k, v in params.items()}
    hf.save(str(tmp_path), cfg, params)
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    assert type(ref_model).__name__ == "DeepseekV3ForCausalLM"
    ids, valid, pos = inputs()
    ids = ids % cfg.vocab_size
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=valid.long(), position_ids=pos).logits
    assert (ours(params, cfg, ids, valid, pos) - ref)[valid].abs().max().item() <= TOL
    cfg2, params2 = hf.load(str(tmp_path))
    assert cfg2 == cfg and all(torch.equal(params[k], params2[k]) for k in params)


def test_the_multi_token_prediction_layer_is_skipped_on_load(tmp_path, caplog):
    m = hf_model()
    m.save_pretrained(tmp_path)
    f = tmp_path / hf.SINGLE
    tensors = load_file(f)
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.2.")}
    save_file({**tensors, **mtp, "model.layers.3.eh_proj.weight": torch.zeros(48, 96)}, f, metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="rlflow.models.hf"):
        cfg, params = hf.load(str(tmp_path))
    assert "skipping layer(s) [3]" in caplog.text
    assert not any(k.startswith("model.layers.3.") for k in params)
    ids, valid, pos = inputs()
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=valid.long(), position_ids=pos).logits
    assert (ours(params, cfg, ids, valid, pos) - ref)[valid].abs().max().item() <= TOL


def test_the_absorbed_decode_equals_the_expanded_attention():
    cfg = get_config("deepseek-tiny")
    params = decoder.init_params(cfg, seed=2, std=0.3)
    a, H = "model.layers.0.self_attn.", cfg.num_attention_heads
    g = torch.Generator().manual_seed(3)
    B, S = 3, 9
    q = torch.randn(B, 1, H, cfg.qk_head_dim, generator=g)
    kv = torch.randn(B, S, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g)
    mask = torch.rand(B, 1, 1, S, generator=g) < 0.7
    mask[..., -1] = True
    absorbed = deepseek._absorbed(params, cfg, a, q, kv, H, mask)
    expanded = deepseek._expanded(params, cfg, a, q, kv, H, mask)
    assert absorbed.shape == expanded.shape == (B, 1, H, cfg.v_head_dim)
    assert (absorbed - expanded).abs().max().item() < 1e-5


def test_the_latent_cache_generates_what_recomputing_the_full_forward_gives():
    """Greedy decoding through the cache (one latent of r + p numbers per token and layer, absorbed decode,
    refilled slots) picks, at every step, the argmax of the full forward over the whole sequence so far."""
    cfg = get_config("deepseek-tiny")
    params = decoder.init_params(cfg, seed=4, std=0.3)
    cache = decoder.KVCache.allocate(cfg, 2, 16, dtype=torch.float32, device="cpu")
    assert cache.k[0].shape == (2, 1, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim) and cache.v[0] is None
    prompts = random_prompts(cfg.vocab_size, 4, torch.Generator().manual_seed(6))
    n = 6
    ro = generate(params, cfg, prompts, SamplingConfig(max_new_tokens=n, eos_id=-1, temperature=0.0), group_size=1, seed=0,
                  max_batch=3)
    for b in range(4):
        seq = prompts.prompt_ids_BTp[b][prompts.prompt_mask_BTp[b]].tolist()
        for t in range(n):
            ids = torch.tensor([seq])
            with torch.no_grad():
                h = decoder.forward(params, cfg, ids, torch.arange(len(seq))[None])[0]
                nxt = int(decoder.logits(params, cfg, h)[0, -1].argmax())
            assert int(ro.response_ids_BTr[b, t]) == nxt, f"row {b} step {t}"
            seq.append(nxt)


@pytest.mark.parametrize("field, value, match", [
    ("scoring_func", "softmax", "scoring_func='softmax' is not implemented by rlflow for deepseek_v3"),
    ("topk_method", "greedy", "topk_method='greedy'"),
    ("moe_layer_freq", 2, "moe_layer_freq=2"),
    ("attention_bias", True, "attention_bias=True"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("quantization_config", {"quant_method": "fp8"}, "quant_method='fp8'"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope type 'dynamic'"),
    ("rope_scaling", {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "low_freq": 1},
     r"field\(s\) \['low_freq'\]"),
    ("n_group", 3, "n_group=3 must divide num_experts=8"),
])
def test_config_values_rlflow_does_not_implement_are_refused_by_name(field, value, match):
    d = get_config("deepseek-tiny").to_hf()
    d[field] = value
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(d)


def test_config_json_round_trips():
    for name in ("deepseek-tiny", "deepseek-r1-671b"):
        cfg = get_config(name)
        assert ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg
    # transformers 4.x reads the YaRN scaling (and with it MLA's mscale) from rope_scaling only
    d = get_config("deepseek-r1-671b").to_hf()
    assert d["rope_scaling"]["type"] == d["rope_parameters"]["rope_type"] == "yarn"
    assert ModelConfig.from_hf({k: v for k, v in d.items() if k != "rope_parameters"}) == get_config("deepseek-r1-671b")


def test_a_routed_scale_on_softmax_routing_is_refused():
    """Softmax routing (Qwen3-MoE) has no routed_scaling_factor: accepted, the replayed weights were scaled
    and the router's were not."""
    with pytest.raises(ValueError, match="routed_scaling_factor=2.0: the routed weights' scale is DeepSeek's"):
        get_config("qwen3-moe-tiny").replace(routed_scaling_factor=2.0)


def test_the_recipe_learns_the_built_in_task_with_deepseek_tiny(tmp_path):
    """``--preset deepseek-tiny`` from random init, one process: the mean reward of the last 10 of 150 steps is
    clearly above the first 10 (+0.29 measured; the 2-process default run reaches +0.68 by step 300)."""
    history = recipe_module().main(["--preset", "deepseek-tiny", "--world", "1", "--steps", "150",
                                    "--out", str(tmp_path / "run")])
    r = [m["reward_mean"] for m in history]
    assert sum(r[-10:]) / 10 - sum(r[:10]) / 10 >= 0.15


def test_in_bfloat16_the_router_stays_float32_and_chooses_what_transformers_chooses(tmp_path):
    """transformers keeps DeepSeek-V3's gate and selection bias in float32 whatever the model's dtype
    (``_keep_in_fp32_modules_strict``): a bfloat16 load here does too, so the bias's small per-expert offsets
    survive and the experts chosen are transformers' own; the layouts carry the same dtypes, and a transition
    between two of them moves the mixed-dtype shards exactly."""
    from rlflow.models.sharding import layout
    from rlflow.ops.moe import route_grouped
    from rlflow.sharding import Mesh
    from rlflow.sharding.execute import simulate
    from rlflow.sharding.reference import shard
    from rlflow.sharding.plan import allgather_swap

    m = hf_model(n_group=1, topk_group=1)
    router = m.model.layers[1].mlp.gate
    E = router.e_score_correction_bias.numel()
    with torch.no_grad():  # offsets below bf16's spacing (2^-9 at 0.3): rounded, they would tie or reorder
        router.e_score_correction_bias.copy_(0.3 + 1e-3 * torch.arange(E).float().flip(0))
        router.weight.mul_(1e-3)  # scores near sigmoid(0): the bias decides between them
    m.save_pretrained(tmp_path)
    cfg, params = hf.load(str(tmp_path), dtype=torch.bfloat16)
    gate, bias = "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"
    assert params[gate].dtype == params[bias].dtype == torch.float32
    assert torch.equal(params[bias], router.e_score_correction_bias) and torch.equal(params[gate], router.weight)
    assert params["model.embed_tokens.weight"].dtype == torch.bfloat16
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).model.layers[1].mlp.gate
    if theirs.weight.dtype != torch.float32:  # transformers < 5.2x keeps only the bias in float32 (5.19 rounds the
        theirs = router  # gate weight to bf16): its router code on the checkpoint's float32 gate is the oracle
    x = (torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    with torch.no_grad():
        want = theirs(x)[2].sort(-1)[0]

        def pick(b):
            return route_grouped(x, params[gate], b, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                                 cfg.norm_topk_prob, cfg.routed_scaling_factor)[1].sort(-1)[0]
        assert torch.equal(pick(params[bias]), want)
        assert not torch.equal(pick(params[bias].to(torch.bfloat16)), want)  # rounded, the bias chooses others
    tiny = get_config("deepseek-tiny")
    src, dst = (layout(tiny, Mesh.parse(s, 2), dtype=torch.bfloat16) for s in ("tp=2", "dp=2"))
    full = decoder.init_params(tiny, dtype=torch.bfloat16)
    assert all(src[n].dtype == full[n].dtype for n in src.names) and full[bias.replace("1", "2", 1)].dtype == torch.float32
    got, want = simulate(allgather_swap(src, dst), shard(full, src)), shard(full, dst)
    for r in (0, 1):
        assert set(got[r]) == set(want[r]) and all(torch.equal(got[r][n], want[r][n]) for n in want[r])
