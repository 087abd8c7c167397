"""The stages of a GRPO iteration as functions of (params, batch): score, log-probs, update. The log-prob
forward itself is the model's (``models/logprobs.py``); here it runs over micro-batches and in the update.

Legend: B samples, Tp prompt tokens, Tr response tokens, N tokens selected by a mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlflow import optim
from rlflow.algos import corrections, grpo
from rlflow.batch import RolloutBatch, TrainBatch, unpad
from rlflow.models import decoder as model, lora
from rlflow.models.config import ModelConfig
from rlflow.models.execution import LOCAL, Exec
from rlflow.models.logprobs import response_logprobs
from rlflow.ops import registry
from rlflow.parallel import dp
from rlflow.parallel import train as ptrain


def score(batch: RolloutBatch, tokenizer, reward_fn) -> Tensor:
    """rewards_B: ``reward_fn(completions, answers) -> one float per row``, called once with the decoded
    responses and the reference answers of all the batch's rows (``rewards.CombinedReward.score``). A row
    the reward leaves unscored (None) is an error here; ``score_rows`` masks it instead."""
    rewards_B, scored_B = score_rows(batch, tokenizer, reward_fn)
    if not bool(scored_B.all()):
        i = int((~scored_B).nonzero()[0, 0])
        raise ValueError(f"score: the reward left {int((~scored_B).sum())} of {batch.size} rows unscored (None), "
                         f"the first sample {int(batch.index_B[i])}; use score_rows to mask them")
    return rewards_B


def score_rows(batch: RolloutBatch, tokenizer, reward_fn) -> tuple[Tensor, Tensor]:
    """(rewards_B, scored_B): ``score``'s rewards, 0 where the reward returned None ("no score"), and which
    rows it scored (bool). Multi-turn rows carry their episodes' (``env_rewards_B``, ``env_scored_B``)."""
    if batch.env_rewards_B is not None:
        scored = batch.env_scored_B.cpu()
        return torch.where(scored, batch.env_rewards_B.cpu(), 0.0), scored
    if len(batch.answers) != batch.size:
        raise ValueError(f"score: batch has {batch.size} rows but {len(batch.answers)} answers")
    texts = [tokenizer.decode(r.tolist()) for r in unpad(batch.response_ids_BTr.cpu(), batch.response_mask_BTr.cpu())]
    got = reward_fn(texts, list(batch.answers))
    if len(got) != batch.size:
        raise ValueError(f"score: the reward gave {len(got)} values for {batch.size} rows")
    scored = torch.tensor([v is not None for v in got], dtype=torch.bool)
    return torch.tensor([0.0 if v is None else float(v) for v in got], dtype=torch.float32), scored


def _trim(batch: RolloutBatch) -> RolloutBatch:
    """Drop columns that are padding in every row (left of the prompts, right of the responses)."""
    tp, tr = torch.stack([batch.prompt_mask_BTp.sum(-1).max(), batch.response_mask_BTr.sum(-1).max()]).tolist()
    tr = max(tr, 1)
    kw = {k: v[:, -tp:] for k, v in batch.tensors().items() if k.endswith(("_BTp", "_BTpMK"))}
    kw.update({k: v[:, :tr] for k, v in batch.tensors().items() if k.endswith(("_BTr", "_BTrMK"))})
    return batch.replace(**kw)


@torch.no_grad()
def batched_logprobs(params, cfg: ModelConfig, batch: RolloutBatch, *, micro_batch_size: int,
                     temperature: float = 1.0, replay: bool = True, ex: Exec = LOCAL) -> Tensor:
    """response_logprobs over micro-batches without gradients (old and reference log-probs); ``ex``: the
    execution context of a layout (every rank of an ep group the same number of micro-batches). With pp the
    micro-batches go through the pipeline and the log-probs are those of the last stage (zeros elsewhere)."""
    def of(mbs):
        if not (ex.first and ex.last):
            return [lp for lp, _ in ptrain.forward_only(params, ex, mbs, temperature=temperature, replay=replay)]
        return [response_logprobs(params, cfg, mb, temperature=temperature, with_aux=False, ex=ex, replay=replay)[0]
                for mb in mbs]
    return per_token(batch, micro_batch_size, of)


