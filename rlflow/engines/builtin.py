"""rlflow's own rollout engine: ``rollout.generate`` (batched, continuous batching, KV cache, pure torch)
in any tensor / expert parallel layout, through the rank's execution context."""

from __future__ import annotations

from rlflow.batch import PromptBatch, RolloutBatch
from rlflow.engines.base import Capabilities, EngineKind, register
from rlflow.models.config import ModelConfig
from rlflow.models.execution import LOCAL, Exec
from rlflow.rollout import SamplingConfig, generate, serve


class BuiltinEngine:
    """Generates with the weights it was last given (``load``), in the layout of ``ex``.

    ``compile_decode``: the decode step through torch.compile (``rollout.generate``); ``record_routes``:
    the MoE expert choices of every token travel with the rows (Rollout Routing Replay)."""
    capabilities = Capabilities(serve=True, partial_rollout=True, routes=True, sharded=True, compile_decode=True)

    def __init__(self, cfg: ModelConfig, sampling: SamplingConfig, *, ex: Exec = LOCAL, compile_decode: bool = False,
                 record_routes: bool = False):
        self.cfg, self.sampling, self.ex = cfg, sampling, ex
        self.compile_decode, self.record_routes = compile_decode, record_routes
        self._weights = None

    def load(self, weights: dict) -> None:
        self._weights = weights

    def generate(self, prompts: PromptBatch, *, group_size: int, seed: int, version: int | None = None,
                 newer=None) -> RolloutBatch:
        """``version``: the loaded weights' (recorded per token); ``newer``: partial rollout, polled before each
        decode step for (version, weights) to continue with, which the engine then holds."""
        if self._weights is None:
            raise RuntimeError("BuiltinEngine.generate: no weights loaded (call load first)")

        def swap():
            got = newer()
            if got is not None:
                self._weights = got[1]
            return got
        return generate(self._weights, self.cfg, prompts, self.sampling, group_size=group_size, seed=seed,
                        compile_decode=self.compile_decode, record_routes=self.record_routes, ex=self.ex,
                        version=version, newer=None if newer is None else swap)

    def serve(self, requests, *, slots: int, max_len: int, seed: int) -> None:
        """Continuous batching over requests that arrive while it decodes (``rollout.serve``): multi-turn
        rollouts, where a turn is requested when its environment has answered."""
        if self._weights is None:
            raise RuntimeError("BuiltinEngine.serve: no weights loaded (call load first)")
        serve(self._weights, self.cfg, self.sampling, requests, slots=slots, max_len=max_len, seed=seed, ex=self.ex)

    def release(self) -> dict:
        weights, self._weights = self._weights, None
        return weights

    def figures(self) -> dict[str, float]:
        return {}  # the weights are used where they are: nothing is loaded

    def close(self) -> None:
        pass


KIND = register(EngineKind(
    "builtin", BuiltinEngine.capabilities,
    lambda cfg, sampling, ex, o: BuiltinEngine(cfg, sampling, ex=ex, compile_decode=o.compile_decode,
                                               record_routes=o.record_routes)))

__all__ = ["BuiltinEngine", "KIND"]
