"""transformers as the outside oracle: rlflow's functional model gives the same logits as
transformers' own modules, loading their checkpoints and saving ones they load."""

import pytest
import torch
import transformers  # a declared test dependency: an install without it fails here, it does not skip

from rlflow.models import decoder, hf

TOL = 1e-4


def _hf_models():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    common = dict(vocab_size=97, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0)
    return {
        "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, head_dim=8, intermediate_size=64, moe_intermediate_size=24, num_experts=6,
            num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])),
        "qwen3_moe_nonorm_tied": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, head_dim=8, intermediate_size=64, moe_intermediate_size=24, num_experts=4,
            num_experts_per_tok=3, norm_topk_prob=False, tie_word_embeddings=True)),
        "qwen3_dense": lambda: Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8, intermediate_size=64)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**common, intermediate_size=64)),
        # SmolLM2's shape: tied embeddings, 3 query heads per kv head, no bias
        "llama_tied": lambda: LlamaForCausalLM(LlamaConfig(**common, intermediate_size=64, tie_word_embeddings=True)),
        "llama_llama3_rope": lambda: LlamaForCausalLM(LlamaConfig(
            **{**common, "rope_theta": 500000.0}, intermediate_size=64, head_dim=16, rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16})),
    }


def _inputs(seed=0, B=3, T=11, V=97):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :4] = False  # left padding
    valid[2, :1] = False
    return ids, valid


def _randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))


@pytest.mark.parametrize("kind", list(_hf_models()))
def test_load_transformers_checkpoint_same_logits(kind, tmp_path):
    torch.manual_seed(0)
    model = _hf_models()[kind]().float().eval()
    _randomize(model, 1)  # norms away from 1, biases non-zero: every parameter matters
    model.save_pretrained(tmp_path)
    cfg, params = hf.load(str(tmp_path))
    ids, valid = _inputs()
    pos = decoder.positions_from_valid(valid)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=valid.long(), position_ids=pos).logits
        h, aux, _ = decoder.forward(params, cfg, ids, pos, valid_BT=valid)
        out = decoder.logits(params, cfg, h)
    diff = (out - ref)[valid].abs().max().item()
    assert diff <= TOL, f"{kind}: max |logits - transformers| = {diff}"
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2", "llama_tied", "llama_llama3_rope"])
def test_saved_checkpoint_loads_in_transformers(kind, tmp_path):
    from transformers import AutoModelForCausalLM
    model = _hf_models()[kind]().float().eval()
    model.save_pretrained(tmp_path / "src")
    cfg, params = hf.load(str(tmp_path / "src"))
    params = {k: v + 0.01 * torch.randn_like(v) for k, v in params.items()}  # not the original weights
    hf.save(str(tmp_path / "dst"), cfg, params, max_shard_bytes=50_000)  # forces sharding + index
    assert (tmp_path / "dst" / hf.INDEX).exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32).eval()
    ids, valid = _inputs(seed=3)
    pos = decoder.positions_from_valid(valid)
    with torch.no_grad():
        ref = loaded(input_ids=ids, attention_mask=valid.long(), position_ids=pos).logits
        h, _, _ = decoder.forward(params, cfg, ids, pos, valid_BT=valid)
        out = decoder.logits(params, cfg, h)
    assert (out - ref)[valid].abs().max().item() <= TOL
    cfg2, params2 = hf.load(str(tmp_path / "dst"))
    assert cfg2 == cfg and all(torch.equal(params[k], params2[k]) for k in params)


def test_load_rejects_mismatched_checkpoint(tmp_path):
    model = _hf_models()["qwen3_dense"]()
    model.save_pretrained(tmp_path)
    import json
    c = json.loads((tmp_path / "config.json").read_text())
    c["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="missing"):
        hf.load(str(tmp_path))


def test_a_config_without_norm_topk_prob_loads_as_transformers_reads_it(tmp_path):
    """transformers' Qwen3MoeConfig defaults norm_topk_prob to False: a config.json that leaves it out must
    give the same logits here (it was read as True: a logit difference of ~3)."""
    import json
    torch.manual_seed(0)
    model = _hf_models()["qwen3_moe"]().float().eval()
    _randomize(model, 2)
    model.save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    d = json.loads(cfg_path.read_text())
    d.pop("norm_topk_prob")
    cfg_path.write_text(json.dumps(d))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    assert ref_model.config.norm_topk_prob is False
    cfg, params = hf.load(str(tmp_path))
    ids, valid = _inputs()
    pos = decoder.positions_from_valid(valid)
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=valid.long(), position_ids=pos).logits
        out = decoder.logits(params, cfg, decoder.forward(params, cfg, ids, pos, valid_BT=valid)[0])
    assert (out - ref)[valid].abs().max().item() < TOL


