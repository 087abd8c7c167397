"""Linearity of the distributed runtime: the recipe's workload at world 1 and world 2, side by side, one run.

Each configuration is the recipe (`recipes/grpo_qwen3_moe.py`) run as a subprocess with the same
workload (preset, task, prompts per step, group size, response length, seed) and one intra-op thread
per process (world 1: one process with one thread; world 2: two processes with one thread each), so
world 2 has twice the compute of world 1. The configurations alternate (A B C A B C ...) for
``--repeat`` rounds so that noise from a shared machine falls on all of them.

    throughput = (prompt tokens + response tokens of the step) / step wall time   (all ranks together)
    TPS (Eq. 5) = throughput / devices
    linearity  = throughput(world 2) / (2 x throughput(world 1)) = TPS(world 2) / TPS(world 1)

The linearity splits into two factors, from a fourth configuration, world 1 with half the batch (what
each rank of world 2 computes; its step is world 2's if the runtime cost nothing):

    workload bound     = step(world 1) / (2 x step(world 1, half batch))   how well the work itself halves
    runtime efficiency = step(world 1, half batch) / step(world 2)         what the runtime keeps of that
    linearity          = workload bound x runtime efficiency

Figures are medians over the steps after ``--warmup`` of every round. Per configuration the report
splits the step into rollout (generation and the weight transition out), transition (train -> rollout
layout, in the rollout time) and the rest (scoring, log-probs, update, the dock), so it says where
the missing linearity goes. The last line printed is one JSON object.

    python bench/scaling.py
    python bench/scaling.py --rlflow-src /tmp/base   # the recipe and rlflow of another checkout
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HALF = "world1 half batch"
CONFIGS = {  # name -> recipe flags (the half batch's prompts per step are set in run())
    "world1": ["--world", "1"],
    HALF: ["--world", "1"],
    "world2 train tp=2, rollout dp=2": ["--world", "2", "--train-layout", "tp=2", "--rollout-layout", "dp=2"],
    "world2 train dp=2, rollout dp=2": ["--world", "2", "--train-layout", "dp=2", "--rollout-layout", "dp=2"],
}


def run(src: str, flags: list[str], a, out: str, half: bool = False) -> list[dict]:
    cmd = [sys.executable, os.path.join(src, "recipes", "grpo_qwen3_moe.py"), "--steps", str(a.steps),
           "--prompts-per-step", str(a.prompts_per_step // (2 if half else 1)), "--group-size", str(a.group_size),
           "--max-new-tokens", str(a.max_new_tokens), "--seed", "0", "--out", out, "--overwrite", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=src)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--rlflow-src", default=ROOT)
    p.add_argument("--only", default="", help="run only the world-2 configurations whose name contains this")
    a = p.parse_args()
    if a.prompts_per_step % 4:
        raise SystemExit(f"--prompts-per-step {a.prompts_per_step}: must be a multiple of 4 (half of it on world 1, "
                         "split over 2 ranks on world 2)")
    configs = {k: v for k, v in CONFIGS.items() if k in ("world1", HALF) or a.only in k}
    steps: dict[str, list[dict]] = {k: [] for k in configs}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.repeat):
            for name, flags in configs.items():
                steps[name] += run(a.rlflow_src, flags, a, os.path.join(d, "run"), half=name == HALF)[a.warmup:]
    print(f"workload: qwen3-moe-tiny, {a.prompts_per_step} prompts x {a.group_size} samples, {a.max_new_tokens} new "
          f"tokens; {a.repeat} rounds x {a.steps - a.warmup} timed steps; one thread per process")
    print("throughput = tokens of the step / step wall time (all ranks); linearity = throughput(world 2) / "
          "(2 x throughput(world 1)) = workload bound x runtime efficiency; workload bound = step(world 1) / "
          "(2 x step(world 1, half batch)); runtime efficiency = step(world 1, half batch) / step(world 2)")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    report = {}
    for name, ms in steps.items():
        world = 1 if name in ("world1", HALF) else 2
        thr = med([(m["prompt_tokens"] + m["response_tokens"]) / m["step_time_s"] for m in ms])
        row = {"throughput": thr, "tps_per_device": thr / world, "step_s": med([m["step_time_s"] for m in ms]),
               "rollout_s": med([m["rollout_time_s"] for m in ms]),
               "transition_s": med([m.get("transition_out_s", 0.0) + m.get("transition_back_s", 0.0) for m in ms]),
               "rest_s": med([m["step_time_s"] - m["rollout_time_s"] for m in ms])}
        report[name] = row
    base = report["world1"]["throughput"]
    half_s = report[HALF]["step_s"]
    bound = report["world1"]["step_s"] / (2 * half_s)
    print(f"workload bound (the work itself, halved): {bound:.2f}")
    for name, row in report.items():
        world = 1 if name in ("world1", HALF) else 2
        extra = ""
        if world == 2:
            row["linearity"] = row["throughput"] / (world * base)
            row["runtime_efficiency"] = half_s / row["step_s"]
            extra = f"linearity {row['linearity']:.2f} = {bound:.2f} x runtime efficiency {row['runtime_efficiency']:.2f}  "
        print(f"{name:34s} throughput {row['throughput']:8.0f} tok/s  TPS/device {row['tps_per_device']:7.0f}  "
              f"{extra}step {row['step_s'] * 1e3:6.1f} ms = rollout "
              f"{row['rollout_s'] * 1e3:6.1f} (transition {row['transition_s'] * 1e3:5.1f}) + rest "
              f"{row['rest_s'] * 1e3:6.1f}")
    print(json.dumps({"bench": "scaling", "workload_bound": round(bound, 4),
                      **{k: {q: round(v, 4) for q, v in r.items()} for k, r in report.items()}}))


if __name__ == "__main__":
    main()
