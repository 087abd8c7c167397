"""Dry runs (rlflow/dryrun.py): a rank of a world executed alone on meta tensors in a fake world issues the same
collectives as the real run on gloo, its live bytes are the plan's ledger at every step, and the check over a
world's traces catches a planted reorder."""

import collections
import contextlib
import dataclasses
import subprocess
import sys
import time

import pytest
import torch

from rlflow import dryrun
from rlflow.models.sharding import layout
from rlflow.runtime.launch import spawn
from rlflow.sharding.mesh import Mesh

CASES = [("qwen3-moe-tiny", "tp=2,ep=2", "tp=2"), ("qwen3-moe-tiny", "pp=2,tp=2", "ep=2,tp=2"),
         ("llama-tiny", "tp=2,dp=2", "dp=4")]
WORLD = 4


def _layouts(model, train, rollout):
    return (layout(model, Mesh.parse(train, WORLD), dtype=torch.float32),
            layout(model, Mesh.parse(rollout, WORLD), dtype=torch.float32))


def _real(rank: int, world: int, cases) -> list:
    """The same transitions on gloo with real tensors, their collectives recorded by the dry run's watch."""
    from rlflow.models import decoder
    from rlflow.models.config import get_config
    from rlflow.parallel.context import shard_params
    from rlflow.sharding import dist as sdist
    from rlflow.sharding.execute import TrainState
    from rlflow.sharding.plan import allgather_swap

    out = []
    for model, train, rollout in cases:
        src, dst = _layouts(model, train, rollout)
        shards = shard_params(decoder.init_params(get_config(model), seed=0), src, rank)
        trace = dryrun.RankTrace(rank)
        with dryrun.Watch(trace):
            sdist.execute(allgather_swap(src, dst), shards, TrainState())
        out.append(trace.collectives)
    return out


@pytest.mark.slow
def test_the_dry_run_issues_the_real_runs_collectives():
    """Every rank's collectives (op, group, shapes, dtypes, in issue order) in the dry run are those the real run
    issues on gloo: all-gathers over tp and ep groups, a pp broadcast, the rollout's slices."""
    real = spawn(_real, WORLD, CASES)
    for i, (model, train, rollout) in enumerate(CASES):
        src, dst = _layouts(model, train, rollout)
        for rank in range(WORLD):
            fake = dryrun.transition(src, dst, rank).collectives
            assert fake, (train, rollout, rank)
            assert fake == real[rank][i], (train, rollout, rank, fake[:2], real[rank][i][:2])


@pytest.mark.parametrize("model, train, rollout", CASES)
def test_the_dry_runs_live_bytes_are_the_ledgers_at_every_step(model, train, rollout):
    """The same peak as the ledger, and at every step within 10% of its peak. The one difference seen: an
    all-to-all bucket, whose buffers the ledger charges every rank at the bucket's largest (a rank that sends
    less holds less); elsewhere equal, byte for byte."""
    src, dst = _layouts(model, train, rollout)
    for rank in range(WORLD):
        t = dryrun.transition(src, dst, rank)
        assert len(t.steps) == len(t.ledger_steps) > 3 and t.peak_bytes == t.ledger_peak_bytes > 0, t
        assert t.ledger_gap() <= 0.10, (rank, t.steps, t.ledger_steps)
        if "ep" not in rollout:  # no all-to-all
            assert t.ledger_gap() == 0, (rank, t.steps, t.ledger_steps)


def test_the_world_check_passes_the_real_order_and_catches_a_planted_reorder():
    src, dst = _layouts(*CASES[1])
    traces = [dryrun.transition(src, dst, r) for r in range(WORLD)]
    assert dryrun.mismatched(traces) == []
    bad = traces[1].collectives
    assert len(bad) >= 2 and bad[0] != bad[1]
    traces[1] = dataclasses.replace(traces[1], collectives=[bad[1], bad[0], *bad[2:]])
    found = dryrun.mismatched(traces)
    assert found and "rank 1" in found[0], found


