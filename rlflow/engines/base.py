"""The engine seam as types: what an engine is (``RolloutEngine``), what it can do (``Capabilities``), and the
registry of engines by name (``EngineKind``, ``register``). The runtime and the recipe ask an engine's
capabilities, never its name: an engine is one file that defines its class and registers its kind."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

from rlflow.batch import PromptBatch, RolloutBatch
from rlflow.models.config import ModelConfig


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond load / generate / release (each False is refused by name where a run asks
    for it, with the engine's reason from ``EngineKind.why_not``)."""
    serve: bool = False  # continuous batching over requests that arrive while it decodes (multi-turn rollouts)
    partial_rollout: bool = False  # generate(version=, newer=): weights swapped in mid-generation
    routes: bool = False  # the MoE expert choices of every token recorded in the rows (routing replay)
    sharded: bool = False  # a rollout layout that splits the model (tp or ep > 1), decoding in lockstep
    tensor_parallel: bool = False  # a rollout layout that splits the model over tp alone (the engine's own tp)
    compile_decode: bool = False  # its decode step through torch.compile
    sleep: bool = False  # frees its device memory while the update runs (``release``)


# what each capability is, as the refusal says it, and the setting (the recipe's flag) that asks for it
NEEDS = {"partial_rollout": ("partial_rollout", "swaps weights mid-generation"),
         "routes": ("routing_replay", "records the rollout's expert choices"),
         "sharded": ("rollout_layout", "splits the model over the rollout ranks (tp or ep > 1)"),
         "compile_decode": ("compile_decode", "compiles the decode step")}


class RolloutEngine(Protocol):
    """Token ids in, a ``RolloutBatch`` with the sampling log-probs out, for this rank's place in the rollout
    layout (the package's docstring has the calls in the order the step makes them)."""
    capabilities: ClassVar[Capabilities]

    def load(self, weights: dict) -> None: ...

    def generate(self, prompts: PromptBatch, *, group_size: int, seed: int) -> RolloutBatch: ...

    def release(self) -> dict: ...

    def figures(self) -> dict[str, float]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Options:
    """What ``build`` hands every engine's constructor: the run's settings an engine may need. ``max_model_len``:
    the longest prompt plus response; ``memory_utilization``: the device memory share it may take (vLLM's)."""
    compile_decode: bool = False
    record_routes: bool = False
    max_model_len: int | None = None
    memory_utilization: float | None = None
    expert_parallel: bool = False  # vLLM's: experts split over the tp ranks, whole (not each expert's width)
    seed: int = 0


@dataclass(frozen=True)
class EngineKind:
    """One engine in the registry. ``make(cfg, sampling, ex, options)`` builds it for a rank; ``options``: the
    run's settings that are this engine's alone (refused with another engine); ``why_not``: its reason for a
    capability it lacks (the refusal's tail); ``model_problems(cfg)``: (setting, why) for a model it cannot run;
    ``missing()``: why it cannot be imported here (how to install it), or None."""
    name: str
    capabilities: Capabilities
    make: Callable
    options: tuple[str, ...] = ()
    why_not: dict[str, str] = dataclasses.field(default_factory=dict)
    model_problems: Callable[[ModelConfig], list[tuple[str, str]]] = lambda cfg: []
    missing: Callable[[], str | None] = lambda: None


REGISTRY: dict[str, EngineKind] = {}


def register(kind: EngineKind) -> EngineKind:
    """Add ``kind`` under its name (a name taken is refused: two engines, one name, would be a silent swap)."""
    if kind.name in REGISTRY and REGISTRY[kind.name] != kind:
        raise ValueError(f"rollout engine {kind.name!r} is registered already")
    REGISTRY[kind.name] = kind
    return kind


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def kind(name: str) -> EngineKind:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"rollout engine {name!r}: expected one of {names()}") from None


def capabilities(engine) -> Capabilities:
    """An engine object's capabilities; an object that declares none can do none (it only generates)."""
    return getattr(engine, "capabilities", Capabilities())


def layout_of(engine, rollout):
    """The layout ``engine`` takes its rollout shards in (``engine.layout(rollout)``; the transition plans into
    it): ``rollout`` itself for an engine that does not say otherwise, or none."""
    held = getattr(engine, "layout", None)
    return rollout if held is None or rollout is None else held(rollout)


def targets(engine) -> dict:
    """Name -> the memory ``engine`` takes its rollout shard in (its own parameters: the transition writes
    there and ``load`` copies nothing, ``engine.targets()``); {} for an engine that offers none."""
    offer = getattr(engine, "targets", None)
    return offer() if offer is not None else {}


def unsupported(name: str, cfg: ModelConfig | None = None, *, sharded: bool = False, tp_only: bool = False,
                compile_decode: bool = False, record_routes: bool = False,
                partial_rollout: bool = False) -> list[tuple[str, str]]:
    """(setting, why) for each thing asked of engine ``name`` that it cannot do, and for a model it cannot run;
    the settings are named as the recipe's flags. ``tp_only``: a ``sharded`` layout splits over tp alone."""
    k = kind(name)
    sharded = sharded and not (tp_only and k.capabilities.tensor_parallel)
    asked = {"sharded": sharded, "compile_decode": compile_decode, "routes": record_routes,
             "partial_rollout": partial_rollout}
    out = []
    for cap, wanted in asked.items():
        if wanted and not getattr(k.capabilities, cap):
            setting, what = NEEDS[cap]
            why = k.why_not.get(cap)
            out.append((setting, f"{what}, which the {name} engine does not" + (f": {why}" if why else "")))
    return out + (k.model_problems(cfg) if cfg is not None else [])


def check(name: str, cfg: ModelConfig | None = None, **asked) -> None:
    """``unsupported`` as one ValueError naming each setting, before anything starts."""
    if bad := unsupported(name, cfg, **asked):
        raise ValueError(f"rollout engine {name}: " + "; ".join(f"{k}: {why}" for k, why in bad))


def option_problems(name: str, given: dict[str, object]) -> list[tuple[str, str]]:
    """(setting, why) for each engine option set (not None) that is another engine's alone."""
    out = []
    for setting, value in given.items():
        if value is None or value is False or setting in kind(name).options:  # False: a flag's default
            continue
        owners = [k.name for k in REGISTRY.values() if setting in k.options]
        out.append((setting, f"is an option of the {' and '.join(owners)} engine only" if owners else
                    "is no engine's option"))
    return out
