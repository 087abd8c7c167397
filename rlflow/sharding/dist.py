"""The torch.distributed executor and process groups.

``execute(plan, shards, state)`` runs on every rank (gloo on CPU, nccl on CUDA, hccl on NPU): the same
per-rank packing as the simulated executor (``rlflow.sharding.execute``), with real collectives:
``all_gather_single`` (in place; ``all_gather_into_tensor`` before torch 2.13) over the all-gathered
source axes, ``broadcast`` along ``pp``, ``all_to_all_single`` over the ranks taking part,
``batch_isend_irecv`` for one-way flows. Each bucket packs into one send buffer and receives into one
buffer, so the temporary memory is what the ledger counts. On an accelerator, swaps go to pinned host
memory.

Process groups have one owner: ``create_groups(meshes)`` makes every group a run's meshes need (the
partitions of ``GROUP_AXES`` of each mesh, its layouts' and the transitions' between them), once and
in one fixed order on every rank, as ``dist.new_group`` requires; ``mesh_group(mesh, axes)`` then hands
out the calling rank's group. ``new_groups(partition)`` is the cached primitive underneath (the plan
executor makes its plan's groups with it, in the plan's order).
Processes are launched by ``rlflow.runtime.launch``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlflow.sharding import execute as ex
from rlflow.sharding.plan import COLLECTIVES, Bucket, Plan

_GROUPS: dict[tuple, object] = {}
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (deprecated) to all_gather_single /
# reduce_scatter_single; the project allows torch >= 2.5. One shim for both executors and the model's collectives.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _key(ranks) -> tuple:
    return (id(dist.group.WORLD), tuple(ranks))


def new_groups(partition) -> list:
    """Process groups of ``partition`` (a tuple of rank tuples), created on first use."""
    out = []
    for ranks in partition:
        ranks = tuple(sorted(ranks))
        if len(ranks) == dist.get_world_size():
            out.append(dist.group.WORLD)
            continue
        k = _key(ranks)
        if k not in _GROUPS:
            _GROUPS[k] = dist.new_group(list(ranks))
        out.append(_GROUPS[k])
    return out


# Every axis set the model execution and the data-parallel reduction use, in creation order.
GROUP_AXES = (("tp",), ("ep",), ("dp",), ("pp",), ("ep", "tp"), ("dp", "ep"), ("pp", "dp", "ep"))


def create_groups(meshes, axes_sets=GROUP_AXES) -> None:
    """Create the process groups of every mesh in ``meshes`` along each axis set of ``axes_sets`` that has
    more than one rank (the same calls, in the same order, on every rank; groups made before are reused)."""
    for mesh in meshes:
        if mesh.size == 1:
            continue
        if dist.get_world_size() != mesh.size:
            raise ValueError(f"{mesh} has {mesh.size} ranks but torch.distributed world size is "
                             f"{dist.get_world_size()}")
        for axes in axes_sets:
            if mesh.axis_size(axes) > 1:
                new_groups(mesh.groups(axes))


def mesh_group(mesh, axes):
    """The calling rank's process group along ``axes`` of ``mesh`` (None when they span one rank). The
    groups must have been made by ``create_groups``: a group made here on demand could be made in a
    different order on different ranks."""
    if mesh.axis_size(axes) == 1:
        return None
    me = dist.get_rank()
    ranks = next(g for g in mesh.groups(axes) if me in g)
    if len(ranks) != dist.get_world_size() and _key(ranks) not in _GROUPS:
        raise RuntimeError(f"no process group for axes {axes} of {mesh}: call create_groups([...]) with every "
                           "mesh of the run first, on every rank")
    return group(ranks)


def group(ranks):
    """The (already created) group of ``ranks``."""
    ranks = tuple(sorted(ranks))
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    return _GROUPS[_key(ranks)]


# None: by the device (HCCL has no float64: there the float64 figures go as float32 pairs); a test sets False
FLOAT64_COLLECTIVES: bool | None = None
_LOCAL_OPS = {dist.ReduceOp.SUM: lambda r: r.sum(0), dist.ReduceOp.MAX: lambda r: r.max(0).values,
              dist.ReduceOp.MIN: lambda r: r.min(0).values}


def takes_float64(device: torch.device) -> bool:
    """Whether the backend of ``device`` reduces float64 tensors (NCCL and gloo do; HCCL does not)."""
    return FLOAT64_COLLECTIVES if FLOAT64_COLLECTIVES is not None else device.type != "npu"


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """``t`` reduced over ``group`` (default: the world), a new tensor on ``t``'s device. The collective runs
    on this process's device (nccl and hccl take no host tensors), so counts and figures kept on the host
    can be reduced under any backend; a float64 one where the backend has no float64 is gathered (as float32
    pairs, ``all_gather_rows``) and reduced here (sum, max, min)."""
    from rlflow.device import process_device
    dev = process_device()
    if t.dtype == torch.float64 and not takes_float64(dev):
        if op not in _LOCAL_OPS:
            raise ValueError(f"all_reduce: float64 {op} on a backend without float64 (only sum, max, min)")
        return _LOCAL_OPS[op](all_gather_rows(t.reshape(-1), group)).reshape(t.shape).to(t.device)
    x = t.to(dev, copy=True)
    dist.all_reduce(x, op=op, group=group)
    return x.to(t.device)


def all_gather_rows(t: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's 1-D ``t`` (the same length on each) as the rows of a [ranks, n] tensor on ``t``'s device,
    one collective, run on this process's device like ``all_reduce``: several reductions of different ops
    (sums, maxima) over a few figures in one round trip. float64 on a backend without it goes as two float32
    halves, x = hi + lo (hi = float32(x), lo = float32(x - hi)): within float32's range to 2^-48 of x,
    integers up to 2^48 exactly (the figures are counts, sums of rewards and losses, times)."""
    from rlflow.device import process_device
    dev = process_device()
    x = t.to(dev, copy=True).reshape(-1)
    split = x.dtype == torch.float64 and not takes_float64(dev)
    if split:
        hi = x.float()
        x = torch.cat([hi, (x - hi.double()).float()])
    out = x.new_empty(dist.get_world_size(group) * x.numel())
    all_gather_single(out, x, group=group)
    rows = out.view(-1, x.numel())
    if split:
        n = x.numel() // 2
        rows = rows[:, :n].double() + rows[:, n:].double()
    return rows.to(t.device)


