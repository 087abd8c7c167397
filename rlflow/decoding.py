"""The built-in engine's decoding pieces (``rlflow/rollout.py`` schedules them): prefill of right-aligned contexts,
seating rows in cache slots, one decode step (forward, sampling, recording), the response buffers, and the
compiled decode step. Every piece is pure torch and runs on any device, in any layout (``ex``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlflow.models import decoder as model
from rlflow.models.execution import LOCAL
from rlflow.ops import counter_noise, sample


def right_align(ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move each row's real tokens to the front (left-padded -> right-padded), keeping their order; returns
    the ids, the mask and the order (right-aligned column j holds the left-padded column order[:, j])."""
    order = torch.argsort((~mask_BT).to(torch.int8), dim=1, stable=True)
    return ids_BT.gather(1, order), mask_BT.gather(1, order), order


def decode_step(params, cfg, scfg, tok_S, valid_S, noise_SV, cache, out, ex=LOCAL):
    """One decode token for every slot: feeds ``tok_S`` (writing its KV and advancing the lengths of
    ``valid_S``'s slots; None: all), samples the next token and records it (``record``). Returns
    (tokens_S, done_S). With ``out.routes``, the fed tokens' experts are kept at their response columns."""
    routing = None if out.routes is None else model.Routing(record=True)
    h, _, cache = model.forward(params, cfg, tok_S[:, None], cache.lengths_B[:, None].clone(),
                                valid_BT=None if valid_S is None else valid_S[:, None], cache=cache, with_aux=False,
                                ex=ex, routing=routing)
    if routing is not None:  # the fed token is the slot's response token n_gen - 1
        active = out.slot_row >= 0
        r = torch.where(active, out.slot_row, out.ids.shape[0] - 1)
        out.routes[r, (out.n_gen - 1).clamp_min(0)] = routing.chosen[:, 0]
    tok, lp = sample(model.logits(params, cfg, h[:, -1], ex), temperature=scfg.temperature, top_k=scfg.top_k,
                     top_p=scfg.top_p, noise_BV=noise_SV)
    return tok, record(scfg, out, tok, lp, out.slot_row >= 0)


@dataclass
class Responses:
    """The responses being written: ids / log-probs / mask [B + 1, Tn] (row B: a spare that free slots
    write to), the output row each slot holds (-1: free) and the tokens each has generated; with routing
    recorded, each response token's experts [B + 1, Tn, M, K] (-1: none) and each prompt's [P, Tp, M, K]
    in the prompts' left-padded columns."""
    ids: torch.Tensor
    lp: torch.Tensor
    mask: torch.Tensor
    slot_row: torch.Tensor
    n_gen: torch.Tensor
    routes: torch.Tensor | None = None
    prompt_routes: torch.Tensor | None = None

    @classmethod
    def allocate(cls, rows: int, slots: int, Tn: int, pad_id: int, dev) -> "Responses":
        return cls(ids=torch.full((rows + 1, Tn), pad_id, dtype=torch.long, device=dev),
                   lp=torch.zeros((rows + 1, Tn), dtype=torch.float32, device=dev),
                   mask=torch.zeros((rows + 1, Tn), dtype=torch.bool, device=dev),
                   slot_row=torch.full((slots,), -1, dtype=torch.long, device=dev),
                   n_gen=torch.zeros(slots, dtype=torch.long, device=dev))


def record(scfg, out: Responses, tok_S, lp_S, where_S):
    """Write the slots' new tokens (where ``where_S``) at their rows' next column; returns which slots
    finished (EOS or ``max_new_tokens``)."""
    spare, Tn = out.ids.shape[0] - 1, out.ids.shape[1]
    r, t = torch.where(where_S, out.slot_row, spare), out.n_gen.clamp_max(Tn - 1)
    out.ids[r, t] = tok_S
    out.lp[r, t] = lp_S
    out.mask[r, t] = where_S
    out.n_gen += where_S.long()
    return where_S & ((tok_S == scfg.eos_id) | (out.n_gen >= Tn))


def prefill(params, cfg, ids_BT, mask_BT, *, dtype, ex, routing=None):
    """Right-aligned contexts [n, T] (``mask_BT``: each row's real tokens first) prefilled into a cache of their
    own; returns (the logits after each context's last token [n, V], that cache)."""
    n, T = ids_BT.shape
    dev = ids_BT.device
    tmp = model.KVCache.allocate(cfg, n, T, dtype=dtype, device=dev, ex=ex)
    h, _, _ = model.forward(params, cfg, ids_BT, torch.arange(T, device=dev).expand(n, T), valid_BT=mask_BT,
                            cache=tmp, with_aux=False, ex=ex, routing=routing)
    return model.logits(params, cfg, h[torch.arange(n, device=dev), mask_BT.sum(-1) - 1], ex), tmp


def seat(scfg, out: Responses, cache, tmp, sl, src, rows, keys, last, tok_S, vocab: int):
    """Rows ``rows`` take slots ``sl``: the prefilled contexts ``tmp[src]`` copied into the slots' cache, their
    first tokens sampled from ``last`` (the noise of ``keys`` at counter 0) and recorded. Returns (tok_S, done_S)."""
    dev = tok_S.device
    cache.copy_rows(sl, tmp, src, tmp.max_len)
    cache.bound = max(cache.bound, tmp.max_len)
    nz = None if scfg.temperature == 0 else counter_noise(keys, torch.zeros_like(keys), vocab)
    t, lp = sample(last, temperature=scfg.temperature, top_k=scfg.top_k, top_p=scfg.top_p, noise_BV=nz)
    out.slot_row[sl], out.n_gen[sl], out.mask[rows] = rows, 0, False
    new = torch.zeros(len(tok_S), dtype=torch.bool, device=dev)
    new[sl] = True
    tok_S = tok_S.index_put((sl,), t)
    return tok_S, record(scfg, out, tok_S, torch.zeros(len(tok_S), device=dev).index_put((sl,), lp), new)


_COMPILED: dict[str, object] = {}


def bucketed(n: int) -> int:
    """The compiled decode step's cache length for ``n`` columns: rounded up to a quarter of n's power of
    two (16 at least), so batches of nearby prompt lengths share one graph (four per doubling of the
    length) for at most 25% more attention columns."""
    step = max(16, (1 << (n.bit_length() - 1)) // 4)
    return -(-n // step) * step


def compile_problem(device_type: str) -> str | None:
    """Why the decode step cannot be compiled on a device of ``device_type`` (None: it can)."""
    if device_type in ("cpu", "cuda"):
        return None  # NPU: torch_npu compiles through its own backend (torchair), not wired
    return (f"on {device_type} is not built (the compiled decode step takes inductor's cpu and cuda options); "
            "decode eagerly there")


def compiled_step(device: torch.device):
    """``decode_step`` (forward + sampling) through torch.compile with static shapes (one graph per
    batch, cache length, model and sampling config), and CUDA graphs on CUDA ("reduce-overhead").
    Compiling takes tens of seconds on a CPU; the CUDA path has not been run here (no GPU was available)."""
    if (why := compile_problem(device.type)) is not None:
        raise ValueError(f"generate: compile_decode {why}")
    if device.type not in _COMPILED:
        # CPU: the graph's wrapper in C++ (one call per step instead of ~60 Python-dispatched kernels)
        how = dict(mode="reduce-overhead") if device.type == "cuda" else dict(options={"cpp_wrapper": True})
        _COMPILED[device.type] = torch.compile(decode_step, dynamic=False, **how)
    return _COMPILED[device.type]
