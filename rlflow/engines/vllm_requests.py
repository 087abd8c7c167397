"""vLLM's requests in rlflow's conventions (used by ``rlflow/engines/vllm.py``): prompts go in as token ids
(``TokensPrompt``), responses come back as ids right-padded over ``max_new_tokens`` columns with their mask and
the sampled tokens' log-probs, each request's noise seeded by its sample index so that its rows do not depend
on the rest of the batch. ``generate``: one batch through ``LLM.generate``; ``generate_partial``: vLLM's steps
driven here, the weights swapped between them (partial rollout); ``serve``: requests that join vLLM's scheduler
as they arrive (multi-turn rollouts).
"""

from __future__ import annotations

import torch

from rlflow.batch import PromptBatch, RolloutBatch, extend
from rlflow.rollout import SamplingConfig


def generate(llm, prompts: PromptBatch, scfg: SamplingConfig, *, group_size: int, seed: int) -> RolloutBatch:
    """``group_size`` responses per prompt from ``llm``, as a ``RolloutBatch`` in rlflow's conventions: rows of
    a prompt adjacent, response ids right-padded with ``pad_id`` over ``max_new_tokens`` columns, the mask on
    every generated token (EOS included), the sampled tokens' log-probs (0 on padding). Sampling: prompt p's
    request draws from vLLM's generator seeded by (``seed``, p's sample index), so its rows do not depend on
    the other prompts of the batch. Greedy: one request per prompt, its response repeated."""
    from vllm.inputs import TokensPrompt

    P, Tn, G = prompts.size, scfg.max_new_tokens, group_size
    ids, mask = prompts.prompt_ids_BTp.cpu(), prompts.prompt_mask_BTp.cpu()
    reqs = [TokensPrompt(prompt_token_ids=ids[p][mask[p]].tolist()) for p in range(P)]
    greedy = scfg.temperature == 0
    if greedy:
        params = _params(scfg, 1)
    else:
        index = prompts.index_B.cpu().tolist()
        params = [_params(scfg, G, seed, index[p]) for p in range(P)]
    outs = llm.generate(reqs, params, use_tqdm=False)
    out_ids = torch.full((P * G, Tn), scfg.pad_id, dtype=torch.long)
    out_mask = torch.zeros((P * G, Tn), dtype=torch.bool)
    out_lp = torch.zeros((P * G, Tn), dtype=torch.float32)
    for p, o in enumerate(outs):
        done = o.outputs * G if greedy else sorted(o.outputs, key=lambda c: c.index)
        for k, c in enumerate(done):
            r, n = p * G + k, len(c.token_ids)
            out_ids[r, :n] = torch.tensor(c.token_ids, dtype=torch.long)
            out_mask[r, :n] = True
            out_lp[r, :n] = torch.tensor(_logprobs(c))
    dev = prompts.prompt_ids_BTp.device
    return extend(prompts.repeat(G), RolloutBatch, response_ids_BTr=out_ids.to(dev),
                  response_mask_BTr=out_mask.to(dev), sample_logprobs_BTr=out_lp.to(dev))


