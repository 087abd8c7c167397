"""ops.attention in half precision on CPU: the float32 matmul path taken for short keys with gradients and
SDPA (flash) otherwise both give the float32 result, forward and backward; inference keeps SDPA."""

import importlib

import pytest
import torch

from rlflow.ops import attention, causal_padding_mask

attention_mod = importlib.import_module("rlflow.ops.attention")  # the module (rlflow.ops.attention is the function)


def _inputs(B, H, K, T, d, masked, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, go = (torch.randn(*s, generator=g) for s in ((B, H, T, d), (B, K, T, d), (B, K, T, d), (B, H, T, d)))
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :3] = False  # a left-padded row
    return q, k, v, go, (causal_padding_mask(valid, 0, T) if masked else None)


def _spy(monkeypatch) -> list:
    calls = []
    real = attention_mod._attention_f32

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(attention_mod, "_attention_f32", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["f32", "flash"])
@pytest.mark.parametrize("masked", [True, False])
def test_half_precision_training_attention_matches_float32(dtype, path, masked, monkeypatch):
    q, k, v, go, mask = _inputs(6, 4, 2, 9, 16, masked)
    calls = _spy(monkeypatch)
    if path == "flash":
        monkeypatch.setattr(attention_mod, "F32_MAX_KEYS", 0)

    def run(dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o = attention(*leaves, mask, is_causal=True)
        o.backward(go.to(dt))
        return [o.float()] + [t.grad.float() for t in leaves]

    ref = run(torch.float32)
    assert calls == []  # float32 always takes SDPA
    got = run(dtype)
    assert len(calls) == (path == "f32")
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


def test_half_precision_attention_keeps_sdpa_without_gradients_or_with_long_keys(monkeypatch):
    calls = _spy(monkeypatch)
    q, k, v, _, mask = _inputs(2, 4, 2, 9, 16, True)
    with torch.no_grad():  # inference (prefill, old log-probs), even on leaves that require grad
        attention(*(t.bfloat16().requires_grad_() for t in (q, k, v)), mask)
    attention(*(t.bfloat16() for t in (q, k, v)), mask)  # no input needs gradients
    q, k, v, _, mask = _inputs(2, 2, 1, attention_mod.F32_MAX_KEYS + 1, 16, True)
    attention(*(t.bfloat16().requires_grad_() for t in (q, k, v)), mask)  # long keys: flash wins
    assert calls == []
