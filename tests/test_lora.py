"""LoRA (``models/lora.py``, ``models/adapters.py``): a fresh adapter leaves the base's outputs exactly as they
are; the adapted forward equals the merged model's and peft's on transformers' model; the update trains the
adapters alone against the base as the reference; peft's files round-trip and what rlflow does not run of them
is refused; the recipe's flags. The layouts' equivalence is tests/test_parallel.py's (its lora-* cases)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rlflow import optim
from rlflow.algos.grpo import GRPOConfig
from rlflow.data import PromptSource
from rlflow.models import adapters, decoder, hf, lora
from rlflow.models.config import get_config
from rlflow.models.lora import LoraConfig
from rlflow.models.shapes import param_shapes
from rlflow.rollout import SamplingConfig
from rlflow.runtime import loop
from rlflow.runtime.state import init, reference
from rlflow.runtime.step import context
from rlflow.tokenizer import CharTokenizer


def _model(preset: str, lc: LoraConfig, *, b_std: float = 0.0, seed: int = 0):
    cfg = get_config(preset).replace(lora=lc)
    base = decoder.init_params(cfg, seed=seed, std=0.1)
    ad = lora.init(cfg, param_shapes(cfg), seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    ad = {k: torch.randn(v.shape, generator=g) * b_std if k.endswith(lora.B) else v for k, v in ad.items()}
    return cfg, base, ad


def _logits(params, cfg, ids):
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        return decoder.logits(params, cfg, decoder.forward(params, cfg, ids, pos)[0])


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny", "qwen2.5-tiny", "deepseek-tiny"])
def test_a_fresh_adapter_gives_exactly_the_base_outputs_and_a_trained_one_its_merged_model(preset):
    # every projection the model has and the (untied) head
    lc = LoraConfig(4, 8.0, targets=("gate_proj", "up_proj", "down_proj", "lm_head") if preset == "deepseek-tiny"
                    else get_config(preset).replace(lora=LoraConfig(4, 8.0)).lora.targets + ("lm_head",))
    cfg, base, ad = _model(preset, lc)
    assert "lm_head.lora_A.weight" in ad
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits({**base, **ad}, cfg, ids), _logits(base, cfg, ids))  # B = 0: bit for bit
    cfg, base, ad = _model(preset, lc, b_std=0.3)
    adapted = _logits({**base, **ad}, cfg, ids)
    assert (adapted - _logits(base, cfg, ids)).abs().max() > 1e-2
    assert (adapted - _logits(adapters.merged({**base, **ad}, cfg), cfg, ids)).abs().max() < 1e-4


def test_targets_are_refused_by_name_when_the_model_has_no_such_module():
    with pytest.raises(ValueError, match="'gate_proj' names no module of this qwen3_moe model"):
        get_config("qwen3-moe-tiny").replace(lora=LoraConfig(4, 8.0, targets=("gate_proj",)))
    with pytest.raises(ValueError, match="'o_proj' is an MLA projection"):
        get_config("deepseek-tiny").replace(lora=LoraConfig(4, 8.0))
    for t, why in (("experts", "stacked parameters"), ("gate", "router"), ("embed_tokens", "embedding"),
                   ("qkv", "no linear")):
        with pytest.raises(ValueError, match=why):
            LoraConfig(4, 8.0, targets=(t,))
    with pytest.raises(ValueError, match="'lm_head': this llama model's head is its embedding"):
        get_config("smollm2-135m").replace(lora=LoraConfig(4, 8.0, targets=("q_proj", "lm_head")))
    with pytest.raises(ValueError, match="rank=0"):
        LoraConfig(0, 8.0)
    # the default targets are those the model has, in one order: configs compare equal however they were named
    cfg = get_config("qwen3-moe-tiny").replace(lora=LoraConfig(4, 8.0))
    assert cfg.lora.targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert cfg == get_config("qwen3-moe-tiny").replace(lora=LoraConfig(4, 8.0, targets=("v_proj", "q_proj", "o_proj",
                                                                                           "k_proj")))


def test_peft_loads_the_adapters_and_its_logits_equal_ours(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    lc = LoraConfig(4, 6.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                     "lm_head"))
    cfg, base, ad = _model("llama-tiny", lc, b_std=0.3)
    hf.save(str(tmp_path / "base"), cfg.replace(lora=None), base)
    adapters.save(str(tmp_path / "adapter"), cfg, {**base, **ad}, base_model=str(tmp_path / "base"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    ours = _logits({**base, **ad}, cfg, ids)
    assert (ours - theirs).abs().max() < 1e-5
    # and back: what peft saves, rlflow loads
    peft_model.save_pretrained(tmp_path / "resaved")
    got = adapters.load(str(tmp_path / "resaved"), cfg)
    assert adapters.read_config(str(tmp_path / "resaved")) == cfg.lora
    assert set(got) == set(ad) | {"lm_head.weight"} and all(torch.equal(got[k], ad[k]) for k in ad)
    assert torch.equal(got["lm_head.weight"], base["lm_head.weight"])  # peft saves an adapted head's own weight


@pytest.mark.parametrize("field, value, match", [
    ("use_dora", True, "use_dora=True is not implemented"),
    ("use_rslora", True, "use_rslora=True is not implemented"),
    ("bias", "all", "bias='all'"),
    ("target_modules", "all-linear", "a list of module names"),
    ("peft_type", "IA3", "LoRA adapters only"),
    ("rank_pattern", {"q_proj": 16}, "rank_pattern"),
])
def test_peft_options_rlflow_does_not_run_are_refused_by_name(tmp_path, field, value, match):
    cfg, base, ad = _model("llama-tiny", LoraConfig(4, 8.0))
    adapters.save(str(tmp_path), cfg, ad)
    conf = json.loads((tmp_path / adapters.CONFIG).read_text())
    (tmp_path / adapters.CONFIG).write_text(json.dumps({**conf, field: value}))
    with pytest.raises(ValueError, match=match):
        adapters.read_config(str(tmp_path))


def test_adapters_of_another_rank_or_base_are_refused_naming_the_tensor(tmp_path):
    cfg, _, ad = _model("llama-tiny", LoraConfig(4, 8.0))
    adapters.save(str(tmp_path), cfg, ad)
    with pytest.raises(ValueError, match=r"rank-8 adapter .*another base model or rank"):
        adapters.load(str(tmp_path), get_config("llama-tiny").replace(lora=LoraConfig(8, 8.0)))
    with pytest.raises(ValueError, match="another base model or rank"):
        adapters.load(str(tmp_path), get_config("qwen2.5-tiny").replace(lora=LoraConfig(4, 8.0)))


def test_the_update_trains_the_adapters_alone_against_the_base_as_the_reference():
    tok = CharTokenizer()
    cfg, base, ad = _model("qwen3-moe-tiny", LoraConfig(4, 8.0))
    cfg = cfg.replace(eos_token_id=tok.eos_id)
    params = {**base, **ad}
    before = {k: v.clone() for k, v in params.items()}
    conf = loop.LoopConfig(steps=2, prompts_per_step=2, grpo=GRPOConfig(group_size=4, kl_coef=0.1), mini_batch_size=8,
                           micro_batch_size=4, optim=optim.AdamWConfig(lr=1e-2),
                           sampling=SamplingConfig(max_new_tokens=4, eos_id=tok.eos_id, pad_id=tok.pad_id))
    state = init(params, PromptSource(task="max_digit"), kl=True)
    assert set(state.opt_state.m) == set(ad)  # no optimizer state for the base
    assert state.ref == {} and set(reference(state)) == set(base)  # the base is the reference: nothing copied
    assert all(reference(state)[k] is state.policy[k] for k in base)
    reward = lambda resp, ans: [float(len(r) % 2) for r in resp]  # noqa: E731 (a reward that varies in a group)
    state, history = loop.train(state, context(cfg, tok, reward, conf))
    assert all(torch.equal(state.policy[k], before[k]) for k in base)
    assert max(float((state.policy[k] - before[k]).abs().max()) for k in ad if k.endswith(lora.B)) > 1e-4
    assert all("kl" in h for h in history)


def test_lora_resume_takes_its_directory_settings_and_refuses_flags_that_would_be_ignored(tmp_path, capsys):
    from helpers import recipe_module
    cfg, _, ad = _model("qwen3-moe-tiny", LoraConfig(4, 8.0))
    adapters.save(str(tmp_path), cfg, ad)
    recipe = recipe_module()
    assert recipe.parse_args(["--lora-resume", str(tmp_path)]).lora_resume == str(tmp_path)
    for flags in (["--lora-alpha", "4"], ["--lora-dropout", "0.1"], ["--lora-rank", "8"]):
        with pytest.raises(SystemExit):
            recipe.parse_args(["--lora-resume", str(tmp_path), *flags])
        assert flags[0] in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_recipes_default_targets_are_the_projections_and_for_a_random_init_preset_its_untied_head_too():
    from rlflow.recipe.flags import Recipe
    from rlflow.recipe.pieces import lora_config
    moe, tied = get_config("qwen3-moe-tiny"), get_config("smollm2-135m")
    assert moe.replace(lora=lora_config(Recipe(lora_rank=8), moe)).lora.targets == lora.ATTENTION + (lora.HEAD,)
    assert tied.replace(lora=lora_config(Recipe(lora_rank=8), tied)).lora.targets == lora.TARGETS  # tied: not adapted
    # a pretrained --model: peft's all-linear, the projections alone; an explicit list is taken as it is
    assert moe.replace(lora=lora_config(Recipe(lora_rank=8, model="ckpt"), moe)).lora.targets == lora.ATTENTION
    assert lora_config(Recipe(lora_rank=8, lora_targets="q_proj,v_proj"), moe).targets == ("q_proj", "v_proj")


def test_lora_resume_refuses_a_peft_copy_of_the_head_that_is_not_the_models(tmp_path):
    """peft saves an adapted head's own weight beside its adapters (``base_layer``): the model's is taken as it
    is, and a directory whose copy differs is another model's adapters."""
    from safetensors.torch import load_file, save_file
    from rlflow.recipe.flags import Recipe
    from rlflow.recipe.pieces import load_model
    r = Recipe(lora_rank=4, lora_targets="q_proj,lm_head")
    cfg, params, _, _ = load_model(r)
    adapters.save(str(tmp_path), cfg, params)
    f = tmp_path / adapters.WEIGHTS
    key = adapters.PREFIX + "lm_head" + adapters.BASE_LAYER
    save_file({**load_file(f), key: params["lm_head.weight"].clone()}, f)
    got = load_model(Recipe(lora_resume=str(tmp_path)))[1]
    assert all(torch.equal(got[k], params[k]) for k in params)
    save_file({**load_file(f), key: params["lm_head.weight"] + 1}, f)
    with pytest.raises(SystemExit, match="lm_head.weight .peft's copy of the adapted head. is not the model's"):
        load_model(Recipe(lora_resume=str(tmp_path)))


