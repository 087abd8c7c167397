"""ops.attention in half precision on CPU with gradients: the math path taken for small score tensors and
the flash path taken for large ones both give the float32 result, forward and backward."""

import importlib

import pytest
import torch

from rlflow.ops import attention, causal_padding_mask

attention_mod = importlib.import_module("rlflow.ops.attention")  # the module (rlflow.ops.attention is the function)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["math", "flash"])
@pytest.mark.parametrize("masked", [True, False])
def test_half_precision_training_attention_matches_float32(dtype, path, masked, monkeypatch):
    g = torch.Generator().manual_seed(0)
    B, H, K, T, d = 6, 4, 2, 9, 16
    q, k, v, go = (torch.randn(*s, generator=g) for s in ((B, H, T, d), (B, K, T, d), (B, K, T, d), (B, H, T, d)))
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :3] = False  # a left-padded row
    mask = causal_padding_mask(valid, 0, T) if masked else None
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **kw):
        calls.append(torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled())
        return real_sdpa(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    if path == "flash":
        monkeypatch.setattr(attention_mod, "MATH_MAX_SCORES", 0)

    def run(dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o = attention(*leaves, mask, is_causal=True)
        o.backward(go.to(dt))
        return [o.float()] + [t.grad.float() for t in leaves]

    ref = run(torch.float32)
    assert calls[-1] is False  # float32 keeps the default backends
    got = run(dtype)
    assert calls[-1] is (path == "math")  # only the math backend enabled inside the small-scores branch
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
