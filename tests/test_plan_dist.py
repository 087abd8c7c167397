"""The torch.distributed executor on real gloo processes: the same shards as the simulated executor on
drawn cases (plain plans, also written into memory given for them, allgather-swap and its way back), Mesh process groups, agreement with
torch.distributed.tensor (DTensor) redistribute as an outside oracle for transitions within one mesh,
and the memory ledger against the bytes the executor really allocates.

One group of WORLD processes runs every case (process start is the expensive part)."""

from __future__ import annotations

import time

import pytest
import torch
from test_plan_cases import cases, collect

from rlflow.models.config import ModelConfig
from rlflow.runtime.launch import spawn
from rlflow.sharding.mesh import AXES, Mesh

WORLD = 4
N_CASES = 24
N_ORACLE = 16

pytestmark = pytest.mark.slow

# For the memory check: every piece of every transition below is a multiple of 16 bytes in fp32, so
# the executor's 16-byte segment alignment adds nothing and live bytes must equal the ledger exactly.
MEM_CFG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=64)
MEM_PAIRS = [("pp=2,tp=2", "tp=2"), ("tp=4", "dp=2,tp=2"), ("dp=2,ep=2", "ep=4"), ("pp=4", "ep=2,tp=2"),
             ("pp=2,ep=2", "tp=4")]