def test_lora_trains_at_the_adapters_learning_rate_unless_lr_is_given_also_in_the_real_model_recipe():
    """``recipes/grpo_smollm2.py --lora-rank 8`` trained its adapters at the full-weight rate (its defaults set
    --lr), and --lora-resume without --lora-rank at the full-weight rate too."""
    import importlib.util
    import os
    from rlflow.recipe.flags import Recipe
    from rlflow.recipe.pieces import LR_DEFAULTS, learning_rate
    (preset_full, preset_lora), (model_full, model_lora) = LR_DEFAULTS["preset"], LR_DEFAULTS["model"]
    assert preset_lora > preset_full and model_lora > model_full
    assert learning_rate(Recipe(lora_rank=8)) == preset_lora and learning_rate(Recipe()) == preset_full
    assert learning_rate(Recipe(lora_resume="dir")) == preset_lora
    assert learning_rate(Recipe(lora_rank=8, lr=5e-5)) == 5e-5
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "grpo_smollm2.py")
    spec = importlib.util.spec_from_file_location("grpo_smollm2", path)
    smol = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smol)
    r = Recipe(**{**smol.DEFAULTS, "lora_rank": 8})
    assert learning_rate(r) == model_lora and learning_rate(dataclasses.replace(r, lora_rank=0)) == model_full
