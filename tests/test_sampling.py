"""The sampler (exponential race over given noise) draws from softmax(logits / T), restricted by top-k/top-p."""

import pytest
import torch

from rlflow.ops import exponential_noise, sample

N = 40000  # draws; frequencies are checked to 5 standard errors (a fixed seed: the test is deterministic)


def _freqs(tok, V):
    return torch.bincount(tok, minlength=V).double() / tok.numel()


def _close(freq, p):
    se = (p * (1 - p) / N).sqrt()
    assert ((freq - p).abs() <= 5 * se + 1e-12).all(), (freq, p)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_follow_the_tempered_softmax_and_logprobs_are_its(temperature):
    logits = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0]).expand(N, 5)
    g = torch.Generator().manual_seed(0)
    tok, lp = sample(logits, temperature=temperature, generator=g)
    p = torch.softmax(logits[0].double() / temperature, -1)
    _close(_freqs(tok, 5), p)
    torch.testing.assert_close(lp, torch.log_softmax(logits / temperature, -1).gather(1, tok[:, None])[:, 0])


def test_top_k_and_top_p_restrict_the_support_and_renormalize():
    logits = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0]).expand(N, 5)
    p = torch.softmax(logits[0].double(), -1)  # sorted: 0, 3, 1, 4, 2
    tok, _ = sample(logits, top_k=2, generator=torch.Generator().manual_seed(1))
    keep = torch.tensor([1.0, 0, 0, 1, 0], dtype=torch.float64)
    _close(_freqs(tok, 5), p * keep / (p * keep).sum())
    # top_p just above p0 + p3: the smallest prefix with mass >= top_p is {0, 3, 1}
    top_p = float(p[0] + p[3]) + 0.01
    tok, _ = sample(logits, top_p=top_p, generator=torch.Generator().manual_seed(2))
    keep = torch.tensor([1.0, 1, 0, 1, 0], dtype=torch.float64)
    _close(_freqs(tok, 5), p * keep / (p * keep).sum())


def test_a_step_is_a_pure_function_of_logits_and_noise():
    logits = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    noise = exponential_noise((64, 32), generator=torch.Generator().manual_seed(4))
    a, b = sample(logits, noise_BV=noise), sample(logits, noise_BV=noise.clone())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    other = sample(logits, noise_BV=exponential_noise((64, 32), generator=torch.Generator().manual_seed(5)))
    assert not torch.equal(a[0], other[0])
    greedy, _ = sample(logits, temperature=0.0, noise_BV=noise)
    assert torch.equal(greedy, logits.argmax(-1))


def test_a_zero_noise_draw_never_picks_a_token_outside_top_k():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    noise = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # token 3 has the smallest possible noise, but top_k=2
    tok, _ = sample(logits, top_k=2, noise_BV=noise)
    assert tok.item() == 0
    tok, _ = sample(logits, noise_BV=noise)  # untruncated, the zero draw wins, as the race says
    assert tok.item() == 3