def _tracker():
    """Dispatch mode that records every storage an op creates (an output storage that is none of its
    inputs' storages: views do not count); ``live()`` is the bytes of those still alive."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    class Track(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.refs, self.peak = {}, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat = [*args, *(kwargs or {}).values()]
            flat += [x for a in flat if isinstance(a, (tuple, list)) for x in a]
            ins = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                    st = t.untyped_storage()
                    k = st.data_ptr()
                    if k not in self.refs or self.refs[k][0].expired():
                        self.refs[k] = (StorageWeakRef(st), st.nbytes())
                        self.peak = max(self.peak, self.live())
            return out

        def live(self) -> int:
            self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
            return sum(n for _, n in self.refs.values())

    return Track()


def _memory_check(rank: int, world: int, fails: list) -> int:
    """allgather-swap on real collectives: the bytes the executor allocates (rollout weights and
    buffers) after every step, and their peak across ops, equal the ledger's."""
    from rlflow.models.sharding import layout
    from rlflow.sharding.dist import execute
    from rlflow.sharding.reference import shard
    from rlflow.sharding.memory import ROLLOUT, TMP, ledger
    from rlflow.sharding.plan import COLLECTIVES, allgather_swap

    checked = 0
    for s, d in MEM_PAIRS:
        src = layout(MEM_CFG, Mesh.parse(s, world), dtype=torch.float32)
        dst = layout(MEM_CFG, Mesh.parse(d, world), dtype=torch.float32)
        fwd = allgather_swap(src, dst, bucket_bytes=32 << 10)
        g = torch.Generator().manual_seed(1)
        mine = shard({p.name: torch.randn(p.shape, generator=g) for p in src.params}, src)[rank]
        led = ledger(fwd).bytes[:, :, rank]
        # After a collective the executor holds only what the bucket keeps (a p2p send buffer is
        # dropped when the collective returns).
        want = [int(led[i + 1, ROLLOUT] + led[i + 1, TMP]) for i in range(len(fwd.steps))]
        for i, step in enumerate(fwd.steps):
            if step.op in COLLECTIVES:
                b = fwd.buckets[step.bucket]
                want[i] -= int(b.tmp[rank] - b.keep[rank])
        seen: list[int] = []

        def on_step(i):
            # the backend's worker thread may drop its reference to the last buffers a moment after
            # the collective returns: wait for that (briefly) before reading
            deadline = time.monotonic() + (0.5 if len(seen) == i and seen == want[:i] else 0)
            while (v := tr.live()) != want[i] and time.monotonic() < deadline:
                time.sleep(0.001)
            seen.append(v)

        with _tracker() as tr:
            execute(fwd, mine, on_step=on_step)
        for i, step in enumerate(fwd.steps):
            if seen[i] != want[i]:
                fails.append(f"memory {s} -> {d}: step {i} {step}: {seen[i]} B live, ledger {want[i]} B")
                break
        peak = int((led[:, ROLLOUT] + led[:, TMP]).max())
        most = max(int(b.tmp[rank] - b.keep[rank]) for b in fwd.buckets)
        if not peak <= tr.peak <= peak + most:
            fails.append(f"memory {s} -> {d}: peak {tr.peak} B, ledger {peak} B")
        checked += len(seen)
    return checked


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

    from rlflow.sharding.dist import create_groups, execute, mesh_group
    from rlflow.optim import AdamWState
    from rlflow.sharding.execute import TrainState, simulate
    from rlflow.sharding.reference import shard
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
        # into memory given (an engine's parameters): the same shards, written there
        into = {n: torch.full((t.numel(),), 7, dtype=t.dtype) for n, t in want.items()}
        got = execute(p, dict(src[rank]), into=into)
        _compare(f"case {i} plan into given memory", got, want, fails)
        if any(got[n].data_ptr() != into[n].data_ptr() for n in got):
            fails.append(f"case {i}: a shard was not written into the memory given for it")
        fwd = allgather_swap(case.src, case.dst, bucket_bytes=case.bucket_bytes)
        mine = dict(src[rank])
        state = TrainState(grads={n: torch.ones(t.shape) for n, t in mine.items()},
                           optim=AdamWState(step=1, m={n: torch.zeros(t.shape) for n, t in mine.items()},
                                            v={n: torch.ones(t.shape) for n, t in mine.items()}))
        rollout = execute(fwd, mine, state)
        _compare(f"case {i} allgather-swap", rollout, want, fails)
        if mine or state.grads or state.optim is not None:
            fails.append(f"case {i}: train state left on the device after allgather-swap")
        back = execute(swap_back(fwd), rollout, state)
        _compare(f"case {i} swap back", back, src[rank], fails)
        if state.grads.keys() != src[rank].keys():
            fails.append(f"case {i}: grads not swapped back in")

    # Mesh process groups: an all-reduce of the ranks over each group sums the group's members.
    n_groups = 0
    meshes, axes_sets = (Mesh(dp=2, tp=2), Mesh(pp=2, ep=2), Mesh(ep=2, tp=2)), ("tp", "dp", "ep", "pp", ("dp", "ep"),
                                                                            ("ep", "tp"), AXES)
    create_groups(meshes, axes_sets)
    for mesh in meshes:
        for axes in axes_sets:
            t = torch.tensor([float(rank)])
            g = mesh_group(mesh, axes)
            if g is not None:
                dist.all_reduce(t, group=g)
            if t.item() != sum(mesh.group_ranks(axes, rank)):
                fails.append(f"mesh_group({mesh}, {axes}): sum {t.item()} != {sum(mesh.group_ranks(axes, rank))}")
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
        p = plan(case.src, case.dst, bucket_bytes=case.bucket_bytes)
        ours = execute(p, dict(shard(full, case.src)[rank]))
        for prm in case.src.params:
            q = case.dst[prm.name]
            d = distribute_tensor(full[prm.name].reshape(prm.view), dm, _placements(prm.spec, m))
            d = d.redistribute(dm, _placements(q.spec, m)).to_local()
            mine = ours[prm.name].reshape(q.local_view(m))
            if not _bytes_equal(d.contiguous(), mine):
                fails.append(f"oracle case {i}: {prm.name} {prm.spec} -> {q.spec} differs from DTensor")
            n_oracle += 1
    n_mem = _memory_check(rank, world, fails)
    return {"fails": fails, "cases": len(drawn), "kinds": sorted(kinds), "groups": n_groups,
            "oracle_params": n_oracle, "memory_steps": n_mem}


def test_dist_executor_matches_simulated_and_dtensor():
    drawn = collect(cases(world=WORLD), N_CASES)
    oracle = collect(cases(world=WORLD, same_mesh=True, pp=False, mesh_order=True,
                           dtypes=(torch.float32, torch.bfloat16, torch.int64)), N_ORACLE)
    results = spawn(worker, WORLD, drawn, oracle)
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["fails"]]
    assert not fails, "\n".join(fails[:20])
    assert all(res["cases"] == N_CASES >= 20 for res in results)
    assert results[0]["groups"] == 21 and results[0]["oracle_params"] >= N_ORACLE
    assert results[0]["memory_steps"] > 50
    # the drawn cases exercise every kind of collective
    assert {"all_gather", "broadcast", "all_to_all", "send_recv", "slice"} <= set(results[0]["kinds"])
