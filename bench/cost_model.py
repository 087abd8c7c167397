"""The whole-step cost model against this machine (issue 44): each stage's time predicted from the dry run's trace
(``dryrun.step`` on meta tensors: per op its FLOPs, bytes and fresh bytes) at the rates micro-benchmarks measure
here (``dryrun.calibrate.measure``), beside the same step run for real (``dryrun.real``: CPU tensors, random weights).

Definitions: measured = the median over steps 2.. of the step's stage clocks (``runtime.step``'s laps: the
rollout is the transition, generation (prefill and decode) and swap back; scoring; the reference log-probs with the
dock's get; the update); predicted = the sum over the stage's ops of ``Rates.seconds`` (the dry trace posed as this CPU:
``StepCase.kernels="cpu"``); ratio = predicted / measured. Every response runs to ``response_len`` in both (an EOS
id no one samples). The real step's own trace priced at the same rates is printed too: it separates the rate
model's error from the dry trace's. Two processes: spawned, gloo, a real dock; the rates measured in each rank at
once (the link an all-reduce's); each figure the slower rank's. The real runs route as the dry run does
(``dryrun.balanced_routing``: every expert as many tokens); ``--routing model``: by their random-init routers.
``--pools``: separate pools of one process each
(``dryrun.real_pools``: rank 0 generates and scores, rank 1 trains, max staleness 1), each stage predicted from the
one-process dry trace at the rates measured in the rank that runs it, against the pools' own stage clocks.

    python bench/cost_model.py                      # qwen3-moe-tiny and qwen3-moe-0.5b, one and two processes
    python bench/cost_model.py --models qwen3-moe-tiny --worlds 2 --steps 6
    python bench/cost_model.py --models qwen3-moe-0.5b --worlds 2 --ops 8    # where the rates miss, op by op
    python bench/cost_model.py --models qwen3-moe-tiny --worlds 1 --pools    # and separate pools, 1 + 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

STAGES = {"rollout": ("transition", "generate", "decode", "swap back"), "score": ("score", "advantage"),
          "logprob": ("ref_logprob", "old_logprob"), "update": ("update",)}
LAPS = {"rollout": "rollout_time_s", "score": "score_time_s", "logprob": "logprob_time_s", "update": "update_time_s"}
LAYOUTS = {1: ("dp=1", "dp=1"), 2: ("tp=2", "dp=2")}  # the recipe's at world 1 and 2 (a transition every step)


def _routed(routing: str):
    """The real run's routing: the dry run's (balanced), or the random-init model's own."""
    from contextlib import nullcontext

    from rlflow import dryrun
    return dryrun.balanced_routing() if routing == "balanced" else nullcontext()


def _measure(model: str):
    """This machine's rates (``calibrate.measure``), measured in a process kept as the recipe's
    (``dryrun.as_the_recipe``), as the step they predict runs."""
    from rlflow import dryrun
    from rlflow.dryrun.calibrate import measure
    dryrun.as_the_recipe()
    return measure(model=model)


def _rank(rank: int, world: int, case, steps: int, dock, routing: str, top: int = 0) -> tuple:
    """One rank of the real run: this machine's rates measured (every rank at once: the link, and the memory as
    the ranks share it), then ``steps`` steps; (the rates, each step's stage clocks, the real trace's ops, and with
    ``top`` where the rates miss: ``op_errors`` of one more step, its ops timed one by one)."""
    from rlflow import dryrun
    rates = _measure(case.model)
    own = dryrun.RankTrace(rank)
    errors = {}
    with _routed(routing):
        _, outs = dryrun.real(case, rank, dock, steps=steps, watch=dryrun.Watch(own, device="cpu"))
        if top:  # the steps above compiled the shapes' kernels
            timed = dryrun.RankTrace(rank)
            _, (out,) = dryrun.real(case, rank, dock, watch=dryrun.Watch(timed, device="cpu", timed=True))
            errors = op_errors(timed, out.figures.times, rates, top)
    return rates, [o.figures.times for o in outs], own.stage_ops, errors


# a pool's rank runs no transition: its pool has one layout
POOL_STAGES = {name: tuple(s for s in parts if s not in ("transition", "swap back")) for name, parts in STAGES.items()}


def _pool_rank(rank: int, world: int, case, steps: int, dock, routing: str) -> tuple:
    """One rank of the real run on separate pools (rank 0 generates and scores, rank 1 trains): the rates measured
    (both ranks at once), then ``steps`` steps; (the rates, the train rank's metrics of each step)."""
    from rlflow import dryrun
    rates = _measure(case.model)
    with _routed(routing):
        return rates, dryrun.real_pools(rank, world, case, dock, steps=steps)


