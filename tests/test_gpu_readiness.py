"""What the first CUDA / NCCL (or NPU / HCCL) run would hit, caught on this CPU (the list in docs/runtime.md,
"On GPUs and NPUs"): the pipeline's point-to-point programs under NCCL's rendezvous semantics; a run whose host
is a separate place, the device's bytes against the ledger at every step; a checkpoint's export gathering on
the writing rank only; the host syncs of the update and of decoding held to a budget; masked grouped-query
attention's arguments off the CPU; --dtype auto; a Ray actor's GPU; the host arena; float64 figures as
float32 pairs. bench/gpu_check.sh's own checks are tests/test_gpu_check.py."""

from __future__ import annotations

import time
from collections import deque

import pytest
import torch

from rlflow.parallel import pp


# ---- pipeline point-to-point under rendezvous semantics ----
def _ops_of(stage: int, steps) -> list[tuple[tuple, bool]]:
    """``pp.program``'s exchanges as (ops, blocking) units; an op is (send | recv, peer stage, message id)
    with the message id (what, micro-batch, sending stage)."""
    units = []
    for op, arg in steps:
        if op != "X":
            continue
        ops = []
        for d, what, m in arg:
            peer = stage + pp.PEER[(d, what)]
            ops.append((d, peer, (what, m, stage if d == "send" else peer)))
        units.append((tuple(ops), True))
    return units


def rendezvous(programs: list[list]) -> list[int]:
    """Run every stage's units under NCCL's point-to-point semantics: a rank's ops with one peer run in order
    on one queue (a unit, one ``batch_isend_irecv``, at a time: its ops progress together); an op completes
    only when the peer's matching op is running (a send waits for its receive, no buffering); a blocking
    unit holds its host until done; ``"wait_all"`` holds it until all its units are done. Returns how far
    each host got (a deadlock leaves one short)."""
    n = len(programs)
    host = [0] * n
    queues = {}  # (rank, peer) -> deque of [ops, done-set]
    posted = [set() for _ in range(n)]
    units_of = [[] for _ in range(n)]

    def unit_done(u) -> bool:
        return len(u[1]) == len(u[0])

    progress = True
    while progress:
        progress = False
        for r in range(n):
            while host[r] < len(programs[r]):
                item = programs[r][host[r]]
                if item == "wait_all":
                    if not all(unit_done(u) for u in units_of[r]):
                        break
                else:
                    ops, blocking = item
                    if host[r] not in posted[r]:
                        peers = {p for _, p, _ in ops}
                        assert len(peers) == 1, f"stage {r}: one exchange with several peers {peers}"
                        u = [ops, set()]
                        queues.setdefault((r, peers.pop()), deque()).append(u)
                        units_of[r].append(u)
                        posted[r].add(host[r])
                        progress = True
                    if blocking and not unit_done(units_of[r][-1]):
                        break
                host[r] += 1
                progress = True
        for (r, peer), q in queues.items():
            if not q:
                continue
            other = queues.get((peer, r))
            head = q[0]
            for i, (d, p, msg) in enumerate(head[0]):
                if i in head[1] or not other:
                    continue
                want = ("recv" if d == "send" else "send", r, msg)
                theirs = other[0]
                for j, op in enumerate(theirs[0]):
                    if op == want and j not in theirs[1]:
                        head[1].add(i)
                        theirs[1].add(j)
                        progress = True
                        break
        for q in queues.values():
            while q and unit_done(q[0]):
                q.popleft()
                progress = True
    return host


@pytest.mark.parametrize("kind", [*pp.SCHEDULES, "forward"])
def test_every_pipeline_program_completes_under_rendezvous_semantics(kind):
    for n_stages in range(1, 7):
        for n_micro in range(1, 10):
            progs = [pp.program("gpipe" if kind == "forward" else kind, n_micro, s, n_stages,
                                backward=kind != "forward") for s in range(n_stages)]
            for s, steps in enumerate(progs):  # each message sent once and received once, in order
                sends = [(w, m) for op, a in steps if op == "X" for d, w, m in a if d == "send"]
                assert len(sends) == len(set(sends))
                want_f = list(range(n_micro))
                assert [m for op, m in steps if op == "F"] == want_f
            units = [_ops_of(s, steps) for s, steps in enumerate(progs)]
            got = rendezvous(units)
            assert got == [len(u) for u in units], f"{kind}: {n_stages} stages, {n_micro} micro-batches: stuck at {got}"


