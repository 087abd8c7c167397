"""The distributed runtime against one process: the same GRPO run (seed, prompts, sizes) on a world of 1, 2
and 4 ranks, with the update and the old/ref log-probs in a train layout, generation in another layout,
the weights moved between them every step (allgather-swap) and every row through a dock whose warehouses
and controllers are processes of their own, reaches the same rewards (the samples are batch-invariant:
the same tokens on any rank) and the same weights after 3 steps, within float tolerance; with PPO's
critic (GAE), the critic's weights too; with LoRA's adapters, those (the model moved once, the adapters alone
after it)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from rlflow import optim
from rlflow.algos import critic as critics, grpo
from rlflow.data import PromptSource
from rlflow.dock.proc_backend import proc_dock
from rlflow.dock.routing import route
from rlflow.models import decoder, lora as loras
from rlflow.models.config import get_config
from rlflow.models.shapes import param_shapes
from rlflow.multiturn import MultiTurnConfig
from rlflow.rewards import per_sample
from rlflow.rollout import SamplingConfig
from rlflow.runtime import launch, loop
from rlflow.runtime.graph import GRPO, PPO, graph_for
from rlflow.runtime.placement import Colocated, Disaggregated
from rlflow.runtime.state import init
from rlflow.runtime.step import context
from rlflow.sharding.mesh import Mesh
from rlflow.tokenizer import CharTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
TOK = CharTokenizer()
CFG = get_config("qwen3-moe-tiny").replace(eos_token_id=TOK.eos_id)
LORA = CFG.replace(lora=loras.LoraConfig(4, 8.0, targets=loras.ATTENTION + (loras.HEAD,)))
P, G, STEPS = 4, 4, 3
TOL = 1e-4  # on weights after 3 AdamW steps of lr 1e-2: a layout bug moves them by ~lr, rounding by < 1% of it


def reward(text: str, answer: str) -> float:
    """A reward with spread in every group from the first step (distinct characters of the response)."""
    return len(set(text)) / 4.0


def lcfg(kl: float = 0.0, gae: bool = False, new_tokens: int = 4, mt: bool = False) -> loop.LoopConfig:
    # eps 1e-4, not 1e-8: AdamW's m / (sqrt(v) + eps) turns a gradient element of ~1e-9 (rounding noise, whose
    # sign the order of a sum decides) into a step of lr; with eps 1e-8 two exact runs differ by 0.2 lr there
    return loop.LoopConfig(steps=STEPS, prompts_per_step=P, mini_batch_size=P * G, micro_batch_size=P * G,
                           grpo=grpo.GRPOConfig(group_size=G, kl_coef=kl, adv_estimator="gae" if gae else "grpo"),
                           optim=optim.AdamWConfig(lr=1e-2, eps=1e-4),
                           sampling=SamplingConfig(max_new_tokens=new_tokens, eos_id=TOK.eos_id, pad_id=TOK.pad_id),
                           seed=3, critic=critics.CriticConfig(optim=optim.AdamWConfig(lr=1e-2, eps=1e-4)) if gae else None,
                           multiturn=MultiTurnConfig(env=f"{HERE}/multiturn_envs.py:Hint", max_turns=2) if mt else None)


def full_params(cfg=CFG):
    p = decoder.init_params(cfg, seed=5, std=0.3)
    return p if cfg.lora is None else {**p, **loras.init(cfg, param_shapes(cfg), seed=6)}


def full_critic(gae: bool):
    return critics.Critic.from_policy(full_params(), CFG, seed=7) if gae else None


def one_process(kl: float, dock=None, gae: bool = False, mt: bool = False, cfg=CFG):
    c = full_critic(gae)
    state, hist = loop.train(init(full_params(cfg), PromptSource(task="max_digit", seed=1), kl=bool(kl), critic=c),
                             context(cfg, TOK, per_sample(reward), lcfg(kl, gae, mt=mt), dock=dock))
    return [m["reward_mean"] for m in hist], {**state.policy, **({} if c is None else prefixed(state.critic.params))}


def prefixed(critic_params: dict) -> dict:
    return {"critic." + k: v for k, v in critic_params.items()}


def worker(rank: int, world: int, train: str, rollout: str, kl: float, dock, gae: bool = False, new_tokens: int = 4,
           mt: bool = False, cfg=CFG):
    from rlflow.models.sharding import RULES, layout
    from rlflow.parallel.context import shard_params
    from rlflow.runtime.weights import gather_full

    mesh = Mesh.parse(train, world)
    clay = layout(CFG, mesh, dtype=torch.float32, head="value")
    where = Colocated(layout(cfg, mesh, dtype=torch.float32),
                           layout(cfg, Mesh.parse(rollout, world), dtype=torch.float32), critic=clay if gae else None)
    mine = shard_params(full_params(cfg), where.train, rank)
    c = full_critic(gae)
    if c is not None:  # the critic's shards in the train layout, its AdamW state fresh
        c = critics.Critic(params=shard_params(c.params, clay, rank), opt_state=None)
        c.opt_state = optim.init(c.params)
    state, hist = loop.train(init(mine, PromptSource(task="max_digit", seed=1), kl=bool(kl), critic=c),
                             context(cfg, TOK, per_sample(reward), lcfg(kl, gae, new_tokens, mt), dock=dock,
                                     placement=where))
    params = state.policy
    whole = lambda head: layout(cfg, Mesh(dp=world), {k: None for k in RULES}, dtype=torch.float32, head=head)  # noqa: E731
    full = gather_full(params, where.train, whole("lm"))
    if c is not None:
        full.update(prefixed(gather_full(state.critic.params, clay, whole("value"))))
    return [m["reward_mean"] for m in hist], full, hist


def compare(world: int, train: str, rollout: str, kl: float = 0.0, ray: bool = False, gae: bool = False,
            receives: bool = True, mt: bool = False, cfg=CFG):
    want_r, want_p = one_process(kl, gae=gae, mt=mt, cfg=cfg)
    graph = graph_for("gae" if gae else "grpo")
    if ray:  # the ranks as Ray actors (a local Ray), the dock's warehouses and controllers too
        import sys

        import ray as ray_mod
        from rlflow.dock.ray_backend import ray_dock
        launch.ray_init(None)
        ray_mod.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
        dock = ray_dock(graph.schema, graph.consumers, capacity=P * G, warehouses=2, group_size=G)
    else:
        dock = proc_dock(graph.schema, graph.consumers, capacity=P * G, warehouses=2, group_size=G)
    try:
        res = (launch.ray_spawn if ray else launch.spawn)(worker, world, train, rollout, kl, dock, gae, 4, mt, cfg)
    finally:
        dock.close()
    got_r, got_p, hist = res[0]
    last = hist[-1]
    assert got_r == want_r, (got_r, want_r)
    assert len(set(want_r)) > 1 or want_r[0] > 0, "the rewards must vary for the test to mean something"
    start = {**full_params(cfg), **({} if not gae else prefixed(full_critic(gae).params))}
    moved = max(float((want_p[k] - start[k]).abs().max()) for k in want_p if not k.startswith("critic."))
    assert moved > 1e-3, "the weights must change for the test to mean something"
    if gae:
        assert max(float((want_p[k] - start[k]).abs().max()) for k in want_p if k.startswith("critic.")) > 1e-3
    diff = {k: float((got_p[k] - want_p[k]).abs().max()) for k in want_p}
    worst = max(diff, key=diff.get)
    assert diff[worst] < TOL, (worst, diff[worst])
    assert (last["transition_recv_bytes"] > 0) == receives and last["dock_busiest_bytes"] > 0
    # the allgather-swap ledger's peak (train state swapped out bucket by bucket) below the naive one's
    assert 0 < last["transition_peak_bytes"] < last["transition_naive_peak_bytes"]
    return res


def test_one_process_with_and_without_the_dock_train_identically():
    from rlflow.dock import Dock
    want_r, want_p = one_process(0.0)
    got_r, got_p = one_process(0.0, Dock.local(GRPO.schema, GRPO.consumers, capacity=P * G, warehouses=2, group_size=G))
    assert got_r == want_r
    assert all(torch.equal(got_p[k], want_p[k]) for k in want_p)


@pytest.mark.slow
@pytest.mark.parametrize("train,rollout,kl", [("tp=2", "dp=2", 0.0), ("ep=2", "dp=2", 0.1)])
def test_world_2_matches_one_process(train, rollout, kl):
    compare(2, train, rollout, kl)


@pytest.mark.slow
def test_lora_world_2_matches_one_process_moving_the_model_once():
    """LoRA (attention and head adapters) in tp=2 training, dp=2 rollout: the adapters after 3 steps equal one
    process's; the frozen model goes into the rollout layout with the first transition only, every later one
    moves the adapters alone."""
    hist = compare(2, "tp=2", "dp=2", cfg=LORA)[0][2]
    adapters = sum(4 * v.numel() for k, v in full_params(LORA).items() if loras.is_adapter(k))
    first, later = hist[0]["transition_recv_bytes"], [m["transition_recv_bytes"] for m in hist[1:]]
    assert first > 4 * adapters and 0 < max(later) <= adapters, (first, later, adapters)


@pytest.mark.slow
def test_multi_turn_world_2_matches_one_process():
    """Episodes of two turns with an environment between them (its observations through the dock as context,
    the loss over the sampled tokens only): the default placement trains as one process does."""
    compare(2, "tp=2", "dp=2", mt=True)


@pytest.mark.slow
@pytest.mark.parametrize("train,rollout", [("tp=2", "dp=2"), ("ep=2", "dp=2"), ("dp=2", "tp=2")])
def test_ppo_with_a_critic_on_world_2_matches_one_process(train, rollout):
    """GAE whitens over the train layout's data ranks and the critic trains in the train layout (its gradient
    summed over them with ep and dp): its weights after 3 steps equal one process's, as the policy's do."""
    compare(2, train, rollout, gae=True, receives=train != "dp=2")  # dp -> tp: each rank slices what it holds


@pytest.mark.slow
def test_world_2_on_ray_actors_matches_one_process():
    pytest.importorskip("ray")
    try:
        compare(2, "tp=2", "dp=2", ray=True)
    finally:
        import ray
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("train", ["ep=2,tp=2", "pp=2,tp=2"])
def test_world_4_matches_one_process(train):
    compare(4, train, "dp=2,tp=2", kl=0.1 if train.startswith("pp") else 0.0)


@pytest.mark.slow
def test_rows_go_through_the_warehouses_and_the_controllers_carry_metadata_only():
    """The controllers (what the train ranks take and the routing plans with) see the same bytes whatever the responses' length,
    while the warehouses' traffic grows with it: no row's tokens pass through the metadata path."""
    traffic = {}
    for T in (4, 16):
        dock = proc_dock(GRPO.schema, GRPO.consumers, capacity=P * G, warehouses=2, group_size=G)
        try:
            launch.spawn(worker, 2, "tp=2", "dp=2", 0.0, dock, False, T)
            traffic[T] = dock.traffic()
        finally:
            dock.close()
    moved = lambda T, kind: sum(v["bytes_in"] + v["bytes_out"] for k, v in traffic[T].items() if k.startswith(kind))  # noqa: E731
    assert moved(4, "controller/") == moved(16, "controller/") > 0, traffic
    assert moved(16, "warehouse/") > moved(4, "warehouse/"), traffic  # longer responses (EOS may end some early)


def test_a_layout_pair_the_runtime_cannot_run_is_refused_by_name():
    from rlflow.models.sharding import layout
    lay = lambda s: layout(CFG, Mesh.parse(s, 2), dtype=torch.float32)  # noqa: E731
    with pytest.raises(ValueError, match="rollout layout .*no pp"):
        Colocated(lay("tp=2"), lay("pp=2"))
    with pytest.raises(ValueError, match="same ranks"):
        Colocated(lay("tp=2"), layout(CFG, Mesh(dp=4), dtype=torch.float32))
    with pytest.raises(ValueError, match="Disaggregated: rollout layout .*no pp"):
        Disaggregated(rollout=lay("pp=2"), train=lay("tp=2"))
    with pytest.raises(ValueError, match="Disaggregated: the critic's layout"):
        Disaggregated(rollout=lay("dp=2"), train=lay("tp=2"),
                      critic=layout(CFG, Mesh(dp=4), dtype=torch.float32, head="value"))


def test_a_disaggregated_placement_is_its_pools_split_and_each_pools_own_layout():
    from rlflow.models.sharding import layout
    lay = lambda s, n: layout(CFG, Mesh.parse(s, n), dtype=torch.float32)  # noqa: E731
    where = Disaggregated(rollout=lay("dp=2", 2), train=lay("dp=3", 3))
    assert where.world == 5 and (where.pools.rollout, where.pools.world) == (2, 5)
    assert [where.pools.pool(g) for g in range(5)] == ["rollout"] * 2 + ["train"] * 3
    own = where.own("rollout"), where.own("train")
    assert (own[0].train, own[0].rollout, own[1].train, own[1].rollout) == (where.rollout,) * 2 + (where.train,) * 2
    assert where.push_plan().src is where.train and where.push_plan().dst is where.rollout
    assert Disaggregated(rollout=lay("dp=1", 1), train=lay("dp=3", 3)).own("rollout") is None  # one rank: one process
    assert Disaggregated(rollout=lay("dp=1", 1), train=lay("pp=2", 2)).own("train").train.mesh.pp == 2  # trains only
    critic = layout(CFG, Mesh(dp=3), dtype=torch.float32, head="value")  # PPO's critic: the train pool's alone
    ppo = Disaggregated(rollout=lay("dp=2", 2), train=lay("dp=3", 3), critic=critic)
    assert ppo.own("train").critic is critic and ppo.own("rollout").critic is None


# ---- sample routing plans ----
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MESHES = st.builds(lambda dp, ep, tp, pp: Mesh(dp=dp, ep=ep, tp=tp, pp=pp), st.sampled_from([1, 2, 3]),
                   st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.sampled_from([1, 2]))


@settings(max_examples=60, deadline=None)
@given(mesh=MESHES, groups=st.integers(1, 12), group_size=st.sampled_from([1, 2, 4]), seed=st.integers(0, 99))
def test_routing_sends_every_row_to_exactly_its_readers(mesh, groups, group_size, seed):
    """Every row reaches exactly the ranks of one data-parallel part (its tp and pp peers included), once;
    groups stay whole; parts differ by at most one group; the bytes add up."""
    rng = np.random.default_rng(seed)
    k = groups * group_size
    index = np.sort(rng.choice(64, size=k, replace=False)) if group_size == 1 else np.arange(k)
    cost, nbytes = rng.integers(1, 50, k), rng.integers(8, 400, k)
    plan = route(index, rng.integers(0, 3, k), cost, nbytes, mesh, group_size=group_size)
    seen = {}
    for r in range(mesh.size):
        for row in plan.rows_of_rank(r).tolist():
            seen.setdefault(row, []).append(r)
    assert sorted(seen) == sorted(index.tolist())  # every row, and nothing else
    readers = mesh.size // mesh.data_parallel_size
    for row, ranks in seen.items():
        assert len(ranks) == len(set(ranks)) == readers  # once per reader
        assert len({mesh.data_parallel_index(r) for r in ranks}) == 1  # one part: tp / pp peers of each other
    part_of = dict(zip(index.tolist(), plan.part.tolist()))
    for g in range(groups):
        assert len({part_of[int(i)] for i in index[g * group_size:(g + 1) * group_size]}) == 1
    counts = np.bincount(plan.part, minlength=mesh.data_parallel_size) // group_size
    assert counts.max() - counts.min() <= 1
    assert plan.bytes_per_rank().sum() == nbytes.sum() * readers
    assert plan.bytes_per_warehouse(3).sum() == nbytes.sum() * readers
    assert f"{k} rows" in str(plan)


def test_the_graph_declares_every_stage_and_column_once():
    """The one declaration the dock, the flow and the cost model read: every column a stage names is declared,
    the dock's consumer is the train group (the rollout group's stages hand over in memory), the disaggregated
    flow's are the stages that read, and each column's batch field is a field of the batches."""
    from rlflow.batch import TrainBatch
    from rlflow.runtime.graph import Graph, Stage
    assert GRPO.consumers == PPO.consumers == ("train",)
    assert GRPO.flow_consumers == ("rollout", "score", "advantage", "ref_logprob", "old_logprob", "update")
    assert PPO.flow_consumers == ("rollout", "score", "ref_logprob", "old_logprob", "values", "gae", "update",
                                  "critic_update")
    fields = {f.name for f in __import__("dataclasses").fields(TrainBatch)}
    for g in (GRPO, PPO):
        assert [s.name for s in g.flow] == [s.name for s in g.stages]
        assert {f for _, f in g.columns} <= fields, {f for _, f in g.columns} - fields
        written = {c for s in g.stages for c in s.writes}
        assert {c for s in g.stages for c in s.reads} <= written  # every column read is produced by a stage
    with pytest.raises(ValueError, match="names columns \\['nope'\\]"):
        Graph(columns=GRPO.columns, stages=(Stage("x", ("nope",), (), "every", fn=print),))
    with pytest.raises(ValueError, match="via must be one of"):
        Stage("x", (), (), "every", via="mail", fn=print)
    with pytest.raises(ValueError, match="Stage 'x' on 'train': needs its function"):  # it would never run
        Stage("x", (), (), "train")
    with pytest.raises(ValueError, match="Stage 'x' on 'rollout': the rollout group's stages are the schedule's"):
        Stage("x", (), (), "rollout", fn=print)


def _listening(rank: int, world: int) -> tuple[str, list[str]]:
    """(the default store's type, this process's listening TCP sockets not bound to a loopback address)."""
    import os

    from torch.distributed import distributed_c10d as c10d

    dist = torch.distributed
    dist.barrier()  # every connection made
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    open_to_all = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        if not os.path.exists(table):  # no IPv6 on this host
            continue
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            local, state, inode = f[1], f[3], f[9]
            addr = local.split(":")[0]
            loop = addr in ("0100007F", "00000000000000000000000001000000") or addr.endswith("0100007F")
            if state == "0A" and inode in mine and not loop:
                open_to_all.append(local)
    store = c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return type(store).__name__, open_to_all


def test_local_ranks_listen_on_no_network_interface(monkeypatch):
    """One host: the ranks' store is a file (torch's TCP store listened on every interface, unauthenticated)
    and gloo's connections are on the loopback; no rank has a listening socket anyone else could reach."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # a value the machine exports is the user's choice
    for store, open_to_all in launch.spawn(_listening, 2):
        assert store == "FileStore" and open_to_all == [], (store, open_to_all)


