"""vLLM's tensor parallelism over rlflow's ranks (a rollout layout of tp=2, two gloo processes), against the
built-in engine in the same layout, in processes of their own (tests/test_vllm_engine.py runs it; see
tests/vllm_checks.py for why). Prints one JSON object of figures per model; the tests assert on them."""

import json
import sys

import torch


def rank_checks(rank: int, world: int, preset: str) -> dict:
    from rlflow.engines.vllm import VLLMEngine
    from rlflow.models import decoder
    from rlflow.models.config import PRESETS
    from rlflow.models.sharding import layout
    from rlflow.parallel.context import context, shard_params
    from rlflow.rollout import SamplingConfig, generate
    from rlflow.sharding.mesh import Mesh

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from helpers import random_prompts

    cfg = PRESETS[preset]
    lay = layout(cfg, Mesh(tp=world), dtype=torch.float32)
    ex = context(lay, cfg, rank)
    batch = random_prompts(cfg.vocab_size, 4, torch.Generator().manual_seed(3))
    scfg = SamplingConfig(max_new_tokens=8, eos_id=cfg.vocab_size - 1, temperature=0)
    eng = VLLMEngine(cfg, scfg, ex=ex, max_model_len=64)
    out = {}
    for seed in (0, 1):  # two weight sets pushed in turn: the second push reaches vLLM's shards too
        shards = shard_params(decoder.init_params(cfg, seed=seed), lay, rank)
        eng.load(shards)
        got = eng.generate(batch, group_size=2, seed=0)
        eng.release()
        want = generate(shards, cfg, batch, scfg, group_size=2, ex=ex)
        out[f"weights_{seed}"] = {
            "ids_equal": torch.equal(got.response_ids_BTr, want.response_ids_BTr),
            "lp_max_diff": float((got.sample_logprobs_BTr - want.sample_logprobs_BTr).abs().max()),
            "lp_sum": float(want.sample_logprobs_BTr.sum())}
    from vllm.distributed import parallel_state
    out["vllm_tp_ranks"] = list(parallel_state.get_tp_group().ranks)
    eng.close()
    return out


def main():
    from rlflow.runtime.launch import spawn
    res = {p: spawn(rank_checks, 2, p) for p in sys.argv[1:] or ["llama-tiny", "qwen3-moe-tiny"]}
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