def per_token(batch: RolloutBatch, micro_batch_size: int, of) -> Tensor:
    """A per-response-token figure [B, Tr] (float32, 0 on padding) of ``batch`` computed over micro-batches of
    ``micro_batch_size`` rows: ``of(micro-batches)`` -> one [b, tr] tensor each (trimmed of padding)."""
    out = torch.zeros(batch.response_ids_BTr.shape, dtype=torch.float32, device=batch.response_ids_BTr.device)
    parts = [torch.arange(s, min(s + micro_batch_size, batch.size)) for s in range(0, batch.size, micro_batch_size)]
    for rows, x in zip(parts, of([_trim(batch.select(rows)) for rows in parts])):
        out[rows, :x.shape[1]] = x
    return out


@dataclass(frozen=True, kw_only=True)
class UpdateConfig:
    mini_batch_size: int  # samples per optimizer step
    micro_batch_size: int  # samples per forward/backward (gradient accumulation within a mini-batch)
    max_grad_norm: float = 1.0
    router_aux_coef: float = 0.0  # weight of the MoE load-balancing loss in the update
    # Dynamic batching: micro-batches hold samples of similar length up to this many (padded) tokens
    # instead of micro_batch_size samples. None: fixed micro_batch_size.
    max_tokens_per_micro_batch: int | None = None
    remat: bool = False  # recompute layer activations in the backward (long sequences)
    # Batches that carry the rollout's expert choices: route by them ("on", Rollout Routing Replay) or only
    # measure how many differ ("measure"); the update reports the shares routed otherwise than in the
    # rollout (routing_flip_frac) and top-k'ed otherwise by the router (routing_router_flip_frac).
    routing_replay: str = "on"
    # The train layout (None: one process, unsharded). Its ("dp", "ep") ranks each hold a share of the
    # batch (tp ranks the same rows); the loss takes the normalizers of the whole (all-rank) mini-batch,
    # gradients are summed over the ranks that share a parameter shard and the gradient norm is that of
    # the full gradient, so the step equals the one-process step on the whole batch. With pp the
    # micro-batches go through the pipeline schedule (``parallel/train.py``).
    layout: object = None


def micro_batches(batch: RolloutBatch, rows: Tensor, ucfg: UpdateConfig) -> list[Tensor]:
    """Split ``rows`` of a mini-batch into micro-batches: fixed size, or by token budget (rows sorted by
    length so each micro-batch pads little; its padded tokens, rows x (longest prompt + longest
    response), stay within the budget, one row at least)."""
    if ucfg.max_tokens_per_micro_batch is None:
        return [rows[u:u + ucfg.micro_batch_size] for u in range(0, len(rows), ucfg.micro_batch_size)]
    rows = rows.cpu()
    lp = batch.prompt_mask_BTp.sum(-1).cpu()[rows]
    lr = batch.response_mask_BTr.sum(-1).cpu()[rows]
    perm = torch.argsort(lp + lr, descending=True, stable=True)
    out, cur, mp, mr = [], [], 0, 0  # a micro-batch pads to its longest prompt + longest response
    for r, p, q in zip(rows[perm].tolist(), lp[perm].tolist(), lr[perm].tolist()):
        if cur and (max(mp, p) + max(mr, q)) * (len(cur) + 1) > ucfg.max_tokens_per_micro_batch:
            out.append(torch.tensor(cur))
            cur, mp, mr = [], 0, 0
        cur.append(r)
        mp, mr = max(mp, p), max(mr, q)
    if cur:
        out.append(torch.tensor(cur))
    return out