def test_the_world_check_catches_all_to_all_sizes_that_do_not_fit():
    """An all-to-all's members send different amounts by design; what one sends to another must be what that one
    receives: a rank whose send sizes are planted out of step is named."""
    src, dst = _layouts(*CASES[1])
    traces = [dryrun.transition(src, dst, r) for r in range(WORLD)]
    r, i = next((t.rank, k) for t in traces for k, c in enumerate(t.collectives)
                if c.splits and len(set(c.splits[1])) > 1)
    c = traces[r].collectives[i]
    planted = dataclasses.replace(c, splits=(c.splits[0], tuple(reversed(c.splits[1]))))
    traces[r].collectives[i] = planted
    found = dryrun.mismatched(traces)
    assert found and "all-to-all" in found[0], found


def test_the_world_check_pairs_each_send_with_its_receive():
    """Point-to-point ops pair up by (sender, receiver), not over a group: in order, of the same size."""
    c = lambda op, peer, n: dryrun.Collective(op, (0, 1, 2), ((n,),), ("torch.uint8",), (), peer)  # noqa: E731
    traces = [dryrun.RankTrace(0, [c("send", 2, 8), c("recv_", 1, 4)]), dryrun.RankTrace(1, [c("send", 0, 4)]),
              dryrun.RankTrace(2, [c("recv_", 0, 8)])]
    assert dryrun.mismatched(traces) == []
    traces[2].collectives[0] = c("recv_", 0, 16)
    found = dryrun.mismatched(traces)
    assert found and "ranks 0 -> 2" in found[0], found


# ---- the whole step ----
# every response at full length in both runs (an EOS id beyond the vocabulary: no one samples it), so the real rows
# have the dry run's shapes; dense models, whose collectives do not depend on the routing
STEP_CASES = [dryrun.StepCase("llama-tiny", WORLD, "tp=2,dp=2", "dp=4", prompts=4, group_size=2, prompt_len=6,
                              response_len=5, response_tokens=5, eos=256),
              dryrun.StepCase("qwen2.5-tiny", WORLD, "pp=2,tp=2", "tp=2,dp=2", prompts=4, group_size=2, prompt_len=6,
                              response_len=5, response_tokens=5, eos=256)]
MOE_CASE = dryrun.StepCase("qwen3-moe-tiny", WORLD, "tp=2,ep=2", "tp=2,dp=2", prompts=4, group_size=2, prompt_len=6,
                           response_len=5, response_tokens=5, eos=256)


def _real_step(rank: int, world: int, cases, dock, balanced: bool) -> list:
    """Each case's step on gloo with real tensors (random weights, a real dock), its collectives recorded by the
    dry run's watch; ``balanced``: routed as the dry run routes (``dryrun.balanced_routing``)."""
    out = []
    for case in cases:
        trace = dryrun.RankTrace(rank)
        with dryrun.balanced_routing() if balanced else contextlib.nullcontext():
            dryrun.real(case, rank, dock, watch=dryrun.Watch(trace))
        out.append(trace.collectives)
    return out


def _spawn_real(cases, balanced: bool = False):
    with dryrun.real_dock(cases[0]) as dock:
        return spawn(_real_step, WORLD, cases, dock, balanced)


@pytest.mark.slow
def test_the_dry_step_issues_the_real_steps_collectives():
    """One RL step (transition, generation, swap back, the dock, reference log-probs, the update and its AdamW
    step) executed for every rank on meta tensors issues, rank by rank, the collectives the real step issues on
    4 gloo processes: op, group, shapes, dtypes and split sizes, in order; tensor and pipeline parallel training
    (the pipeline's sends and receives, its broadcast of the figures) and data / tensor parallel rollouts."""
    real = _spawn_real(STEP_CASES)
    for i, case in enumerate(STEP_CASES):
        for rank in range(WORLD):
            fake = dryrun.step(case, rank).collectives
            assert len(fake) > 20, (case, rank)
            assert fake == real[rank][i], (case.model, rank, next(
                (k, a, b) for k, (a, b) in enumerate(zip(fake, real[rank][i])) if a != b), len(fake), len(real[rank][i]))
    assert any(c.op == "send" for c in real[0][1]) and any(c.op == "broadcast_object_list" for c in real[0][1])