def test_the_checker_finds_the_deadlock_of_sends_queued_before_receives():
    """The schedule's 1F1B with non-blocking sends (waited at the end) and blocking receives, the way gloo
    tolerates: two stages, two micro-batches deadlock (stage 0 sends h1 then needs g0, stage 1 sends g0's
    input gradient then needs h1), and a blocked exchange would show the same."""
    def queued(stage, n_stages, n_micro):
        units = []
        for op, m in pp.schedule("1f1b", n_micro, stage, n_stages):
            if op == "F" and stage > 0:
                units.append(((("recv", stage - 1, ("act", m, stage - 1)),), True))
            if op == "B" and stage < n_stages - 1:
                units.append(((("recv", stage + 1, ("grad", m, stage + 1)),), True))
            if op == "F" and stage < n_stages - 1:
                units.append(((("send", stage + 1, ("act", m, stage)),), False))
            if op == "B" and stage > 0:
                units.append(((("send", stage - 1, ("grad", m, stage)),), False))
        return units + ["wait_all"]
    progs = [queued(s, 2, 2) for s in range(2)]
    assert rendezvous(progs) != [len(p) for p in progs]
    one = [queued(s, 2, 1) for s in range(2)]  # one micro-batch has nothing to cross: it completes
    assert rendezvous(one) == [len(p) for p in one]


