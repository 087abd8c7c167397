"""The KV-cache rollout agrees with recomputing the full forward at every step."""

import pytest
import torch
from helpers import random_prompts

from rlflow.algos import stages
from rlflow.models import decoder as model
from rlflow.models.config import get_config
from rlflow.decoding import bucketed
from rlflow.rollout import SamplingConfig, generate

CFG = get_config("qwen3-moe-tiny")


def _prompts(seed=0, P=4):
    return random_prompts(CFG.vocab_size, P, torch.Generator().manual_seed(seed), answers=True)


def _params(seed=0):
    return model.init_params(CFG, seed=seed, std=0.3)  # large std: peaked, input-dependent logits


def test_greedy_kv_cache_equals_full_recompute():
    params, prompts = _params(), _prompts()
    scfg = SamplingConfig(max_new_tokens=10, eos_id=2, temperature=0.0)
    out = generate(params, CFG, prompts, scfg)
    for b in range(prompts.size):
        seq = prompts.prompt_ids_BTp[b][prompts.prompt_mask_BTp[b]].tolist()
        for t in range(scfg.max_new_tokens):
            ids = torch.tensor([seq])
            h, _, _ = model.forward(params, CFG, ids, torch.arange(len(seq))[None])
            nxt = int(model.logits(params, CFG, h[0, -1]).argmax())
            assert out.response_mask_BTr[b, t], f"row {b} stopped early at {t}"
            assert out.response_ids_BTr[b, t].item() == nxt, f"row {b} token {t}"
            seq.append(nxt)
            if nxt == scfg.eos_id:
                assert not out.response_mask_BTr[b, t + 1:].any()
                break


def test_sampling_logprobs_match_recomputed_and_reproducible():
    params, prompts = _params(1), _prompts(1)
    scfg = SamplingConfig(max_new_tokens=8, eos_id=2, temperature=0.7, top_k=10, top_p=0.9)
    a = generate(params, CFG, prompts, scfg, group_size=3, seed=5)
    b = generate(params, CFG, prompts, scfg, group_size=3, seed=5)
    assert torch.equal(a.response_ids_BTr, b.response_ids_BTr)
    assert a.size == 12 and torch.equal(a.group_B, prompts.group_B.repeat_interleave(3))
    lp = stages.batched_logprobs(params, CFG, a, micro_batch_size=5, temperature=0.7)
    m = a.response_mask_BTr
    torch.testing.assert_close(lp[m], a.sample_logprobs_BTr[m], atol=1e-4, rtol=1e-4)
    c = generate(params, CFG, prompts, scfg, group_size=3, seed=6)
    assert not torch.equal(a.response_ids_BTr, c.response_ids_BTr)


def test_sampling_config_errors():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingConfig(max_new_tokens=0, eos_id=2)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(max_new_tokens=1, eos_id=2, top_p=0.0)


def test_continuous_batching_matches_full_batch():
    """Few slots refilled as rows finish give every row the same greedy tokens as one big batch."""
    params, prompts = _params(2), _prompts(2, P=6)
    free = generate(params, CFG, prompts, SamplingConfig(max_new_tokens=12, eos_id=-1, temperature=0.0), group_size=2)
    # an EOS id that ends rows at different steps: a token some rows emit early and others late or never
    firsts = {}
    for b in range(free.size):
        for t, x in enumerate(free.response_ids_BTr[b].tolist()):
            firsts.setdefault(x, []).append(t) if t not in firsts.get(x, []) else None
    eos = max(firsts, key=lambda x: len(set(firsts[x])))
    scfg = SamplingConfig(max_new_tokens=12, eos_id=eos, temperature=0.0)
    full = generate(params, CFG, prompts, scfg, group_size=2)
    lens = full.response_mask_BTr.sum(-1)
    assert lens.min() < lens.max(), "test needs rows of different lengths"
    for max_batch in (1, 3, 5):
        cb = generate(params, CFG, prompts, scfg, group_size=2, max_batch=max_batch)
        assert torch.equal(cb.response_mask_BTr, full.response_mask_BTr), max_batch
        assert torch.equal(cb.response_ids_BTr, full.response_ids_BTr), max_batch
        torch.testing.assert_close(cb.sample_logprobs_BTr, full.sample_logprobs_BTr, atol=1e-5, rtol=1e-5)


