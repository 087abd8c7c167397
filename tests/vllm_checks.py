"""The vLLM engine against the built-in one, in a process of its own (tests/test_vllm_engine.py runs it):
vLLM binds this process's threads and, in one process, starts a torch.distributed world of its own, which
the test session must not inherit. Prints one JSON object of figures; the tests assert on them."""

import dataclasses
import json
import sys

import torch

from rlflow.engines.vllm import VLLMEngine
from rlflow.models import decoder
from rlflow.models.config import PRESETS
from rlflow.models.logprobs import response_logprobs
from rlflow.rollout import SamplingConfig, generate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from helpers import random_prompts  # noqa: E402

TN = 12


def prompts(cfg, P=6, seed=0):
    return random_prompts(cfg.vocab_size, P, torch.Generator().manual_seed(seed))


def an_eos(params, cfg, batch) -> int:
    """A token the greedy responses produce after their first one, so that some rows end at EOS."""
    out = generate(params, cfg, batch, SamplingConfig(max_new_tokens=TN, eos_id=cfg.vocab_size - 1, temperature=0))
    return int(torch.mode(out.response_ids_BTr[:, 1:].flatten()).values)


def greedy(name: str) -> dict:
    cfg = PRESETS[name]
    params = decoder.init_params(cfg, seed=1)
    batch = prompts(cfg)
    scfg = SamplingConfig(max_new_tokens=TN, eos_id=an_eos(params, cfg, batch), temperature=0)
    eng = VLLMEngine(cfg, scfg, max_model_len=64)
    eng.load(params)
    got = eng.generate(batch, group_size=2, seed=0)
    eng.release()
    eng.close()
    want = generate(params, cfg, batch, scfg, group_size=2)
    return {"ids_equal": torch.equal(got.response_ids_BTr, want.response_ids_BTr),
            "mask_equal": torch.equal(got.response_mask_BTr, want.response_mask_BTr),
            "lp_max_diff": float((got.sample_logprobs_BTr - want.sample_logprobs_BTr).abs().max()),
            "ended_at_eos": int((want.response_mask_BTr.sum(-1) < TN).sum()),
            "prompt_lengths": sorted(set(batch.prompt_mask_BTp.sum(-1).tolist())),
            "rows": int(got.response_ids_BTr.shape[0])}


def pushes(cfg) -> dict:
    """Weights pushed again and again into one engine: each time, greedy against the built-in engine with the
    same weights. One parameter at a time is changed (a stale one would keep the old log-probs)."""
    batch = prompts(cfg, P=4, seed=3)
    scfg = SamplingConfig(max_new_tokens=8, eos_id=cfg.vocab_size - 1, temperature=0)
    eng = VLLMEngine(cfg, scfg, max_model_len=64)

    def both(params):
        eng.load(params)
        got = eng.generate(batch, group_size=1, seed=0)
        eng.release()
        want = generate(params, cfg, batch, scfg)
        return got, want

    def diff(a, b):
        return float((a.sample_logprobs_BTr - b.sample_logprobs_BTr).abs().max())

    a, b = decoder.init_params(cfg, seed=0), decoder.init_params(cfg, seed=1)
    got_a, want_a = both(a)
    got_b, want_b = both(b)
    got_b2, _ = both(b)  # the same weights pushed twice
    per_param = {}
    g = torch.Generator().manual_seed(0)
    for name in sorted(b):
        changed = dict(b)
        changed[name] = b[name] + 0.5 * b[name].abs().mean().clamp_min(0.02) * torch.randn(b[name].shape, generator=g)
        got, want = both(changed)
        per_param[name] = {"engine_vs_builtin": diff(got, want), "visible": diff(want, want_b)}
    direct = eng.dest is not None
    eng.close()
    return {"a": diff(got_a, want_a), "b": diff(got_b, want_b), "a_vs_b": diff(want_a, want_b),
            "b_twice": diff(got_b2, want_b),
            "ids_b_equal": torch.equal(got_b.response_ids_BTr, want_b.response_ids_BTr),
            "per_param": per_param, "direct": direct}