# ---- allgather-swap frees the device: a run whose host is a separate place ----
def _separate_host_worker(rank: int, world: int, train: str, rollout: str, gae: bool, dock) -> tuple[list, int]:
    """A 2-step run on ``world`` ranks in which the swap really copies, as on an accelerator: ``to_host``
    makes a new ("host") tensor, ``to_device`` a new ("device") one. Every storage the transitions create
    is tracked; host copies are left out of the device's bytes. Returns (failures, checks made)."""
    import dataclasses
    import gc

    from test_plan_dist import _tracker
    from test_runtime import CFG, TOK, full_critic, full_params, lcfg, reward
    from torch.multiprocessing.reductions import StorageWeakRef

    from rlflow import optim
    from rlflow.algos import critic as critics
    from rlflow.data import PromptSource
    from rlflow.models.sharding import layout
    from rlflow.parallel.context import shard_params
    from rlflow.rewards import per_sample
    from rlflow.runtime import loop, weights as wmod
    from rlflow.runtime.placement import Colocated
    from rlflow.runtime.state import init
    from rlflow.runtime.step import context
    from rlflow.sharding import dist as sdist, execute as ex
    from rlflow.sharding.memory import ledger
    from rlflow.sharding.mesh import Mesh
    from rlflow.sharding.plan import COLLECTIVES

    host: list = []  # weak references to every host copy made

    def to_host(t, arena=None):
        h = torch.empty_like(t).copy_(t)
        host.append((StorageWeakRef(h.untyped_storage()), h.untyped_storage().data_ptr()))
        return h

    def to_device(t, device):
        return t.clone()

    for mod in (ex, critics):
        mod.to_host, mod.to_device = to_host, to_device

    fails, checks = [], [0]

    def refs(tensors) -> dict:
        out = {}
        for t in tensors:
            st = t.untyped_storage()
            out[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        return out

    def alive(rs: dict) -> int:
        return sum(n for r, n in rs.values() if not r.expired())

    def host_ptrs() -> set:
        return {p for r, p in host if not r.expired()}

    def device_bytes(tr, pre: dict) -> int:
        hp = host_ptrs()
        tracked = {k: v for k, v in tr.refs.items() if not v[0].expired() and k not in hp}
        return alive(pre) + sum(n for _, n in tracked.values())

    def state_tensors(run) -> list:
        o = run.opt_state
        return [*run.policy.values(), *o.m.values(), *o.v.values(), *o.master.values()]

    def critic_tensors(c) -> list:
        if c is None:
            return []
        o = c.opt_state
        return [*c.params.values(), *o.m.values(), *o.v.values(), *o.master.values()]

    def per_step(plan, led, tr, pre, label):
        want = [int(led[i + 1].sum()) for i in range(len(plan.steps))]
        for i, s in enumerate(plan.steps):
            if s.op in COLLECTIVES:  # after a collective only what the bucket keeps is still there
                b = plan.buckets[s.bucket]
                want[i] -= int(b.tmp[rank] - b.keep[rank])

        def on_step(i):
            gc.collect()
            deadline = time.monotonic() + 3  # the backend's thread drops its last buffers a moment late
            while (v := device_bytes(tr, pre)) != want[i] and time.monotonic() < deadline:
                time.sleep(0.001)
            checks[0] += 1
            if v != want[i]:
                fails.append(f"rank {rank} {label} step {i} {plan.steps[i]}: {v} B on the device, ledger {want[i]} B")
        return on_step

    probe = {}
    real_execute, real_out, real_back = sdist.execute, wmod.Weights.to_rollout, wmod.Weights.to_train

    def execute(plan, shards, state=None, **kw):
        if plan is probe.get("plan"):
            kw["on_step"] = probe["on_step"]
        return real_execute(plan, shards, state, **kw)

    def to_rollout(self, run, into=None):
        gc.collect()
        pre = refs(state_tensors(run))
        probe["train"], probe["critic"] = pre, refs(critic_tensors(run.critic))
        led = ledger(self.forward, self.state_bytes).bytes[:, :, rank]
        if alive(pre) != int(led[0].sum()):
            fails.append(f"rank {rank}: {alive(pre)} B of train state before the swap, ledger {int(led[0].sum())} B")
        with _tracker() as tr:
            probe.update(plan=self.forward, on_step=per_step(self.forward, led, tr, pre, "to_rollout"))
            out = real_out(self, run, into)
        probe.update(tracker=tr, want=int(led[-1].sum()))
        return out

    def to_train(self, run, rollout_params, device):
        gc.collect()
        pre = refs(rollout_params.values())
        led = ledger(self.back, self.state_bytes).bytes[:, :, rank]
        with _tracker() as tr:
            probe.update(plan=self.back, on_step=per_step(self.back, led, tr, pre, "to_train"))
            real_back(self, run, rollout_params, device)
        gc.collect()
        checks[0] += 1
        if alive(pre):
            fails.append(f"rank {rank}: {alive(pre)} B of rollout weights alive after the swap back")
        if host_ptrs():
            fails.append(f"rank {rank}: {len(host_ptrs())} host copies alive after the swap back")

    sdist.execute, wmod.Weights.to_rollout, wmod.Weights.to_train = execute, to_rollout, to_train

    mesh = Mesh.parse(train, world)
    clay = layout(CFG, mesh, dtype=torch.float32, head="value")
    where = Colocated(layout(CFG, mesh, dtype=torch.float32), layout(CFG, Mesh.parse(rollout, world),
                                                                    dtype=torch.float32),
                      critic=clay if gae else None)
    c = full_critic(gae)
    if c is not None:
        c = critics.Critic(params=shard_params(c.params, clay, rank), opt_state=None)
        c.opt_state = optim.init(c.params)
    state = init(shard_params(full_params(), where.train, rank), PromptSource(task="max_digit", seed=1), critic=c)
    del c
    ctx = context(CFG, TOK, per_sample(reward), dataclasses.replace(lcfg(gae=gae), steps=2), dock=dock,
                  placement=where)
    generate = ctx.engine.generate

    def generating(*a, **k):  # the engine has the rollout weights: nothing of the train state is on the device
        gc.collect()
        checks[0] += 1
        if alive(probe["train"]) or alive(probe["critic"]):
            fails.append(f"rank {rank}: {alive(probe['train'])} B of the policy's train state and "
                         f"{alive(probe['critic'])} B of the critic's alive on the device during the rollout")
        v = device_bytes(probe["tracker"], {})
        if v != probe["want"]:
            fails.append(f"rank {rank}: {v} B on the device during the rollout, ledger {probe['want']} B")
        return generate(*a, **k)

    ctx.engine.generate = generating
    loop.train(state, ctx)
    return fails, checks[0]


@pytest.mark.slow
@pytest.mark.parametrize("train,rollout,gae", [("tp=2", "dp=2", False), ("pp=2", "tp=2", False),
                                               ("tp=2", "dp=2", True)])
def test_during_rollout_the_device_holds_the_rollout_weights_only(train, rollout, gae):
    """With the host a separate place (the swap copies, as on an accelerator): while the engine generates no
    tensor of the policy's train state (weights, AdamW moments) or the critic's is alive, and the device
    holds exactly the ledger's bytes (the rollout weights); at every step of both transitions the device
    holds the ledger's bytes; after the swap back no rollout weight and no host copy is alive."""
    from rlflow.dock.proc_backend import proc_dock
    from rlflow.runtime import launch
    from rlflow.runtime.graph import graph_for
    from test_runtime import G, P

    graph = graph_for("gae" if gae else "grpo")
    dock = proc_dock(graph.schema, graph.consumers, capacity=P * G, warehouses=2, group_size=G)
    try:
        res = launch.spawn(_separate_host_worker, 2, train, rollout, gae, dock)
    finally:
        dock.close()
    fails = [f for f, _ in res for f in f]
    assert not fails, "\n".join(fails[:10])
    assert all(n > 20 for _, n in res), res  # the probes ran: per plan step and per rollout


# ---- a checkpoint's consolidated export: no whole model on any device ----
def _export_worker(rank: int, world: int, train: str, root: str) -> tuple[int, int, int, int, bool, int]:
    """(the peak bytes the export allocates on this rank beyond what it returns, the most one tensor's blocks
    from the other ranks take, the bytes it returns, the whole model's, whether the returned tensors equal
    the whole ones, the peak bytes a whole sharded checkpoint's save allocates on this rank)."""
    from test_plan_dist import _tracker
    from test_runtime import CFG, full_params

    from rlflow.data import PromptSource
    from rlflow.models.sharding import layout
    from rlflow.parallel.context import shard_params
    from rlflow.runtime import checkpoint
    from rlflow.runtime.state import init
    from rlflow.runtime.weights import gather_to_host
    from rlflow.sharding.mesh import Mesh

    lay = layout(CFG, Mesh.parse(train, world), dtype=torch.float32)
    whole = full_params()
    mine = shard_params(whole, lay, rank)
    with _tracker() as tr:
        got = gather_to_host(mine, lay)
        kept = sum(t.untyped_storage().nbytes() for t in got.values())
    block = max(int(torch.tensor(p.local_view(lay.mesh)).prod()) * p.itemsize * (lay.mesh.size - 1)
                for p in lay.params)  # one tensor's blocks from the other ranks
    model = sum(t.numel() * t.element_size() for t in whole.values())
    same = rank != 0 or (got.keys() == whole.keys() and all(got[k].equal(whole[k]) for k in whole))
    del got
    state = init(mine, PromptSource(task="max_digit"))
    with _tracker() as saving:
        checkpoint.save_state(root, "checkpoint-000001", state, cfg=CFG, args={}, train=lay, rank=rank, world=world)
    return tr.peak - kept, block, kept, model, same, saving.peak


@pytest.mark.slow
@pytest.mark.parametrize("train", ["tp=2", "pp=2"])
def test_the_export_gathers_the_whole_model_on_the_writing_rank_only(train, tmp_path):
    """The consolidated export of a sharded checkpoint: rank 0 gets the whole tensors, equal to the model's,
    with no more than one tensor's received blocks beside them; the other rank allocates nothing, and saving
    the whole checkpoint allocates far less than the model there."""
    from rlflow.runtime import checkpoint, launch

    (extra0, block, kept0, model, same, _), (extra1, _, kept1, _, _, save1) = launch.spawn(
        _export_worker, 2, train, str(tmp_path))
    assert same and kept0 == model and kept1 == 0
    assert extra0 <= block, (extra0, block)
    assert extra1 == 0, extra1
    assert save1 < model // 4, (save1, model)
    checkpoint.verify(str(tmp_path / "checkpoint-000001"))


# ---- host syncs in the hot loops ----
class HostSyncs:
    """Counts what makes the host wait for the device on an accelerator, by where it happens: a scalar read
    (``item``, ``float``, ``bool``, ``int``, or ``aten._local_scalar_dense``), an op whose output size depends
    on values (``nonzero``, boolean indexing, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave``
    without its size), and ``tolist`` / ``numpy`` / ``cpu``. On a CPU nothing waits, but the calls are the same."""

    VALUE_SIZED = ("nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "bincount")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if counter.inside:  # a read counted where it was asked for (below)
                    pass
                elif name == "_local_scalar_dense" or name in HostSyncs.VALUE_SIZED:
                    counter.hit(name)
                elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                             for i in (args[1] if len(args) > 1 else ())):
                    counter.hit("bool_index")
                elif name == "repeat_interleave" and (kwargs or {}).get("output_size") is None \
                        and isinstance(args[0], torch.Tensor) and len(args) == 1:
                    counter.hit("repeat_interleave")
                return func(*args, **(kwargs or {}))

        self.mode, self.counts, self._saved, self.inside = Mode(), {}, {}, 0

    def hit(self, what: str) -> None:
        import traceback
        self.counts[what] = self.counts.get(what, 0) + 1
        self.where = getattr(self, "where", [])
        self.where.append((what, traceback.extract_stack(limit=8)[:-3]))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    # Python's reads of a tensor: under inference mode ``bool(t)`` and ``float(t)`` reach no dispatch mode
    READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu")

    def __enter__(self):
        for meth in self.READS:
            orig = getattr(torch.Tensor, meth)
            self._saved[meth] = orig

            def wrapped(t, *a, _orig=orig, _m=meth, **k):
                if not self.inside:
                    self.hit(_m.strip("_"))
                self.inside += 1
                try:
                    return _orig(t, *a, **k)
                finally:
                    self.inside -= 1
            setattr(torch.Tensor, meth, wrapped)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for meth, orig in self._saved.items():
            setattr(torch.Tensor, meth, orig)


# What one more micro-batch of the update may read on the host: the packed forward's shapes depend on the rows
# (``_trim``'s lengths, ``_prompt_groups``' group sizes, the shared-prompt plan's counts, the real tokens'
# positions for the log-probs). Its loss and metrics stay on the device, read once per update.
UPDATE_SYNCS_PER_MICRO_BATCH = 11
# One more decode step: whether a slot finished (to free and refill it).
DECODE_SYNCS_PER_STEP = 1


def test_host_syncs_per_micro_batch_of_the_update_and_per_decode_step():
    from test_update import CFG, _batch

    from rlflow import optim
    from rlflow.algos import stages
    from rlflow.algos.grpo import GRPOConfig
    from rlflow.models import decoder as model
    from rlflow.rollout import SamplingConfig, generate
    from helpers import random_prompts

    params, tb = _batch()

    def update(micro: int) -> int:
        p = {k: v.clone() for k, v in params.items()}
        ucfg = stages.UpdateConfig(mini_batch_size=tb.size, micro_batch_size=micro)
        with HostSyncs() as h:
            stages.update(p, optim.init(p), tb, CFG, GRPOConfig(group_size=4), ucfg,
                          optim.AdamWConfig(lr=1e-2, eps=1e-3))
        return h.total

    one, four = update(tb.size), update(tb.size // 4)
    assert (four - one) / 3 <= UPDATE_SYNCS_PER_MICRO_BATCH, (one, four)

    fresh = model.init_params(CFG, seed=0, std=0.2)
    prompts = random_prompts(CFG.vocab_size, 4, torch.Generator().manual_seed(0))

    def decode(n: int) -> int:  # no EOS: every row decodes n tokens
        with HostSyncs() as h:
            generate(fresh, CFG, prompts, SamplingConfig(max_new_tokens=n, eos_id=-1), group_size=4, seed=0)
        return h.total

    short, long = decode(4), decode(12)
    assert 0 < (long - short) / 8 <= DECODE_SYNCS_PER_STEP, (short, long)


# ---- masked grouped-query attention keeps a fused kernel on an accelerator ----
def test_masked_grouped_query_attention_repeats_the_heads_off_the_cpu():
    """The arguments SDPA gets on an accelerator for a masked GQA call (a mask and enable_gqa together fall
    back to the math kernel there): the key/value heads repeated, enable_gqa off, the same result. Which
    kernel CUDA then picks is not checked here (no GPU)."""
    import torch.nn.functional as F

    from rlflow.ops.attention import causal_padding_mask, fused_kernel_heads

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g) for h in (4, 2, 2))
    mask = causal_padding_mask(torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool), 0, 5)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    class OnDevice(torch.Tensor):  # q as an accelerator sees it: only its device type is asked
        @property
        def device(self):
            return torch.device("cuda")

    k2, v2, gqa = fused_kernel_heads(q.as_subclass(OnDevice), k, v, mask)
    assert not gqa and k2.shape[1] == v2.shape[1] == 4
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k2, v2, attn_mask=mask), want)
    assert fused_kernel_heads(q, k, v, mask)[2]  # the CPU's kernels take both: nothing repeated
    assert fused_kernel_heads(q.as_subclass(OnDevice), k, v, None)[2]  # no mask: flash takes grouped heads


