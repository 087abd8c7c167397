"""Rollout engines behind one seam: token ids in, a ``RolloutBatch`` with the sampling log-probs out.

An engine is built once per run for this rank's place in the rollout layout (``build``) and driven by the
step:

    engine.layout(rollout) -> Layout        optional: the layout it takes its shards in, when not the rollout
                                            layout's own (vLLM's expert parallelism); the transition plans there
    engine.targets() -> dict                optional: name -> the memory the engine takes that rollout shard
                                            in (vLLM: views of its parameters); the transition writes there
    engine.load(weights)                    this rank's rollout shards (the transition's output), as given
    engine.generate(prompts, group_size=G, seed=s) -> RolloutBatch
                                            ``group_size`` samples per prompt of a ``PromptBatch``:
                                            response ids, masks, the sampling log-probs (and, asked at
                                            build time, the MoE routes)
    engine.generate(..., version=v, newer=f)
                                            capability ``partial_rollout`` (separate pools): each token's
                                            version recorded; ``newer`` polled for weights to continue with
                                            mid-generation
    engine.serve(requests, slots=, max_len=, seed=)
                                            capability ``serve``: continuous batching over requests that
                                            arrive while it decodes (multi-turn rollouts, ``rollout.serve``)
    engine.release() -> weights             the weights handed back (the transition's way back frees
                                            them); the engine keeps nothing of them
    engine.figures() -> dict                its figures, the same names every step (vLLM: its last weight
                                            load's seconds and bytes); the step adds them to its times
    engine.close()                          at the end of a run

What an engine can do is declared (``base.Capabilities``) and each engine kind is registered by name
(``base.register``): the runtime and the recipe ask capabilities, never names, so an engine is one file.
``builtin`` is rlflow's own engine (``rlflow/rollout.py``); ``vllm`` drives vLLM in the rank's process
(``engines/vllm.py``; the vllm package is imported only when one starts).
"""

from __future__ import annotations

from rlflow.engines.base import (Capabilities, EngineKind, Options, RolloutEngine, capabilities, check, kind,
                                 layout_of, names, option_problems, register, targets,
                                 unsupported)
from rlflow.engines.builtin import BuiltinEngine
from rlflow.engines import vllm as _vllm  # noqa: F401, E402  (registers "vllm" after "builtin")
from rlflow.models.config import ModelConfig
from rlflow.models.execution import LOCAL, Exec
from rlflow.rollout import SamplingConfig


def build(name: str, cfg: ModelConfig, sampling: SamplingConfig, *, ex: Exec = LOCAL,
          options: Options = Options()) -> RolloutEngine:
    """The rollout engine ``name`` for this rank (``ex``: its execution context in the rollout layout); what it
    cannot do of what ``options`` and ``ex`` ask is refused here, by name (ValueError)."""
    k = kind(name)
    if (why := k.missing()) is not None:
        raise ImportError(f"rollout engine {name}: {why}")
    check(name, cfg, sharded=ex.collective_forward, tp_only=ex.tp_only, compile_decode=options.compile_decode,
          record_routes=options.record_routes)
    return k.make(cfg, sampling, ex, options)


__all__ = ["BuiltinEngine", "Capabilities", "EngineKind", "Options", "RolloutEngine", "build", "capabilities", "check",
           "kind", "layout_of", "names", "option_problems", "register", "targets", "unsupported"]