def clear_groups() -> None:
    _GROUPS.clear()


def _partitions(plan: Plan) -> list[tuple]:
    parts, seen = [], set()

    def add(p):
        if p not in seen:
            seen.add(p)
            parts.append(p)
    mesh = plan.src.mesh
    for b in plan.buckets:
        if b.kind in ("all_gather", "broadcast") and b.axes:
            add(mesh.groups(b.axes))
        if b.kind == "broadcast":
            add(mesh.groups(("pp",)))
        if b.kind == "all_to_all":
            add((b.group,))
    return parts


def _gather(plan: Plan, b: Bucket, rank: int, shards: dict, device):
    """All-gather phase: (segments, buffer) of this rank's gather group, or None if it has nothing."""
    grp = ex.gather_group(plan, b, rank)
    mine = ex.own_segs(plan, b, rank)
    if not mine:
        return None
    n = ex.offsets(plan.src, mine)[1]
    segs = [s for m in grp for s in ex.own_segs(plan, b, m)]
    out = torch.empty(len(grp) * n, dtype=torch.uint8, device=device)
    i = grp.index(rank)
    ex.pack(plan, mine, shards, rank, device, out=out[i * n:(i + 1) * n])
    if len(grp) > 1:  # in place: the input is this rank's slot of the output
        all_gather_single(out, out[i * n:(i + 1) * n], group=group(grp))
    return segs, out