@pytest.mark.slow
def test_the_dry_moe_step_issues_the_real_steps_collectives_when_both_route_alike():
    """With experts over ep=2 the all-to-alls' sizes follow the router's choices: a real step routed as the dry
    run routes (balanced, ``dryrun.balanced_routing``) issues the dry step's collectives exactly, the all-to-alls'
    shapes and split sizes too."""
    real = _spawn_real([MOE_CASE], balanced=True)
    for rank in range(WORLD):
        fake = dryrun.step(MOE_CASE, rank).collectives
        assert any(c.op == "alltoall_base_" for c in fake)
        assert fake == real[rank][0], (rank, next(
            (k, a, b) for k, (a, b) in enumerate(zip(fake, real[rank][0])) if a != b), len(fake), len(real[rank][0]))


def test_balanced_routing_routes_a_real_forward_as_the_dry_run_does():
    """Under ``dryrun.balanced_routing`` every MoE layer of a real forward sends token n's k-th slot to expert
    (n K + k) mod E (``values.balanced``, the dry run's choices), weighed as the router weighed its own k-th choice,
    and issues no op of its own (the count moves by the experts' groups alone: within 2%, where recomputing the
    weights at the forced experts added a fifth); outside it the router chooses (a random-init one, unevenly)."""
    from rlflow.dryrun.values import balanced
    from rlflow.models import decoder
    from rlflow.models.config import get_config
    cfg = get_config("qwen3-moe-tiny")
    params = decoder.init_params(cfg, seed=0)
    ids = torch.arange(24).reshape(2, 12) % 7
    pos = torch.arange(12).expand(2, 12)
    K, E = cfg.num_experts_per_tok, cfg.num_experts

    def chosen():
        routing = decoder.Routing(record=True)
        trace = dryrun.RankTrace(0)
        with dryrun.Watch(trace, device="cpu"):
            decoder.forward(params, cfg, ids, pos, routing=routing)
        return routing.chosen.long(), sum(sum(ops.values()) for ops in trace.stage_ops.values())  # [B, T, M, K]

    own, own_ops = chosen()
    x, gate = torch.randn(5, cfg.hidden_size), params["model.layers.0.mlp.gate.weight"]
    w_own, idx_own, _ = decoder.route(x, gate, K, True)
    with dryrun.balanced_routing():
        forced, forced_ops = chosen()
        w, idx, _ = decoder.route(x, gate, K, True)
    assert torch.equal(forced, balanced(24, K, E).reshape(2, 12, 1, K).expand_as(forced))
    assert not torch.equal(own, forced) and abs(forced_ops - own_ops) <= 0.02 * own_ops
    assert torch.equal(idx, balanced(5, K, E)) and torch.equal(w, w_own) and not torch.equal(idx_own, idx)
    assert torch.equal(decoder.route(x, gate, K, True)[1], idx_own)  # the model's own again
def _pools_rank(rank: int, world: int, case, dock) -> list[dict]:
    return dryrun.real_pools(rank, world, case, dock, steps=2)


