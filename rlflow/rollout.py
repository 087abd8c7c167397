"""The built-in rollout engine: batched sampling with a preallocated KV cache, pure torch, any device.

Legend: P prompts, G samples per prompt, B = P*G rows, Tp prompt tokens, Tn new tokens, V vocab.
GRPO prefix sharing: each prompt is prefilled once and its KV cache is copied to its G samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlflow.batch import PromptBatch, RolloutBatch, extend
from rlflow.models import qwen3_moe as model
from rlflow.models.config import ModelConfig
from rlflow.ops import sample


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    max_new_tokens: int
    eos_id: int
    pad_id: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")


@torch.no_grad()
def generate(params: model.Params, cfg: ModelConfig, prompts: PromptBatch, scfg: SamplingConfig, *,
             group_size: int = 1, seed: int = 0) -> RolloutBatch:
    """Sample ``group_size`` responses per prompt. Rows of one prompt are adjacent and share its group id.

    A response ends at EOS (included in the mask) or after ``max_new_tokens``. Reproducible: the same
    params, prompts, config and seed give the same tokens on the same device.
    """
    dev = prompts.prompt_ids_BTp.device
    P, Tp = prompts.prompt_ids_BTp.shape
    G, Tn = group_size, scfg.max_new_tokens
    B = P * G
    dtype = params["model.embed_tokens.weight"].dtype
    gen = torch.Generator(device=dev).manual_seed(seed)
    params = model.fuse_for_inference(params, cfg)

    valid = prompts.prompt_mask_BTp
    cache = model.KVCache.allocate(cfg, P, Tp + Tn, dtype=dtype, device=dev)
    h, _, cache = model.forward(params, cfg, prompts.prompt_ids_BTp, model.positions_from_valid(valid),
                                valid_BT=valid, cache=cache, with_aux=False)
    next_logits = model.logits(params, cfg, h[:, -1]).repeat_interleave(G, 0)
    if G > 1:  # prefix sharing: one prefill per prompt, copied to its G samples
        cache = model.KVCache(k=[x.repeat_interleave(G, 0) for x in cache.k],
                              v=[x.repeat_interleave(G, 0) for x in cache.v],
                              valid_BS=cache.valid_BS.repeat_interleave(G, 0), length=cache.length)
    pos = valid.sum(-1).repeat_interleave(G, 0)  # next position per row

    out_ids = torch.full((B, Tn), scfg.pad_id, dtype=torch.long, device=dev)
    out_lp = torch.zeros((B, Tn), dtype=torch.float32, device=dev)
    out_mask = torch.zeros((B, Tn), dtype=torch.bool, device=dev)
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    for t in range(Tn):
        tok, lp = sample(next_logits, temperature=scfg.temperature, top_k=scfg.top_k, top_p=scfg.top_p,
                         generator=gen)
        alive = ~finished
        out_ids[:, t] = torch.where(alive, tok, scfg.pad_id)
        out_lp[:, t] = torch.where(alive, lp, 0.0)
        out_mask[:, t] = alive
        finished = finished | (tok == scfg.eos_id)
        if t == Tn - 1 or bool(finished.all()):
            break
        h, _, cache = model.forward(params, cfg, out_ids[:, t:t + 1], (pos + t)[:, None],
                                    valid_BT=out_mask[:, t:t + 1], cache=cache, with_aux=False)
        next_logits = model.logits(params, cfg, h[:, -1])
    return extend(prompts.repeat(G), RolloutBatch, response_ids_BTr=out_ids, response_mask_BTr=out_mask,
                  sample_logprobs_BTr=out_lp)
