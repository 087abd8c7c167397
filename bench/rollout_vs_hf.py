"""Rollout throughput: rlflow's built-in engine vs transformers' `generate`, same model, same prompts, same run.

Both sample (temperature 1, no top-k/top-p) a fixed number of new tokens per prompt (EOS never ends a row),
from the same weights: rlflow's random init saved as a transformers checkpoint and loaded by
`AutoModelForCausalLM.from_pretrained`. Figure: decode tokens/s = rows x new tokens / wall time of the
whole call (prefill included), median over timed repeats. Last line: one JSON object.

    python bench/rollout_vs_hf.py                      # CPU: batch 64, tiny Qwen3-MoE
    python bench/rollout_vs_hf.py --device cuda --batch 256 --preset qwen3-moe-0.5b
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from rlflow.data import PromptSource, prompt_batch
from rlflow.models import decoder, hf
from rlflow.models.config import get_config
from rlflow.rollout import SamplingConfig, generate
from rlflow.tokenizer import CharTokenizer

DEFINITION = "tokens/s = rows x new tokens / wall time of one generate call (prefill included); median of repeats"
BOUND_DEFINITION = ("decode bound: per decode step, bytes read = all weights except the embedding table, experts "
                    "counted only as far as the step's tokens can reach them (E (1 - (1 - K/E)^rows) of E per layer, "
                    "uniform routing) + the KV cache at the mean length; bound tokens/s = rows / (bytes read / copy "
                    "bandwidth), copy bandwidth = bytes of a large device-to-device tensor copy / its time")


def copy_bandwidth(dev, nbytes=256 * 2**20, repeats=5) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(dev)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def decode_bytes_per_step(params, cfg, rows: int, mean_len: float) -> float:
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    reached = 1.0 - (1.0 - K / E) ** rows if E else 1.0  # expected share of a layer's experts the rows use
    w = sum(t.numel() * t.element_size() * (reached if ".experts." in k else 1.0)
            for k, t in params.items() if k != "model.embed_tokens.weight")
    if cfg.tie_word_embeddings:
        w += params["model.embed_tokens.weight"].numel() * params["model.embed_tokens.weight"].element_size()
    elt = params["model.embed_tokens.weight"].element_size()
    kv = 2 * cfg.num_hidden_layers * rows * cfg.num_key_value_heads * cfg.head_dim * mean_len * elt
    return w + kv


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def workload_args(doc: str, group_size: int, compile_help: str) -> argparse.ArgumentParser:
    """The rollout benchmarks' flags: the model, the rows, the tokens, the repeats, the device."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-moe-tiny")
    ap.add_argument("--batch", type=int, default=64, help="rows per generate call")
    ap.add_argument("--group-size", type=int, default=group_size, help="samples per prompt (rlflow shares the prefill)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help=compile_help)
    return ap


def main(argv=None):
    a = workload_args(__doc__, 1, "rlflow's decode step through torch.compile (static shapes; compile time "
                                  "excluded)").parse_args(argv)
    dev = torch.device(a.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    tok = CharTokenizer()
    cfg = get_config(a.preset).replace(eos_token_id=tok.eos_id)
    params = decoder.init_params(cfg, seed=a.seed, dtype=dtype, device=dev)
    P = a.batch // a.group_size
    prompts = prompt_batch(PromptSource(task="max_digit", seed=a.seed).take(P), tok).to(dev)

    from transformers import AutoModelForCausalLM
    with tempfile.TemporaryDirectory() as d:
        hf.save(d, cfg, params)
        ref = AutoModelForCausalLM.from_pretrained(d, **hf.dtype_kwarg(dtype)).to(dev).eval()

    scfg = SamplingConfig(max_new_tokens=a.new_tokens, eos_id=-1, pad_id=tok.pad_id, temperature=1.0)

    def run_rlflow(seed):
        out = generate(params, cfg, prompts, scfg, group_size=a.group_size, seed=seed, compile_decode=a.compile)
        assert int(out.response_mask_BTr.sum()) == a.batch * a.new_tokens
        return out

    ids = prompts.prompt_ids_BTp.repeat_interleave(a.group_size, 0)
    mask = prompts.prompt_mask_BTp.repeat_interleave(a.group_size, 0).long()

    @torch.no_grad()
    def run_hf(seed):
        torch.manual_seed(seed)
        out = ref.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, pad_token_id=tok.pad_id,
                           eos_token_id=None)
        assert out.shape == (a.batch, ids.shape[1] + a.new_tokens)
        return out

    times = {"rlflow": [], "transformers": []}
    first = {}
    for name, fn in (("rlflow", run_rlflow), ("transformers", run_hf)):
        t = time.perf_counter()
        warm = fn(0)  # warm-up (with --compile: rlflow's compilation)
        _sync(dev)
        first[name] = time.perf_counter() - t
        if name == "rlflow" and a.compile:  # the compiled step against the eager one, same seed
            eager = generate(params, cfg, prompts, scfg, group_size=a.group_size, seed=0)
            same = float((eager.response_ids_BTr == warm.response_ids_BTr).float().mean())
    for r in range(a.repeats):  # alternate to share the machine's noise
        for name, fn in (("rlflow", run_rlflow), ("transformers", run_hf)):
            _sync(dev)
            t = time.perf_counter()
            fn(r + 1)
            _sync(dev)
            times[name].append(time.perf_counter() - t)
    tps = {k: a.batch * a.new_tokens / statistics.median(v) for k, v in times.items()}
    bw = copy_bandwidth(dev)
    step_bytes = decode_bytes_per_step(params, cfg, a.batch, ids.shape[1] + a.new_tokens / 2)
    bound = a.batch / (step_bytes / bw)
    print(DEFINITION)
    print(BOUND_DEFINITION)
    print(f"rlflow decode step: {'torch.compile (static shapes)' if a.compile else 'eager'}")
    print(f"model {a.preset} ({sum(p.numel() for p in params.values()) / 1e6:.1f}M params) on {dev} {a.dtype}; "
          f"batch {a.batch} (group {a.group_size}), prompt {ids.shape[1]} tokens, {a.new_tokens} new tokens")
    for k in tps:
        print(f"  {k:13s} {tps[k]:12.0f} tokens/s   (median {statistics.median(times[k]):.3f} s)  "
              f"{tps[k] / bound:.1%} of the bandwidth bound")
    print(f"  first call (warm-up, not timed): rlflow {first['rlflow']:.1f} s, transformers {first['transformers']:.1f} s"
          + ("  (rlflow's includes compiling the decode step)" if a.compile else ""))
    if a.compile:
        print(f"  compiled decode step vs eager, same seed: {same:.2%} of the tokens equal")
    print(f"  bound         {bound:12.0f} tokens/s   ({step_bytes / 2**20:.1f} MiB per decode step, copy bandwidth "
          f"{bw / 1e9:.1f} GB/s)")
    res = {"rlflow_tokens_per_s": tps["rlflow"], "hf_tokens_per_s": tps["transformers"],
           "ratio": tps["rlflow"] / tps["transformers"], "bound_tokens_per_s": bound,
           "rlflow_fraction_of_bound": tps["rlflow"] / bound, "copy_bandwidth_GBps": bw / 1e9,
           "first_call_s": first, "compiled_equals_eager_tokens": same if a.compile else None, "batch": a.batch, "new_tokens": a.new_tokens,
           "preset": a.preset, "compile": a.compile, "device": str(dev), "dtype": a.dtype, "torch_threads": torch.get_num_threads()}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