@pytest.mark.slow
def test_a_real_step_on_separate_pools_reports_both_pools_stages_at_the_cases_lengths():
    """``real_pools``: rank 0 generates and scores, rank 1 trains, through a real dock and the push; the train rank's
    metrics carry the rollout pool's stage clocks and its own, every response at the case's full length (an EOS no
    one samples), rows at most one version stale."""
    from rlflow.runtime.pools import Pools
    case = dryrun.StepCase("qwen3-moe-tiny", 1, "dp=1", "dp=1", prompts=2, group_size=2, prompt_len=6,
                           response_len=5, response_tokens=5, eos=10 ** 9, kernels="cpu")
    with dryrun.real_dock(case, steps=2) as dock:
        rollout, history = spawn(_pools_rank, 2, case, dock, pools=Pools(1, 2))
    assert rollout == [] and len(history) == 2
    for h in history:
        assert h["rollout_time_s"] > 0 and h["score_time_s"] > 0 and h["update_time_s"] > 0 and h["push_time_s"] > 0
        assert h["response_tokens"] == 4 * 5 and h["prompt_tokens"] == 4 * 6 and h["staleness"] <= 1


def _real_peaks(rank: int, world: int, case, dock) -> tuple[dict, int]:
    """The real step's peak of live CPU bytes per stage (the dry run's watch counting CPU tensors), and the bytes
    of the train state a transition swaps out on an accelerator (on a CPU it stays where it is)."""
    trace = dryrun.RankTrace(rank)
    state, _ = dryrun.real(case, rank, dock, watch=dryrun.Watch(trace, device="cpu"))
    moved = sum(t.untyped_storage().nbytes() for t in [*state.policy.values(), *state.opt_state.m.values(),
                                                         *state.opt_state.v.values(), *state.opt_state.master.values()])
    return trace.stage_peaks, moved


@pytest.mark.slow
def test_the_dry_steps_memory_peaks_are_the_real_cpu_runs():
    """Per stage, the peak of live bytes of the real step on 4 gloo processes (CPU tensors) is the dry run's
    (meta tensors) within 1%. A CPU keeps the train state where it is while the engine generates (an
    accelerator's transition swaps it out to the host): there, the real peak less the swapped state's bytes is
    the dry run's. The transitions themselves (whose CPU runs swap nothing) are the ledger tests' above."""
    case = STEP_CASES[0]
    with dryrun.real_dock(case) as dock:
        real = spawn(_real_peaks, WORLD, case, dock)
    for rank in range(WORLD):
        fake = dryrun.step(case, rank).stage_peaks
        got, moved = real[rank]
        assert set(got) == set(fake) and fake["update"] > fake["state"] > 0
        for stage, want in fake.items():
            if stage not in ("transition", "swap back"):
                swapped = moved if stage in ("generate", "decode") else 0
                assert abs(got[stage] - swapped - want) <= 0.01 * want, (rank, stage, got[stage], swapped, want)


def test_activation_checkpointing_reaches_the_update_and_lowers_its_peak():
    """``LoopConfig.remat`` (the recipe's ``--remat``) makes the step's update recompute each layer's activations:
    the update's peak above the train state falls (llama-tiny, 128 tokens a row: by half here); nothing else
    moves."""
    case = dryrun.StepCase("llama-tiny", WORLD, "tp=2,dp=2", "dp=4", prompts=4, group_size=2, prompt_len=64,
                           response_len=64)
    kept, remat = (dryrun.step(dataclasses.replace(case, remat=r), 0).stage_peaks for r in (False, True))
    assert remat["update"] - remat["state"] < 0.6 * (kept["update"] - kept["state"]), (kept, remat)
    assert {k: v for k, v in remat.items() if k != "update"} == {k: v for k, v in kept.items() if k != "update"}


