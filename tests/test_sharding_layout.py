"""Layouts built from the per-model tables: every preset, the specs they give, stages, views, printing,
and the errors for an unknown axis, a dim that does not divide, a dim without a rule, a param without
a table row. DeepSeek-R1 671B shapes."""

from __future__ import annotations

import math
import re

import pytest
import torch

from rlflow.models.config import PRESETS
from rlflow.models.shapes import num_params
from rlflow.models.sharding import RULES, _logical, layout, logical_params, model_shapes
from rlflow.sharding.reference import shard
from rlflow.sharding.layout import Layout, ParamLayout, split_layers
from rlflow.sharding.mesh import Mesh
from rlflow.sharding.spec import P

ALL_MODELS = sorted(PRESETS)


@pytest.mark.parametrize("model", ALL_MODELS)
def test_every_preset_has_a_layout_with_default_rules(model):
    lg = logical_params(model)
    assert list(lg) == list(model_shapes(model))
    for name, info in lg.items():
        assert set(info.dims) <= set(RULES), name
        assert math.prod(info.view) == math.prod(info.shape)
    moe = any("experts" in n for n in lg)
    # SmolLM2's 9 heads (3 kv heads) take tp 3, not 2
    mesh = Mesh(pp=2, ep=2, tp=2) if moe else Mesh(pp=2, tp=3) if model == "smollm2-135m" else Mesh(pp=2, dp=2, tp=2)
    lay = layout(model, mesh, {"kv_heads": None} if model == "qwen3-moe-tiny" else None)
    assert lay.names == tuple(lg)
    assert lay[lay.names[0]].stage == 0 and lay[lay.names[-1]].stage == 1


def test_qwen3_moe_specs_and_local_shapes():
    m = Mesh(pp=2, ep=4, tp=2)
    lay = layout("qwen3-moe-30b-a3b", m)
    q = lay["model.layers.0.self_attn.q_proj.weight"]
    assert q.dims == ("heads", "head_dim", "embed") and q.view == (32, 128, 2048)
    assert q.spec == P("tp", None, None) and q.local_shape(m) == (2048, 2048)
    gu = lay["model.layers.3.mlp.experts.gate_up_proj"]
    assert gu.view == (128, 2, 768, 2048) and gu.spec == P("ep", None, "tp", None)
    assert gu.local_shape(m) == (32, 768, 2048)
    assert lay["model.layers.3.mlp.experts.down_proj"].spec == P("ep", None, "tp")
    assert lay["model.layers.3.mlp.gate.weight"].spec == P(None, None)  # router: replicated over ep
    assert lay["model.embed_tokens.weight"].spec == P("tp", None)
    assert lay["model.layers.23.input_layernorm.weight"].stage == 0
    assert lay["model.layers.24.input_layernorm.weight"].stage == 1
    assert lay["lm_head.weight"].stage == 1 and lay["model.norm.weight"].stage == 1
    text = lay.summary()
    assert "model.layers.*.self_attn.q_proj.weight x48: bf16[heads:32@tp, head_dim:128, embed:2048]" in text
    assert "model.layers.*.mlp.experts.gate_up_proj x48: bf16[experts:128@ep, gate_up:2, " \
           "expert_mlp:768@tp, embed:2048]  stages 0,1" in text
    assert str(lay).count("\n") == len(lay.params)


