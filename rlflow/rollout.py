"""The built-in rollout engine: batched sampling with a preallocated KV cache, pure torch, any device.

Legend: P prompts, G samples per prompt, B = P*G rows, Tp prompt tokens, Tn new tokens, V vocab.
GRPO prefix sharing: each prompt is prefilled once and its KV cache is copied to its G samples.

In a layout (``ex``, ``rlflow.parallel.context``): tensor parallel ranks compute their heads (the KV cache
holds the local ones) and share their rows, so they sample the same tokens; expert parallel ranks hold
different rows and every forward is an all-to-all among them, so they step in lockstep: each admission
and decode step is taken by all of them together (a rank with nothing to do takes part with no rows),
until none has work left. Data parallel ranks generate their own prompts independently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlflow.batch import PromptBatch, RolloutBatch, extend, pad
from rlflow.decoding import Responses, bucketed, compiled_step, decode_step, prefill, right_align, seat
from rlflow.models import decoder as model
from rlflow.models.config import ModelConfig
from rlflow.models.execution import LOCAL, Exec
from rlflow.ops import counter_keys, counter_noise


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
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"SamplingConfig.temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")


def generate(params: model.Params, cfg: ModelConfig, prompts: PromptBatch, scfg: SamplingConfig, *,
             group_size: int = 1, seed: int = 0, max_batch: int | None = None,
             compile_decode: bool = False, record_routes: bool = False, ex: Exec = LOCAL,
             version: int | None = None, newer=None) -> RolloutBatch:
    """Sample ``group_size`` responses per prompt. Rows of one prompt are adjacent and share its group id.

    A response ends at EOS (included in the mask) or after ``max_new_tokens``. At most ``max_batch``
    rows decode at once (default: all); when a row finishes, its slot is refilled with the next waiting
    row (continuous batching). Each admission prefills its prompts once and copies their KV to their
    samples (a prompt whose G rows are admitted in two refills is prefilled twice). Batch-invariant: a
    row's sampling noise is a function of (``seed``, its row id ``index_B * group_size + k``, token
    position) (``ops.counter_noise``), so the same params, prompts, config and seed give a row the same
    tokens whatever ``max_batch``, the other rows of the batch, or the rank it is generated on.

    ``compile_decode``: run the decode step compiled with static shapes (attention spans the whole
    cache, masked), for launch-bound small models; the first call per shape pays the compilation.

    ``record_routes``: an MoE model's expert choices for every prompt and response token the rollout
    computed (``prompt_routes_BTpMK`` / ``response_routes_BTrMK``, -1 where none: padding, and the last
    response token, which is never fed back), for Rollout Routing Replay in training.

    ``ex``: the execution context of a layout (``params`` then hold this rank's shards): tensor and
    expert parallel, not a pipeline stage. Each rank samples its own ``prompts`` (the tp ranks of a
    group the same ones); a row's tokens are those one process gives for it.

    ``version``: the policy version of ``params``, recorded for every response token (``versions_BTr``).
    ``newer`` (partial rollout): polled before every decode step, it returns None or (version, params) of a
    newer policy, which the rest of the generation uses: the rows in flight have their contexts (prompt and the
    tokens sampled so far) prefilled again under the new weights, so each token's log-prob is that of the
    weights that sampled it, given its whole context, and its version is recorded. Not in a layout whose
    forward calls collectives (tp or ep > 1: the ranks would have to swap at the same step), nor with
    ``record_routes`` (the routes would mix versions).
    """
    if record_routes and not cfg.is_moe:
        raise ValueError("generate: record_routes needs an MoE model (this one has no routed experts)")
    if newer is not None and (version is None or record_routes or ex.collective_forward):
        raise ValueError("generate: newer weights mid-generation (partial rollout) need the version of the first "
                         "ones, and neither recorded routes nor a layout with tp or ep > 1")
    swaps = [] if version is None else [(version, None)]
    with torch.inference_mode():  # less per-op work than no_grad (no version counters or view tracking)
        out = _generate(params, cfg, prompts, scfg, group_size, seed, max_batch, compile_decode, record_routes, ex,
                        newer, swaps)
    # inference tensors cannot be saved for backward (the update embeds these ids): hand out normal ones
    B = prompts.size * group_size
    routes = {} if out.routes is None else dict(prompt_routes_BTpMK=out.prompt_routes.repeat_interleave(group_size, 0),
                                                response_routes_BTrMK=out.routes[:B].clone())
    if swaps:
        routes["versions_BTr"] = _versions(swaps, B, scfg.max_new_tokens, out.ids.device)
    return extend(prompts.repeat(group_size), RolloutBatch, response_ids_BTr=out.ids[:B].clone(),
                  response_mask_BTr=out.mask[:B].clone(), sample_logprobs_BTr=out.lp[:B].clone(), **routes)


def _versions(swaps, B: int, Tn: int, dev) -> torch.Tensor:
    """[B, Tn] each response column's version: ``swaps`` is [(the first version, None), (version, at_B), ...],
    ``at_B``: how many tokens each row had sampled when that version came in (the rest are its)."""
    col = torch.arange(Tn, device=dev)
    out = torch.full((B, Tn), swaps[0][0], dtype=torch.long, device=dev)
    for v, at in swaps[1:]:
        out = torch.where(col >= at[:B, None], v, out)
    return out


def _reprefill(params, cfg, cache, out: Responses, ids_r, mask_r, G: int, *, dtype, ex) -> None:
    """The rows in flight get their KV computed again under ``params``: each slot's context (its prompt, then
    every response token but the last sampled one, which the next decode step feeds) prefilled and copied in."""
    sl = (out.slot_row >= 0).nonzero()[:, 0]
    if not len(sl):
        return
    rows = out.slot_row[sl]
    prompt_ids, prompt_len = ids_r[rows // G], mask_r[rows // G].sum(-1, keepdim=True)
    length = prompt_len + out.n_gen[sl, None] - 1  # = the slots' cache lengths
    T = int(length.max())
    col = torch.arange(T, device=ids_r.device)
    from_response = out.ids[rows].gather(1, (col - prompt_len).clamp(0, out.ids.shape[1] - 1))
    prompt = torch.nn.functional.pad(prompt_ids, (0, out.ids.shape[1]))[:, :T]
    ids = torch.where(col < prompt_len, prompt, from_response)
    _, tmp = prefill(params, cfg, ids, col < length, dtype=dtype, ex=ex)
    cache.copy_rows(sl, tmp, torch.arange(len(sl), device=sl.device), tmp.max_len)
    cache.bound = max(cache.bound, tmp.max_len)


def _generate(params, cfg, prompts, scfg, group_size, seed, max_batch, compile_decode, record_routes, ex,
              newer=None, swaps=None):
    if not (ex.first and ex.last):
        raise ValueError("generate: the rollout runs every layer on each rank; a layout with pp > 1 is for "
                         "training (use a rollout layout without pp)")
    if compile_decode and ex.collective_forward:
        raise ValueError("generate: compile_decode is not supported in a layout with tp or ep > 1 (its decode "
                         "step calls collectives); decode eagerly there")
    dev = prompts.prompt_ids_BTp.device
    P, Tp = prompts.prompt_ids_BTp.shape
    G, Tn = group_size, scfg.max_new_tokens
    if G < 1 or (max_batch is not None and max_batch < 1):
        raise ValueError(f"generate: group_size={group_size} and max_batch={max_batch} must be >= 1")
    empty = (~prompts.prompt_mask_BTp.any(-1)).nonzero()[:, 0].tolist()
    if empty:
        raise ValueError(f"generate: prompts at rows {empty[:8]} have no tokens")
    B = P * G
    slots = min(B, max_batch or B)
    dtype = params["model.embed_tokens.weight"].dtype
    params = model.fuse_for_inference(params, cfg, ex)
    ids_r, mask_r, order_r = right_align(prompts.prompt_ids_BTp, prompts.prompt_mask_BTp)

    max_len = bucketed(Tp + Tn) if compile_decode else Tp + Tn  # compiled: one graph per cache length
    cache = model.KVCache.allocate(cfg, slots, max_len, dtype=dtype, device=dev, ex=ex)
    out = Responses.allocate(B, slots, Tn, scfg.pad_id, dev)
    if record_routes:
        M, K = model.n_moe_layers(cfg), cfg.num_experts_per_tok
        out.routes = torch.full((B + 1, Tn, M, K), -1, dtype=torch.int16, device=dev)
        out.prompt_routes = torch.full((P, Tp, M, K), -1, dtype=torch.int16, device=dev)
    tok_S = torch.zeros(slots, dtype=torch.long, device=dev)  # each slot's last token, fed next step
    greedy = scfg.temperature == 0
    keys_B = counter_keys(seed, (prompts.index_B.to(dev).repeat_interleave(G) * G + torch.arange(G, device=dev).repeat(P)))
    admitted = 0  # rows are admitted in order

    def admit(free_slots: torch.Tensor) -> torch.Tensor:
        """Prefill the next rows into free slots and record their first tokens; returns done_S."""
        nonlocal admitted, tok_S
        n = min(len(free_slots), B - admitted)
        sl, rows = free_slots[:n], torch.arange(admitted, admitted + n, device=dev)
        p0, p1 = admitted // G, (admitted + n - 1) // G + 1  # prompts these rows sample from
        routing = model.Routing(record=True) if record_routes else None
        last, tmp = prefill(params, cfg, ids_r[p0:p1], mask_r[p0:p1], dtype=dtype, ex=ex, routing=routing)
        if routing is not None:
            where = order_r[p0:p1, :, None, None].expand_as(routing.chosen)
            out.prompt_routes[p0:p1] = out.prompt_routes[p0:p1].scatter(1, where, routing.chosen)
        src = rows // G - p0  # prefix sharing: each prompt's KV goes to all its sampled rows
        tok_S, done = seat(scfg, out, cache, tmp, sl, src, rows, keys_B[rows], last[src], tok_S, cfg.vocab_size)
        admitted += n
        return done

    def take_part() -> None:
        """A forward with no rows, so that this rank's experts serve the rows its ep peers admit."""
        tmp = model.KVCache.allocate(cfg, 0, 1, dtype=dtype, device=dev, ex=ex)
        none = torch.zeros(0, 1, dtype=torch.long, device=dev)
        model.forward(params, cfg, none, none, valid_BT=none.bool(), cache=tmp, with_aux=False, ex=ex)

    if compile_decode and dev.type == "cuda":  # NOT RUN HERE (no GPU was available): CUDA graph trees skip a
        # graph whose inputs it mutates unless their addresses are static; the cache is, for this call
        for t in (*cache.buffers(), out.ids, out.lp, out.mask, out.n_gen, *([] if out.routes is None else [out.routes])):
            torch._dynamo.mark_static_address(t, guard=False)
    step = compiled_step(dev) if compile_decode else decode_step
    done = admit(torch.arange(slots, device=dev))
    masked = compile_decode  # one static graph: every slot, masked, attention over the whole cache
    # ``ex.any_rank`` is the flag itself in one process; with expert parallelism every rank makes the same
    # calls in the same order (the same admissions and decode steps, with no rows where it has none)
    while True:
        # free finished slots and refill them (an admitted row may end at once)
        while ex.any_rank(any_done := bool(done.any())):
            out.slot_row[done] = -1
            cache.lengths_B[done] = 0
            refill = any_done and admitted < B
            peers_refill = ex.any_rank(refill)
            if refill:
                done = admit(torch.nonzero(out.slot_row < 0)[:, 0])
            else:
                done = done & False
                if peers_refill:  # an ep peer admits rows: its tokens reach this rank's experts
                    take_part()
            active = out.slot_row >= 0
            if not ex.any_rank(bool(active.any())):
                return out
            masked = compile_decode or not bool(active.all())
            if not compile_decode:
                cache.bound = int(cache.lengths_B.max())  # this step syncs anyway: tighten the attention span
        if newer is not None and (got := newer()) is not None:  # partial rollout: the rest under newer weights
            at = torch.full((B + 1,), Tn, dtype=torch.long, device=dev)  # finished rows keep their tokens' version
            at[admitted:] = 0
            active = out.slot_row >= 0
            at[out.slot_row[active]] = out.n_gen[active]
            swaps.append((got[0], at))
            params = model.fuse_for_inference(got[1], cfg, ex)
            _reprefill(params, cfg, cache, out, ids_r, mask_r, G, dtype=dtype, ex=ex)
        if compile_decode:
            cache.bound = cache.max_len - 1
        valid = (out.slot_row >= 0) if masked else None
        nz = None if greedy else counter_noise(keys_B[out.slot_row.clamp_min(0)], out.n_gen, cfg.vocab_size)
        tok_S, done = step(params, cfg, scfg, tok_S, valid, nz, cache, out, ex)