@pytest.mark.parametrize("H, K, dv, masked", [(4, 4, 16, True), (8, 2, 16, True), (4, 4, 8, True), (8, 2, 16, False)])
def test_meta_attention_is_the_memory_efficient_kernels(H, K, dv, masked):
    """On meta tensors attention runs the memory-efficient kernel an accelerator's SDPA runs (``ops/backends/
    meta.py``): the reference's output shape (grouped heads, MLA's narrower values, a mask or causal), and a
    forward and backward that keep per layer the output and a log-sum-exp, not SDPA's math path's [B, H, T, S]
    scores (the reference on meta: what a CPU would do)."""
    from rlflow.ops import attention
    from rlflow.ops.attention import attention_reference
    B, T, d = 2, 512, 16

    def peak(fn):
        trace = dryrun.RankTrace(0)
        with dryrun.Watch(trace):
            q = torch.empty(B, H, T, d, device="meta", dtype=torch.bfloat16, requires_grad=True)
            k = torch.empty(B, K, T, d, device="meta", dtype=torch.bfloat16, requires_grad=True)
            v = torch.empty(B, K, T, dv, device="meta", dtype=torch.bfloat16, requires_grad=True)
            mask = torch.ones(B, 1, T, T, device="meta", dtype=torch.bool) if masked else None
            out = fn(q, k, v, mask, is_causal=True)
            assert out.shape == (B, H, T, dv)
            out.sum().backward()
        return trace.peak_bytes
    scores = B * H * T * T * 2
    fused, reference = peak(attention), peak(attention_reference)
    assert reference > scores and fused < reference - scores / 2, (fused, reference, scores)


# ---- the cost model ----
def _rates():
    from rlflow.dryrun import cost
    return cost.Rates("unit", {f"{k}:{d}": ((1.0, 1e9),) for k in cost.MATMULS for d in ("float32", "bfloat16")},
                      ((1.0, 1e9),), (), op_s=1e-6, link=1e9, link_s=1e-5)


