"""The full-size step without the hardware (issue 44): rlflow's code executed for the ranks of a full-size world on
meta tensors in torch's fake world (``rlflow/dryrun/``).

Per case:
- **the step** (``dryrun.step``: ``runtime.step.step`` itself, colocated GRPO: the transition, prefill and
  ``response_tokens`` decode steps of the built-in engine, the swap back, scoring, the dock, the reference
  log-probs, the update and its AdamW step) for one rank of each *shape class* (ranks whose shards have the same
  shapes in both layouts: the same pipeline stages; under balanced routing they run the same shapes): its peak
  of live device bytes per stage;
- **the transition** (``dryrun.transition``) for every rank (cheap): its live bytes after every plan step
  against the plan's ledger, and every group's members' collectives compared (``dryrun.mismatched``);
- ``--world-check``: the step for every rank too, its collectives compared over the world (minutes per rank);
- ``--device npu``: the step on a fake NPU's tensors running the NPU backend's entries (``dryrun.npu``: torch_npu's
  operators stood in for, shaped as its meta registrations shape them, one op each with its FLOPs:
  ``dryrun.npu_kernels``), where meta tensors run CUDA's kernels in shapes.

The largest peak against an H200 (141 GB) and an Ascend 910B (64 GB). Each case's step priced at their datasheets'
rates (``cost.DATASHEETS``, ``cost.whole_step``: predictions from stated inputs, not measurements; docs/dryrun.md),
with ``bench/pools_projection.py``'s roofline for the same step beside. Last line: one JSON object with ``cases``.

    python bench/dryrun.py                          # the three full-size cases
    python bench/dryrun.py --cases qwen3-30b --world-check
    python bench/dryrun.py --device npu             # the same cases as an Ascend NPU's program
"""

from __future__ import annotations

import argparse
import json
import time

import torch

H200, ASCEND_910B = 141e9, 64e9
# bench/pools_projection.py's colocated layouts (and a dense one), the update with activation checkpointing
# (--remat). The rows per step are fewer than the paper's (the dry run's time grows with the micro-batches a rank
# runs; a peak does not): prompts x group rows
CASES = {
    "qwen3-30b": dict(model="qwen3-moe-30b-a3b", world=16, train="ep=8,dp=2", rollout="tp=4,dp=4", prompts=16,
                      group_size=8, prompt_len=512, response_len=2048, remat=True),
    "qwen2.5-32b": dict(model="qwen2.5-32b", world=16, train="pp=2,tp=8", rollout="tp=4,dp=4", prompts=16,
                        group_size=2, prompt_len=512, response_len=2048, micro_batch=4, remat=True),
    "v3": dict(model="deepseek-r1-671b", world=384, train="pp=8,ep=16,dp=3", rollout="ep=32,tp=2,dp=6", prompts=384,
               group_size=2, prompt_len=1024, response_len=4096, micro_batch=96, remat=True),
    # a small world to check the bench itself (tests/test_bench_dryrun.py): qwen3-moe-tiny, pp=2 and ep=2 over 4
    "tiny": dict(model="qwen3-moe-tiny", world=4, train="pp=2,dp=2", rollout="ep=2,dp=2", prompts=4, group_size=2,
                 prompt_len=16, response_len=64, micro_batch=2, remat=True),
}
FULL = ("qwen3-30b", "qwen2.5-32b", "v3")


PAPER = {"deepseek-r1-671b": "200-250 TPS on 384 NPUs (MindSpeed RL, Figure 11: tokens per device per second)"}
PRICED = ("transition", "generate", "decode", "swap back", "score", "advantage", "ref_logprob", "update")