def serve(params: model.Params, cfg: ModelConfig, scfg: SamplingConfig, requests, *, slots: int, max_len: int,
          seed: int, ex: Exec = LOCAL) -> None:
    """Continuous batching over requests that arrive while the engine decodes (multi-turn rollouts: a turn is
    requested when its environment has answered the previous one), up to ``slots`` at once in a KV cache of
    ``max_len`` positions per slot.

    ``requests.take(n, wait)``: up to ``n`` ready requests ``(key, context ids, sample index)``; [] when none is
    ready, and with ``wait`` (no slot is decoding) it blocks until one is, [] then meaning none will come.
    ``requests.done(key, ids, logprobs)``: a finished response (EOS included, or ``max_new_tokens``). Every
    decode step admits what is ready into the free slots, so a request waits for a free slot, never for the
    batch. A request's sampling noise is that of its sample index under ``seed`` (``ops.counter_noise``): its
    tokens are ``generate``'s for the same context, index and seed, whatever else shares the batch."""
    if not (ex.first and ex.last) or ex.collective_forward:
        raise ValueError("serve: each rank serves its own requests (a layout with tp, ep or pp > 1 steps in "
                         "lockstep across ranks; use generate)")
    with torch.inference_mode():
        _serve(params, cfg, scfg, requests, slots, max_len, seed, ex)


