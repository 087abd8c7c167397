"""The values a dry run needs: meta tensors have no data, yet the step reads some on the host (how many tokens are
real, how many rows each expert gets, the all-to-all's split sizes, a response's end). ``Values`` is a dispatch
mode that gives small meta tensors a *value*, a CPU tensor computed alongside by the same op:

- a CPU tensor copied to the meta device keeps its own (the prompts' ids and masks), and factory ops
  (``arange``, ``zeros``, ``full``) on the meta device get theirs; uninitialised memory (``empty``) has none;
- an op whose meta inputs all have values gets its outputs' values by running on them (``argsort``, ``bincount``,
  ``nonzero``, ``index_add_``; an op whose output shape depends on the data, ``nonzero`` among them, takes its
  meta output's shape from the value's); outputs over ``CAP`` elements get none (activations, masks [B, T, T]);
- what no value can say (an index drawn from the weights' numbers: the router's top-k, the sampled token) is
  chosen by ``Choices``: balanced routing (row n's k-th expert is (n K + k) mod E), tokens that are never the end
  of a response until the ``response_tokens``-th draw, then EOS;
- a collective over values follows "every peer alike": a rank's peers hold what it holds, so a sum is the
  value times the group's size, an all-gather repeats it, an all-to-all receives from each peer what the rank
  sends to itself (balanced routing makes that exact);
- an in-place op that a value cannot follow (a meta input without one) poisons the storage it writes: any later
  read of a value there is an error, never a stale number.

The same holds for a fake accelerator's tensors (``FakeTensorMode``'s, a dry run on a fake NPU: ``device``), where
the ops on CPU tensors alone run for real, outside the fake mode, as they do beside meta tensors.

A host read (``item``, ``tolist``, ``bool``, a copy to the CPU) of a meta tensor returns its value; of one without
a value it returns ``unknown`` (0.0 by default: the update's figures, a loss; a flag reads True: a finiteness
check passes) and is counted per call site (``unknown_reads``): a read that steers the computation shows there.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from rlflow.dryrun.trace import call_site

CPU = torch.device("cpu")
CAP = 1 << 22  # elements: the largest value kept (an int64 [64, 65536] is 32 MB)
aten = torch.ops.aten
# the host reads of device data (inference mode dispatches ``to`` itself, not ``_to_copy``)
_READS = {aten._local_scalar_dense.default, aten._to_copy.default, aten.copy_.default, aten.to.dtype_layout,
          aten.to.device}
# ops whose integer outputs index what the numbers chose: topk, sort, argmax over meta floats
_CHOSEN = {aten.topk.default, aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable,
           aten.argmax.default, aten.max.dim, aten.min.dim, aten.argmin.default}
# uninitialised memory has no value (a copy into it gives it one)
_EMPTY = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
          aten.new_empty_strided.default}
_RED = {int(dist.ReduceOp.RedOpType.SUM): "sum", int(dist.ReduceOp.RedOpType.PRODUCT): "prod"}


def balanced(rows: int, k: int, n: int) -> torch.Tensor:
    """[rows, k] choices among ``n``: row r's j-th is (r k + j) mod n, distinct within a row (k <= n) and every index
    as often (balanced routing: the dry run's, and a real run's under ``real.balanced_routing``)."""
    return (torch.arange(rows)[:, None] * k + torch.arange(k)) % n


@dataclass
class Choices:
    """What the numbers would choose. ``vocab``: the model's vocabulary (an argmax over it is a sampled token);
    ``eos``: the end-of-response id; ``response_tokens``: draws before a row's EOS (None: never)."""
    vocab: int
    eos: int | None = None
    response_tokens: int | None = None
    draws: int = field(default=0, init=False)

    def chosen(self, func, x: torch.Tensor, out: torch.Tensor, dim: int) -> torch.Tensor:
        if func is aten.argmax.default and x.shape[dim] == self.vocab:  # a sampling step's tokens
            self.draws += 1
            ended = self.eos is not None and self.response_tokens is not None and self.draws >= self.response_tokens
            tok = self.draws % (self.vocab - (self.eos is not None))
            tok = self.eos if ended else tok + (self.eos is not None and tok >= self.eos)  # never EOS before its time
            return torch.full(out.shape, tok, dtype=out.dtype)
        if out.dim() == 0:
            return torch.zeros((), dtype=out.dtype)
        kept = out.dim() == x.dim()  # a reduction without keepdim drops the dim
        n, k = max(x.shape[dim], 1), out.shape[dim] if kept else 1
        moved = out.movedim(dim, -1).shape if kept else (*out.shape, 1)
        v = balanced(out.numel() // max(k, 1), k, n)
        v = v.reshape(moved).movedim(-1, dim) if kept else v.reshape(out.shape)
        return v.to(out.dtype)


class Values(TorchDispatchMode):
    """Values of small meta tensors (module docstring); ``choices``: what an index drawn from the numbers is.
    ``device``: the dry run's device type, ``meta``, or a fake accelerator's (``npu``: its tensors
    ``FakeTensorMode``'s, entered before this mode; an op on CPU tensors alone then runs on them, outside it)."""

    def __init__(self, choices: Choices, unknown: float = 0.0, device: str = "meta"):
        super().__init__()
        self.choices, self.unknown, self.device = choices, unknown, device
        self._v = WeakTensorKeyDictionary()
        self._poisoned: dict[StorageWeakRef, bool] = {}
        self.unknown_reads: dict[str, int] = {}  # call site -> count

    def value(self, t):
        """The value of dry tensor ``t`` (meta, or fake), or None (unknown, or its storage written by an op no value
        follows)."""
        if not _dry(t):
            return t
        key = StorageWeakRef(t.untyped_storage())
        if key in self._poisoned:
            if not key.expired():
                return None
            del self._poisoned[key]
        return self._v.get(t)

    def _real(self):
        """Where values are computed: on real CPU tensors, outside a fake accelerator's ``FakeTensorMode``."""
        return nullcontext() if self.device == "meta" else _disable_current_modes()

    def _poison(self, t: torch.Tensor) -> None:
        self._poisoned[StorageWeakRef(t.untyped_storage())] = True
        self._v.pop(t, None)

    def _read(self, func, args, kwargs):
        """A host read of a meta tensor: its value, else ``unknown`` (counted by call site)."""
        src = args[1] if func is aten.copy_.default else args[0]
        v = self.value(src)
        if v is None:
            site = call_site()
            self.unknown_reads[site] = self.unknown_reads.get(site, 0) + 1
            v = torch.full(src.shape, True if src.dtype == torch.bool else self.unknown, dtype=src.dtype)
        if func is aten._local_scalar_dense.default:
            return v.item()
        if func is aten.copy_.default:
            return args[0].copy_(v)
        return v.to(next((a for a in args[1:] if isinstance(a, torch.dtype)), kwargs.get("dtype", v.dtype)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "prim":  # a metadata query (a fake tensor's device): no value to follow
            return func(*args, **kwargs)
        metas = _metas(args, kwargs)
        if self.device != "meta" and not metas and not _made_on(self.device, args, kwargs):
            with self._real():  # CPU tensors stay real, as beside meta ones
                return func(*args, **kwargs)
        if func in _READS and metas and _to_host(func, args, kwargs, self.device):
            with self._real():
                return self._read(func, args, kwargs)
        if func.namespace == "c10d":
            out = func(*args, **kwargs)
            with self._real():
                self._collective(func, args)
            return out
        if func is aten.copy_.default and _dry(args[0]) and self.value(args[0]) is None:
            return self._copy_into(args[0], args[1])
        known = func not in _EMPTY and all(self.value(t) is not None for t in metas)
        try:
            out = func(*args, **kwargs)
        except Exception:  # an output shape that depends on the data (nonzero): the value's
            if not (known and metas):
                raise
            out = None
        outs = _metas(out if isinstance(out, (list, tuple)) else (out,), {})
        if known and (out is None or (outs and all(o.numel() <= CAP for o in outs))):
            with self._real():
                vout = func(*tree_map(_on_cpu(self), args), **tree_map(_on_cpu(self), kwargs))
            if out is None:
                out = tree_map(lambda v: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=self.device)
                               if isinstance(v, torch.Tensor) else v, vout)
            for o, v in zip(tree_flatten(out)[0], tree_flatten(vout)[0]):
                if _dry(o) and isinstance(v, torch.Tensor):
                    self._v[o] = v
        elif func in _CHOSEN and metas and not known:
            x, dim = args[0], _dim(func, args, kwargs)
            for o in outs:
                if not o.dtype.is_floating_point and o.numel() <= CAP:
                    with self._real():
                        self._v[o] = self.choices.chosen(func, x, o, dim)
        if not known:  # what it wrote in place no value follows
            for t in _written(func, args, kwargs):
                if _dry(t):
                    self._poison(t)
        return out

    def _copy_into(self, dst: torch.Tensor, src) -> torch.Tensor:
        """A copy into memory without a value (fresh, or poisoned): it has the source's value from now on."""
        out = dst.copy_(src)
        v = self.value(src)
        if v is not None and dst.numel() <= CAP:
            with self._real():
                self._v[dst] = v.to(dst.dtype).expand(dst.shape).clone()
        return out

    def _collective(self, func, args) -> None:
        """The values of a collective's outputs with every peer alike (module docstring)."""
        name = func.__name__.split(".")[0]
        pg = next(a for a in args if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()))
        group = dist.get_process_group_ranks(dist.ProcessGroup.unbox(pg))
        n, me = len(group), group.index(dist.get_rank()) if dist.get_rank() in group else 0
        if name == "allreduce_":
            how = _RED.get(args[2].op(), "same")
            for t in args[0]:
                self._set(t, lambda v: v * n if how == "sum" else v ** n if how == "prod" else v, t)
        elif name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
            self._set(args[0], lambda v: v.repeat(n, *[1] * (v.dim() - 1)), args[1])
        elif name == "allgather_":
            for outs, x in zip(args[0], args[1]):
                for o in outs:
                    self._set(o, lambda v: v, x)
        elif name == "_reduce_scatter_base_":
            how = _RED.get(args[3].op(), "same")
            self._set(args[0], lambda v: (c := v.chunk(n)[me]) * n if how == "sum" else c, args[1])
        elif name == "alltoall_base_":
            out, x, out_splits, in_splits = args[0], args[1], args[3], args[4]
            ins = list(in_splits) or [x.shape[0] // n] * n
            outs = list(out_splits) or [out.shape[0] // n] * n
            if all(o == ins[me] for o in outs):
                self._set(out, lambda v: v.split(ins)[me].repeat(n, *[1] * (v.dim() - 1)), x)
            else:
                self._drop(out)
        elif name not in ("broadcast_", "barrier", "send", "monitored_barrier_"):
            for t in _written(func, args, {}):  # a receive, a scatter: what arrives is unknown
                self._drop(t)

    def _set(self, out: torch.Tensor, how, src: torch.Tensor) -> None:
        v = self.value(src)
        if v is None:
            return self._drop(out)
        got = how(v)
        if _dry(out):
            if out.numel() <= CAP:
                self._v[out] = got.reshape(out.shape).to(out.dtype)
        else:
            out.copy_(got.reshape(out.shape))

    def _drop(self, t: torch.Tensor) -> None:
        if _dry(t):
            self._poison(t)


def _dry(t) -> bool:
    """A tensor of the dry run: a meta one, or a fake one (``FakeTensorMode``'s: a fake accelerator's)."""
    return isinstance(t, torch.Tensor) and (t.device.type == "meta" or isinstance(t, FakeTensor))


def _made_on(device: str, args, kwargs) -> bool:
    """Whether an op makes a tensor on the dry run's ``device`` (type): a factory's or a copy's device argument."""
    return any(isinstance(a, torch.device) and a.type == device for a in (*args, *kwargs.values()))


def _to_host(func, args, kwargs, device: str = "meta") -> bool:
    if func is aten._local_scalar_dense.default:
        return True
    if func is aten.copy_.default:
        return not _dry(args[0]) and _dry(args[1])
    dev = kwargs.get("device", next((a for a in args[1:] if isinstance(a, torch.device)), None))
    return dev is not None and torch.device(dev).type not in ("meta", device)


def _on_cpu(mode: Values):
    def swap(a):
        if _dry(a):
            return mode.value(a)
        if isinstance(a, torch.device) and a.type in ("meta", mode.device):
            return CPU
        return a
    return swap


def _dim(func, args, kwargs) -> int:
    if func is aten.topk.default:
        d = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    else:
        d = args[1] if len(args) > 1 and isinstance(args[1], int) else kwargs.get("dim", -1)
    d = -1 if d is None else d
    return d % max(args[0].dim(), 1)


def _metas(args, kwargs) -> list[torch.Tensor]:
    """The dry run's tensors (``_dry``) among an op's arguments (a list of them counts: ``cat``, the collectives')."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if _dry(a):
                out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [t for t in a if _dry(t)]
    return out


_WRITES: dict = {}  # op -> its written arguments' (position, name)


def _written(func, args, kwargs) -> list[torch.Tensor]:
    if func not in _WRITES:
        _WRITES[func] = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                         if a.alias_info is not None and a.alias_info.is_write]
    out = []
    for i, name in _WRITES[func]:
        v = args[i] if i < len(args) else kwargs.get(name)
        out += [t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)]
    return out


__all__ = ["CAP", "Choices", "Values", "balanced"]