def descend(params: model.Params, opt_state: optim.AdamWState, batch: TrainBatch, ucfg: UpdateConfig,
            ocfg: optim.AdamWConfig, *, epochs: int, seed: int, lr: float | None, grads_of, sums: dict
            ) -> tuple[model.Params, optim.AdamWState, int]:
    """``epochs`` passes over ``batch`` in shuffled mini-batches, one AdamW step per mini-batch: the
    optimizer loop the policy and the critic share. ``grads_of(live, leaves, mbs, n_tokens, n_seqs, reduce)``:
    the mini-batch's gradients (one float32 tensor or None per leaf of ``live``), summed over its micro-batches
    ``mbs`` with the whole mini-batch's normalizers (``n_tokens`` response tokens, ``n_seqs`` rows, over
    every data rank of ``ucfg.layout``); it may hand ``reduce`` (or None) to ``accumulate`` for the last
    micro-batch, which then starts the sum over the data ranks during that backward (else the sum runs
    after it, ``dp.OverlappedGrads`` either way). They are summed over the data ranks and clipped to
    ``ucfg.max_grad_norm`` by the full gradient's norm; a non-finite norm skips the step (parameters and
    state unchanged). Adds ``grad_norm`` and ``update_skipped`` to ``sums``; returns (params, state, the
    number of mini-batches). ``params`` and ``opt_state`` are donated (updated in place)."""
    layout = ucfg.layout
    g = torch.Generator().manual_seed(seed)
    off = lora.frozen(params)  # LoRA: the base takes no gradient
    names = [k for k in params if k not in off]
    leaves = [params[k].detach().requires_grad_(True) for k in names]
    live = {**params, **dict(zip(names, leaves))}
    # the data-parallel sum of the gradients, started during each mini-batch's last backward
    overlap = dp.OverlappedGrads(names, leaves, layout) if layout is not None else None
    n_mb = 0
    perms = [torch.randperm(batch.size, generator=g) for _ in range(epochs)]
    minis = [perm[s:s + ucfg.mini_batch_size] for perm in perms for s in range(0, batch.size, ucfg.mini_batch_size)]
    # every mini-batch's normalizers (response tokens, rows) over the data ranks, in one reduction
    totals = torch.tensor([[float(batch.loss_mask[m].sum()), len(m)] for m in minis], dtype=torch.float64)
    if layout is not None:
        totals = dp.batch_sum(totals, layout)
    for mini, (n_tokens, n_seqs) in zip(minis, totals.tolist()):
        n_seqs = int(n_seqs)
        mbs = [_trim(batch.select(rows)) for rows in micro_batches(batch, mini, ucfg)]
        grads = grads_of(live, leaves, mbs, n_tokens, n_seqs, overlap)
        if overlap is not None:  # the sum of the ranks' shares (a pipelined update's all go now)
            if not overlap.started:
                overlap.start()
            grads = overlap.finish(grads)
        gdict = {k: torch.zeros_like(p, dtype=torch.float32) if gr is None else gr
                 for k, p, gr in zip(names, leaves, grads)}
        if layout is not None:
            gdict, norm = dp.clip_grads(gdict, layout, ucfg.max_grad_norm)  # the full gradient's norm
        else:
            gdict, norm = optim.clip_by_global_norm(gdict, ucfg.max_grad_norm)
        norm_f = float(norm)  # the same on every rank: computed from the summed gradients
        sums["grad_norm"] = sums.get("grad_norm", 0.0) + norm_f
        n_mb += 1
        if not math.isfinite(norm_f):  # a NaN/inf reward, loss or gradient: this step is skipped, the
            sums["update_skipped"] = sums.get("update_skipped", 0.0) + 1  # parameters and state unchanged
            continue
        with torch.no_grad():
            _, opt_state = optim.step(live, gdict, opt_state, ocfg, lr=lr)
    sums.setdefault("update_skipped", 0.0)
    return {k: p.detach() for k, p in live.items()}, opt_state, n_mb


def record(sums: dict, loss: Tensor, metrics: dict[str, Tensor], share: float) -> None:
    """Add a micro-batch's figures to a mini-batch's ``sums``: its loss as it is (it carries the mini-batch's
    normalizers, so the micro-batches' parts add up), its per-token means (clip_frac, kl, ...) weighted by
    ``share``, its share of the mini-batch's rows. They stay on the device (``read`` takes them once)."""
    sums["loss"] = sums.get("loss", 0.0) + loss.detach().float()
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + torch.as_tensor(v).detach().float() * share


def read(figures: dict) -> dict[str, float]:
    """``figures`` as floats, every device tensor among them read in one transfer (one host sync)."""
    on_device = [k for k, v in figures.items() if isinstance(v, Tensor)]
    values = torch.stack([figures[k].reshape(()) for k in on_device]).tolist() if on_device else []
    return {**figures, **dict(zip(on_device, values))}


def averaged(sums: dict[str, float], n_mb: int, layout) -> dict[str, float]:
    """The mean per optimizer step of ``descend``'s ``sums`` over ``n_mb`` mini-batches, the loss summed over
    the data ranks' shares of each mini-batch (``layout`` None: one process)."""
    sums = read(sums)
    if layout is not None:
        sums = {**sums, "loss": dp.batch_total(sums.get("loss", 0.0), layout)}
    return {k: v / max(n_mb, 1) for k, v in sums.items()}


