"""Separate pools against the colocated run, projected on paper for 16 and 384 devices.

No accelerator has run rlflow yet, so every time below comes from a model whose inputs are printed with it
(hardware rates, efficiencies, the workload), not from a measurement. What is computed, not assumed: each
rank's shards in rlflow's own layouts (``models.sharding.layout``), the bytes of rlflow's plans for them
(``plan.allgather_swap`` for the colocated transition, ``plan.push_plan`` for the pools' push) and of the
dock's cost model (``dock.cost.streaming`` for the pools).

The model, per step of R rows (prompt Lp, response Lr tokens, G samples per prompt), per device:

    decode step  = max(bytes read / (HBM x decode_eff), 2 x active params x rows / (replica x peak x 0.5)):
                   bytes read = the device's dense shards (replicated over ep, split by tp) + its experts that
                   the replica's rows touch (each expert E x (1 - (1 - k/E)^rows)) + its rows' KV cache at the
                   mean length; decode is bound by memory bandwidth until the rows are many
    T_gen        = prefill (2 x active x prompts x Lp per replica / (replica x peak x mfu): each prompt once)
                   + Lr decode steps; no long tail (every row runs to Lr: the tail's idle time, which the pools
                   do not remove within a step, is left out)
    T_train      = train_flops x active x R x (Lp + Lr) / (devices x peak x mfu); 6 (the update's forward and
                   backward: rlflow's defaults take no old or reference log-probs); + 2 per extra forward
    colocated    = T_gen(D) + T_train(D) + T_swap, T_swap = the train state (14 bytes a parameter: bf16 weights,
                   float32 master, two AdamW moments) to host and back + the allgather-swap's received bytes /
                   the intra link
    pools (k>=1) = max(T_gen(K), T_train(D - K) + exposed push) at a split K; the push (the busiest train rank's
                   sent bytes / inter link) overlaps the next update, exposed only beyond it
    memory       = a split runs only if every device fits in --usable-GB: a rollout device holds two copies of its
                   shards (the engine's and the one the next version lands in) and its rows' KV cache; a train
                   device its train state and one push in flight (its shards in bf16); colocated, a device holds
                   the train state during the update and, the state swapped out, the rollout shards and the KV
                   cache during generation. Activations are not counted

So the pools gain where decode is bound by memory bandwidth: K devices with D/K times the rows each take
nearly the time D devices do, while the train pool has the other devices. With linear stages they would
gain nothing but the swap (docs/runtime.md). The peers' published speed-ups (beside) also remove the
long tail (partial rollout across steps, streaming), which this model leaves out.

Beside it, the same colocated step and splits priced from dry traces (``dry_priced``: rlflow's step executed on
meta tensors for one rank of each shape class, every op priced at the H200's and the 910B's datasheet rates,
``rlflow.dryrun.cost``): the ops rlflow issues, not a formula's, with the memory each rank peaks at.

    python bench/pools_projection.py                # the roofline for both scenarios, Qwen3-30B-A3B's from dry traces
    python bench/pools_projection.py --dry          # the roofline alone (seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass

from rlflow.dock.cost import Shape, streaming
from rlflow.dryrun.cost import DATASHEETS
from rlflow.models.config import get_config
from rlflow.models.sharding import layout
from rlflow.models.shapes import param_shapes
from rlflow.runtime.config import share_problems
from rlflow.runtime.graph import GRPO, ROWS, VERSIONS
from rlflow.runtime.step import dock_columns
from rlflow.sharding.mesh import Mesh
from rlflow.sharding.plan import allgather_swap, push_plan

BF16 = 2
TRAIN_STATE_BYTES = 14  # per parameter: bf16 weights, float32 master, two float32 AdamW moments
PUT = (*ROWS, "rewards", "advantages", VERSIONS)  # what the rollout pool puts (runtime/flow.py DockFlow.put_rows)
TAKEN = (*ROWS, *dock_columns(GRPO, "off", pools=True))  # what the train pool takes
# as the issue quotes them: the peers' published async-over-sync speed-ups
PEERS = ("verl fully-async 2.35-2.67x (Qwen2.5-Math-7B, 128 GPUs); AReaL 2.77x; ROLL 2.24x (RLVR), 2.72x (agentic); "
         "NeMo-RL DeepSeek-V3 111 -> 64 s per step (1.73x, one step off-policy)")


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    devices: int
    prompts: int
    group: int
    prompt_len: int
    response_len: int
    colocated: tuple[str, str]  # (train, rollout) layouts over all devices
    splits: tuple[tuple[int, str, str], ...]  # (rollout devices K, train layout on D - K, rollout layout on K)


SCENARIOS = (
    # 96 prompts: every split's pools share them evenly (rlflow refuses 128 over 12 ranks: runtime.config's
    # share_problems)
    Scenario("16 devices: Qwen3-30B-A3B", "qwen3-moe-30b-a3b", 16, 96, 8, 512, 2048, ("ep=8,dp=2", "tp=4,dp=4"),
             ((4, "ep=4,dp=3", "tp=4"), (8, "ep=8", "tp=4,dp=2"), (12, "ep=4", "tp=4,dp=3"))),
    Scenario("384 devices: DeepSeek-R1-671B", "deepseek-r1-671b", 384, 512, 16, 1024, 4096,
             ("pp=8,ep=16,dp=3", "ep=32,tp=2,dp=6"), ((128, "pp=8,ep=16,dp=2", "ep=32,tp=2,dp=2"),
                                                      (256, "pp=8,ep=16", "ep=32,tp=2,dp=4"),
                                                      (128, "pp=8,ep=16,dp=2", "ep=16,dp=8"))),
)


def _active(cfg) -> int:
    """Parameters one token runs through (no embedding lookup): dense + top-k experts of every MoE layer."""
    shapes = param_shapes(cfg)
    dense = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." not in n and n != "model.embed_tokens.weight")
    experts = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n)
    return dense + (experts // cfg.num_experts * cfg.num_experts_per_tok if cfg.num_experts else 0)


def _kv_bytes_per_token(cfg) -> float:
    if cfg.kv_lora_rank:  # MLA caches the latent and the rotary key
        return cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * BF16
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * BF16


@dataclass(frozen=True)
class Shards:
    """One rank's shards in a layout (the busiest pipeline stage's): parameters, and bytes in bf16 of the dense
    (non-expert, no embedding) and expert ones."""
    params: int
    dense_bytes: float
    expert_bytes: float

    @classmethod
    def of(cls, lay) -> "Shards":
        best = None
        for st in range(lay.mesh.pp):
            mine = [q for q in lay.params if q.stage == st]
            n = sum(math.prod(q.local_shape(lay.mesh)) for q in mine)
            dense = sum(math.prod(q.local_shape(lay.mesh)) for q in mine
                        if ".mlp.experts." not in q.name and q.name != "model.embed_tokens.weight") * BF16
            experts = sum(math.prod(q.local_shape(lay.mesh)) for q in mine if ".mlp.experts." in q.name) * BF16
            if best is None or n > best.params:
                best = cls(n, dense, experts)
        return best


def t_gen(cfg, rollout, s: Scenario, hw) -> tuple[float, float]:
    """(generation seconds, a rollout device's KV bytes) of the step's rows on the rollout layout."""
    mesh, sh = rollout.mesh, Shards.of(rollout)
    replica = mesh.size // mesh.dp
    rows = s.prompts * s.group / mesh.dp  # per replica
    touched = 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** rows if cfg.num_experts else 0.0
    kv = rows / replica * (s.prompt_len + s.response_len / 2) * _kv_bytes_per_token(cfg)
    read = sh.dense_bytes + touched * sh.expert_bytes + kv
    active = _active(cfg)
    step = max(read / (hw.hbm * hw.decode_eff), 2 * active * rows / (replica * hw.peak * 0.5))
    prefill = 2 * active * (rows / s.group) * s.prompt_len / (replica * hw.peak * hw.mfu)
    kv_full = rows / replica * (s.prompt_len + s.response_len) * _kv_bytes_per_token(cfg)
    return prefill + s.response_len * step, kv_full


def t_train(cfg, devices: int, s: Scenario, hw) -> float:
    return hw.train_flops * _active(cfg) * s.prompts * s.group * (s.prompt_len + s.response_len) / (
        devices * hw.peak * hw.mfu)


ROLLOUT_STAGES = ("generate", "decode", "score", "advantage")  # a split's rollout pool's (the push lands meanwhile)
TRAIN_STAGES = ("ref_logprob", "old_logprob", "update")
COLOCATED_STAGES = ("transition", *ROLLOUT_STAGES[:2], "swap back", *ROLLOUT_STAGES[2:], *TRAIN_STAGES)


def dry_priced(s: Scenario, micro: int, inter: float) -> dict:
    """The colocated step and each split's pools priced from dry traces at the datasheets' rates (``rlflow.dryrun``:
    rlflow's step executed for one rank of each shape class on meta tensors, priced by ``cost.slowest``): the
    colocated step's every stage; a split's rollout pool, the generation and scoring of the step's rows on its K
    devices (a dry step whose two layouts are the pool's rollout layout); its train pool, the reference log-probs
    and the update on the other D - K (both layouts the pool's train layout); the push at ``inter`` bytes/s. A split's
    step is max(gen, train + the push beyond them), as the roofline's. Each time a pair of the queue's bounds (the
    host always ahead; every op waited for) and a third, the first with the decode steps at their device work alone
    (a captured graph's). Memory: a train device's dry peak plus one push in flight (its shards in bf16); a rollout
    device's, its generation's less the train state its dry step holds, plus its shards twice (the engine's, and
    the spare copy the next version lands in). ``micro``: samples a data-parallel rank's micro-batch holds."""
    from rlflow import dryrun
    from rlflow.dryrun import cost
    from rlflow.dryrun.calibrate import issue_seconds

    op_s = issue_seconds()
    cfg = get_config(s.model)

    def stepped(world: int, train: str, rollout: str, trains: bool = True):
        # a rollout pool's dry step trains too (``runtime.step``'s schedule), unpriced: in one micro-batch, its fastest
        case = dryrun.StepCase(s.model, world, train, rollout, prompts=s.prompts, group_size=s.group,
                               prompt_len=s.prompt_len, response_len=s.response_len, remat=True,
                               micro_batch=micro * Mesh.parse(train, world).data_parallel_size if trains else
                               s.prompts * s.group)
        why = share_problems(case.loop_config(), world, Mesh.parse(train, world))
        if why:
            raise ValueError(f"{s.name}: {world} devices ({train} / {rollout}): rlflow refuses it: "
                             + "; ".join(f"{f} {getattr(case.loop_config(), f)} {w}" for f, w in why))
        t0 = time.perf_counter()
        traces = [dryrun.step(case, r) for r in case.shape_classes()]
        print(f"    dry step on {world} ({train} / {rollout}): {len(traces)} shape class(es) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        return case, traces

    def priced(case, traces, rates, stages) -> tuple[float, float, float]:
        got = cost.slowest(traces, rates, response_len=case.response_len, n_micro=case.micro_batches,
                           pp=case.layouts()[0].mesh.pp)
        return cost.bounds({k: got[k] for k in stages if k in got})

    def peak(traces, stages) -> float:
        return max(t.stage_peaks.get(k, 0) for t in traces for k in stages)

    colocated = stepped(s.devices, *s.colocated)
    splits = []
    for K, tl, rl in s.splits:
        trk, rok = layout(cfg, Mesh.parse(tl, s.devices - K)), layout(cfg, Mesh.parse(rl, K))
        splits.append((K, tl, rl, stepped(K, rl, rl, trains=False), stepped(s.devices - K, tl, tl),
                       push_plan(trk, rok).bytes_sent().max() / inter,
                       Shards.of(rok).params * BF16, Shards.of(trk).params * BF16))
    out = {}
    for key, sheet in DATASHEETS.items():
        rates = sheet.rates(op_s)
        col = priced(*colocated, rates, COLOCATED_STAGES)
        col_mem = peak(colocated[1], COLOCATED_STAGES)
        rows = {"colocated_s": [round(x, 3) for x in col], "colocated_peak_bytes": int(col_mem)}
        print(f"  {sheet.name}: colocated {col[0]:.1f}-{col[1]:.1f} s ({col[2]:.1f} with decode as a graph); peak "
              f"{col_mem / 1e9:.0f} GB{'' if col_mem <= sheet.memory else ' (DOES NOT FIT)'}")
        for K, tl, rl, ro, tr, push_s, spare, in_flight in splits:
            g, t = priced(*ro, rates, ROLLOUT_STAGES), priced(*tr, rates, TRAIN_STAGES)
            step = [max(a, b + max(0.0, push_s - max(a, b))) for a, b in zip(g, t)]
            # a rollout device's: generation's less the train state its dry step holds (identical layouts: no
            # transition swaps it out), plus its shards twice (the engine's; the spare a next version lands in)
            held = max(t.stage_peaks[k] - t.stage_peaks["state"] for t in ro[1] for k in ROLLOUT_STAGES[:2])
            mem_r = held + 2 * spare
            mem_t = peak(tr[1], TRAIN_STAGES) + in_flight
            fits = max(mem_r, mem_t) <= sheet.memory
            print(f"    pools K={K:3d} (rollout {rl}, train {tl}): gen {g[0]:.1f}-{g[1]:.1f} s ({g[2]:.1f}), train "
                  f"{t[0]:.1f}-{t[1]:.1f} s, push {push_s:.1f} s -> {step[0]:.1f}-{step[1]:.1f} s ({step[2]:.1f}): "
                  f"{col[0] / step[0]:.2f}-{col[1] / step[1]:.2f}x colocated ({col[2] / step[2]:.2f}x); memory "
                  f"rollout {mem_r / 1e9:.0f} GB, train {mem_t / 1e9:.0f} GB{'' if fits else ' (DOES NOT FIT)'}")
            rows[f"pools_K{K}_{rl}"] = {"gen_s": [round(x, 3) for x in g], "train_s": [round(x, 3) for x in t],
                                        "push_s": round(push_s, 3), "step_s": [round(x, 3) for x in step],
                                        "rollout_peak_bytes": int(mem_r), "train_peak_bytes": int(mem_t),
                                        "fits": fits}
        out[key] = rows
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h200 = DATASHEETS["h200"]
    p.add_argument("--hbm-TBps", type=float, default=h200.hbm / 1e12, help="HBM bandwidth per device (H200's)")
    p.add_argument("--peak-TFLOPs", type=float, default=h200.bf16_flops / 1e12,
                   help="dense bf16 rate per device (H200's)")
    p.add_argument("--usable-GB", type=float, default=round(h200.memory * 0.9 / 1e9),
                   help="device memory a rank may fill (H200's x 0.9)")
    p.add_argument("--mfu", type=float, default=0.35, help="training's and prefill's share of the peak")
    p.add_argument("--decode-eff", type=float, default=0.6, help="decode's share of the HBM bandwidth")
    p.add_argument("--train-flops", type=float, default=6.0,
                   help="FLOPs per active parameter and token of a step's training: 6 the update; +2 for each of "
                        "the old log-probs (several updates per batch) and the reference's (--kl-coef)")
    p.add_argument("--inter-GBps", type=float, default=25.0, help="per-rank link between nodes (the push, the dock)")
    p.add_argument("--intra-GBps", type=float, default=200.0, help="per-rank link within a node (the allgather)")
    p.add_argument("--host-GBps", type=float, default=h200.host / 1e9, help="device <-> host (the swap)")
    p.add_argument("--dry", nargs="*", default=[SCENARIOS[0].model], choices=[x.model for x in SCENARIOS],
                   help="scenarios priced from dry traces too (Qwen3-30B-A3B's: 6 minutes here; DeepSeek-R1's 8192 "
                        "rows on 384 devices far longer); none: the roofline alone")
    p.add_argument("--dry-micro", type=int, default=8, help="samples in a data-parallel rank's micro-batch (dry)")
    a = p.parse_args()
    if a.dry_micro < 1:
        p.error(f"--dry-micro {a.dry_micro}: samples per micro-batch, at least 1")
    hw = argparse.Namespace(hbm=a.hbm_TBps * 1e12, peak=a.peak_TFLOPs * 1e12, mfu=a.mfu, decode_eff=a.decode_eff,
                            train_flops=a.train_flops)
    usable = a.usable_GB * 1e9
    print(f"inputs: HBM {a.hbm_TBps} TB/s x {a.decode_eff} for decode, {a.peak_TFLOPs} TFLOP/s x {a.mfu} MFU, "
          f"{a.train_flops:g} FLOPs per active parameter and token of training, {a.usable_GB:g} GB usable per device; "
          f"links inter {a.inter_GBps} GB/s, intra {a.intra_GBps} GB/s, host {a.host_GBps} GB/s per rank. "
          "Projections, not measurements (no accelerator has run rlflow)")
    report = {}
    for s in SCENARIOS:
        cfg, D = get_config(s.model), s.devices
        shape = Shape(s.prompts, s.group, s.prompt_len, s.response_len)
        tr, ro = (layout(cfg, Mesh.parse(x, D)) for x in s.colocated)
        state = Shards.of(tr).params * TRAIN_STATE_BYTES
        swap = 2 * state / (a.host_GBps * 1e9) + allgather_swap(tr, ro).bytes_received().max() / (a.intra_GBps * 1e9)
        gen, kv = t_gen(cfg, ro, s, hw)
        train = t_train(cfg, D, s, hw)
        colocated = gen + train + swap
        peak = max(state, Shards.of(ro).params * BF16 + kv)
        print(f"\n{s.name}: {s.prompts} prompts x {s.group} samples, {s.prompt_len} + {s.response_len} tokens")
        print(f"  colocated train {s.colocated[0]}, rollout {s.colocated[1]}: gen {gen:.1f} s + train {train:.1f} s + "
              f"swap {swap:.1f} s = {colocated:.1f} s per step; memory {peak / 1e9:.0f} GB per device"
              + ("" if peak <= usable else " (does not fit)"))
        rows = {"colocated_s": round(colocated, 2), "gen_s": round(gen, 2), "train_s": round(train, 2),
                "swap_s": round(swap, 2), "colocated_fits": peak <= usable}
        for K, tl, rl in s.splits:
            trk, rok = layout(cfg, Mesh.parse(tl, D - K)), layout(cfg, Mesh.parse(rl, K))
            push = push_plan(trk, rok)
            g, kv = t_gen(cfg, rok, s, hw)
            t = t_train(cfg, D - K, s, hw)
            push_s = push.bytes_sent().max() / (a.inter_GBps * 1e9)
            step = max(g, t + max(0.0, push_s - max(g, t)))
            mem_r = 2 * Shards.of(rok).params * BF16 + kv
            mem_t = Shards.of(trk).params * (TRAIN_STATE_BYTES + BF16)
            fits = max(mem_r, mem_t) <= usable
            stream = streaming(shape, max(K // 8, 1), PUT, TAKEN, GRPO.schema, staleness=1,
                               readers=trk.mesh.tp * trk.mesh.pp)
            print(f"  pools K={K:3d} (rollout {rl}, train {tl}): gen {g:.1f} s, train {t:.1f} s, push "
                  f"{push.bytes_sent().max() / 2**30:.1f} GiB/train rank = {push_s:.1f} s (overlapped) -> "
                  f"{step:.1f} s per step: {colocated / step:.2f}x colocated; memory rollout {mem_r / 1e9:.0f} GB, "
                  f"train {mem_t / 1e9:.0f} GB per device{'' if fits else ' (DOES NOT FIT)'}; dock "
                  f"{stream['busiest'] / 2**30:.2f} GiB per step through its busiest process")
            rows[f"pools_K{K}_{rl}_s"] = round(step, 2)
            rows[f"pools_K{K}_{rl}_fits"] = fits
        if s.model in a.dry:
            print(f"  from dry traces (rlflow's step on meta tensors) at the datasheets' rates, push over "
                  f"{a.inter_GBps} GB/s; seconds between the queue's bounds (with decode as a graph):", flush=True)
            rows["dry"] = dry_priced(s, a.dry_micro, a.inter_GBps * 1e9)
        report[s.name] = rows
    print(f"\nbeside: {PEERS}")
    print(json.dumps({"bench": "pools_projection", **report}))


if __name__ == "__main__":
    main()
