"""Rollout engines behind one seam: token ids in, a ``RolloutBatch`` with the sampling log-probs out.

An engine is built once per run for this rank's place in the rollout layout and driven by the step:

    engine.load(weights)                    this rank's rollout shards (the transition's output), as given
    engine.generate(prompts, group_size=G, seed=s) -> RolloutBatch
                                            ``group_size`` samples per prompt of a ``PromptBatch``:
                                            response ids, masks, the sampling log-probs (and, asked at
                                            build time, the MoE routes)
    engine.release() -> weights             the weights handed back (the transition's way back frees
                                            them); the engine keeps nothing of them

``builtin`` is rlflow's own engine (``rlflow/rollout.py``).
"""

from rlflow.engines.builtin import BuiltinEngine

__all__ = ["BuiltinEngine"]