def accumulate(grads: list[Tensor | None], loss: Tensor, leaves: list[Tensor], reduce=None,
               cast: list[Tensor] | None = None) -> None:
    """Add d loss / d leaves into ``grads`` in float32, whatever the parameters' dtype. ``reduce``: the
    mini-batch's last backward starts the data-parallel reduction (``dp.OverlappedGrads``, from ``descend``):
    each leaf's sum goes to it as soon as the backward has computed the leaf's gradient. ``cast``: the caller's
    list holding the CPU's cast buffer (below) from one micro-batch to the next."""
    # on a CPU a later micro-batch's half-precision gradient is cast into one float32 buffer, then added: a fresh
    # float32 copy of every gradient every micro-batch is memory first touched each time (page faults: two
    # thirds of a 0.5B update; docs/dryrun.md), and an in-place add of the half precision gradient is slower
    # still. The buffer grows to the largest gradient added so far, held through the backward and, in the
    # caller's ``cast``, to the next micro-batch's (a new one, above glibc's mmap threshold, is faulted in
    # afresh: the 0.5B head's, 131 MB a micro-batch). An accelerator's caching allocator makes fresh copies
    # free, and they hold less
    cast = [] if cast is None else cast

    def add(j, gr):
        if grads[j] is None:
            grads[j] = gr.float()
        elif gr.dtype == torch.float32 or registry.computes_as(gr) != "cpu":
            grads[j].add_(gr.float())
        else:
            if not cast or cast[0].numel() < gr.numel():
                cast.clear()  # the smaller one freed first
                cast.append(torch.empty(gr.numel(), dtype=torch.float32, device=gr.device))
            grads[j].add_(cast[0][:gr.numel()].view(gr.shape).copy_(gr))

    if reduce is None:
        for j, gr in enumerate(torch.autograd.grad(loss, leaves, allow_unused=True)):
            if gr is not None:
                add(j, gr)
        return

    def hook(j):
        def on_grad(gr):
            add(j, gr)
            reduce.ready(j, grads)
        return on_grad

    reduce.start()
    handles = [leaf.register_hook(hook(j)) for j, leaf in enumerate(leaves)]
    try:
        torch.autograd.grad(loss, leaves, allow_unused=True)  # the hooks took the gradients
    finally:
        for h in handles:
            h.remove()


