"""The whole-step cost model against this machine (issue 44): each stage's time predicted from the dry run's trace
(``dryrun.step`` on meta tensors: per op its FLOPs, bytes and fresh bytes) at the rates micro-benchmarks measure
here (``dryrun.cost.measure``), beside the same step run for real (``dryrun.real``: CPU tensors, random weights).

Definitions: measured = the median over steps 2.. of the step's stage clocks (``runtime.step``'s laps: the
rollout is the transition, generation and swap back; scoring; the reference log-probs with the dock's get; the
update); predicted = the sum over the stage's ops of ``Rates.seconds``; ratio = predicted / measured. Every
response runs to ``response_len`` in both (an EOS id no one samples). The real step's own trace priced at the same
rates is printed too: it separates the rate model's error from the dry trace's (the meta tensors run an
accelerator's kernel choices, not this CPU's).

    python bench/cost_model.py                      # qwen3-moe-tiny and qwen3-moe-0.5b, one process
    python bench/cost_model.py --models qwen3-moe-tiny --steps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

STAGES = {"rollout": ("transition", "generate", "swap back"), "score": ("score", "advantage"),
          "logprob": ("ref_logprob", "old_logprob"), "update": ("update",)}
LAPS = {"rollout": "rollout_time_s", "score": "score_time_s", "logprob": "logprob_time_s", "update": "update_time_s"}


def run(model: str, steps: int, rates) -> dict:
    from rlflow import dryrun
    from rlflow.dryrun import cost

    case = dryrun.StepCase(model, 1, "dp=1", "dp=1", prompts=4, group_size=4, prompt_len=16, response_len=32,
                           response_tokens=32, eos=10 ** 9, kernels="cpu")
    t0 = time.perf_counter()
    dry = cost.predict(dryrun.step(case, 0).stage_ops, rates)
    dry_s = time.perf_counter() - t0
    own = dryrun.RankTrace(0)
    _, outs = dryrun.real(case, 0, None, steps=steps, watch=dryrun.Watch(own, device="cpu"))
    real_trace = cost.predict(own.stage_ops, rates)
    rows = {}
    for name, parts in STAGES.items():
        measured = statistics.median(o.figures.times[LAPS[name]] for o in outs[1:])
        pred = sum(dry[p].seconds for p in parts if p in dry)
        pred_real = sum(real_trace[p].seconds for p in parts if p in real_trace)
        rows[name] = dict(measured_s=measured, predicted_s=pred, ratio=pred / measured,
                          real_trace_ratio=pred_real / measured,
                          ops=sum(dry[p].ops for p in parts if p in dry),
                          real_ops=sum(real_trace[p].ops for p in parts if p in real_trace),
                          gflops=sum(dry[p].flops for p in parts if p in dry) / 1e9)
    return dict(model=model, world=1, dry_seconds=dry_s, stages=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-moe-tiny,qwen3-moe-0.5b")
    ap.add_argument("--steps", type=int, default=4, help="real steps per model; the first (warm-up) is not timed")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: the first step warms up; at least 2")
    from rlflow.dryrun import cost

    t0 = time.perf_counter()
    rates = cost.measure()
    print(f"rates measured in {time.perf_counter() - t0:.1f} s: an op of rlflow's code issues in "
          f"{rates.op_s * 1e6:.2f} us; a 1024-side bf16 matmul from cold caches at "
          f"{rates.matmul['mm:bfloat16'][-1][1] / 1e9:.0f} GFLOP/s; a 256 MiB copy at "
          f"{rates.memory[-1][1] / 1e9:.0f} GB/s")
    cases = []
    for model in args.models.split(","):
        out = run(model, args.steps, rates)
        cases.append(out)
        print(f"\n{model}, one process (dry trace priced in {out['dry_seconds']:.0f} s):")
        print(f"  {'stage':8s} {'measured s':>11s} {'predicted s':>12s} {'ratio':>6s} {'real trace':>11s} "
              f"{'ops dry/real':>14s} {'GFLOP':>8s}")
        for name, r in out["stages"].items():
            print(f"  {name:8s} {r['measured_s']:11.4f} {r['predicted_s']:12.4f} {r['ratio']:6.2f} "
                  f"{r['real_trace_ratio']:11.2f} {r['ops']:>7d}/{r['real_ops']:<6d} {r['gflops']:8.2f}")
    print(json.dumps({"rates": rates.name, "op_s": rates.op_s, "cases": cases}))


if __name__ == "__main__":
    main()
