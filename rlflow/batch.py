"""Typed sample batches: the rows that flow between the stages of one RL iteration.

Shape legend: B samples (rows), Tp prompt tokens (left-padded), Tr response tokens (right-padded).
A row's sequence is ``prompt_ids_BTp[b][prompt_mask_BTp[b]]`` followed by
``response_ids_BTr[b][response_mask_BTr[b]]``. ``index_B`` is the row's global sample index (the dock's
key) and ``group_B`` the prompt it was sampled from: the G samples of one prompt share a group id.

A multi-turn row (``rlflow/multiturn.py``) holds a whole episode in its response: the model's turns and, between
them, the environment's observations. ``response_mask_BTr`` covers all of it (the sequence the model reads);
``loss_mask_BTr`` only the model's own sampled tokens, the ones the RL losses and the log-probs are over
(``loss_mask``: that mask, or the response's for a single-turn row).

Every batch is a frozen dataclass validated on construction: a field with the wrong dtype, rank or a
size that disagrees with another field raises ``ValueError`` naming the field, the expected and the
actual value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

# field suffix -> dim symbols; dtypes per field below
_DIMS = {"_BTpMK": ("B", "Tp", "M", "K"), "_BTrMK": ("B", "Tr", "M", "K"), "_BTp": ("B", "Tp"), "_BTr": ("B", "Tr"),
         "_B": ("B",)}


def _dims_of(name: str) -> tuple[str, ...]:
    for suffix, dims in _DIMS.items():
        if name.endswith(suffix):
            return dims
    raise AssertionError(f"field {name} has no shape suffix")


def check_tensor(owner: str, name: str, t: object, dtype: torch.dtype, dims: Sequence[str],
                 sizes: dict[str, int]) -> None:
    """Check ``t`` is a tensor of ``dtype`` whose dims agree with ``sizes`` (filled in as first seen)."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{owner}.{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{owner}.{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != len(dims):
        raise ValueError(f"{owner}.{name}: expected {len(dims)} dims [{', '.join(dims)}], "
                         f"got shape {tuple(t.shape)}")
    for sym, n in zip(dims, t.shape):
        if sizes.setdefault(sym, n) != n:
            raise ValueError(f"{owner}.{name}: dim {sym} is {n}, but other fields have {sym}={sizes[sym]} "
                             f"(shape {tuple(t.shape)})")


