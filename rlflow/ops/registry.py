"""Which implementation each op runs: one table, by device kind.

Each op of ``rlflow.ops`` (``rmsnorm``, ``attention``, ``moe_experts``, ...) has a plain torch reference,
defined next to it and registered with ``reference``; a backend (``rlflow/ops/backends/<kind>.py``) may
register a fused implementation of it for its device kind (``cpu``, ``cuda``, ``npu``; ``meta``: what an
accelerator's kernel computes, in shapes and memory, for dry runs) with ``fused``.
An op asks ``run(name, device, *args)``: the fused entry for ``device.type`` if there is one and it takes
these arguments, else None, and the op computes its reference. A fused entry returns None where it does
not apply (dtype, shapes, its kernels unavailable, inside torch.compile), so the reference is always
the answer of last resort; tests compare every fused entry against it. Model code only calls the ops.

Backends are imported with ``rlflow.ops`` (``import_backends``); the CPU one builds its kernels on first use.
"""

from __future__ import annotations

import importlib
import threading
from contextlib import contextmanager
from typing import Callable

import torch

KINDS = ("cpu", "cuda", "npu", "meta")  # meta: dry runs, an accelerator's kernels in shapes and memory
_BACKENDS = {kind: f"rlflow.ops.backends.{kind}" for kind in KINDS}
_fused: dict[str, dict[str, Callable]] = {}
_reference: dict[str, Callable] = {}
_imported: set[str] = set()
_lock = threading.Lock()


def reference(name: str) -> Callable:
    """Decorator: ``fn`` is op ``name``'s plain torch reference."""
    def deco(fn: Callable) -> Callable:
        _reference[name] = fn
        return fn
    return deco


def fused(name: str, kind: str) -> Callable:
    """Decorator (backends): ``fn`` is op ``name``'s fused implementation on devices of ``kind``; it takes
    the op's arguments and returns its result, or None where it does not apply."""
    if kind not in KINDS:
        raise ValueError(f"unknown device kind {kind!r}: expected one of {KINDS}")

    def deco(fn: Callable) -> Callable:
        _fused.setdefault(name, {})[kind] = fn
        return fn
    return deco


def _import_backend(kind: str) -> None:
    if kind in _imported:
        return
    with _lock:
        if kind not in _imported:
            importlib.import_module(_BACKENDS[kind])
            _imported.add(kind)


def lookup(name: str, kind: str) -> Callable | None:
    """Op ``name``'s fused entry for device ``kind`` (None: none registered, or an unknown kind such as
    ``mps``: the reference runs)."""
    if kind not in _BACKENDS:
        return None
    _import_backend(kind)
    return _fused.get(name, {}).get(kind)


def get_reference(name: str) -> Callable:
    return _reference[name]


def run(name: str, device: torch.device, *args, **kwargs):
    """The fused result of op ``name`` for tensors on ``device``, or None (the caller runs the reference). Meta
    tensors posing as another kind (``posing``) take the meta entry (what that kind's kernel keeps, in shapes),
    else that kind's."""
    kind = computes_as(device)
    fn = lookup(name, "meta") if device.type == "meta" else None
    fn = fn or lookup(name, kind)
    return None if fn is None else fn(*args, **kwargs)


_pose = "meta"


def computes_as(where: torch.Tensor | torch.device) -> str:
    """The device kind whose kernels a tensor's ops (or a device's) take: its device's type, but a meta tensor's
    is the kind a dry run poses it as (``posing``; ``meta``, an accelerator's kernels, unless told). Every
    choice of a kernel by device in ``rlflow.ops`` asks this, and whether a swap moves the train state to the host
    (``sharding.execute.to_host``: a CPU keeps it in place)."""
    t = where.device.type if isinstance(where, torch.Tensor) else where.type
    return _pose if t == "meta" else t


@contextmanager
def posing(kind: str):
    """Within the block, meta tensors compute as devices of ``kind`` do (a dry run of that kind's program:
    ``dryrun.StepCase.kernels``)."""
    global _pose
    if kind not in KINDS:
        raise ValueError(f"posing: unknown device kind {kind!r}: expected one of {KINDS}")
    before, _pose = _pose, kind
    try:
        yield
    finally:
        _pose = before


def table() -> dict[str, dict[str, str]]:
    """{op: {kind: qualified name of the entry}} of every backend (docs and tests)."""
    import_backends()
    return {op: {k: f"{fn.__module__}.{fn.__qualname__}" for k, fn in sorted(kinds.items())}
            for op, kinds in sorted(_fused.items())}


def import_backends() -> None:
    """Import every backend module now (``rlflow.ops`` does, so that no import happens while
    torch.compile traces an op). Cheap: the CPU kernels are built on their first use, not here."""
    for kind in KINDS:
        _import_backend(kind)