def run_pools(model: str, steps: int, routing: str = "balanced") -> dict:
    """Separate pools of one process each, at max staleness 1: each stage predicted from the one-process dry trace
    (the pools run the same shapes: every row on one rank) at the rates measured in the rank that runs it, against
    the train rank's metrics of the pools' own stage clocks (the rollout pool reports its own); the step against
    the slower pool's predicted work (what the overlap reaches at best)."""
    from rlflow import dryrun
    from rlflow.dryrun import cost
    from rlflow.runtime.launch.local import spawn
    from rlflow.runtime.pools import Pools

    case = dryrun.StepCase(model, 1, "dp=1", "dp=1", prompts=4, group_size=4, prompt_len=16, response_len=32,
                           response_tokens=32, eos=10 ** 9, kernels="cpu")
    trace = dryrun.step(case, 0)
    with dryrun.real_dock(case, warehouses=2, steps=2) as dock:
        (r_rates, _), (t_rates, history) = spawn(_pool_rank, 2, case, steps, dock, routing, pools=Pools(1, 2))
    by = {"rollout": r_rates, "score": r_rates, "logprob": t_rates, "update": t_rates}
    rows = {}
    for name, parts in POOL_STAGES.items():
        p = cost.predict(trace.stage_ops, by[name])
        pred = sum(p[s].seconds for s in parts if s in p)
        measured = statistics.median(h[LAPS[name]] for h in history[1:])
        rows[name] = dict(measured_s=measured, predicted_s=pred, ratio=pred / measured)
    bound = max(rows["rollout"]["predicted_s"] + rows["score"]["predicted_s"],
                rows["logprob"]["predicted_s"] + rows["update"]["predicted_s"])
    step = statistics.median(h["step_time_s"] for h in history[1:])
    return dict(model=model, pools="1 + 1, max staleness 1", routing=routing, stages=rows,
                step=dict(measured_s=step, slower_pool_predicted_s=bound, ratio=bound / step))


def op_errors(own, clocks: dict, rates, top: int) -> dict:
    """Where the rates miss: per stage of ``own`` (a timed ``Watch``'s trace of a real step, its ops timed one by
    one; a collective's time is its issue alone: the transfer and the wait for the peers come in the ``Work``'s
    wait, outside the op) the stage's clock (of ``clocks``, that step's) and its ops' timed and predicted seconds
    summed (the clock's time outside the ops: collectives' waits, Python between ops), and the ``top`` kinds of
    op (name, matmul kernel, dtype) whose summed time is furthest from their predicted work (``Rates.work``: the
    issue left out)."""
    out = {}
    for name, parts in STAGES.items():
        by: dict = {}
        timed = predicted = 0.0
        for p in parts:
            for c, secs in own.op_seconds.get(p, {}).items():
                n = own.stage_ops[p][c]
                m, w, k = by.get((c.op, c.kernel, c.dtype), (0.0, 0.0, 0))
                by[(c.op, c.kernel, c.dtype)] = (m + secs, w + n * rates.work(c), k + n)
                timed, predicted = timed + secs, predicted + n * rates.seconds(c)
        out[name] = dict(clock_s=clocks[LAPS[name]], timed_s=timed, predicted_s=predicted, kinds=[
            dict(op=" ".join(x for x in key if x), ops=k, timed_s=m, work_s=w)
            for key, (m, w, k) in sorted(by.items(), key=lambda kv: -abs(kv[1][0] - kv[1][1]))[:top]])
    return out