@pytest.mark.parametrize("field, value, match", [
    ("use_sliding_window", True, "use_sliding_window"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic'"),
    ("rope_scaling", {"rope_type": "longrope", "factor": 8.0}, "rope type 'longrope'"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, r"'llama3' needs \[.*'low_freq_factor'"),
])
def test_config_fields_rlflow_does_not_implement_are_refused_by_name(field, value, match):
    """Each of these loaded without error and gave wrong logits against transformers."""
    from rlflow.models.config import ModelConfig, get_config
    d = get_config("qwen3-moe-tiny").to_hf()
    d[field] = value
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(d)


@pytest.mark.parametrize("field", ["mlp_bias", "attention_bias"])
def test_llama_biases_are_refused_by_name(field):
    """Llama's biases cover the MLP, or o_proj beside q/k/v: rlflow has neither, so they are refused."""
    from rlflow.models.config import ModelConfig
    d = {**_hf_models()["llama_tied"]().config.to_dict(), field: True}
    with pytest.raises(ValueError, match=f"{field}=true"):
        ModelConfig.from_hf(d)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 16, "beta_slow": 2,
     "attention_factor": 1.3},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
])
def test_rope_scalings_give_the_same_logits(rope, tmp_path):
    """Linear, YaRN (Qwen2.5's long-context setting) and llama3 (Llama 3.1+) rope scaling as transformers computes
    them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        max_position_embeddings=128, head_dim=8, intermediate_size=64, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, rope_parameters={"rope_theta": 10000.0, **rope})).float().eval()
    _randomize(model, 3)
    model.save_pretrained(tmp_path)
    cfg, params = hf.load(str(tmp_path))
    assert cfg.rope_scaling is not None and cfg.rope_scaling.kind == rope["rope_type"]
    ids, valid = _inputs()
    pos = decoder.positions_from_valid(valid) + 20  # past the original context
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=valid.long(), position_ids=pos).logits
        out = decoder.logits(params, cfg, decoder.forward(params, cfg, ids, pos, valid_BT=valid)[0])
        plain = decoder.logits(params, cfg.replace(rope_scaling=None),
                                 decoder.forward(params, cfg.replace(rope_scaling=None), ids, pos, valid_BT=valid)[0])
    assert (out - ref)[valid].abs().max().item() < TOL
    assert (plain - ref)[valid].abs().max().item() > 100 * TOL  # the scaling is really applied


@pytest.mark.parametrize("damage", ["truncate", "random"])
def test_a_damaged_safetensors_file_is_refused_naming_it(damage, tmp_path):
    from rlflow.models.config import get_config
    cfg = get_config("qwen3-moe-tiny")
    hf.save(str(tmp_path), cfg, decoder.init_params(cfg))
    f = tmp_path / hf.SINGLE
    data = f.read_bytes()
    noise = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else noise.numpy().tobytes())
    with pytest.raises(ValueError, match=str(f)):
        hf.load(str(tmp_path))


def test_saving_over_an_older_sharded_checkpoint_replaces_all_of_it(tmp_path):
    """The stale index of an older sharded checkpoint made ``load`` read the old weights."""
    from rlflow.models.config import get_config
    cfg = get_config("qwen3-moe-tiny")
    old, new = decoder.init_params(cfg, seed=1), decoder.init_params(cfg, seed=2)
    assert len(hf.save(str(tmp_path), cfg, old, max_shard_bytes=20_000)) > 1  # sharded, with an index
    hf.save(str(tmp_path), cfg, new)  # one file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", hf.SINGLE]
    _, got = hf.load(str(tmp_path))
    assert all(torch.equal(got[k], new[k]) for k in new)
    names = hf.save(str(tmp_path), cfg, old, max_shard_bytes=20_000)  # and back: the single file goes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["config.json", hf.INDEX, *names])
    _, got = hf.load(str(tmp_path))
    assert all(torch.equal(got[k], old[k]) for k in old)


def test_every_preset_and_rope_kind_round_trips_through_config_json():
    """to_hf writes each rope kind's own fields (models/config.py and RopeScaling.FIELDS); from_hf reads them back
    into the same config."""
    from rlflow.models.config import PRESETS, ModelConfig, get_config
    from rlflow.ops import RopeScaling
    ropes = [RopeScaling(kind="linear", factor=2.0),
             RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0, beta_fast=16.0),
             RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=16, low_freq_factor=1.0,
                         high_freq_factor=4.0)]
    configs = list(PRESETS.values()) + [get_config("llama-tiny").replace(rope_scaling=r) for r in ropes]
    for cfg in configs:
        d = cfg.to_hf()
        assert ModelConfig.from_hf(d) == cfg, cfg
        if cfg.rope_scaling is not None:
            assert set(d["rope_parameters"]) - {"rope_theta", "rope_type", "factor"} <= \
                set(RopeScaling.FIELDS[cfg.rope_scaling.kind]), d["rope_parameters"]


def test_a_llama_config_with_qwens_switches_is_refused():
    """A Llama config.json carries no q/k norm: a ModelConfig that had one would save a checkpoint transformers
    reads without it."""
    from rlflow.models.config import get_config
    for kw in (dict(qk_norm=True), dict(attention_bias=True)):
        with pytest.raises(ValueError, match=f"llama has no qk_norm \\(got {kw.get('qk_norm', False)}\\)"):
            get_config("llama-tiny").replace(**kw)