class _Batch:
    """Validation and row selection shared by the batch types."""

    __slots__ = ()
    _DTYPES: dict[str, torch.dtype] = {}

    def __post_init__(self):
        sizes: dict[str, int] = {}
        owner = type(self).__name__
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in self._DTYPES:
                if v is None and f.default is None:
                    continue
                check_tensor(owner, f.name, v, self._DTYPES[f.name], _dims_of(f.name), sizes)
        ans = getattr(self, "answers", ())
        if ans and len(ans) != sizes["B"]:
            raise ValueError(f"{owner}.answers: expected {sizes['B']} entries (one per row), got {len(ans)}")

    @property
    def size(self) -> int:
        return self.index_B.shape[0]

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), Tensor)}

    def select(self, rows: Tensor | Sequence[int]):
        """The batch restricted to ``rows`` (positions, not global indices), in that order."""
        rows_t = torch.as_tensor(rows, dtype=torch.long)
        kw = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                kw[f.name] = v[rows_t.to(v.device)]
            elif f.name == "answers" and v:
                kw[f.name] = tuple(v[i] for i in rows_t.tolist())
            else:
                kw[f.name] = v
        return type(self)(**kw)

    def to(self, device: torch.device | str):
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptBatch(_Batch):
    prompt_ids_BTp: Tensor  # int64, left-padded
    prompt_mask_BTp: Tensor  # bool, True on real prompt tokens
    index_B: Tensor  # int64, global sample index
    group_B: Tensor  # int64, prompt id shared by the G samples of a prompt
    answers: tuple[str, ...] = ()  # reference answers for the verifier (one per row), may be empty

    _DTYPES = {"prompt_ids_BTp": torch.long, "prompt_mask_BTp": torch.bool, "index_B": torch.long,
               "group_B": torch.long}

    def repeat(self, group_size: int) -> "PromptBatch":
        """Each prompt repeated ``group_size`` times (adjacent); sample index = prompt index * G + k."""
        if group_size <= 0:
            raise ValueError(f"group_size must be positive, got {group_size}")
        rows = torch.arange(self.size).repeat_interleave(group_size)
        b = self.select(rows)
        k = torch.arange(group_size, device=b.index_B.device).repeat(self.size)
        return b.replace(index_B=b.index_B * group_size + k)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutBatch(PromptBatch):
    response_ids_BTr: Tensor  # int64, right-padded
    response_mask_BTr: Tensor  # bool, True on generated tokens up to and including EOS
    sample_logprobs_BTr: Tensor  # float32, log-prob of each token under the sampling policy
    # int16, an MoE rollout's experts per token and MoE layer (M), top-k (K); -1: none (routing replay only)
    prompt_routes_BTpMK: Tensor | None = None
    response_routes_BTrMK: Tensor | None = None
    # bool, a multi-turn row's sampled tokens (True) among its response tokens (observations: False); None:
    # every response token was sampled (a single turn)
    loss_mask_BTr: Tensor | None = None
    # float32, a multi-turn row's reward (the environment's, or the run's reward of its last turn); None: no
    # environment. bool, whether the row is scored (False: its episode failed, or no reward applied to it)
    env_rewards_B: Tensor | None = None
    env_scored_B: Tensor | None = None
    # int64, the policy version that sampled each response token (separate pools: the updates the weights had
    # seen; a partial rollout's row may span several); None: not recorded
    versions_BTr: Tensor | None = None

    _DTYPES = {**PromptBatch._DTYPES, "response_ids_BTr": torch.long, "response_mask_BTr": torch.bool,
               "sample_logprobs_BTr": torch.float32, "prompt_routes_BTpMK": torch.int16,
               "response_routes_BTrMK": torch.int16, "loss_mask_BTr": torch.bool, "env_rewards_B": torch.float32,
               "env_scored_B": torch.bool, "versions_BTr": torch.long}

    def __post_init__(self):
        _Batch.__post_init__(self)
        if self.loss_mask_BTr is not None and bool((self.loss_mask_BTr & ~self.response_mask_BTr).any()):
            raise ValueError("RolloutBatch.loss_mask_BTr: True on a padding token (outside response_mask_BTr)")
        if (self.env_rewards_B is None) != (self.env_scored_B is None):
            raise ValueError("RolloutBatch: env_rewards_B and env_scored_B come together (a multi-turn rollout's)")

    @property
    def loss_mask(self) -> Tensor:
        """The response tokens the model sampled: what the log-probs and the losses are over."""
        return self.response_mask_BTr if self.loss_mask_BTr is None else self.loss_mask_BTr


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainBatch(RolloutBatch):
    rewards_B: Tensor  # float32
    old_logprobs_BTr: Tensor  # float32, log-probs under the policy before this step's updates
    # the advantages: one per sample (the outcome estimators: GRPO, RLOO, ...) or one per response token
    # (GAE); exactly one of the two
    advantages_B: Tensor | None = None  # float32
    token_advantages_BTr: Tensor | None = None  # float32, 0 on padding
    ref_logprobs_BTr: Tensor | None = None  # float32, reference policy (None when kl_coef == 0)
    # PPO with a critic: the critic's values before this step's updates (of the state before each
    # response token) and the returns it regresses on (``algos/critic.py``); None without a critic
    values_BTr: Tensor | None = None
    returns_BTr: Tensor | None = None
    scored_B: Tensor | None = None  # uint8: 1 where a reward scored the row, 0 where it left it unscored

    _DTYPES = {**RolloutBatch._DTYPES, "rewards_B": torch.float32, "advantages_B": torch.float32,
               "token_advantages_BTr": torch.float32, "old_logprobs_BTr": torch.float32,
               "ref_logprobs_BTr": torch.float32, "values_BTr": torch.float32, "returns_BTr": torch.float32,
               "scored_B": torch.uint8}

    def __post_init__(self):
        RolloutBatch.__post_init__(self)
        if (self.advantages_B is None) == (self.token_advantages_BTr is None):
            raise ValueError("TrainBatch: give exactly one of advantages_B (per sample) and token_advantages_BTr "
                             f"(per token); got {'both' if self.advantages_B is not None else 'neither'}")
        if (self.values_BTr is None) != (self.returns_BTr is None):
            raise ValueError("TrainBatch: values_BTr and returns_BTr come together (the critic's batch)")


def extend(batch: PromptBatch, cls: type, **fields) -> PromptBatch:
    """Build a ``cls`` batch from ``batch``'s fields plus ``fields`` (e.g. RolloutBatch -> TrainBatch)."""
    base = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return cls(**{**base, **fields})


# ---- padding ----
def pad(seqs: Sequence[Tensor], pad_value: int | float = 0, *, left: bool = False,
        length: int | None = None) -> tuple[Tensor, Tensor]:
    """Stack 1-D tensors into [B, T] (T = longest, or ``length``); returns (padded, mask)."""
    T = max((len(s) for s in seqs), default=0) if length is None else length
    if seqs and max(len(s) for s in seqs) > T:
        raise ValueError(f"pad: a sequence of length {max(len(s) for s in seqs)} exceeds length={T}")
    dtype = seqs[0].dtype if seqs else torch.long
    out = torch.full((len(seqs), T), pad_value, dtype=dtype)
    mask = torch.zeros((len(seqs), T), dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s)
        if n:
            sl = slice(T - n, T) if left else slice(0, n)
            out[i, sl] = s
            mask[i, sl] = True
    return out, mask


def unpad(x_BT: Tensor, mask_BT: Tensor) -> list[Tensor]:
    """The rows of a padded tensor without their padding."""
    return [x_BT[i][mask_BT[i]] for i in range(x_BT.shape[0])]