def test_an_ops_cost_is_its_flops_and_the_bytes_it_reads_makes_and_writes_in_place():
    """A matmul's FLOPs (2 M K N), its bytes (both inputs read, the output made: fresh); an in-place add reads and
    writes its tensor with nothing fresh; a view costs nothing; a grouped matmul's FLOPs and rows per group; an
    indexed write in place (a KV cache's rows) touches the rows it writes, not its whole destination; an empty
    tensor moves nothing and makes its bytes (their first touch comes with whichever op writes it first)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from rlflow.dryrun import cost

    class Costs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.append(cost.op_cost(func, args, kwargs or {}, out))
            return out

    a, b = torch.ones(4, 8, device="meta"), torch.ones(8, 16, device="meta")
    ga, gb = torch.ones(12, 8, device="meta", dtype=torch.bfloat16), torch.ones(3, 8, 16, device="meta",
                                                                              dtype=torch.bfloat16)
    cache, rows = torch.ones(1000, 16, device="meta"), torch.ones(3, 16, device="meta")
    at = torch.ones(3, dtype=torch.long, device="meta")
    with Costs() as c:
        y = a @ b
        y.add_(1.0)
        y.view(-1)
        torch._grouped_mm(ga, gb, torch.tensor([4, 8, 12], dtype=torch.int32, device="meta"))
        cache.index_put_((at,), rows)
        cache.index_add_(0, at, rows)
        torch.empty(1000, 16, device="meta")
    mm, add, view, grouped, put, index_add, empty = c.ops
    assert mm == cost.OpCost("aten.mm", "float32", 2 * 4 * 8 * 16, 4 * (32 + 128 + 64), 4 * 64, "mm", 4)
    assert add.op == "aten.add_" and add.flops == 0 and add.bytes == 2 * 4 * 64 and add.fresh == 0
    assert view is None
    assert grouped.flops == 2 * 12 * 8 * 16 and (grouped.kernel, grouped.small) == ("grouped_mm", 4)
    assert put.op == "aten.index_put_" and put.bytes == 2 * 3 * 16 * 4 + 3 * 8 and put.fresh == 0
    assert index_add.bytes == 3 * 3 * 16 * 4 + 3 * 8  # the rows read, the source read, the rows written
    assert empty == cost.OpCost("aten.empty", "float32", 0, 0, 4 * 16000)


def test_an_op_costs_its_issue_plus_its_roofline_or_the_longer_of_the_two_on_a_queue():
    """Issue plus the longer of FLOPs (at the rate of the matmul's smallest dimension, interpolated in log-log)
    and bytes, plus fresh memory's first touch above ``fresh_from`` (an empty tensor's too: no kernel, but its
    pages); a collective its latency and bytes; on a queue the longer of issue and work."""
    from rlflow.dryrun import cost
    r = cost.Rates("test", {"mm:float32": ((1.0, 1e8), (100.0, 1e9))}, ((1.0, 1e8),), ((1 << 20, 1e7),), op_s=1e-3,
                   link=1e6, link_s=1e-2, fresh_from=1 << 19)
    compute = cost.OpCost("aten.mm", "float32", flops=10 ** 7, bytes=10 ** 5, kernel="mm", small=100)  # 10 ms, 1 ms
    skinny = dataclasses.replace(compute, small=10)  # between the table's sizes: 10^8.5 FLOP/s
    memory = cost.OpCost("aten.add", "float32", flops=0, bytes=10 ** 6, fresh=1 << 20)  # 10 ms + 105 ms fresh
    small = cost.OpCost("aten.add", "float32", flops=0, bytes=10 ** 6, fresh=1 << 10)  # reused memory
    coll = cost.OpCost("c10d.allgather_", "float32", flops=0, bytes=10 ** 4)
    assert r.seconds(compute) == pytest.approx(1e-3 + 1e-2)
    assert r.seconds(skinny) == pytest.approx(1e-3 + 1e7 / 10 ** 8.5)
    assert r.seconds(memory) == pytest.approx(1e-3 + 1e-2 + (1 << 20) / 1e7)
    assert r.seconds(small) == pytest.approx(1e-3 + 1e-2)
    made, reused = (cost.OpCost("aten.empty", "float32", flops=0, bytes=0, fresh=n) for n in (1 << 20, 1 << 10))
    assert (r.seconds(made), r.seconds(reused)) == pytest.approx((1e-3 + (1 << 20) / 1e7, 1e-3))
    assert r.seconds(coll) == pytest.approx(1e-3 + 1e-2 + 1e-2)
    queued = dataclasses.replace(r, queued=True, op_s=5e-2)
    assert queued.seconds(compute) == pytest.approx(5e-2)
    # on a queue a stage takes between the longer of its issue and work summed apart and the sum of its ops'
    fast = dataclasses.replace(queued, op_s=2e-3, kernel_s=1e-4)
    empty = cost.OpCost("aten.add", "float32", flops=0, bytes=8)  # a kernel's least time, not its 8 bytes'
    assert fast.work(empty) == pytest.approx(1e-4) and fast.seconds(empty) == pytest.approx(2e-3)
    assert dataclasses.replace(fast, fresh=()).work(made) == 0  # an accelerator's: no kernel, memory cached
    stage = cost.predict({"s": collections.Counter({compute: 1, empty: 10})}, fast)["s"]
    assert (stage.issue_s, stage.work_s, stage.seconds) == pytest.approx((11 * 2e-3, 1e-2 + 10 * 1e-4,
                                                                          1e-2 + 10 * 2e-3))


def test_a_whole_step_scales_the_executed_decode_steps_and_stretches_the_pipelines_stages():
    """The dry step's decode steps are counted apart from the prefill (stage "decode", ``decode_steps``) and cost
    the same each: a step that executes 2 of them priced for a response of 9 tokens is one that executes 4; the
    prefill's stage is the same in both. With 2 pipeline stages over 2 micro-batches the log-probs and the update
    take 3/2 of their ops' time; nothing else changes."""
    from rlflow.dryrun import cost
    case = dryrun.StepCase("qwen3-moe-tiny", 2, "dp=2", "tp=2", prompts=2, group_size=2, prompt_len=6,
                           response_len=9, response_tokens=3)
    short, long = (dryrun.step(dataclasses.replace(case, response_tokens=n), 0) for n in (3, 5))
    assert (short.decode_steps, long.decode_steps) == (2, 4)
    assert short.stage_ops["generate"] == long.stage_ops["generate"]
    a, b = (cost.whole_step(t, _rates(), response_len=9) for t in (short, long))
    assert a["decode"].flops > 0 and a["decode"].seconds == pytest.approx(b["decode"].seconds, rel=0.05)
    assert a["decode"].seconds == pytest.approx(cost.predict(short.stage_ops, _rates())["decode"].seconds * 4)
    piped = cost.whole_step(short, _rates(), response_len=9, n_micro=2, pp=2)
    for stage, c in a.items():
        assert piped[stage].seconds == pytest.approx(c.seconds * (1.5 if stage in cost.PIPELINED else 1)), stage


