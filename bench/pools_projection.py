"""Separate pools against the colocated run, projected on paper for 16 and 384 devices.

No accelerator has run rlflow yet, so every time below comes from a model whose inputs are printed with it
(hardware rates, efficiencies, the workload), not from a measurement. What is computed, not assumed: the
bytes of rlflow's own plans for the named layouts (``plan.allgather_swap`` for the colocated transition,
``plan.push_plan`` for the pools' push) and of the dock's cost model (``dock.cost``: the busiest dock
process per step, ``streaming`` for the pools).

The model, per step of R rows (prompt Lp, response Lr tokens), on d devices:

    decode step  = max(bytes read / (s x HBM x decode_eff), 2 x active params x rows / (s x peak x 0.5))
                   per replica of s devices (the rollout layout's size): bytes read = the dense weights
                   + the experts the replica's rows touch (E x (1 - (1 - k/E)^rows) per MoE layer) + the rows'
                   KV cache at the mean length; decode is bound by memory bandwidth until the rows are many
    T_gen(d)     = prefill (2 x active x rows x Lp / (s x peak x mfu)) + Lr decode steps; no long tail (every
                   row runs to Lr: the tail's idle time, which the pools do not remove within a step, is left out)
    T_train(d)   = (6 + 2 + 2) x active x R x (Lp + Lr) / (d x peak x mfu): the update and the old and
                   reference log-probs' forwards
    colocated    = T_gen(D) + T_train(D) + T_swap, T_swap = the swap of the train weights to host and back
                   (2 x a rank's train shards / host link) + the allgather-swap's received bytes / intra link
    pools (k>=1) = max(T_gen(K), T_train(D - K) + exposed push) at the best split K; the push (the busiest
                   train rank's sent bytes / inter link) overlaps the next update, exposed only beyond it

So the pools gain where decode is bound by memory bandwidth: K devices with D/K times the rows each take
nearly the time D devices do, while the train pool has the other devices. With linear stages they would
gain nothing but the swap (docs/runtime.md). The peers' published speed-ups (beside) also remove the
long tail (partial rollout across steps, streaming), which this model leaves out.

    python bench/pools_projection.py
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

from rlflow.dock.cost import Shape, project, streaming
from rlflow.models.config import get_config
from rlflow.models.sharding import layout
from rlflow.models.shapes import param_shapes
from rlflow.runtime.graph import GRPO, ROWS, VERSIONS
from rlflow.runtime.step import dock_columns
from rlflow.sharding.mesh import Mesh
from rlflow.sharding.plan import allgather_swap, push_plan

BF16 = 2
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
    Scenario("16 devices: Qwen3-30B-A3B", "qwen3-moe-30b-a3b", 16, 128, 8, 512, 2048, ("ep=8,dp=2", "tp=4,dp=4"),
             ((4, "ep=4,dp=3", "tp=4"), (8, "ep=8", "tp=4,dp=2"), (12, "ep=4", "tp=4,dp=3"))),
    Scenario("384 devices: DeepSeek-R1-671B", "deepseek-r1-671b", 384, 512, 16, 1024, 4096,
             ("pp=8,ep=16,dp=3", "ep=16,dp=24"), ((128, "pp=8,ep=16,dp=2", "ep=16,dp=8"),
                                                  (256, "pp=8,ep=16", "ep=16,dp=16"))),
)


def _model_bytes(cfg):
    """(dense bytes read per decode step, bytes of one expert of one layer, MoE layers, active params)."""
    shapes = param_shapes(cfg)
    dense = expert = 0
    moe_layers = set()
    for name, shape in shapes.items():
        n = math.prod(shape)
        if ".mlp.experts." in name:
            expert += n // cfg.num_experts
            moe_layers.add(name.split(".mlp.")[0])
        elif name != "model.embed_tokens.weight" or cfg.tie_word_embeddings:
            dense += n
    layers = len(moe_layers)
    per_layer = expert // max(layers, 1)
    active = dense + layers * per_layer * cfg.num_experts_per_tok
    return dense * BF16, per_layer * BF16, layers, active


def _kv_bytes_per_token(cfg) -> float:
    if cfg.kv_lora_rank:  # MLA caches the latent and the rotary key
        return cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * BF16
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * BF16


def t_gen(cfg, rows: int, devices: int, replica: int, s: Scenario, hw) -> float:
    dense, expert, layers, active = _model_bytes(cfg)
    per = rows / (devices // replica)  # rows per replica
    touched = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** per) if layers else 0
    kv = per * (s.prompt_len + s.response_len / 2) * _kv_bytes_per_token(cfg)
    read = dense + layers * touched * expert + kv
    step = max(read / (replica * hw.hbm * hw.decode_eff), 2 * active * per / (replica * hw.peak * 0.5))
    prefill = 2 * active * per * s.prompt_len / (replica * hw.peak * hw.mfu)
    return prefill + s.response_len * step


def t_train(cfg, rows: int, devices: int, s: Scenario, hw) -> float:
    active = _model_bytes(cfg)[3]
    return 10 * active * rows * (s.prompt_len + s.response_len) / (devices * hw.peak * hw.mfu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hbm-TBps", type=float, default=4.8, help="HBM bandwidth per device (H200: 4.8)")
    p.add_argument("--peak-TFLOPs", type=float, default=989.0, help="dense bf16 rate per device (H200: 989)")
    p.add_argument("--mfu", type=float, default=0.35, help="training's and prefill's share of the peak")
    p.add_argument("--decode-eff", type=float, default=0.6, help="decode's share of the HBM bandwidth")
    p.add_argument("--inter-GBps", type=float, default=25.0, help="per-rank link between nodes (the push)")
    p.add_argument("--intra-GBps", type=float, default=200.0, help="per-rank link within a node (the allgather)")
    p.add_argument("--host-GBps", type=float, default=50.0, help="device <-> host (the swap)")
    a = p.parse_args()
    hw = argparse.Namespace(hbm=a.hbm_TBps * 1e12, peak=a.peak_TFLOPs * 1e12, mfu=a.mfu, decode_eff=a.decode_eff)
    print(f"inputs: HBM {a.hbm_TBps} TB/s x {a.decode_eff} for decode, {a.peak_TFLOPs} TFLOP/s x {a.mfu} MFU; links "
          f"inter {a.inter_GBps} GB/s, intra {a.intra_GBps} GB/s, host {a.host_GBps} GB/s per rank. Projections, "
          "not measurements (no accelerator has run rlflow)")
    report = {}
    for s in SCENARIOS:
        cfg, D, R = get_config(s.model), s.devices, s.prompts * s.group
        tr, ro = (layout(cfg, Mesh.parse(x, D)) for x in s.colocated)
        ags = allgather_swap(tr, ro)
        shard = max(sum(math.prod(q.local_shape(tr.mesh)) * q.dtype.itemsize for q in tr.params if q.stage == st)
                    for st in range(tr.mesh.pp))  # the busiest pipeline stage's rank
        swap = 2 * shard / (a.host_GBps * 1e9) + ags.bytes_received().max() / (a.intra_GBps * 1e9)
        gen, train = t_gen(cfg, R, D, ro.mesh.size // ro.mesh.dp, s, hw), t_train(cfg, R, D, s, hw)
        colocated = gen + train + swap
        shape = Shape(s.prompts, s.group, s.prompt_len, s.response_len)
        dock = project(shape, D, GRPO.flow, GRPO.schema)  # colocated: every stage through the dock
        stream = streaming(shape, D // 8, PUT, TAKEN, GRPO.schema, staleness=1)  # pools: one put, one take
        print(f"\n{s.name}: {s.prompts} prompts x {s.group} samples, {s.prompt_len} + {s.response_len} tokens; "
              f"dock's busiest process per step {dock['dock_busiest'] / 2**30:.2f} GiB colocated, "
              f"{stream['busiest'] / 2**30:.2f} GiB pools ({stream['busiest'] / (a.inter_GBps * 1e9):.2f} s at the "
              f"inter link, beside the stages), holding {stream['held_per_warehouse'] / 2**30:.2f} GiB per warehouse "
              "at k = 1 (one per node)")
        print(f"  colocated train {s.colocated[0]}, rollout {s.colocated[1]}: gen {gen:.1f} s + train {train:.1f} s + "
              f"swap {swap:.1f} s = {colocated:.1f} s per step")
        rows = {"colocated_s": round(colocated, 2), "gen_s": round(gen, 2), "train_s": round(train, 2),
                "swap_s": round(swap, 2)}
        for K, tl, rl in s.splits:
            trk, rok = layout(cfg, Mesh.parse(tl, D - K)), layout(cfg, Mesh.parse(rl, K))
            push = push_plan(trk, rok)
            g, t = t_gen(cfg, R, K, rok.mesh.size // rok.mesh.dp, s, hw), t_train(cfg, R, D - K, s, hw)
            push_s = push.bytes_sent().max() / (a.inter_GBps * 1e9)
            step = max(g, t + max(0.0, push_s - max(g, t)))
            print(f"  pools K={K:3d} (rollout {rl}, train {tl}): gen {g:.1f} s, train {t:.1f} s, push "
                  f"{push.bytes_sent().max() / 2**30:.1f} GiB/train rank = {push_s:.1f} s (overlapped) -> "
                  f"{step:.1f} s per step: {colocated / step:.2f}x colocated")
            rows[f"pools_K{K}_s"] = round(step, 2)
        report[s.name] = rows
    print(f"\nbeside: {PEERS}")
    print(json.dumps({"bench": "pools_projection", **report}))


if __name__ == "__main__":
    main()
