"""Decode in a tensor-parallel layout: tp=2 over 2 local processes (gloo on a CPU, one thread each) against
one process with 2 threads, same weights, prompts and seed, in the same run.

Figure: decode tokens/s = rows x new tokens / wall time of one ``generate`` call (prefill included),
median of repeats; ratio = tp2 / one process. Where the tp2 time goes: the wall time inside the
collectives (the attention and MLP all-reduces, the logits' all-gather) against the rest (compute), on
rank 0. The tokens of both runs are compared (they must be equal). Last line: one JSON object.

    python bench/decode_tp.py                                  # qwen3-moe-0.5b, 16 rows, 16 new tokens
    python bench/decode_tp.py --preset qwen3-moe-tiny --batch 64 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rlflow.models import decoder
from rlflow.models.config import get_config
from rlflow.rollout import SamplingConfig, generate
from rlflow.runtime.launch import spawn

DEFINITION = ("tokens/s = rows x new tokens / wall time of one generate call (prefill included), median of "
              "repeats; ratio = tp2 (2 processes x 1 thread, gloo) / one process (2 threads)")


def _prompts(cfg, rows: int, plen: int):
    from rlflow.batch import PromptBatch
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (rows, plen), generator=g)
    idx = torch.arange(rows)
    return PromptBatch(prompt_ids_BTp=ids, prompt_mask_BTp=torch.ones_like(ids, dtype=torch.bool), index_B=idx,
                       group_B=idx)


def _run(params, cfg, a, ex=None):
    scfg = SamplingConfig(max_new_tokens=a.new_tokens, eos_id=-1, temperature=1.0)  # EOS never ends a row
    kw = {} if ex is None else {"ex": ex}
    prompts = _prompts(cfg, a.batch, a.prompt_len)
    out = generate(params, cfg, prompts, scfg, seed=1, **kw)  # warm-up
    times = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        out = generate(params, cfg, prompts, scfg, seed=1, **kw)
        times.append(time.perf_counter() - t)
    return statistics.median(times), out.response_ids_BTr


def _tp_worker(rank, world, a):
    import torch.distributed as dist

    from rlflow.models import sharding as msh
    from rlflow.parallel import collectives, context
    from rlflow.sharding.mesh import Mesh

    cfg = get_config(a.preset)
    layout = msh.layout(cfg, Mesh(tp=world), dtype=torch.float32)
    ex = context.context(layout, cfg)
    local = context.shard_params(decoder.init_params(cfg, seed=0), layout, rank)
    spent = [0.0]

    def timed(fn):
        def f(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[0] += time.perf_counter() - t
        return f
    dist.all_reduce = timed(dist.all_reduce)
    collectives._all_gather_single = timed(collectives._all_gather_single)
    _run(local, cfg, a, ex)  # warm-up run, not counted
    spent[0] = 0.0
    wall, ids = _run(local, cfg, a, ex)
    return {"wall": wall, "collective_s_per_call": spent[0] / (a.repeats + 1), "ids": ids}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-moe-0.5b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cfg = get_config(a.preset)
    torch.set_num_threads(2)
    wall1, ids1 = _run(decoder.init_params(cfg, seed=0), cfg, a)
    res = spawn(_tp_worker, 2, a, backend="gloo")
    wall2 = max(r["wall"] for r in res)
    toks = a.batch * a.new_tokens
    coll = res[0]["collective_s_per_call"]
    same = all(torch.equal(r["ids"], ids1) for r in res)
    print(DEFINITION)
    print(f"{a.preset}: {a.batch} rows x {a.new_tokens} new tokens (prompts of {a.prompt_len})")
    print(f"one process, 2 threads: {toks / wall1:9.1f} tokens/s ({wall1:.3f} s)")
    print(f"tp=2, 2 x 1 thread:     {toks / wall2:9.1f} tokens/s ({wall2:.3f} s); rank 0 in collectives "
          f"{coll:.3f} s ({100 * coll / wall2:.0f}%), the rest {wall2 - coll:.3f} s")
    print(f"ratio tp2 / one process = {wall1 / wall2:.2f}x; same tokens: {same}")
    print(json.dumps({"bench": "decode_tp", "preset": a.preset, "rows": a.batch, "new_tokens": a.new_tokens,
                      "tps_1proc": toks / wall1, "tps_tp2": toks / wall2, "ratio": wall1 / wall2,
                      "collective_share": coll / wall2, "same_tokens": same, "definition": DEFINITION}))


if __name__ == "__main__":
    main()