# ---- bfloat16 by default on an accelerator ----
def test_dtype_auto_is_bfloat16_on_an_accelerator_and_float32_on_a_cpu(monkeypatch):
    """--dtype auto (the default): bfloat16 where the MoE grouped GEMM runs (float32 there takes the padded
    expert path, E/K times the FLOPs), float32 on a CPU; an explicit --dtype is kept."""
    import dataclasses

    from rlflow import device
    from rlflow.recipe.flags import Recipe
    from rlflow.recipe.pieces import concrete

    r = Recipe()
    monkeypatch.setattr(device, "kind", lambda: "cpu")
    assert r.dtype == "auto" and concrete(r).dtype == "float32"
    for kind in ("cuda", "npu"):
        monkeypatch.setattr(device, "kind", lambda kind=kind: kind)
        assert concrete(r).dtype == "bfloat16"
        assert concrete(dataclasses.replace(r, dtype="float32")).dtype == "float32"


# ---- the compiled decode step off cpu and cuda ----
def test_compile_decode_is_refused_where_its_options_are_not_the_devices(monkeypatch, capsys):
    """The compiled decode step takes inductor's cpu options (C++ wrapper) or cuda's (CUDA graphs); an NPU would
    get the CPU's: --compile-decode is refused there by flag, and ``generate`` refuses it off cpu and cuda."""
    from helpers import recipe_module

    from rlflow import device
    from rlflow.decoding import compiled_step

    monkeypatch.setattr(device, "kind", lambda: "npu")
    with pytest.raises(SystemExit):
        recipe_module().parse_args(["--compile-decode"])
    assert "--compile-decode: on npu is not built" in capsys.readouterr().err
    monkeypatch.setattr(device, "kind", lambda: "cpu")
    recipe_module().parse_args(["--compile-decode"])  # a CPU compiles it
    with pytest.raises(ValueError, match="compile_decode on meta is not built"):
        compiled_step(torch.device("meta"))