def _serve(params, cfg, scfg, requests, slots, max_len, seed, ex):
    dtype = params["model.embed_tokens.weight"].dtype
    dev = params["model.embed_tokens.weight"].device
    params = model.fuse_for_inference(params, cfg, ex)
    Tn, V = scfg.max_new_tokens, cfg.vocab_size
    cache = model.KVCache.allocate(cfg, slots, max_len, dtype=dtype, device=dev, ex=ex)
    out = Responses.allocate(slots, slots, Tn, scfg.pad_id, dev)  # row s: slot s's response
    keys_S = torch.zeros(slots, dtype=torch.long, device=dev)
    tok_S = torch.zeros(slots, dtype=torch.long, device=dev)
    owner: list = [None] * slots  # the request key each slot serves (None: free)
    free = list(range(slots))
    greedy = scfg.temperature == 0

    def admit(reqs, free: list[int]) -> torch.Tensor:
        """Prefill the requests' contexts into free slots and sample their first tokens; returns done_S."""
        nonlocal tok_S
        n = len(reqs)
        ids, mask = pad([torch.tensor(c, dtype=torch.long) for _, c, _ in reqs], scfg.pad_id, left=True)
        if ids.shape[1] + Tn > max_len:
            raise ValueError(f"serve: a context of {ids.shape[1]} tokens and {Tn} new ones exceed the cache's "
                             f"{max_len} positions")
        ids_r, mask_r, _ = right_align(ids.to(dev), mask.to(dev))
        last, tmp = prefill(params, cfg, ids_r, mask_r, dtype=dtype, ex=ex)
        sl = torch.tensor(free[:n], dtype=torch.long, device=dev)
        keys = counter_keys(seed, torch.tensor([i for _, _, i in reqs], dtype=torch.long, device=dev))
        keys_S[sl] = keys
        for s, (key, _, _) in zip(free[:n], reqs):
            owner[s] = key
        del free[:n]
        tok_S, done = seat(scfg, out, cache, tmp, sl, torch.arange(n, device=dev), sl, keys, last, tok_S, V)
        return done

    done = torch.zeros(slots, dtype=torch.bool, device=dev)
    while True:
        if bool(done.any()):  # hand out the finished responses and free their slots
            finished = done.nonzero()[:, 0]
            n_gen = out.n_gen[finished].tolist()
            ids, lps = out.ids[finished].tolist(), out.lp[finished].tolist()
            for s, n, i, lp in zip(finished.tolist(), n_gen, ids, lps):
                requests.done(owner[s], i[:n], lp[:n])
                owner[s] = None
                free.append(s)
            out.slot_row[finished] = -1
            cache.lengths_B[finished] = 0
            done = done & False
        if free:
            reqs = requests.take(len(free), wait=len(free) == slots)
            if not reqs and len(free) == slots:
                return
            if reqs:
                done = admit(reqs, free)
                continue  # an admitted request may be done at once (EOS first)
        cache.bound = int(cache.lengths_B.max())
        valid = None if not free else out.slot_row >= 0
        nz = None if greedy else counter_noise(keys_S, out.n_gen, V)
        tok_S, done = decode_step(params, cfg, scfg, tok_S, valid, nz, cache, out, ex)