def update(params: model.Params, opt_state: optim.AdamWState, batch: TrainBatch, cfg: ModelConfig,
           gcfg: grpo.GRPOConfig, ucfg: UpdateConfig, ocfg: optim.AdamWConfig, *, seed: int = 0,
           lr: float | None = None, old_is_current: bool = False, max_len: int | None = None, ex: Exec = LOCAL
           ) -> tuple[model.Params, optim.AdamWState, dict[str, float]]:
    """The policy update: ``descend`` with ``grpo.policy_loss`` (``gcfg.epochs`` passes, gradients
    accumulated over micro-batches with the normalizers of the whole mini-batch, so accumulation is exact).
    The advantages are the batch's per-token ones when it has them (GAE), else its per-sample ones.
    ``params`` and ``opt_state`` are donated, as with JAX's donated buffers: updated in place and returned.

    ``old_is_current``: the batch was sampled by exactly these params and this call makes one optimizer
    step, so the ratio's denominator is the current log-prob detached (exact; saves a forward pass).
    ``max_len``: the response-length constant of ``seq-mean-token-sum-norm`` (the generation budget;
    default: the batch's padded response length).
    ``ex``: this rank's execution context in ``ucfg.layout`` (``params``: its shards)."""
    layout = ucfg.layout
    pipelined = not (ex.first and ex.last)
    if old_is_current and (gcfg.epochs != 1 or ucfg.mini_batch_size < batch.size):
        raise ValueError(f"update: old_is_current needs exactly one optimizer step, but epochs={gcfg.epochs} and "
                         f"mini_batch_size={ucfg.mini_batch_size} (batch {batch.size}) give several")
    Tr = max_len or batch.response_ids_BTr.shape[1]
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    routing_stats: dict = {}

    def grads_of(live, leaves, mbs, n_tokens, n_seqs, reduce):
        rows = sum(mb.size for mb in mbs)

        def mb_loss(lp, ent, aux, mb):
            """Micro-batch ``mb``'s loss with the mini-batch normalizers; records its metrics."""
            old = lp.detach() if old_is_current else mb.old_logprobs_BTr  # the trainer's, at the sampling weights
            sample, rmask = mb.sample_logprobs_BTr, mb.loss_mask
            w = corrections.is_weights(sample, old, rmask, level=gcfg.rollout_is, cap=gcfg.rollout_is_cap,
                                       mode=gcfg.rollout_is_mode)
            adv = mb.advantages_B if mb.token_advantages_BTr is None else mb.token_advantages_BTr
            loss, met = grpo.policy_loss(lp, old, adv, rmask, gcfg, ref_logp_BT=mb.ref_logprobs_BTr, entropy_BT=ent,
                                         n_tokens=n_tokens, n_seqs=n_seqs, max_len=Tr, is_weights_BT=w)
            mis = corrections.mismatch(sample, old, rmask, cap=gcfg.rollout_is_cap)
            worst = mis.pop("logp_diff_max")
            maxes["logp_diff_max"] = worst if "logp_diff_max" not in maxes else torch.maximum(maxes["logp_diff_max"],
                                                                                              worst)
            met = {**met, **mis}
            if aux is not None and ucfg.router_aux_coef:
                loss = loss + ucfg.router_aux_coef * aux * (mb.size / n_seqs)
            record(sums, loss, {**met, **({} if aux is None else {"router_aux": aux.detach()})}, mb.size / rows)
            return loss

        if pipelined:  # the pipeline schedule: each stage its layers; the loss on the last stage
            aux_w = [ucfg.router_aux_coef * mb.size / n_seqs for mb in mbs] if ucfg.router_aux_coef else None
            _, got = ptrain.forward_backward(live, ex, mbs, lambda lp, ent, mb: mb_loss(lp, ent, None, mb),
                                             aux_weights=aux_w, temperature=gcfg.temperature,
                                             with_entropy=bool(gcfg.entropy_coef), remat=ucfg.remat,
                                             replay=ucfg.routing_replay == "on")
            return [got[k].float() for k in got]  # the leaves', in their order
        grads: list[Tensor | None] = [None] * len(leaves)
        cast: list[Tensor] = []
        for mb in mbs:
            lp, ent, aux = response_logprobs(live, cfg, mb, temperature=gcfg.temperature,
                                             with_entropy=bool(gcfg.entropy_coef), remat=ucfg.remat,
                                             with_aux=bool(ucfg.router_aux_coef), ex=ex,
                                             replay=ucfg.routing_replay == "on", routing_stats=routing_stats)
            accumulate(grads, mb_loss(lp, ent, aux, mb), leaves, reduce if mb is mbs[-1] else None, cast)
        return grads

    new_params, opt_state, n_mb = descend(params, opt_state, batch, ucfg, ocfg, epochs=gcfg.epochs, seed=seed, lr=lr,
                                          grads_of=grads_of, sums=sums)
    sums, maxes = read(sums), read(maxes)
    if pipelined:  # the loss and its metrics were computed on the last stage: every stage reports them
        got = [(sums, maxes)]
        torch.distributed.broadcast_object_list(got, src=ex.peer(ex.pp_stages - 1), group=ex.pp_group)
        sums, maxes = {**got[0][0], "grad_norm": sums["grad_norm"], "update_skipped": sums["update_skipped"]}, \
            got[0][1]
    metrics = {**averaged(sums, n_mb, layout), **maxes}
    if routing_stats:  # (token, MoE layer) pairs routed / top-k'ed otherwise than in the rollout, all ranks' rows
        n = {k: float(v) for k, v in routing_stats.items()}
        if layout is not None:
            n = {k: dp.batch_total(v, layout) for k, v in n.items()}
        metrics["routing_flip_frac"] = n["flipped"] / max(n["compared"], 1.0)
        metrics["routing_router_flip_frac"] = n["router_flipped"] / max(n["compared"], 1.0)
    return new_params, opt_state, finite_or_nan(metrics)


def finite_or_nan(metrics: dict[str, float]) -> dict[str, float]:
    """Non-finite figures as NaN (one spelling of "no value" in the logs)."""
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in metrics.items()}