def lora_pushes() -> dict:
    """A LoRA policy (Llama, every projection and the head adapted): the engine is pushed the merged weights, two
    adapter versions in turn; greedy against the built-in engine applying the adapters to the model."""
    from rlflow.models import lora, shapes
    cfg = PRESETS["llama-tiny"].replace(lora=lora.LoraConfig(4, 8.0, targets=lora.ADAPTABLE))
    base = decoder.init_params(cfg, seed=1)
    batch = prompts(cfg, P=4, seed=3)
    scfg = SamplingConfig(max_new_tokens=8, eos_id=cfg.vocab_size - 1, temperature=0)
    eng = VLLMEngine(cfg, scfg, max_model_len=64)
    plain = generate(base, cfg, batch, scfg)
    out = []
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        ad = {k: torch.randn(v.shape, generator=g) * 0.3 if k.endswith(lora.B) else v
              for k, v in lora.init(cfg, shapes.param_shapes(cfg), seed=seed).items()}
        params = {**base, **ad}
        eng.load(params)
        got = eng.generate(batch, group_size=1, seed=0)
        eng.release()
        want = generate(params, cfg, batch, scfg)
        out.append({"ids_equal": torch.equal(got.response_ids_BTr, want.response_ids_BTr),
                    "lp_max_diff": float((got.sample_logprobs_BTr - want.sample_logprobs_BTr).abs().max()),
                    "adapters_visible": float((want.sample_logprobs_BTr - plain.sample_logprobs_BTr).abs().max()),
                    "pushed_bytes": eng.load_bytes})
    eng.close()
    return {"versions": out}


def sampled() -> dict:
    """Sampled at temperature 0.7: vLLM's log-probs of its tokens against the trainer's of the same tokens."""
    cfg = PRESETS["qwen3-moe-tiny"]
    params = decoder.init_params(cfg, seed=2)
    batch = prompts(cfg, P=8, seed=5)
    scfg = SamplingConfig(max_new_tokens=TN, eos_id=cfg.vocab_size - 1, temperature=0.7)
    eng = VLLMEngine(cfg, scfg, max_model_len=64)
    eng.load(params)
    out = eng.generate(batch, group_size=4, seed=11)
    again = eng.generate(batch, group_size=4, seed=11)
    other = eng.generate(batch, group_size=4, seed=12)
    eng.close()
    with torch.no_grad():
        lp, _, _ = response_logprobs(params, cfg, out, temperature=0.7)
    m = out.response_mask_BTr
    d = (lp - out.sample_logprobs_BTr).abs()[m]
    groups = out.response_ids_BTr.view(8, 4, -1)
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "tokens": int(m.sum()),
            "same_seed_same_tokens": torch.equal(out.response_ids_BTr, again.response_ids_BTr),
            "other_seed_differs": not torch.equal(out.response_ids_BTr, other.response_ids_BTr),
            "distinct_in_groups": int(sum(len({tuple(r.tolist()) for r in grp}) for grp in groups))}


def partial() -> dict:
    """Partial rollout: the weights change while vLLM samples (temperature 0.7); each token's log-prob against
    the trainer's under the weights its version names, and greedy rows against the built-in engine's partial
    rollout with the swap at the same token."""
    from rlflow.engines import BuiltinEngine

    cfg = PRESETS["qwen3-moe-tiny"]
    a, b = decoder.init_params(cfg, seed=2), decoder.init_params(cfg, seed=3)
    batch = prompts(cfg, P=4, seed=5)

    def at(poll, weights, log):
        def newer():
            log.append(None)
            return (7, weights) if len(log) == poll else None
        return newer

    out = {}
    for temp in (0.7, 0.0):
        scfg = SamplingConfig(max_new_tokens=TN, eos_id=-1, temperature=temp)
        eng = VLLMEngine(cfg, scfg, max_model_len=64)
        eng.load(a)
        got = eng.generate(batch, group_size=2, seed=11, version=6, newer=at(5, b, []))
        eng.close()
        v, m = got.versions_BTr, got.response_mask_BTr
        swap = (v == 6).sum(-1)  # each row's tokens before the swap
        if temp:
            with torch.no_grad():
                lp_a, _, _ = response_logprobs(a, cfg, got, temperature=temp)
                lp_b, _, _ = response_logprobs(b, cfg, got, temperature=temp)
            want = torch.where(v == 6, lp_a, lp_b)
            out["sampled"] = {"lp_max_diff": float((want - got.sample_logprobs_BTr).abs()[m].max()),
                              "swapped_at": sorted(set(swap.tolist())), "tokens": int(m.sum())}
            continue
        for poll in range(1, TN + 2):  # the built-in engine's poll whose swap lands at vLLM's token
            ref = BuiltinEngine(cfg, scfg)
            ref.load(a)
            want = ref.generate(batch, group_size=2, seed=11, version=6, newer=at(poll, b, []))
            if torch.equal(want.versions_BTr[m], v[m]):
                break
        out["greedy"] = {"versions_equal": torch.equal(want.versions_BTr[m], v[m]),
                         "ids_equal": torch.equal(want.response_ids_BTr, got.response_ids_BTr),
                         "lp_max_diff": float((want.sample_logprobs_BTr - got.sample_logprobs_BTr).abs()[m].max()),
                         "swapped_at": sorted(set(swap.tolist()))}
    return out