def priced(case, steps, sheet, op_s: float) -> dict:
    """The step at ``sheet``'s rates (``cost.whole_step``: the decode steps scaled to the whole response, the
    pipeline's stages by its bubble), each stage the slowest stepped rank's: its seconds between the queue's bounds
    (``StageCost``), the step's, and its tokens (prompt and response) per device per second; and the same with the
    decode steps at their device work alone (``graph``: a captured decode step's, as vLLM's CUDA / ACL graphs run
    it, the host's issue gone)."""
    from rlflow.dryrun import cost
    stages = cost.slowest(steps, sheet.rates(op_s), response_len=case.response_len, n_micro=case.micro_batches,
                          pp=case.layouts()[0].mesh.pp)
    stages = {s: stages[s] for s in PRICED if s in stages}
    lo, hi, graph = cost.bounds(stages)
    tokens = case.prompts * case.group_size * (case.prompt_len + case.response_len)
    tps = lambda t: round(tokens / (case.world * t), 1)  # noqa: E731
    return {"device": sheet.name, "roofline_s": roofline(case, sheet),
            "stages_s": {s: [_sig(max(c.issue_s, c.work_s)), _sig(c.seconds)] for s, c in stages.items()},
            "host_bound": [s for s, c in stages.items() if c.issue_s > c.work_s],
            "step_s": [_sig(lo), _sig(hi)], "tps": [tps(hi), tps(lo)],
            "graph": {"decode_s": _sig(stages["decode"].work_s), "step_s": _sig(graph), "tps": tps(graph)}}


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def roofline(case, sheet) -> dict:
    """``bench/pools_projection.py``'s roofline for the same colocated step at ``sheet``'s figures (its default
    shares of them): generation and training seconds (the update, the reference's forward and, with remat, the
    recomputed one), and the swap's."""
    import argparse as ap

    import pools_projection as pp

    from rlflow.models.config import get_config
    cfg = get_config(case.model)
    train, rollout = case.layouts()
    s = pp.Scenario(case.model, case.model, case.world, case.prompts, case.group_size, case.prompt_len,
                    case.response_len, (case.train, case.rollout), ())
    hw = ap.Namespace(hbm=sheet.hbm, peak=sheet.bf16_flops, mfu=0.35, decode_eff=0.6,
                      train_flops=6 + 2 * case.kl + 2 * case.remat)
    swap = (2 * pp.Shards.of(train).params * pp.TRAIN_STATE_BYTES / sheet.host
            + pp.allgather_swap(train, rollout).bytes_received().max() / sheet.link)
    return {"gen": _sig(pp.t_gen(cfg, rollout, s, hw)[0]), "train": _sig(pp.t_train(cfg, case.world, s, hw)),
            "swap": _sig(swap)}