def test_fused_gate_up_shard_has_matching_gate_and_up_rows():
    m = Mesh(ep=2, tp=2)
    lay = layout("qwen3-moe-tiny", m, {"kv_heads": None}, dtype=torch.float32)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    E, F2, D = lay[name].shape
    F = F2 // 2
    full = {n: torch.randn(p.shape) for n, p in ((p.name, p) for p in lay.params)}
    shards = shard(full, lay)
    for r in range(m.size):
        c = m.coords(r)
        e0, f0 = c["ep"] * E // 2, c["tp"] * F // 2
        gate = full[name][e0:e0 + E // 2, f0:f0 + F // 2]
        up = full[name][e0:e0 + E // 2, F + f0:F + f0 + F // 2]
        assert torch.equal(shards[r][name], torch.cat([gate, up], dim=1))


def test_split_layers_and_stage_errors():
    assert split_layers(61, 6) == (11, 10, 10, 10, 10, 10)
    assert split_layers(48, 4) == (12, 12, 12, 12)
    lay = layout("deepseek-r1-671b", Mesh(pp=6, ep=16, tp=4))
    assert lay["model.layers.10.mlp.experts.gate_up_proj"].stage == 0
    assert lay["model.layers.11.mlp.experts.gate_up_proj"].stage == 1
    lay = layout("qwen3-moe-tiny", Mesh(pp=2), layers_per_stage=(1, 3))
    assert lay["model.layers.1.input_layernorm.weight"].stage == 1
    with pytest.raises(ValueError, match=r"layers_per_stage=\(2, 3\) must have pp=2 entries summing to 4"):
        layout("qwen3-moe-tiny", Mesh(pp=2), layers_per_stage=(2, 3))
    with pytest.raises(ValueError, match="pp=8 is larger than the number of layers 4"):
        layout("qwen3-moe-tiny", Mesh(pp=8))


def test_layout_errors_name_the_param_and_the_value():
    with pytest.raises(ValueError, match=re.escape(
            "P('tp', None, None) on param model.layers.0.self_attn.k_proj.weight: dim 0 of size 2 "
            "does not divide by tp=4")):
        layout("qwen3-moe-tiny", Mesh(tp=4))
    with pytest.raises(ValueError, match="param model.embed_tokens.weight.*unknown mesh axis 'xp'"):
        layout("qwen3-moe-tiny", Mesh(tp=2), {"vocab": "xp"})
    with pytest.raises(ValueError, match="'pp' holds pipeline stages, it cannot shard a dim"):
        layout("qwen3-moe-tiny", Mesh(pp=2), {"vocab": "pp"})
    rules = dict(RULES)
    del rules["router"]
    with pytest.raises(ValueError, match="param model.layers.0.mlp.gate.weight: no rule for logical "
                                         "dim 'router'"):
        Layout.build(Mesh(), logical_params("qwen3-moe-tiny"), rules)
    with pytest.raises(ValueError, match="param model.layers.0.mlp.mystery.weight: no row of the "
                                         "sharding table"):
        _logical("model.layers.0.mlp.mystery.weight", (4, 4), (), {})
    with pytest.raises(ValueError, match="param w: stage 2 is outside pp=2"):
        Layout(Mesh(pp=2), (ParamLayout(name="w", shape=(4,), dtype=torch.float32, spec=P(None), stage=2),))
    with pytest.raises(ValueError, match="layout names param w twice"):
        p = ParamLayout(name="w", shape=(4,), dtype=torch.float32, spec=P(None))
        Layout(Mesh(), (p, p))
    with pytest.raises(KeyError, match="unknown model name 'gpt-5'"):
        model_shapes("gpt-5")


def test_deepseek_r1_671b_shapes():
    cfg = PRESETS["deepseek-r1-671b"]
    shapes = model_shapes("deepseek-r1-671b")
    assert 670.5e9 < num_params(cfg) < 671.5e9
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (129280, 7168)
    a = "model.layers.5.self_attn."
    assert shapes[a + "q_a_proj.weight"] == (1536, 7168)
    assert shapes[a + "q_a_layernorm.weight"] == (1536,)
    assert shapes[a + "q_b_proj.weight"] == (128 * 192, 1536)
    assert shapes[a + "kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert shapes[a + "kv_a_layernorm.weight"] == (512,)
    assert shapes[a + "kv_b_proj.weight"] == (128 * 256, 512)
    assert shapes[a + "o_proj.weight"] == (7168, 128 * 128)
    assert shapes["model.layers.2.mlp.gate_proj.weight"] == (18432, 7168)
    assert "model.layers.3.mlp.gate_proj.weight" not in shapes
    assert shapes["model.layers.3.mlp.experts.gate_up_proj"] == (256, 4096, 7168)
    assert shapes["model.layers.3.mlp.experts.down_proj"] == (256, 7168, 2048)
    assert shapes["model.layers.60.mlp.shared_experts.down_proj.weight"] == (7168, 2048)
    assert shapes["model.layers.60.mlp.gate.weight"] == (256, 7168)
    assert "model.layers.61.input_layernorm.weight" not in shapes
    lay = layout("deepseek-r1-671b", Mesh(pp=6, ep=16, tp=4))
    assert lay[a + "q_b_proj.weight"].spec == P("tp", None, None)
    assert lay[a + "o_proj.weight"].spec == P(None, "tp", None)
    assert lay[a + "kv_a_proj_with_mqa.weight"].spec == P(None, None)
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be in"):
        cfg.replace(num_experts=8, n_group=1, topk_group=1, num_experts_per_tok=9)
