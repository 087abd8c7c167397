"""A model family is one row (``models/families.py``): a family whose decoder is a set of the existing switches
is added by its row alone, and its transformers checkpoints load with transformers' logits."""

from __future__ import annotations

import json

import pytest
import torch

from rlflow.models import decoder, families, hf
from rlflow.models.config import ModelConfig


def _refuse_sliding_window(d: dict) -> None:
    if d.get("sliding_window") is not None:
        raise ValueError(f"config.json sliding_window={d['sliding_window']} is not implemented by rlflow for "
                         "mistral (full attention only)")


# ---- what a new family is: one row ----
MISTRAL = families.Family("mistral", "MistralForCausalLM", refuse_json=_refuse_sliding_window)


@pytest.fixture
def mistral(monkeypatch):
    monkeypatch.setitem(families.FAMILIES, MISTRAL.model_type, MISTRAL)


def _model(**kw):
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    m = MistralForCausalLM(MistralConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                         rope_theta=10000.0, **kw)).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m


def test_a_family_added_as_one_row_loads_with_transformers_logits(mistral, tmp_path):
    model = _model(sliding_window=None)
    model.save_pretrained(tmp_path)
    cfg, params = hf.load(str(tmp_path))
    assert cfg.model_type == "mistral" and not cfg.qk_norm and not cfg.attention_bias
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    valid = torch.ones(2, 9, dtype=torch.bool)
    pos = decoder.positions_from_valid(valid)
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos).logits
        out = decoder.logits(params, cfg, decoder.forward(params, cfg, ids, pos, valid_BT=valid)[0])
    assert (out - ref).abs().max().item() <= 1e-4
    assert cfg.to_hf()["architectures"] == ["MistralForCausalLM"]


def test_what_the_row_refuses_is_refused_by_name_and_an_unknown_family_names_the_rows(mistral, tmp_path):
    d = _model(sliding_window=4096).config.to_dict()
    with pytest.raises(ValueError, match="sliding_window=4096 is not implemented by rlflow for mistral"):
        ModelConfig.from_hf(d)
    with pytest.raises(ValueError, match="model_type='gemma' is not supported .*mistral"):
        ModelConfig.from_hf({**d, "model_type": "gemma"})


def test_without_its_row_the_family_is_refused(tmp_path):
    _model(sliding_window=None).save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type='mistral' is not supported"):
        ModelConfig.from_hf(d)
