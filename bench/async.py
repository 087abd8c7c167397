"""Separate device pools against the synchronous runs: the recipe's workload, one run, alternating.

Configurations (each the recipe, `recipes/grpo_qwen3_moe.py`, as a subprocess with the same workload):

    world1 (2 threads)     one process using both cores: the best synchronous configuration on this CPU
    world2 colocated       two processes, one thread each, taking turns at every stage (the default run)
    pools k=0, 1, 2        two processes, one thread each: rank 0 generates and scores (--rollout-ranks 1),
                           rank 1 trains, --max-staleness k
    pools k=1 rollout-is   the same at k=1 with the importance correction of the stale rows (--rollout-is token:
                           the trainer's log-probs over the sampling weights', truncated)
    pools k=1 partial      the same at k=1 with partial rollout (--partial-rollout: a version that lands while a
                           step generates is swapped in before the next decode step)

Rounds alternate the configurations (A B C D E, A B C D E, ...) with seed = the round's number, so noise
from a shared machine falls on all of them and the reward figures have a spread across seeds.

    samples/s          = prompts x group size x timed steps / the loop's wall time over them (``elapsed_s``:
                         the steps, their reduction and logging; pools: the train pool's clock)
    reward per sample  = the mean reward over all steps (every configuration trains on the same number of
                         samples per step, so this is the area under the reward curve per sample), and the
                         mean of the last 10 steps; median and spread over the rounds' seeds, and the
                         difference to world2 colocated on the same seed (paired: mean +- spread)
    busy (pools)       = rollout pool: (generation + scoring) / wall; train pool: 1 - its wait for rows / wall
    steps to +0.25     = the first step whose last 10 steps' mean reward is 0.25 above the first 10 steps'
                         (the issue's learning bar; every configuration's step has the same samples)
    bound (pools)      = the slower pool's own work per step, max(rollout + score, log-probs + update + push): the step
                         the overlap can reach at best; what it does not reach goes to waits and contention
    fresh (pools)      = the share of the timed steps' sampled tokens trained at staleness 0 (``stale_tokens/0``)

Ratios are samples/s against world2 colocated and against world1. The last line printed is one JSON object.
``--configs`` runs some of the pools' configurations (world1 and world2 colocated always run: the ratios').

    python bench/async.py
    python bench/async.py --configs "pools k=1,pools k=1 partial" --max-new-tokens 32
    python bench/async.py --rlflow-src /tmp/base   # the recipe and rlflow of another checkout
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
CONFIGS = {  # name -> (recipe flags, threads per process)
    "world1 (2 threads)": (["--world", "1"], 2),
    "world2 colocated": (["--world", "2"], 1),
    **{f"pools k={k}": (["--world", "2", "--rollout-ranks", "1", "--max-staleness", str(k)], 1) for k in (0, 1, 2)},
    "pools k=1 rollout-is": (["--world", "2", "--rollout-ranks", "1", "--max-staleness", "1", "--rollout-is", "token"],
                             1),
    "pools k=1 partial": (["--world", "2", "--rollout-ranks", "1", "--max-staleness", "1", "--partial-rollout"], 1),
}
BASES = ("world1 (2 threads)", "world2 colocated")


def run(src: str, flags: list[str], threads: int, seed: int, a, out: str) -> list[dict]:
    cmd = [sys.executable, os.path.join(src, "recipes", "grpo_qwen3_moe.py"), "--steps", str(a.steps),
           "--prompts-per-step", str(a.prompts_per_step), "--group-size", str(a.group_size),
           "--max-new-tokens", str(a.max_new_tokens), "--seed", str(seed), "--out", out, "--overwrite", *flags]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=src)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def steps_to_rise(rewards: list[float], rise: float) -> float:
    """The first step (1-based count) whose last 10 steps' mean exceeds the first 10 steps' by ``rise``; inf if none."""
    first = statistics.fmean(rewards[:10])
    for i in range(10, len(rewards) + 1):
        if statistics.fmean(rewards[i - 10:i]) >= first + rise:
            return float(i)
    return float("inf")


def figures(history: list[dict], a) -> dict[str, float]:
    timed = history[a.warmup:]
    wall = history[-1]["elapsed_s"] - history[a.warmup - 1]["elapsed_s"]
    per = lambda k: sum(m.get(k, 0.0) for m in timed) / len(timed)  # noqa: E731
    f = {"samples_per_s": a.prompts_per_step * a.group_size * len(timed) / wall, "step_s": wall / len(timed),
         "reward_mean": statistics.fmean(m["reward_mean"] for m in history),
         "reward_last10": statistics.fmean(m["reward_mean"] for m in history[-10:]),
         "steps_to_rise": steps_to_rise([m["reward_mean"] for m in history], 0.25)}
    if "staleness" in history[0]:
        rollout = per("rollout_time_s") + per("score_time_s")
        train = per("logprob_time_s") + per("update_time_s") + per("push_time_s")
        f.update(rollout_busy=rollout / f["step_s"], train_busy=1 - per("train_wait_s") / f["step_s"],
                 rollout_s=rollout, train_s=train, bound_s=max(rollout, train),
                 staleness=statistics.fmean(m["staleness"] for m in timed),
                 fresh=sum(m["stale_tokens/0"] for m in timed) / max(sum(m["response_tokens"] for m in timed), 1))
    return f


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=5, help="steps before the timed ones (at least 1)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (seed = the round's number)")
    p.add_argument("--prompts-per-step", type=int, default=16)  # the recipe's defaults
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=3)
    p.add_argument("--rlflow-src", default=ROOT)
    p.add_argument("--configs", default=",".join(n for n in CONFIGS if n not in BASES),
                   help="the pools' configurations to run, comma-separated")
    a = p.parse_args()
    chosen = [n.strip() for n in a.configs.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in CONFIGS or n in BASES]
    if unknown:
        raise SystemExit(f"--configs {a.configs}: {unknown} not among {[n for n in CONFIGS if n not in BASES]}")
    if a.warmup < 1:
        raise SystemExit(f"--warmup {a.warmup}: at least 1 (the timed steps start at a step's end)")
    if a.steps < a.warmup + 10:
        raise SystemExit(f"--steps {a.steps}: at least --warmup + 10 ({a.warmup + 10})")
    got: dict[str, list[dict]] = {k: [] for k in (*BASES, *chosen)}
    with tempfile.TemporaryDirectory() as d:
        for seed in range(a.repeat):
            for name in got:
                flags, threads = CONFIGS[name]
                got[name].append(figures(run(a.rlflow_src, flags, threads, seed, a, os.path.join(d, "run")), a))
    print(f"workload: qwen3-moe-tiny, {a.prompts_per_step} prompts x {a.group_size} samples, {a.max_new_tokens} new "
          f"tokens, {a.steps} steps ({a.steps - a.warmup} timed); {a.repeat} rounds, seeds 0..{a.repeat - 1}")
    print("samples/s = samples of the timed steps / the loop's wall time over them; reward = mean over all steps "
          "(per sample: every configuration trains on the same samples per step) and over the last 10, median +- "
          "spread over seeds, and paired with world2 colocated's on the same seed; bound = the slower pool's own "
          "work per step")
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    spread = lambda rows, k: statistics.pstdev(r[k] for r in rows) if len(rows) > 1 else 0.0  # noqa: E731
    base = got["world2 colocated"]
    colocated, world1 = med(base, "samples_per_s"), med(got["world1 (2 threads)"], "samples_per_s")
    report = {}
    for name, rows in got.items():
        row = {k: med(rows, k) for k in rows[0]}
        row["reward_mean_spread"] = spread(rows, "reward_mean")
        row["reward_last10_spread"] = spread(rows, "reward_last10")
        row["vs_colocated"], row["vs_world1"] = row["samples_per_s"] / colocated, row["samples_per_s"] / world1
        paired = [x["reward_mean"] - y["reward_mean"] for x, y in zip(rows, base)]
        row["reward_vs_sync"] = statistics.fmean(paired)
        row["reward_vs_sync_spread"] = statistics.pstdev(paired) if len(paired) > 1 else 0.0
        report[name] = row
        line = (f"{name:20s} {row['samples_per_s']:7.0f} samples/s  x{row['vs_colocated']:.2f} colocated  "
                f"x{row['vs_world1']:.2f} world1  step {row['step_s'] * 1e3:6.1f} ms  reward "
                f"{row['reward_mean']:.3f} +- {row['reward_mean_spread']:.3f} (last 10 {row['reward_last10']:.3f} "
                f"+- {row['reward_last10_spread']:.3f}; vs sync {row['reward_vs_sync']:+.3f} +- "
                f"{row['reward_vs_sync_spread']:.3f}); steps to +0.25 {row['steps_to_rise']:.0f}")
        if "bound_s" in row:
            line += (f"  busy rollout {row['rollout_busy']:.0%} train {row['train_busy']:.0%}; own work rollout "
                     f"{row['rollout_s'] * 1e3:.1f} ms, train {row['train_s'] * 1e3:.1f} ms -> bound "
                     f"{row['bound_s'] * 1e3:.1f} ms; staleness {row['staleness']:.2f}, fresh tokens "
                     f"{row['fresh']:.1%}")
        print(line)
    print(json.dumps({"bench": "async", **{k: {q: round(v, 4) for q, v in r.items()} for k, r in report.items()}}))


if __name__ == "__main__":
    main()
