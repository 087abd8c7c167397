"""Rollout engines behind one seam: token ids in, a ``RolloutBatch`` with the sampling log-probs out.

An engine is built once per run for this rank's place in the rollout layout (``build``) and driven by the
step:

    engine.load(weights)                    this rank's rollout shards (the transition's output), as given
    engine.generate(prompts, group_size=G, seed=s) -> RolloutBatch
                                            ``group_size`` samples per prompt of a ``PromptBatch``:
                                            response ids, masks, the sampling log-probs (and, asked at
                                            build time, the MoE routes)
    engine.generate(..., version=v, newer=f)
                                            separate pools (the built-in engine): each token's version
                                            recorded; ``newer`` polled for weights to continue with
                                            mid-generation (partial rollout)
    engine.serve(requests, slots=, max_len=, seed=)
                                            optional (the built-in engine): continuous batching over requests
                                            that arrive while it decodes (multi-turn rollouts, ``rollout.serve``)
    engine.release() -> weights             the weights handed back (the transition's way back frees
                                            them); the engine keeps nothing of them
    engine.figures() -> dict                the last load's seconds and bytes, for the metrics
    engine.close()                          at the end of a run

``builtin`` is rlflow's own engine (``rlflow/rollout.py``); ``vllm`` drives vLLM in the rank's process
(``engines/vllm.py``).
"""

from __future__ import annotations

from rlflow.engines.builtin import BuiltinEngine
from rlflow.models.config import ModelConfig
from rlflow.models.execution import LOCAL, Exec
from rlflow.rollout import SamplingConfig

ENGINES = ("builtin", "vllm")


def build(name: str, cfg: ModelConfig, sampling: SamplingConfig, *, ex: Exec = LOCAL, compile_decode: bool = False,
          record_routes: bool = False, max_model_len: int | None = None, memory_utilization: float | None = None,
          seed: int = 0):
    """The rollout engine ``name`` for this rank (``ex``: its execution context in the rollout layout).
    ``max_model_len`` (the longest prompt plus response; default the model's positions), ``memory_utilization``
    and ``seed`` are vLLM's."""
    if name == "builtin":
        return BuiltinEngine(cfg, sampling, ex=ex, compile_decode=compile_decode, record_routes=record_routes)
    if name == "vllm":
        from rlflow.engines.vllm import VLLMEngine

        return VLLMEngine(cfg, sampling, ex=ex, compile_decode=compile_decode, record_routes=record_routes,
                          max_model_len=max_model_len or cfg.max_position_embeddings,
                          memory_utilization=memory_utilization, seed=seed)
    raise ValueError(f"rollout engine {name!r}: expected one of {ENGINES}")


__all__ = ["BuiltinEngine", "ENGINES", "build"]
