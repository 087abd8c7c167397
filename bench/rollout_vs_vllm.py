"""Rollout throughput: rlflow's built-in engine vs vLLM (rlflow/engines/vllm.py), same weights, same prompts,
same run, alternating repeats; and the weight push into vLLM against a plain memory copy of the same bytes.

Both sample (temperature 1, no top-k/top-p) a fixed number of new tokens per row (EOS never ends a row) from
the same weights (rlflow's random init, pushed into vLLM in place as the RL step does). Figures: decode
tokens/s = rows x new tokens / wall time of one generate call (prefill included), median over the timed
repeats; push = wall time of ``VLLMEngine.load`` (the in-place copy into vLLM's parameters and, on a CPU MoE, the experts' repack),
bound = its bytes / the device's copy bandwidth. Last line: one JSON object.

    python bench/rollout_vs_vllm.py                                   # CPU: 64 rows x 64 tokens, tiny Qwen3-MoE
    python bench/rollout_vs_vllm.py --preset qwen3-moe-0.5b --batch 16 --new-tokens 32
    python bench/rollout_vs_vllm.py --compile                         # the built-in engine's compiled decode too
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from rlflow.data import PromptSource, prompt_batch
from rlflow.engines import BuiltinEngine
from rlflow.engines.vllm import VLLMEngine
from rlflow.models import decoder
from rlflow.models.config import get_config
from rlflow.rollout import SamplingConfig
from rlflow.tokenizer import CharTokenizer
from rollout_vs_hf import _sync, copy_bandwidth, workload_args

DEFINITION = "tokens/s = rows x new tokens / wall time of one generate call (prefill included); median of repeats"
PUSH_DEFINITION = ("push: wall time of one VLLMEngine.load of the whole weights (median of repeats); bound: "
                   "their bytes / copy bandwidth (a large tensor copy on the device)")


def main(argv=None):
    a = workload_args(__doc__, 8, "also the built-in engine's compiled decode step").parse_args(argv)
    dev = torch.device(a.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    tok = CharTokenizer()
    cfg = get_config(a.preset).replace(eos_token_id=tok.eos_id)
    params = decoder.init_params(cfg, seed=a.seed, dtype=dtype, device=dev)
    G = a.group_size
    prompts = prompt_batch(PromptSource(task="max_digit", seed=a.seed).take(a.batch // G), tok).to(dev)
    scfg = SamplingConfig(max_new_tokens=a.new_tokens, eos_id=-1, pad_id=tok.pad_id, temperature=1.0)

    engines = {"builtin": BuiltinEngine(cfg, scfg)}
    if a.compile:
        engines["builtin-compiled"] = BuiltinEngine(cfg, scfg, compile_decode=True)
    vllm = VLLMEngine(cfg, scfg, max_model_len=prompts.prompt_ids_BTp.shape[1] + a.new_tokens)
    engines["vllm"] = vllm
    first = {}
    for name, eng in engines.items():
        t = time.perf_counter()
        eng.load(params)
        out = eng.generate(prompts, group_size=G, seed=0)  # warm-up (start-up, compilation)
        first[name] = time.perf_counter() - t
        assert int(out.response_mask_BTr.sum()) == a.batch * a.new_tokens, name
    times = {k: [] for k in engines}
    pushes = []
    for r in range(a.repeats):  # alternate to share the machine's noise
        for name, eng in engines.items():
            if name == "vllm":
                _sync(dev)
                t = time.perf_counter()
                eng.load(params)
                _sync(dev)
                pushes.append(time.perf_counter() - t)
            _sync(dev)
            t = time.perf_counter()
            eng.generate(prompts, group_size=G, seed=r + 1)
            _sync(dev)
            times[name].append(time.perf_counter() - t)
    vllm.close()
    tps = {k: a.batch * a.new_tokens / statistics.median(v) for k, v in times.items()}
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    bw = copy_bandwidth(dev)
    push = statistics.median(pushes)
    print(DEFINITION)
    print(PUSH_DEFINITION)
    print(f"model {a.preset} ({sum(p.numel() for p in params.values()) / 1e6:.1f}M params) on {dev} {a.dtype}; "
          f"{a.batch} rows ({a.batch // G} prompts x {G}), prompt {prompts.prompt_ids_BTp.shape[1]} tokens, "
          f"{a.new_tokens} new tokens")
    for k in tps:
        print(f"  {k:17s} {tps[k]:10.0f} tokens/s   (median {statistics.median(times[k]):.3f} s; first call "
              f"{first[k]:.1f} s)   builtin / this: {tps['builtin'] / tps[k]:.2f}x")
    print(f"  weight push     {push * 1e3:10.1f} ms for {nbytes / 2**20:.1f} MiB   "
          f"bound (copy at {bw / 1e9:.1f} GB/s): "
          f"{nbytes / bw * 1e3:.1f} ms   push / bound: {push / (nbytes / bw):.1f}x")
    res = {"tokens_per_s": tps, "builtin_over_vllm": tps["builtin"] / tps["vllm"], "push_s": push,
           "push_bytes": nbytes, "push_bound_s": nbytes / bw, "copy_bandwidth_GBps": bw / 1e9, "first_call_s": first,
           "preset": a.preset, "batch": a.batch, "group_size": G, "new_tokens": a.new_tokens, "device": str(dev),
           "dtype": a.dtype, "torch_threads": torch.get_num_threads()}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