def test_the_dry_steps_flops_and_ops_are_the_real_steps_when_its_meta_tensors_pose_as_the_cpus():
    """Per stage, the FLOPs of the dry step (meta tensors running the CPU's program: ``StepCase.kernels="cpu"``)
    are the real step's (CPU tensors) within 1% and its count of ops within 5%; one process, a dense and a MoE
    model. The meta tensors take the CPU's kernels only so: as an accelerator's (the default), they take other
    ones (attention: the memory-efficient kernel where the CPU computes in float32)."""
    from rlflow.dryrun import cost
    for model in ("llama-tiny", "qwen3-moe-tiny"):
        case = dryrun.StepCase(model, 1, "dp=1", "dp=1", prompts=2, group_size=2, prompt_len=6, response_len=5,
                               response_tokens=5, eos=256, kernels="cpu")
        fake = cost.predict(dryrun.step(case, 0).stage_ops, _rates())
        own = dryrun.RankTrace(0)
        dryrun.real(case, 0, None, watch=dryrun.Watch(own, device="cpu"))
        real = cost.predict(own.stage_ops, _rates())
        assert set(fake) == set(real)
        for stage in ("generate", "decode", "ref_logprob", "update"):
            assert fake[stage].flops > 0 and abs(fake[stage].flops - real[stage].flops) <= 0.01 * real[stage].flops, (
                model, stage, fake[stage].flops, real[stage].flops)
            assert abs(fake[stage].ops - real[stage].ops) <= 0.05 * real[stage].ops, (model, stage, fake[stage].ops,
                                                                                      real[stage].ops)
    efficient = "aten._scaled_dot_product_efficient_attention"
    accelerator = {c.op for c in dryrun.step(dataclasses.replace(case, kernels="meta"), 0).stage_ops["update"]}
    assert efficient in accelerator and efficient not in {c.op for c in own.stage_ops["update"]}


def _link(rank: int, world: int) -> tuple[float, float]:
    from rlflow.dryrun.calibrate import link_seconds
    return link_seconds(small=1 << 10, large=1 << 20)


@pytest.mark.slow
def test_the_link_is_measured_in_a_process_group_and_free_in_one_process():
    """``calibrate.link_seconds``: two gloo ranks measure an all-reduce's latency and rate together (finite, and
    the same order on both ranks); one process has no link: its collectives cost nothing."""
    from rlflow.dryrun.calibrate import link_seconds
    assert link_seconds() == (float("inf"), 0.0)
    for rate, latency in spawn(_link, 2):
        assert 0 < latency < 0.1 and 1e6 < rate < float("inf"), (rate, latency)