def _collective(plan: Plan, b: Bucket, rank: int, shards: dict, device) -> list:
    if b.kind == "all_gather":
        g = _gather(plan, b, rank, shards, device)
        return [g] if g else []
    if b.kind == "broadcast":
        mesh = plan.src.mesh
        root = ex.bcast_root(plan, b, rank)
        if mesh.coords(rank)["pp"] == b.stage:
            segs, buf = _gather(plan, b, rank, shards, device)
        else:
            segs = [s for m in ex.gather_group(plan, b, root) for s in ex.own_segs(plan, b, m)]
            buf = torch.empty(ex.offsets(plan.src, segs)[1], dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=root, group=group(ex.bcast_group(plan, b, rank)))
        return [(segs, buf)]
    send, recv, _ = ex.p2p_segs(plan, b, rank)
    if rank not in b.group:
        return []
    peers = b.group if b.kind == "all_to_all" else sorted(set(send) | set(recv))
    in_splits = [ex.offsets(plan.src, send[p])[1] if p in send else 0 for p in peers]
    inp = torch.empty(sum(in_splits), dtype=torch.uint8, device=device)  # one send buffer, packed once
    packs, pos = {}, 0
    for p, n in zip(peers, in_splits):
        if n:
            packs[p] = ex.pack(plan, send[p], shards, rank, device, out=inp[pos:pos + n])
        pos += n
    sizes = {p: ex.offsets(plan.src, s)[1] for p, s in recv.items()}
    if b.kind == "all_to_all":
        out_splits = [sizes.get(p, 0) for p in b.group]
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group(b.group))
        res, pos = [], 0
        for p, n in zip(b.group, out_splits):
            if n:
                res.append((recv[p], out[pos:pos + n]))
            pos += n
        return res
    out = torch.empty(sum(sizes.values()), dtype=torch.uint8, device=device)  # one receive buffer
    bufs, pos = {}, 0
    for p in sorted(sizes):
        bufs[p], pos = out[pos:pos + sizes[p]], pos + sizes[p]
    ops = [dist.P2POp(dist.isend, packs[p], p) for p in sorted(packs)]
    ops += [dist.P2POp(dist.irecv, bufs[p], p) for p in sorted(bufs)]
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return [(recv[p], bufs[p]) for p in sorted(bufs)]


def _slice(plan: Plan, b: Bucket, rank: int, shards: dict, received: list, device, into) -> dict:
    """Allocate this rank's destination shards of bucket ``b`` (or take them from ``into``) and fill them (a
    function, so that no local name keeps a buffer alive after ``free tmp``)."""
    out = ex.alloc_dst(plan, b, rank, device, into)
    if out:
        if b.kind in ("slice", "all_to_all", "send_recv"):
            ex.copy_local(plan, ex.p2p_segs(plan, b, rank)[2], shards, out, rank)
        for segs, buf in received:
            ex.unpack(plan, segs, buf, out, rank)
    return ex.finish_dst(plan, b, out, rank)


def execute(plan: Plan, shards: dict, state: ex.TrainState | None = None, *, device=None,
            on_step=None, into: dict | None = None) -> dict:
    """Run ``plan`` on this rank; returns its destination shards (see ``execute.simulate``).
    ``on_step(i)`` is called after step ``i`` (e.g. to read the allocator's counters). ``into``: name -> the
    memory a destination shard is written into instead of a new tensor (an engine's parameters)."""
    rank = dist.get_rank()
    if dist.get_world_size() != plan.world:
        raise ValueError(f"plan is over {plan.world} ranks, torch.distributed world is "
                         f"{dist.get_world_size()}")
    state = state if state is not None else ex.TrainState()
    if device is None:
        device = next((t.device for t in shards.values()), None)
        if device is None:  # a rank that holds nothing yet
            from rlflow.device import process_device
            device = process_device()
    for part in _partitions(plan):
        new_groups(part)
    outs: dict = {}
    tmp: dict[int, list] = {}
    for i, step in enumerate(plan.steps):
        b = plan.buckets[step.bucket] if step.bucket is not None and plan.buckets else None
        if step.op in COLLECTIVES:
            tmp[b.index] = _collective(plan, b, rank, shards, device)
        elif step.op == "slice":
            outs.update(_slice(plan, b, rank, shards, tmp.get(b.index, ()), device, into))
        elif step.op == "free" and step.what == "tmp":
            tmp.pop(b.index, None)
        else:
            ex.swap_step(plan, step, rank, shards, state, outs, device)
        if on_step is not None:
            on_step(i)
    return outs


