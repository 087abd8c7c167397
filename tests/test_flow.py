"""The GRPO loop trains identically whether its stages hand batches over in memory or through a
transfer dock (in-process here; the Ray dock has the same client)."""

import pytest
import torch

from rlflow import optim
from rlflow.algos.grpo import GRPOConfig
from rlflow.data import PromptSource
from rlflow.dock import Dock
from rlflow.models import qwen3_moe
from rlflow.models.config import get_config
from rlflow.rollout import SamplingConfig
from rlflow.runtime import loop
from rlflow.tokenizer import CharTokenizer


def _run(dock, **gkw):
    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(eos_token_id=tok.eos_id)
    params = qwen3_moe.init_params(cfg, seed=0)
    P, G = 4, 4
    gcfg = GRPOConfig(group_size=G, **gkw)
    mini = P * G if gcfg.epochs == 1 else P * G // 2
    lcfg = loop.LoopConfig(steps=3, prompts_per_step=P, grpo=gcfg, mini_batch_size=mini, micro_batch_size=mini // 2,
                           optim=optim.AdamWConfig(lr=3e-3),
                           sampling=SamplingConfig(max_new_tokens=4, eos_id=tok.eos_id, pad_id=tok.pad_id))
    d = None if dock is None else Dock.local(capacity=P * G, warehouses=dock, group_size=G)
    # a dense reward (response length) so that groups differ and every step has a gradient
    params, _, hist = loop.train(params, cfg, tok, PromptSource(task="sum_mod10", seed=1),
                                 lambda resp, ans: len(resp) / 4, lcfg, dock=d)
    return params, hist, d


@pytest.mark.parametrize("gkw", [dict(), dict(kl_coef=0.1, epochs=2, loss_agg="seq-mean-token-sum-norm")])
def test_dock_flow_trains_like_memory_flow(gkw):
    p_mem, h_mem, _ = _run(None, **gkw)
    p_dock, h_dock, d = _run(2, **gkw)
    keys = ["reward_mean", "loss", "grad_norm", "prompt_tokens", "response_tokens"] + (["kl"] if gkw else [])
    for a, b in zip(h_mem, h_dock):
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    assert all(m["grad_norm"] > 0 for m in h_mem)
    for k in p_mem:
        torch.testing.assert_close(p_dock[k], p_mem[k], rtol=1e-5, atol=1e-6)
    t = d.traffic()
    assert sum(v["bytes_in"] for k, v in t.items() if k.startswith("warehouse")) > 0  # rows went through it