class Calls:
    """An engine without ``serve``: the driver generates a batch per call."""

    def __init__(self, engine):
        self.load, self.release, self.generate = engine.load, engine.release, engine.generate


def multiturn() -> dict:
    """Episodes of three turns: greedy through vLLM (serving turns as they come) and through the built-in engine,
    the same rows; sampled through vLLM served and driven call by call, the same rows (each request's seed)."""
    from rlflow.engines import BuiltinEngine
    from rlflow.multiturn import MultiTurn, MultiTurnConfig
    from rlflow.rewards import per_sample
    cfg = PRESETS["qwen3-moe-tiny"]
    params = decoder.init_params(cfg, seed=1)
    batch = prompts(cfg, P=4, seed=7)
    scfg = SamplingConfig(max_new_tokens=6, eos_id=an_eos(params, cfg, batch), temperature=0)

    def episodes(engine):
        mt = MultiTurn(MultiTurnConfig(env=__file__.rsplit("/", 1)[0] + "/multiturn_envs.py:Hint", max_turns=3),
                       render=lambda messages, closed: [3, 4], decode=lambda ids: "", reward_fn=per_sample(lambda t, a: 0.0),
                       max_new_tokens=6, max_positions=64, vocab_size=cfg.vocab_size, eos_id=scfg.eos_id)
        engine.load(params)
        rows = mt.rollout(engine, batch, group_size=2, seed=0)
        engine.release()
        mt.close()
        return rows, mt.figures()[0]

    got, counts = episodes(eng := VLLMEngine(cfg, scfg, max_model_len=64))
    eng.close()
    want, _ = episodes(BuiltinEngine(cfg, scfg))
    scfg = dataclasses.replace(scfg, temperature=0.7)
    eng = VLLMEngine(cfg, scfg, max_model_len=64)
    served, _ = episodes(eng)
    called, _ = episodes(Calls(eng))
    eng.close()
    return {"ids_equal": torch.equal(got.response_ids_BTr, want.response_ids_BTr),
            "loss_mask_equal": torch.equal(got.loss_mask_BTr, want.loss_mask_BTr),
            "lp_max_diff": float((got.sample_logprobs_BTr - want.sample_logprobs_BTr).abs().max()),
            "turns": counts["env/turns"], "observation_tokens": int((got.response_mask_BTr & ~got.loss_mask_BTr).sum()),
            "sampled_served_equal_called": torch.equal(served.response_ids_BTr, called.response_ids_BTr),
            "sampled_lp_diff": float((served.sample_logprobs_BTr - called.sample_logprobs_BTr).abs().max()),
            "sampled_distinct": int(len({tuple(r.tolist()) for r in served.response_ids_BTr}))}


def main():
    if sys.argv[1:]:  # named checks only (a quicker run while working on one)
        print("RESULT " + json.dumps({k: globals()[k]() for k in sys.argv[1:]}))
        return
    res = {"greedy_moe": greedy("qwen3-moe-tiny"), "greedy_dense": greedy("qwen2.5-tiny"),
           "greedy_llama": greedy("llama-tiny"), "pushes": pushes(PRESETS["qwen3-moe-tiny"]),
           "pushes_tied_llama": pushes(dataclasses.replace(PRESETS["llama-tiny"], tie_word_embeddings=True)),
           "sampled": sampled(), "multiturn": multiturn(), "lora": lora_pushes(), "partial": partial()}
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