def test_gloo_across_hosts_gets_the_interface_towards_master_addr(monkeypatch):
    """With several hosts on gloo and this host's name resolving to a loopback address, gloo bound the
    loopback and the run died after its timeout (connectFullMesh failed, "rank 1 was lost"): the rank then
    takes the interface its route to MASTER_ADDR leaves by. Where gloo's own choice works, nothing is set."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the route's source address
            here = s.getsockname()[0]
        except OSError:
            pytest.skip("this machine has no IPv4 route off the loopback")
    if here.startswith("127."):
        pytest.skip("this machine has no IPv4 interface off the loopback")
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "SLURM_NNODES"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")  # a name /etc/hosts maps to 127.0.0.1
    name = launch.gloo_interface(here)
    assert name is not None and name != "lo" and launch.world._ipv4_of(name) == here
    assert launch.gloo_interface("127.0.0.1") is None  # one host
    # the master's own host, MASTER_ADDR its name (a loopback address there): the default route's interface
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert launch.gloo_interface("127.0.0.1") == name
    monkeypatch.setattr(launch.world, "_ipv4_of", lambda n: None)  # no interface can be told: gloo's choice, said
    with pytest.warns(RuntimeWarning, match="set GLOO_SOCKET_IFNAME"):
        assert launch.gloo_interface(here) is None
    monkeypatch.undo()
    monkeypatch.setattr(socket, "gethostname", lambda: here)  # a name that resolves off the loopback
    assert launch.gloo_interface(here) is None


def _stops_badly(rank: int, world: int, ready: str) -> None:
    """On SIGINT rank 1 fails at once and rank 0 hangs (as one waiting on it in a collective that does not
    notice: gloo here notices a dead peer's closed connection, NCCL need not)."""
    import os
    import signal
    import time as _time

    asked = []
    signal.signal(signal.SIGINT, lambda *_: asked.append(1))
    open(os.path.join(ready, str(rank)), "w").close()
    while not asked:
        _time.sleep(0.01)
    if rank == 1:
        raise SystemExit(1)
    while True:
        _time.sleep(1)


def test_the_launchers_wait_after_a_signal_is_bounded_when_a_rank_fails(tmp_path):
    """After forwarding a Ctrl-C the launcher waited for every rank without bound; one whose peer had failed
    waited in a collective (30 min on gloo; once over 5 minutes in a run). Now the others get 3 s, then
    are killed, and the run ends naming the exit codes."""
    import os
    import signal
    import threading
    import time as _time

    def interrupt_when_ready():
        while len(os.listdir(tmp_path)) < 2:
            _time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # the launcher (this process) forwards it to the ranks
    threading.Thread(target=interrupt_when_ready, daemon=True).start()
    t0 = _time.monotonic()
    # the hung rank killed after 3 s (-9), or stopped by torch's own join a moment before (SIGTERM: 143 from the
    # start-up handler the test's rank left in place, or -15)
    with pytest.raises(RuntimeError, match=r"ranks ended with exit codes \[(-(9|15), 1|1, 143)\] after signal 2"):
        launch.spawn(_stops_badly, 2, str(tmp_path))
    assert _time.monotonic() - t0 < 30


def _fresh_weights_worker(rank: int, world: int, dock) -> list[dict]:
    """Two steps, train dp=2 -> rollout tp=2 (every weight moves through the transition), the sampler's
    log-probs checked against the trainer's every step."""
    import dataclasses

    from rlflow.models.sharding import layout
    from rlflow.parallel.context import shard_params

    where = Colocated(layout(CFG, Mesh.parse("dp=2", world), dtype=torch.float32),
                      layout(CFG, Mesh.parse("tp=2", world), dtype=torch.float32))
    conf = dataclasses.replace(lcfg(), steps=2, check_logprobs=1e-3)
    _, hist = loop.train(init(shard_params(full_params(), where.train, rank), PromptSource(task="max_digit", seed=1)),
                         context(CFG, TOK, per_sample(reward), conf, dock=dock, placement=where))
    return hist


def test_the_rollout_samples_with_the_weights_just_trained_and_dp_sums_the_gradients():
    """Fast guards of two bugs only slow tests caught: a weight the transition left stale (the second step's
    sampler would run the first step's weights: its log-probs then differ from the trainer's by far more
    than 1e-3 and check_logprobs stops the run), and data-parallel gradients averaged instead of summed (the
    loss carries the whole batch's normalizers, so the sum is the one-process gradient: the first step's
    gradient norm equals one process's, an average would halve it)."""
    import dataclasses

    one = loop.train(init(full_params(), PromptSource(task="max_digit", seed=1)),
                     context(CFG, TOK, per_sample(reward), dataclasses.replace(lcfg(), steps=1)))[1]
    dock = proc_dock(GRPO.schema, GRPO.consumers, capacity=P * G, warehouses=2, group_size=G)
    try:
        hist = launch.spawn(_fresh_weights_worker, 2, dock)[0]
    finally:
        dock.close()
    assert len(hist) == 2 and hist[1]["logp_diff_max"] < 1e-3
    assert one[0]["grad_norm"] > 0
    assert hist[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_torchrun_on_two_hosts_whose_names_resolve_to_the_loopback(tmp_path):
    """Two hosts (network namespaces joined by a link, sharing this machine's /etc/hosts, where the host's name
    is a loopback address as on Debian): torchrun's two nodes train on gloo. Without the interface choice
    gloo bound 127.0.0.1 on both and died after its timeout (connectFullMesh failed). Needs root (ip netns);
    skipped elsewhere."""
    import os
    import shutil
    import socket
    import subprocess
    import sys
    import uuid

    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 (network namespaces)")
    if not launch.world._is_loopback(socket.gethostname()):
        pytest.skip("this host's name does not resolve to a loopback address: nothing to show")
    tag = uuid.uuid4().hex[:6]
    ns, links, procs = [f"rlh1{tag}", f"rlh2{tag}"], [f"rlv1{tag}", f"rlv2{tag}"], []
    sh = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True)  # noqa: E731
    try:
        try:
            for n in ns:
                sh("netns", "add", n)
            sh("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot make network namespaces here: {e.stderr.decode().strip()}")
        for i, (n, link) in enumerate(zip(ns, links)):
            sh("link", "set", link, "netns", n)
            sh("-n", n, "addr", "add", f"10.213.0.{i + 1}/24", "dev", link)
            sh("-n", n, "link", "set", link, "up")
            sh("-n", n, "link", "set", "lo", "up")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        procs = [subprocess.Popen(["ip", "netns", "exec", n, torchrun, "--nnodes", "2", "--node-rank", str(i),
                                   "--nproc-per-node", "1", "--master-addr", "10.213.0.1", "--master-port", "29641",
                                   os.path.join(root, "recipes", "grpo_qwen3_moe.py"), "--steps", "2",
                                   "--dist-timeout", "60", "--out", str(tmp_path / "run")],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for i, n in enumerate(ns)]
        outs = [p.communicate(timeout=240)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
        assert (tmp_path / "run" / "checkpoint-final").is_dir()
    finally:
        for p in procs:  # a hung node (the failure this guards) must not outlive the test
            if p.poll() is None:
                os.killpg(p.pid, 9)  # torchrun and its rank: the group the node was started in
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