def run_case(name: str, world_check: bool, op_s: float, device: str = "meta") -> dict:
    from rlflow import dryrun

    case = dryrun.StepCase(**CASES[name], device=device)
    t0 = time.perf_counter()
    train, rollout = case.layouts()
    moves = [dryrun.transition(train, rollout, r) for r in range(case.world)]
    classes = case.shape_classes()
    ranks = range(case.world) if world_check else classes
    steps = []
    for r in ranks:
        t = time.perf_counter()
        steps.append(dryrun.step(case, r))
        print(f"  rank {r}: the step in {time.perf_counter() - t:.0f} s, peak {steps[-1].peak_bytes / 1e9:.2f} GB",
              flush=True)
    peak = max(t.peak_bytes for t in steps + moves)
    stages = {s: max(t.stage_peaks.get(s, 0) for t in steps) for s in steps[0].stage_peaks}
    bad = dryrun.mismatched(moves) + (dryrun.mismatched(steps) if world_check else [])
    unknown = sorted({k for t in steps for k in t.unknown_reads})
    secs = time.perf_counter() - t0
    from rlflow.dryrun.cost import DATASHEETS
    predictions = [priced(case, steps, sheet, op_s) for sheet in DATASHEETS.values()]
    print(f"{case.model} on {case.world} ({device} tensors): train {train.mesh} -> rollout {rollout.mesh}; "
          f"{case.prompts} prompts x {case.group_size}, {case.prompt_len} + {case.response_len} tokens, remat "
          f"{case.remat}; the step for "
          f"{'every rank' if world_check else f'{len(classes)} shape classes'}, the transition for every rank: "
          f"largest peak {peak / 1e9:.2f} GB (per stage: "
          f"{', '.join(f'{s} {b / 1e9:.2f}' for s, b in stages.items())}); transition ledger "
          f"{max(t.ledger_peak_bytes for t in moves) / 1e9:.2f} GB, live bytes within "
          f"{max(t.ledger_gap() for t in moves):.1%} of it at every step; collectives "
          f"{'matched' if not bad else bad[:3]} ({'step and transition' if world_check else 'transition'}); host reads "
          f"of unknown values at {unknown}; fits H200 {peak <= H200}, 910B {peak <= ASCEND_910B}; {secs:.0f} s",
          flush=True)
    for p in predictions:
        print(f"  predicted on {p['device']} (s, between the queue's bounds): "
              + ", ".join(f"{s} {lo:g}-{hi:g}" for s, (lo, hi) in p["stages_s"].items())
              + f"; the step {p['step_s'][0]:g}-{p['step_s'][1]:g} s, {p['tps'][0]:g}-{p['tps'][1]:g} tokens per "
              f"device per second; host-bound (issue over work): {', '.join(p['host_bound']) or 'none'}"
              + (f"; the paper: {PAPER[case.model]}" if case.model in PAPER else ""), flush=True)
        g = p["graph"]
        print(f"    the decode steps at their device work alone (a captured graph's): {g['decode_s']:g} s, the step "
              f"{g['step_s']:g} s, {g['tps']:g} tokens per device per second", flush=True)
        print(f"    pools_projection's roofline for the same step: "
              + ", ".join(f"{k} {v:g} s" for k, v in p["roofline_s"].items()), flush=True)
    return {"model": case.model, "world": case.world, "device": device, "train": str(train.mesh),
            "rollout": str(rollout.mesh),
            "rows": case.prompts * case.group_size, "tokens": [case.prompt_len, case.response_len], "remat": case.remat,
            "rank_classes": len(classes), "ranks_stepped": len(steps), "stage_peaks": stages,
            "peak_bytes_max": peak, "ledger_bytes_max": max(t.ledger_peak_bytes for t in moves),
            "ledger_gap_max": max(t.ledger_gap() for t in moves), "fits_h200": peak <= H200,
            "fits_910b": peak <= ASCEND_910B, "collectives_matched": not bad,
            "collectives_checked": "step and transition" if world_check else "transition",
            "unknown_reads": unknown, "seconds": round(secs), "predicted": predictions}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(FULL), choices=sorted(CASES))
    ap.add_argument("--world-check", action="store_true", help="the step for every rank, its collectives compared")
    ap.add_argument("--device", choices=("meta", "npu"), default="meta",
                    help="the step's tensors: meta (CUDA's kernels in shapes) or a fake NPU's (the NPU backend's)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.device == "npu":  # before this process's first backward (``issue_seconds``'): autograd sizes its queues
        from rlflow.dryrun.npu import fake_device  # per device once
        fake_device()
    from rlflow.dryrun.calibrate import issue_seconds
    op_s = issue_seconds()
    print(f"the host issues an op of rlflow's code in {op_s * 1e6:.2f} us (measured here: the predictions' host)")
    from rlflow.dryrun.cost import DATASHEETS
    for d in DATASHEETS.values():
        print(f"{d.name} (published; shares assumed): {d.bf16_flops / 1e12:g} TFLOP/s bf16 ({d.fp32_flops / 1e12:g} "
              f"fp32) x {d.mfu} from {d.tile} rows, HBM {d.hbm / 1e12:g} TB/s x {d.hbm_eff}, links {d.link / 1e9:g} "
              f"GB/s + {d.link_s * 1e6:g} us, host {d.host / 1e9:g} GB/s, a kernel at least {d.kernel_s * 1e6:g} us, "
              f"{d.memory / 1e9:g} GB")
    out = {"op_s": op_s, "cases": [run_case(c, a.world_check, op_s, a.device) for c in a.cases]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
