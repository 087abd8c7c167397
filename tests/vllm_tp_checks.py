"""vLLM's tensor parallelism over rlflow's ranks (a rollout layout of tp=2, two gloo processes), against the
built-in engine in the same layout, in processes of their own (tests/test_vllm_engine.py runs it; see
tests/vllm_checks.py for why). Prints one JSON object of figures per model; the tests assert on them."""

import json
import sys

import torch


def rank_checks(rank: int, world: int, preset: str, vocab: int | None = None, reload: bool = False,
                lora_rank: int = 0, expert_parallel: bool = False) -> dict:
    """Train dp=2 -> rollout tp=2 every step through the runtime's transition, written into vLLM's parameters
    where the engine offers them (``targets``), two weight sets in turn; greedy against the built-in engine in
    the rollout layout. ``vocab``: the preset's vocabulary resized (vLLM's padded vocab split is rlflow's when
    it is a multiple of 64). ``reload``: as for a model vLLM processes the weights of (MLA's, a quantization's),
    the push through vLLM's reload of whole tensors (gathered over tp). ``lora_rank``: a LoRA policy (every
    projection and the head adapted, the adapters changing each push), which reaches vLLM merged shard by
    shard. ``expert_parallel``: vLLM's, the transition planning into the layout the engine holds (experts split
    whole over the tp ranks)."""
    from types import SimpleNamespace

    from rlflow.engines import layout_of, vllm_layout
    from rlflow.engines.vllm import VLLMEngine
    from rlflow.models import decoder, lora, shapes
    from rlflow.models.config import PRESETS
    from rlflow.models.sharding import layout
    from rlflow.parallel.context import context, shard_params
    from rlflow.rollout import SamplingConfig, generate
    from rlflow.runtime.weights import Weights
    from rlflow.sharding.mesh import Mesh

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from helpers import random_prompts

    if reload:
        vllm_layout.plain_modules = lambda model: (False, "the test")
    cfg = PRESETS[preset] if vocab is None else PRESETS[preset].replace(vocab_size=vocab)
    if lora_rank:
        cfg = cfg.replace(lora=lora.LoraConfig(lora_rank, 8.0, targets=lora.ADAPTABLE))

    def policy(seed: int) -> dict:
        if not lora_rank:
            return decoder.init_params(cfg, seed=seed)
        g = torch.Generator().manual_seed(seed)  # one model, adapters of their own each push (B not 0)
        ad = {k: torch.randn(v.shape, generator=g) * 0.3 if k.endswith(lora.B) else v
              for k, v in lora.init(cfg, shapes.param_shapes(cfg), seed=seed).items()}
        return {**decoder.init_params(cfg, seed=1), **ad}
    train, lay = layout(cfg, Mesh(dp=world), dtype=torch.float32), layout(cfg, Mesh(tp=world), dtype=torch.float32)
    ex = context(lay, cfg, rank)
    batch = random_prompts(cfg.vocab_size, 4, torch.Generator().manual_seed(3))
    scfg = SamplingConfig(max_new_tokens=8, eos_id=cfg.vocab_size - 1, temperature=0)
    eng = VLLMEngine(cfg, scfg, ex=ex, max_model_len=64, expert_parallel=expert_parallel)
    moves = Weights(train, layout_of(eng, lay), rank)
    out = {}
    for seed in (0, 1, 2):  # the first push starts the engine; the later ones land in its parameters
        run = SimpleNamespace(policy=policy(seed), opt_state=None, critic=None)
        want_shards = shard_params(run.policy, lay, rank)
        whole = sum(t.numel() * t.element_size() for t in run.policy.values())
        shards = moves.to_rollout(run, into=eng.targets())
        received = sum(t.numel() * t.element_size() for t in shards.values())
        experts = [list(t.shape) for n, t in shards.items() if n.endswith("layers.0.mlp.experts.gate_up_proj")]
        eng.load(shards)
        got = eng.generate(batch, group_size=2, seed=0)
        moves.to_train(run, eng.release(), torch.device("cpu"))
        want = generate(want_shards, cfg, batch, scfg, group_size=2, ex=ex)
        out[f"weights_{seed}"] = {
            "ids_equal": torch.equal(got.response_ids_BTr, want.response_ids_BTr),
            "lp_max_diff": float((got.sample_logprobs_BTr - want.sample_logprobs_BTr).abs().max()),
            "lp_sum": float(want.sample_logprobs_BTr.sum()),
            "received_bytes": received, "whole_bytes": whole,
            "copied_bytes": eng.load_copied, "regathered": None if reload else sorted(eng.dest.regathered),
            "experts_local": experts}
    from vllm.distributed import parallel_state
    out["vllm_tp_ranks"] = list(parallel_state.get_tp_group().ranks)
    eng.close()
    return out


def main():
    from rlflow.runtime.launch import spawn
    cases = {"llama-tiny": ("llama-tiny", None, False),  # vocab 32: vLLM splits its padded rows otherwise
             "qwen3-moe-tiny": ("qwen3-moe-tiny", 128, False), "reload": ("qwen3-moe-tiny", None, True),
             "lora": ("llama-tiny", None, False, 4), "expert_parallel": ("qwen3-moe-tiny", 128, False, 0, True)}
    res = {k: spawn(rank_checks, 2, *c) for k, c in cases.items() if k in (sys.argv[1:] or cases)}
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
