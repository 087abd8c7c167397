"""Chunked log-probs (recomputed per chunk in the backward, or kept when small) equal the plain
log_softmax over the whole [N, V] logits: values, entropies and gradients."""

import pytest
import torch

from rlflow.ops import logprobs as L


@pytest.mark.parametrize("keep_bytes", [0, L.KEEP_LOGITS_BYTES])  # 0: every chunk recomputed
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_equal_the_full_softmax(keep_bytes, temperature, monkeypatch):
    monkeypatch.setattr(L, "KEEP_LOGITS_BYTES", keep_bytes)
    recomputed, checkpoint = [], L.checkpoint
    monkeypatch.setattr(L, "checkpoint", lambda fn, *a, **k: recomputed.append(1) or checkpoint(fn, *a, **k))
    g = torch.Generator().manual_seed(0)
    N, D, V = 37, 8, 11
    h = torch.randn(N, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    t = torch.randint(0, V, (N,), generator=g)
    lp, ent = L.token_logprobs(h, w, t, temperature=temperature, chunk=5, with_entropy=True)
    logp = torch.log_softmax((h @ w.T) / temperature, -1)
    ref_lp, ref_ent = logp.gather(1, t[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    c1, c2 = torch.randn(N, generator=g), torch.randn(N, generator=g)
    got = torch.autograd.grad((lp * c1 + ent * c2).sum(), (h, w))
    want = torch.autograd.grad((ref_lp * c1 + ref_ent * c2).sum(), (h, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert len(recomputed) == (8 if keep_bytes == 0 else 0)  # ceil(37 / 5) chunks, each recomputed, or none