_FRESH = """
import resource, sys, torch
from rlflow import device
from rlflow.dryrun.calibrate import _into_fresh
if not device.keep_host_memory():
    sys.exit(3)
def faults(fn):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
x = torch.ones(64 << 18)
junk = [torch.ones(16 << 18) for _ in range(8)]  # 128 MiB of the heap touched, freed and kept
del junk
print(faults(lambda: x.clone()), faults(lambda: _into_fresh(x)), x.nbytes // 4096)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and Linux's page faults")
def test_the_fresh_memory_rate_is_measured_on_memory_fresh_from_the_kernel_whatever_the_heap_holds():
    """A clone above glibc's mmap threshold can be served from a free chunk of the heap a process keeps (no fault:
    the bench once measured "fresh" memory at 629 GB/s); ``calibrate._into_fresh`` copies into an anonymous mapping,
    every page faulted in."""
    p = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=120)
    if p.returncode == 3:
        pytest.skip("not glibc's malloc")
    clone, fresh, pages = map(int, p.stdout.split())
    assert clone < pages // 10 <= pages <= fresh < 1.1 * pages, (clone, fresh, pages)


def _lockstep(rank: int, world: int) -> list[int]:
    """Calls of a timed op whose time differs by rank tenfold, as ``calibrate._timed`` makes them: in batches, and
    from cold caches (a flush between calls)."""
    from rlflow.dryrun.calibrate import _timed
    counts = []
    for flush in (None, lambda: None):
        calls = [0]

        def fn():
            calls[0] += 1
            time.sleep(0.001 if rank == 0 else 0.01)
        _timed(fn, min_s=0.03, flush=flush)
        counts.append(calls[0])
    return counts


@pytest.mark.slow
def test_a_process_groups_members_time_their_calls_at_once_as_many_as_the_slowest_needs():
    """The rates are measured on every rank at once, as a step's ranks contend for the memory: each timed call in
    step across the group, so the faster rank makes as many calls as the slower one (it made more, alone)."""
    fast, slow = spawn(_lockstep, 2)
    assert fast == slow, (fast, slow)


def test_the_swaps_host_copies_are_the_train_states_bytes_priced_over_the_host_link():
    """A colocated step swaps the train state (bf16 weights, float32 AdamW moments and master: 14 bytes an element)
    to the host in its transition and back after generation: the dry trace counts those bytes as host copies
    (``cost.HOST_COPY``), which a device's host link prices and a CPU's own memory does not. Posed as the CPU
    (whose real run keeps the state in place) the step moves nothing to the host."""
    from rlflow.dryrun import cost
    from rlflow.dryrun.run import meta_shards
    case = dryrun.StepCase("qwen3-moe-tiny", 2, "dp=2", "tp=2", prompts=2, group_size=2, prompt_len=6,
                           response_len=9, response_tokens=3)
    trace = dryrun.step(case, 0)
    state = sum(t.numel() for t in meta_shards(case.layouts()[0], 0).values()) * 14
    moved = {s: sum(n * c.bytes for c, n in ops.items() if c.op == cost.HOST_COPY)
             for s, ops in trace.stage_ops.items()}
    assert moved["transition"] == moved["swap back"] == state and sum(moved.values()) == 2 * state
    free, linked = _rates(), dataclasses.replace(_rates(), host=1e6)
    for stage in ("transition", "swap back"):
        a, b = (cost.predict(trace.stage_ops, r)[stage].seconds for r in (free, linked))
        assert b - a == pytest.approx(state / 1e6)
    cpu = dryrun.step(dataclasses.replace(case, kernels="cpu"), 0)
    assert not any(c.op == cost.HOST_COPY for ops in cpu.stage_ops.values() for c in ops)


def test_a_few_executed_decode_steps_price_the_whole_responses_decode():
    """The dry step runs its few decode steps at the response's middle (``run.decode_marked``'s ``advance``): scaled
    to the response (``cost.whole_step``), their bytes and time are those of every decode step executed, within 2%
    (the KV columns attention reads grow with each token: run at the prompt's end, 5% fewer bytes here)."""
    from rlflow.dryrun import cost
    R = 33
    every = dryrun.StepCase("qwen3-moe-tiny", 2, "dp=2", "tp=2", prompts=2, group_size=2, prompt_len=6,
                            response_len=R, response_tokens=R)
    want = cost.whole_step(dryrun.step(every, 0), _rates(), response_len=R)["decode"]
    for executed in (3, 9):
        got = cost.whole_step(dryrun.step(dataclasses.replace(every, response_tokens=executed), 0), _rates(),
                              response_len=R)["decode"]
        assert got.bytes == pytest.approx(want.bytes, rel=0.02) and got.seconds == pytest.approx(want.seconds,
                                                                                                  rel=0.02), executed