def run(model: str, world: int, steps: int, top: int = 0, routing: str = "balanced") -> dict:
    from rlflow import dryrun
    from rlflow.dryrun import cost

    case = dryrun.StepCase(model, world, *LAYOUTS[world], prompts=4, group_size=4, prompt_len=16, response_len=32,
                           response_tokens=32, eos=10 ** 9, kernels="cpu")
    t0 = time.perf_counter()
    traces = [dryrun.step(case, r) for r in range(world)]
    dry_s = time.perf_counter() - t0
    if world == 1:
        ranks = [_rank(0, 1, case, steps, None, routing, top)]
    else:
        from rlflow.runtime.launch.local import spawn
        with dryrun.real_dock(case, warehouses=world) as dock:
            ranks = spawn(_rank, world, case, steps, dock, routing, top)
    # each rank's dry and real traces priced at its own rates
    dry = [cost.predict(t.stage_ops, rates) for t, (rates, *_) in zip(traces, ranks)]
    real = [cost.predict(ops, rates) for rates, _, ops, _ in ranks]
    rows = {}
    for name, parts in STAGES.items():
        # a stage ends when its slowest rank's does: each figure the largest over the ranks
        measured = max(statistics.median(t[LAPS[name]] for t in times[1:]) for _, times, *_ in ranks)
        pred, pred_real = (max(sum(p[s].seconds for s in parts if s in p) for p in ps) for ps in (dry, real))
        rows[name] = dict(measured_s=measured, predicted_s=pred, ratio=pred / measured,
                          real_trace_ratio=pred_real / measured,
                          ops=sum(dry[0][p].ops for p in parts if p in dry[0]),
                          real_ops=sum(real[0][p].ops for p in parts if p in real[0]),
                          gflops=sum(dry[0][p].flops for p in parts if p in dry[0]) / 1e9,
                          collective_mb=sum(dry[0][p].collective_bytes for p in parts if p in dry[0]) / 1e6)
    rates = ranks[0][0]
    return dict(model=model, world=world, routing=routing, layouts=LAYOUTS[world], dry_seconds=dry_s, stages=rows,
                op_errors=[r[3] for r in ranks],
                rates=dict(op_us=rates.op_s * 1e6, mm_gflops=rates.matmul["mm:bfloat16"][-1][1] / 1e9,
                           copy_gbps=rates.memory[-1][1] / 1e9, fresh_gbps=rates.fresh[0][1] / 1e9,
                           link_gbps=None if rates.link == float("inf") else rates.link / 1e9,
                           link_us=rates.link_s * 1e6))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-moe-tiny,qwen3-moe-0.5b")
    ap.add_argument("--worlds", default="1,2", help=f"processes: of {sorted(LAYOUTS)} (train, rollout layouts: "
                                                    f"{LAYOUTS})")
    ap.add_argument("--routing", choices=("balanced", "model"), default="balanced",
                    help="the real runs' MoE routing: the dry run's (balanced), or their random-init routers'")
    ap.add_argument("--steps", type=int, default=4, help="real steps per model; the first (warm-up) is not timed")
    ap.add_argument("--pools", action="store_true", help="also separate pools of one process each (generate and "
                                                         "score; train), at max staleness 1, per model")
    ap.add_argument("--ops", type=int, default=0, metavar="N",
                    help="per rank and stage the N kinds of op whose timed seconds (one more step, its ops timed one "
                         "by one) are furthest from their predicted work")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: the first step warms up; at least 2")
    worlds = [w for w in args.worlds.split(",")]
    if any(not w.isdigit() or int(w) not in LAYOUTS for w in worlds):
        ap.error(f"--worlds {args.worlds}: a comma-separated list of {sorted(LAYOUTS)}")
    worlds = [int(w) for w in worlds]
    if args.ops < 0:
        ap.error(f"--ops {args.ops}: a count of op kinds (>= 0)")
    cases = []
    for model in args.models.split(","):
        for world in worlds:
            out = run(model, world, args.steps, args.ops, args.routing)
            cases.append(out)
            r = out["rates"]
            print(f"\n{model}, {world} process(es), train {out['layouts'][0]} / rollout {out['layouts'][1]} (dry "
                  f"traces in {out['dry_seconds']:.0f} s); rates (rank 0): an op issues in {r['op_us']:.2f} us, a "
                  f"1024-side bf16 matmul from cold caches at {r['mm_gflops']:.0f} GFLOP/s, a 256 MiB copy at "
                  f"{r['copy_gbps']:.0f} GB/s, into fresh memory at {r['fresh_gbps']:.1f} GB/s (64 MiB), "
                  + ("no link (one process):" if r["link_gbps"] is None else
                     f"an all-reduce at {r['link_gbps']:.2f} GB/s + {r['link_us']:.0f} us:"))
            print(f"  {'stage':8s} {'measured s':>11s} {'predicted s':>12s} {'ratio':>6s} {'real trace':>11s} "
                  f"{'ops dry/real':>14s} {'GFLOP':>8s} {'coll. MB':>9s}")
            for name, s in out["stages"].items():
                print(f"  {name:8s} {s['measured_s']:11.4f} {s['predicted_s']:12.4f} {s['ratio']:6.2f} "
                      f"{s['real_trace_ratio']:11.2f} {s['ops']:>7d}/{s['real_ops']:<6d} {s['gflops']:8.2f} "
                      f"{s['collective_mb']:9.2f}", flush=True)
            for rank, errors in enumerate(out["op_errors"]):
                for name, e in errors.items():
                    print(f"  {name} (rank {rank}): its clock {e['clock_s']:.4f} s (its ops timed one by one), the "
                          f"ops timed {e['timed_s']:.4f} s, predicted {e['predicted_s']:.4f} s; timed / predicted "
                          f"work, s: " + "; ".join(f"{k['op']} x{k['ops']} {k['timed_s']:.4f} / {k['work_s']:.4f}"
                                                   for k in e["kinds"]))
    pooled = []
    for model in args.models.split(",") if args.pools else ():
        out = run_pools(model, args.steps, args.routing)
        pooled.append(out)
        print(f"\n{model}, separate pools ({out['pools']}): each stage at the rates of the rank that runs it")
        print(f"  {'stage':8s} {'measured s':>11s} {'predicted s':>12s} {'ratio':>6s}")
        for name, r in out["stages"].items():
            print(f"  {name:8s} {r['measured_s']:11.4f} {r['predicted_s']:12.4f} {r['ratio']:6.2f}")
        st = out["step"]
        print(f"  step: measured {st['measured_s']:.4f} s, the slower pool's predicted work "
              f"{st['slower_pool_predicted_s']:.4f} s ({st['ratio']:.2f})", flush=True)
    print(json.dumps({"bench": "cost_model", "cases": cases, "pools": pooled}))


if __name__ == "__main__":
    main()