def test_one_token_responses_and_eos_as_the_first_token_with_refills():
    params, prompts = _params(6), _prompts(6, P=6)
    one = generate(params, CFG, prompts, SamplingConfig(max_new_tokens=1, eos_id=-1), group_size=3, max_batch=4)
    assert one.response_mask_BTr.shape == (18, 1) and one.response_mask_BTr.all()
    # an EOS that many rows sample first: those rows end at once and their slots are refilled
    first = generate(params, CFG, prompts, SamplingConfig(max_new_tokens=1, eos_id=-1), group_size=3, seed=1)
    eos = int(first.response_ids_BTr[:, 0].mode().values)
    scfg = SamplingConfig(max_new_tokens=6, eos_id=eos)
    full = generate(params, CFG, prompts, scfg, group_size=3, seed=1)
    assert (full.response_mask_BTr.sum(-1) == 1).any(), "test needs rows that end at their first token"
    for mb in (1, 4):
        cb = generate(params, CFG, prompts, scfg, group_size=3, seed=1, max_batch=mb)
        lens = cb.response_mask_BTr.sum(-1)
        assert (lens >= 1).all() and (lens <= 6).all()
        for b in range(cb.size):  # EOS only as the last token, padding after it
            L = int(lens[b])
            assert cb.response_mask_BTr[b, :L].all() and not cb.response_mask_BTr[b, L:].any()
            assert (cb.response_ids_BTr[b, :L - 1] != eos).all()
            assert L == 6 or cb.response_ids_BTr[b, L - 1] == eos


def test_every_step_draws_fresh_noise():
    """With a flat distribution (zero output weights: uniform logits) a row's tokens vary along the
    response; noise reused across steps would repeat one token per row."""
    params = dict(_params(7))
    params["lm_head.weight"] = torch.zeros_like(params["lm_head.weight"])
    out = generate(params, CFG, _prompts(7), SamplingConfig(max_new_tokens=12, eos_id=-1), group_size=2)
    per_row_distinct = torch.tensor([len(set(r.tolist())) for r in out.response_ids_BTr])
    assert (per_row_distinct > 4).all(), per_row_distinct


def test_kv_cache_refuses_to_write_past_max_len():
    params = _params()
    cache = model.KVCache.allocate(CFG, 1, 4, dtype=torch.float32, device="cpu")
    ids = torch.tensor([[5, 6, 7]])
    model.forward(params, CFG, ids, torch.arange(3)[None], cache=cache)
    model.forward(params, CFG, ids[:, :1], torch.tensor([[3]]), cache=cache)  # fills the 4th column
    with pytest.raises(RuntimeError, match="KVCache overflow"):
        model.forward(params, CFG, ids[:, :1], torch.tensor([[4]]), cache=cache)


def test_generate_rejects_empty_prompts_and_bad_sizes():
    params, prompts = _params(), _prompts()
    scfg = SamplingConfig(max_new_tokens=2, eos_id=2)
    empty = prompts.replace(prompt_mask_BTp=prompts.prompt_mask_BTp.clone().index_fill_(0, torch.tensor([1]), False))
    with pytest.raises(ValueError, match=r"rows \[1\] have no tokens"):
        generate(params, CFG, empty, scfg)
    with pytest.raises(ValueError, match="max_batch=0"):
        generate(params, CFG, prompts, scfg, max_batch=0)