# ---- Ray: an actor sees its node's GPUs and picks its own ----
def test_a_ray_actor_picks_its_gpu_among_the_devices_it_sees():
    """Ray's GPU actors keep the node's CUDA_VISIBLE_DEVICES (``RAY_GPU_ENV``) so NCCL sees the same-node
    peers' devices; the actor's device index is its Ray GPU id's place among them. (No GPU or Ray cluster
    here: the index rule only.)"""
    from rlflow.runtime.launch import RAY_GPU_ENV, gpu_index

    assert RAY_GPU_ENV == {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert gpu_index([3], None) == 3 and gpu_index(["5"], "") == 5
    assert gpu_index([6], "4,6,7") == 1 and gpu_index(["7"], "4, 6, 7") == 2
    with pytest.raises(RuntimeError, match="does not list"):
        gpu_index([1], "4,6")


# ---- the host swap: one exact-size buffer per rank, reused ----
def test_the_host_arena_holds_exactly_the_swapped_bytes_and_is_reused():
    """Every swap-out's tensors are views of one buffer (pinned on an accelerator: here unpinned, no GPU) of
    exactly their aligned bytes, the same buffer step after step; a take past it, or a reserve while its
    tensors are in use, is refused. (The pinned allocation and the copies' overlap need a GPU: not run.)"""
    from rlflow.sharding.execute import ALIGN, HostArena, to_host

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g).to(dt) for s, dt in (((3, 5), torch.float32), ((7,), torch.bfloat16),
                                                                ((2, 2, 2), torch.float32))]
    need = HostArena.size_of(tensors)
    assert need == sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors) == 64 + 16 + 32
    arena = HostArena(pin=False)
    buffers = []
    for _ in range(3):  # three steps
        arena.reserve(need)
        got = [arena.take(t) for t in tensors]
        for h, t in zip(got, tensors):
            h.copy_(t)
            assert h.shape == t.shape and h.dtype == t.dtype and h.equal(t)
            assert h.untyped_storage().data_ptr() == arena.buf.untyped_storage().data_ptr()
            assert (h.data_ptr() - arena.buf.data_ptr()) % ALIGN == 0
        with pytest.raises(RuntimeError, match="past its"):
            arena.take(tensors[0])
        with pytest.raises(RuntimeError, match="still in use"):
            arena.reserve(need)
        buffers.append(arena.buf.data_ptr())
        arena.reset()
    assert len(set(buffers)) == 1 and arena.buf.numel() == need  # one buffer, exactly the bytes, reused
    assert to_host(tensors[0], arena) is tensors[0]  # a CPU tensor is already on the host