def generate_partial(llm, prompts: PromptBatch, scfg: SamplingConfig, *, group_size: int, seed: int, version: int,
                     newer, load) -> RolloutBatch:
    """``generate`` with partial rollout: vLLM's steps driven here, ``newer()`` polled before each; when it gives
    (version, weights), the requests in flight are aborted, the weights loaded (``load``), and each is submitted
    again with its prompt and the tokens it has sampled so far as its context (prefilled under the new weights,
    as the built-in engine does) for the tokens it has left. Each token's log-prob is that of the weights that
    sampled it, and its version is recorded (``versions_BTr``). A sample is its own request (seeded by the
    sample's index and how many tokens it had when submitted)."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    P, Tn, G = prompts.size, scfg.max_new_tokens, group_size
    ids, mask = prompts.prompt_ids_BTp.cpu(), prompts.prompt_mask_BTp.cpu()
    context = [ids[p][mask[p]].tolist() for p in range(P)]
    index = prompts.index_B.cpu().tolist()
    toks, lps, vers = ([[] for _ in range(P * G)] for _ in range(3))
    engine, live, current = llm.llm_engine, {}, version

    def submit(r: int) -> None:
        p, n = r // G, len(toks[r])
        params = _params(scfg, 1, seed, (index[p] * G + r % G) * (Tn + 1) + n)
        params.max_tokens, params.output_kind = Tn - n, RequestOutputKind.CUMULATIVE
        rid = str(next(llm.request_counter))
        engine.add_request(rid, TokensPrompt(prompt_token_ids=context[p] + toks[r]), params)
        live[rid] = (r, 0)  # (row, the request's tokens recorded)

    for r in range(P * G):
        submit(r)
    while live:
        if (got := newer()) is not None:  # the rest of every row in flight under the newer weights
            engine.abort_request(list(live))
            rows = [r for r, _ in live.values()]
            live.clear()
            current = got[0]
            load(got[1])
            for r in rows:
                submit(r)
        for o in engine.step():
            if o.request_id not in live:
                continue
            r, seen = live[o.request_id]
            c = o.outputs[0]
            toks[r] += c.token_ids[seen:]
            lps[r] += _logprobs(c)[seen:]
            vers[r] += [current] * (len(c.token_ids) - seen)
            live[o.request_id] = (r, len(c.token_ids))
            if o.finished:
                del live[o.request_id]
    out_ids = torch.full((P * G, Tn), scfg.pad_id, dtype=torch.long)
    out_mask = torch.zeros((P * G, Tn), dtype=torch.bool)
    out_lp = torch.zeros((P * G, Tn), dtype=torch.float32)
    out_v = torch.full((P * G, Tn), version, dtype=torch.long)
    for r in range(P * G):
        n = len(toks[r])
        out_ids[r, :n], out_mask[r, :n] = torch.tensor(toks[r], dtype=torch.long), True
        out_lp[r, :n], out_v[r, :n] = torch.tensor(lps[r]), torch.tensor(vers[r], dtype=torch.long)
        out_v[r, n:] = vers[r][-1] if n else version
    dev = prompts.prompt_ids_BTp.device
    return extend(prompts.repeat(G), RolloutBatch, response_ids_BTr=out_ids.to(dev),
                  response_mask_BTr=out_mask.to(dev), sample_logprobs_BTr=out_lp.to(dev), versions_BTr=out_v.to(dev))


def _params(scfg: SamplingConfig, n: int, seed: int = 0, index: int = 0):
    """vLLM's sampling parameters of ``n`` samples of one request: greedy, or drawn from vLLM's generator
    seeded by (``seed``, the request's sample ``index``), so its tokens do not depend on the other requests."""
    from vllm import SamplingParams
    # eos_id < 0: no token ends a row (the built-in engine's convention)
    stop = dict(stop_token_ids=[scfg.eos_id]) if scfg.eos_id >= 0 else dict(ignore_eos=True)
    common = dict(max_tokens=scfg.max_new_tokens, logprobs=0, detokenize=False, skip_special_tokens=False, **stop)
    if scfg.temperature == 0:
        return SamplingParams(n=n, temperature=0.0, **common)
    return SamplingParams(n=n, temperature=scfg.temperature, top_k=scfg.top_k, top_p=scfg.top_p,
                          seed=(seed * 1_000_003 + index) % 2**63, **common)


def _logprobs(c) -> list[float]:
    """The sampled tokens' log-probs of one vLLM completion."""
    return [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


def serve(llm, scfg: SamplingConfig, requests, *, slots: int, seed: int) -> None:
    """Continuous batching over requests that arrive while vLLM decodes (``rollout.serve``'s contract): each
    ready request joins vLLM's own scheduler (``LLMEngine.add_request``) between its steps, up to ``slots`` at
    once, and each finished one is handed back; a request's noise is ``generate``'s for its sample index."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine, keys = llm.llm_engine, {}
    while True:
        reqs = requests.take(slots - len(keys), wait=not keys)
        if not reqs and not keys:
            return
        for key, ctx, index in reqs:
            params = _params(scfg, 1, seed, index)
            params.output_kind = RequestOutputKind.FINAL_ONLY
            rid = str(next(llm.request_counter))
            engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ctx)), params)
            keys[rid] = key
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                requests.done(keys.pop(o.request_id), list(c.token_ids), _logprobs(c))


__all__ = ["generate", "generate_partial", "serve"]