@pytest.mark.slow
def test_compiled_decode_step_gives_the_eager_tokens():
    """torch.compile of the decode step (static shapes, whole-cache masked attention, in-graph sampling)
    changes no token: sampled, with rows ending at EOS and slots refilled (continuous batching)."""
    params, prompts = _params(4), _prompts(4, P=5)
    free = generate(params, CFG, prompts, SamplingConfig(max_new_tokens=8, eos_id=-1), group_size=2, seed=3)
    eos = int(free.response_ids_BTr[:, 2].mode().values)  # a token sampled early by some rows: rows end unevenly
    scfg = SamplingConfig(max_new_tokens=8, eos_id=eos)
    eager = generate(params, CFG, prompts, scfg, group_size=2, seed=3, max_batch=4)
    lens = eager.response_mask_BTr.sum(-1)
    assert lens.min() < lens.max(), "test needs rows of different lengths"
    compiled = generate(params, CFG, prompts, scfg, group_size=2, seed=3, max_batch=4, compile_decode=True)
    assert torch.equal(compiled.response_mask_BTr, eager.response_mask_BTr)
    assert torch.equal(compiled.response_ids_BTr, eager.response_ids_BTr)
    torch.testing.assert_close(compiled.sample_logprobs_BTr, eager.sample_logprobs_BTr, atol=1e-4, rtol=1e-4)
    # padding being padding, longer padded prompts sample the same tokens; two lengths whose caches
    # round up to the same bucket share one compiled graph (no recompilation)
    def padded(n):
        return prompts.replace(prompt_ids_BTp=torch.nn.functional.pad(prompts.prompt_ids_BTp, (n, 0)),
                               prompt_mask_BTp=torch.nn.functional.pad(prompts.prompt_mask_BTp, (n, 0)))
    Tp, Tn = prompts.prompt_ids_BTp.shape[1], scfg.max_new_tokens
    assert bucketed(Tp + 2 + Tn) == bucketed(Tp + 6 + Tn)
    first = generate(params, CFG, padded(2), scfg, group_size=2, seed=3, max_batch=4, compile_decode=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    again = generate(params, CFG, padded(6), scfg, group_size=2, seed=3, max_batch=4, compile_decode=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(first.response_ids_BTr, compiled.response_ids_BTr)
    assert torch.equal(again.response_ids_BTr, compiled.response_ids_BTr)


def test_sampled_rows_do_not_depend_on_the_batch():
    """Sampling noise is keyed by row id and position: the same prompts sampled as one batch, with few slots
    (refills), or split in two calls (as two rollout ranks would) give each row the same tokens; another
    seed gives other tokens."""
    params, prompts = _params(3), _prompts(3, P=6)
    scfg = SamplingConfig(max_new_tokens=10, eos_id=5, temperature=1.0)
    full = generate(params, CFG, prompts, scfg, group_size=3, seed=7)
    lens = full.response_mask_BTr.sum(-1)
    assert lens.min() < lens.max(), "test needs rows of different lengths"
    few = generate(params, CFG, prompts, scfg, group_size=3, seed=7, max_batch=4)
    halves = [generate(params, CFG, prompts.select(torch.arange(a, b)), scfg, group_size=3, seed=7) for a, b in ((0, 2), (2, 6))]
    for name, got in (("max_batch=4", few), ("halves", None)):
        ids = torch.cat([h.response_ids_BTr[:, :10] for h in halves]) if got is None else got.response_ids_BTr
        mask = torch.cat([h.response_mask_BTr[:, :10] for h in halves]) if got is None else got.response_mask_BTr
        assert torch.equal(mask, full.response_mask_BTr), name
        assert torch.equal(ids * mask, full.response_ids_BTr * full.response_mask_BTr), name
    other = generate(params, CFG, prompts, scfg, group_size=3, seed=8)
    assert not torch.equal(other.response_ids_BTr, full.response_ids_BTr)


def test_partial_rollout_records_each_tokens_version_and_its_weights_logprobs():
    """Newer weights arriving mid-generation: the rows in flight continue under them. Every token records the
    version that sampled it, and its log-prob is that version's (given the whole context); the tokens sampled
    before the swap are the ones the first weights alone give."""
    old, new, prompts = _params(1), _params(3), _prompts(1, P=4)
    scfg = SamplingConfig(max_new_tokens=8, eos_id=2, temperature=0.8, top_k=20)
    polls = []

    def newer():
        polls.append(1)
        return (7, new) if len(polls) == 4 else None  # before the fourth decode step

    out = generate(old, CFG, prompts, scfg, group_size=2, seed=5, max_batch=5, version=6, newer=newer)
    alone = generate(old, CFG, prompts, scfg, group_size=2, seed=5, max_batch=5)
    m, v = out.response_mask_BTr, out.versions_BTr
    assert set(v[m].tolist()) == {6, 7}
    assert bool((v[:, 1:] >= v[:, :-1]).all())  # a row's versions never go back
    by_row = [set(v[b][m[b]].tolist()) for b in range(out.size)]
    assert {6, 7} in by_row and {7} in by_row, by_row  # rows in flight span both; later admissions the new one
    first = (v == 6) & m
    assert torch.equal(out.response_ids_BTr[first], alone.response_ids_BTr[first])
    for params, version in ((old, 6), (new, 7)):
        lp = stages.batched_logprobs(params, CFG, out, micro_batch_size=8, temperature=0.8)
        at = (v == version) & m
        torch.testing.assert_close(out.sample_logprobs_BTr[at], lp[at], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="partial rollout"):
        generate(old, CFG, prompts, scfg, newer=newer)  # no version of the first weights
