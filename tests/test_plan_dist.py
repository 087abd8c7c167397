"""The torch.distributed executor on real gloo processes: the same shards as the simulated executor on
drawn cases (plain plans, allgather-swap and its way back), Mesh process groups, and agreement with
torch.distributed.tensor (DTensor) redistribute as an outside oracle for transitions within one mesh.

One group of WORLD processes runs every case (process start is the expensive part)."""

from __future__ import annotations

import pytest
import torch
from test_plan_cases import cases, collect

from rlflow.sharding.dist import spawn
from rlflow.sharding.mesh import AXES, Mesh

WORLD = 4
N_CASES = 24
N_ORACLE = 16

pytestmark = pytest.mark.slow


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _compare(tag: str, got: dict, want: dict, out: list) -> None:
    if got.keys() != want.keys():
        out.append(f"{tag}: params {sorted(got)} != {sorted(want)}")
        return
    for n in want:
        if not _bytes_equal(got[n], want[n]):
            out.append(f"{tag}: {n} differs ({tuple(got[n].shape)} vs {tuple(want[n].shape)})")


def _placements(spec, mesh: Mesh):
    from torch.distributed.tensor import Replicate, Shard
    out = []
    for a in ("dp", "ep", "tp"):
        d = next((i for i, e in enumerate(spec) if a in spec.dim_axes(e)), None)
        out.append(Replicate() if d is None else Shard(d))
    return out


def worker(rank: int, world: int, drawn: list, oracle: list) -> dict:
    import logging

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    from rlflow.sharding.dist import execute
    from rlflow.sharding.execute import TrainState, shard, simulate
    from rlflow.sharding.plan import allgather_swap, plan, swap_back

    logging.disable(logging.WARNING)  # DTensor's advice on sequential all-gathers, gloo's lack of alltoall
    fails: list[str] = []
    kinds: set[str] = set()
    for i, case in enumerate(drawn):
        full = case.full()
        src = shard(full, case.src)
        p = plan(case.src, case.dst, bucket_bytes=case.bucket_bytes)
        kinds.update(b.kind for b in p.buckets)
        want = simulate(p, shard(full, case.src))[rank]
        _compare(f"case {i} plan", execute(p, dict(src[rank])), want, fails)
        fwd = allgather_swap(case.src, case.dst, bucket_bytes=case.bucket_bytes)
        mine = dict(src[rank])
        state = TrainState(grads={n: torch.ones(t.shape) for n, t in mine.items()},
                           optim={n: (torch.zeros(t.shape), torch.ones(t.shape)) for n, t in mine.items()})
        rollout = execute(fwd, mine, state)
        _compare(f"case {i} allgather-swap", rollout, want, fails)
        if mine or state.grads or state.optim:
            fails.append(f"case {i}: train state left on the device after allgather-swap")
        back = execute(swap_back(fwd), rollout, state)
        _compare(f"case {i} swap back", back, src[rank], fails)
        if state.grads.keys() != src[rank].keys():
            fails.append(f"case {i}: grads not swapped back in")

    # Mesh process groups: an all-reduce of the ranks over each group sums the group's members.
    n_groups = 0
    for mesh in (Mesh(dp=2, tp=2), Mesh(pp=2, ep=2), Mesh(ep=2, tp=2)):
        for axes in ("tp", "dp", "ep", "pp", ("dp", "ep"), ("ep", "tp"), AXES):
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=mesh.group(axes))
            if t.item() != sum(mesh.group_ranks(axes, rank)):
                fails.append(f"{mesh}.group({axes}): sum {t.item()} != {sum(mesh.group_ranks(axes, rank))}")
            n_groups += 1

    # DTensor redistribute as an oracle (one mesh, no pp, axes of one dim in mesh order).
    meshes: dict = {}
    n_oracle = 0
    for i, case in enumerate(oracle):
        m = case.src.mesh
        if m.shape not in meshes:
            meshes[m.shape] = DeviceMesh("cpu", torch.arange(world).reshape(m.dp, m.ep, m.tp),
                                         mesh_dim_names=("dp", "ep", "tp"))
        dm = meshes[m.shape]
        full = case.full()
        ours = execute(plan(case.src, case.dst, bucket_bytes=case.bucket_bytes), dict(shard(full, case.src)[rank]))
        for prm in case.src.params:
            q = case.dst[prm.name]
            d = distribute_tensor(full[prm.name].reshape(prm.view), dm, _placements(prm.spec, m))
            d = d.redistribute(dm, _placements(q.spec, m)).to_local()
            mine = ours[prm.name].reshape(q.local_view(m))
            if not _bytes_equal(d.contiguous(), mine):
                fails.append(f"oracle case {i}: {prm.name} {prm.spec} -> {q.spec} differs from DTensor")
            n_oracle += 1
    return {"fails": fails, "cases": len(drawn), "kinds": sorted(kinds), "groups": n_groups,
            "oracle_params": n_oracle}


def test_dist_executor_matches_simulated_and_dtensor():
    drawn = collect(cases(world=WORLD), N_CASES)
    oracle = collect(cases(world=WORLD, same_mesh=True, pp=False, mesh_order=True,
                           dtypes=(torch.float32, torch.bfloat16, torch.int64)), N_ORACLE)
    results = spawn(worker, WORLD, drawn, oracle)
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["fails"]]
    assert not fails, "\n".join(fails[:20])
    assert all(res["cases"] == N_CASES >= 20 for res in results)
    assert results[0]["groups"] == 21 and results[0]["oracle_params"] >= N_ORACLE
    # the drawn cases exercise every kind of collective
    assert {"all_gather", "broadcast", "all_to_all", "send_recv", "slice"} <= set(results[0]["kinds"])