# ---- float64 figures on a backend without float64 (HCCL) ----
def _pairs_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from rlflow.sharding import dist as sdist

    sdist.FLOAT64_COLLECTIVES = False  # as on HCCL
    seen = []  # the dtypes the backend is handed
    real_gather, real_reduce = sdist.all_gather_single, dist.all_reduce
    sdist.all_gather_single = lambda out, x, **k: (seen.append(x.dtype), real_gather(out, x, **k))[1]
    dist.all_reduce = lambda x, *a, **k: (seen.append(x.dtype), real_reduce(x, *a, **k))[1]
    x = torch.tensor([2.0 ** 40 + rank, 0.1 * (rank + 1), -3.0 ** 0.5 * rank, 1e-30], dtype=torch.float64)
    out = {op: sdist.all_reduce(x, op=getattr(dist.ReduceOp, op)).tolist() for op in ("SUM", "MAX", "MIN")}
    out["rows"] = sdist.all_gather_rows(x).tolist()
    with pytest.raises(ValueError, match="only sum, max, min"):
        sdist.all_reduce(x, op=dist.ReduceOp.PRODUCT)
    out["dtypes"] = sorted({str(d) for d in seen})
    return out


def test_float64_figures_go_as_float32_pairs_where_the_backend_has_no_float64():
    """HCCL reduces no float64 (the loop's closing figures, the batch normalizers, whitening, the log-prob
    gate are float64): there they go as two float32 halves each, gathered and reduced on the rank. Forced on
    gloo here (no NPU): within float32's range the results equal float64's to 2^-48 relative, integers up to
    2^48 exactly."""
    import math

    from rlflow.runtime import launch

    got = launch.spawn(_pairs_worker, 2)[0]
    assert got["dtypes"] == ["torch.float32"]  # no float64 reached the backend
    rows = [[2.0 ** 40 + r, 0.1 * (r + 1), -3.0 ** 0.5 * r, 1e-30] for r in range(2)]
    for op, f in (("SUM", sum), ("MAX", max), ("MIN", min)):
        want = [f(col) for col in zip(*rows)]
        for g, w in zip(got[op], want):
            assert g == w if w == int(w) and abs(w) < 2 ** 48 else math.isclose(g, w, rel_tol=2 ** -47), (op, g, w)
    assert got["SUM"][0] == 2.0 ** 41 + 1  # exact: float32 alone would round it to 2^41
    for gr, wr in zip(got["rows"], rows):
        for g, w in zip(gr, wr):
            assert math.isclose(g, w, rel_tol=2 ** -47), (g, w)
