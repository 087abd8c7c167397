"""Multi-turn rollouts: the model and an environment (``rlflow.envs``) take turns; each episode is one row.

Token in, token out: an episode's context is its prompt's ids followed by exactly the ids the engine sampled and
the observations' ids, appended as they come. Nothing is decoded and encoded again (the text of a turn is made
only for the environment to read), so the row trained on is the sequence generated, token for token. The row's
response holds the whole episode; ``loss_mask_BTr`` marks the model's sampled tokens, the only ones the
log-probs and the losses are over (observations are context), and ``sample_logprobs_BTr`` holds theirs.

The driver overlaps the engine and the environments (sync ``step`` in threads, ``async def step`` on an event
loop: ``rlflow/envs/calls.py``), so a slow environment delays its own episode, not the batch. An engine that
serves requests as they come (``engine.serve``, the built-in one: continuous batching across turns) gets each
episode's next turn the moment its environment answers, into the running batch; any other engine is driven call
by call (``engine.generate`` over the contexts of every episode whose environment has answered, one turn each).
The engine waits only when no episode is ready: that time is ``rollout_idle_s``.

Sampling: turn t of the episode of sample index i draws the noise of sample index ``i * max_turns + t``, so its
tokens do not depend on which other episodes share a generation call (the built-in engine's batch
invariance), and with one turn they are the single-turn rollout's.

The rules at the limits:
- ``max_turns``: the environment's step after the model's last allowed turn still runs and its reward counts;
  an episode it does not end there ends (counted ``env/max_turns``), its observation unused.
- ``max_total_tokens`` (response tokens of an episode, model turns and observations): an observation after
  which a whole next turn (``max_new_tokens``) would not fit within it, or within the model's positions, ends
  the episode before it is appended (counted ``env/max_tokens``), with the rewards so far.
- An environment that raises (``env/errors``), outlasts ``timeout_s`` in its start or a step
  (``env/timeouts``), or returns anything but a ``Feedback`` of text or in-vocabulary ids, a finite reward
  and a bool ``done`` (``env/malformed``) ends that episode unscored; the run goes on.
- The episode's reward is the sum of the environment's rewards; an episode that got none is scored by the
  run's reward on the model's last turn (a verifier of the final answer).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import functools
import inspect
import json
import logging
import math
import numbers
import threading
import time
from dataclasses import dataclass, field

import torch

from rlflow.batch import PromptBatch, RolloutBatch, extend, pad, unpad
from rlflow.data import Example
from rlflow.engines.base import capabilities
from rlflow.envs import Feedback, load_env
from rlflow.envs.calls import EnvCalls, EnvTimeout

log = logging.getLogger("rlflow")

FAILURES = ("errors", "timeouts", "malformed")  # ends that leave the episode unscored
ENDS = FAILURES + ("max_turns", "max_tokens")
TIMES = ("rollout_idle_s", "rollout_driver_s")


def check_budget(mcfg: "MultiTurnConfig", max_new_tokens: int) -> None:
    """ValueError when an episode's budget cannot hold its first turn."""
    if mcfg.max_total_tokens is not None and mcfg.max_total_tokens < max_new_tokens:
        raise ValueError(f"max_total_tokens={mcfg.max_total_tokens} is below max_new_tokens={max_new_tokens}: "
                         "an episode's budget must hold its first turn")


def figure_names(mcfg: "MultiTurnConfig") -> tuple[str, ...]:
    """The names of a rollout's figures (``MultiTurn.figures``): its counts, then its times."""
    counts = tuple(getattr(load_env(mcfg.env), "COUNTS", ()))
    return tuple(f"env/{e}" for e in ENDS + counts) + ("env/episodes", "env/turns", "env/calls",
                                                        "env/sampled_tokens") + TIMES


@dataclass(frozen=True, kw_only=True)
class MultiTurnConfig:
    env: str  # a built-in environment (``envs.ENVS``) or path/to/file.py:Class / module:Class
    max_turns: int = 2  # the model's turns per episode
    max_total_tokens: int | None = None  # response tokens per episode (None: the model's positions bound them)
    timeout_s: float = 60.0  # seconds an environment's start or step may take
    tools: str | None = None  # the tools an environment that runs them gets (``envs.tools.load_tools``)
    # environment calls in flight at once: the threads sync steps run in (a step that waits on a tool or a
    # sandbox holds one while it waits); async steps share the event loop
    concurrency: int = 256

    def __post_init__(self):
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"max_turns={self.max_turns!r} must be an integer >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens={self.max_total_tokens!r} must be >= 1 (None: no limit)")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be > 0")
        if not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency!r} must be an integer >= 1")


@dataclass
class _Episode:
    example: object  # what the environment starts from (``data.Example``)
    prompt: list[int]
    budget: int  # response tokens the episode may hold
    env: object = None
    ids: list[int] = field(default_factory=list)  # the response so far: turns and observations
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    last_turn: list[int] = field(default_factory=list)
    reward: float | None = None  # the environment's, summed
    end: str | None = None  # why it ended at a limit or a failure (None: the environment ended it, or running)


def example_of(answer: str, prompt_ids: list[int], decode) -> Example:
    """The example an episode starts from: an answer carried as the JSON of the prompt, the answer and the extra
    columns (``rewards.CombinedReward(context=True)``, as the recipe makes them with ``--env``) unpacked; a plain
    answer with the prompt's text decoded."""
    try:
        row = json.loads(answer)
    except ValueError:
        row = None
    if isinstance(row, dict) and set(row) == {"prompt", "answer", "extra"}:
        return Example(row["prompt"], row["answer"], extra=row["extra"])
    return Example(decode(prompt_ids), answer)


def plain_render(encode):
    """Observations without a chat template: their messages' text, encoded as it is."""
    return lambda messages, closed: list(encode("".join(m["content"] for m in messages)))


def chat_render(template, encode):
    """Observations through ``template`` (``tokenizer.ChatTemplate``): the text that follows the model's turn to
    add the messages and open its next turn (``ChatTemplate.continuation``), encoded once."""
    return lambda messages, closed: list(encode(template.continuation(messages, closed=closed)))


# Once an environment has answered, the engine waits while others keep answering within this window, so the
# steps submitted together (a generation call's episodes) rejoin together: one call for them, not one per answer.
COALESCE_S = 0.01


def _gather(pending) -> None:
    """Wait for the first of ``pending`` to complete, then for the others as long as each arrives within
    ``COALESCE_S`` of the one before."""
    cf.wait(pending, return_when=cf.FIRST_COMPLETED)
    n = sum(f.done() for f in pending)
    while n < len(pending):
        cf.wait(pending, timeout=COALESCE_S, return_when=cf.ALL_COMPLETED)
        now = sum(f.done() for f in pending)
        if now == n:
            return
        n = now


class MultiTurn:
    """One rank's multi-turn rollouts (``rollout``) with the environment ``mcfg.env``. ``render(messages, closed)
    -> ids`` makes an observation into tokens (``plain_render``, ``chat_render``; ``closed``: the model's turn ended
    with its end-of-sequence token); ``decode(ids) -> text``: the tokenizer's; ``reward_fn(completions,
    answers)``: the run's reward, for episodes the environment gave none; ``max_positions`` and ``vocab_size``: the
    model's; ``max_new_tokens``: a turn's budget (the engine's); ``eos_id``: where a turn ends; ``tools``: the
    run's tools (name -> function), given to an environment class that takes a ``tools`` keyword."""

    def __init__(self, mcfg: MultiTurnConfig, *, render, decode, reward_fn, max_new_tokens: int,
                 max_positions: int, vocab_size: int, eos_id: int, tools: dict | None = None):
        self.mcfg, self.env_cls = mcfg, load_env(mcfg.env)
        self.count_names = tuple(getattr(self.env_cls, "COUNTS", ()))
        self._count_keys = [n for n in figure_names(mcfg) if n not in TIMES]
        if "tools" in inspect.signature(self.env_cls).parameters:
            if not tools:
                raise ValueError(f"env {mcfg.env}: it runs tools, and none are given (--tools)")
            self.env_cls = functools.partial(self.env_cls, tools=tools)
        check_budget(mcfg, max_new_tokens)
        self.render, self.decode, self.reward_fn, self.eos_id = render, decode, reward_fn, eos_id
        self.max_new_tokens, self.max_positions, self.vocab_size = max_new_tokens, max_positions, vocab_size
        self._calls = EnvCalls(mcfg.env, concurrency=mcfg.concurrency, timeout_s=mcfg.timeout_s)
        self._counts: dict[str, float] = {}
        self._times: dict[str, float] = {}

    def close(self) -> None:
        self._calls.close()

    # ---- the driver ----
    def rollout(self, engine, prompts: PromptBatch, *, group_size: int, seed: int) -> RolloutBatch:
        """``group_size`` episodes per prompt of ``prompts`` with the weights ``engine`` holds; rows in the
        single-turn rollout's order, sample index ``prompt index * group_size + k``."""
        start = time.perf_counter()
        rows = prompts.repeat(group_size)
        plist = [p.tolist() for p in unpad(rows.prompt_ids_BTp.cpu(), rows.prompt_mask_BTp.cpu())]
        eps = [_Episode(example=example_of(rows.answers[b] if rows.answers else "", plist[b], self.decode), prompt=plist[b],
                        budget=min(self.mcfg.max_total_tokens or self.max_positions, self.max_positions - len(plist[b])))
               for b in range(rows.size)]
        counts = dict.fromkeys(self._count_keys, 0.0)
        if capabilities(engine).serve:
            idle = self._stream(engine, rows, eps, seed, counts)
        else:
            idle = self._waves(engine, rows, eps, seed, counts)
        for ep in eps:
            counts["env/episodes"] += 1
            counts["env/turns"] += ep.turns
            counts["env/sampled_tokens"] += sum(ep.sampled)
            if ep.end is not None:
                counts[f"env/{ep.end}"] += 1
        self._counts = counts
        self._times = dict(zip(TIMES, (idle, time.perf_counter() - start)))
        return self._rows(rows, eps)

    def _stream(self, engine, rows: RolloutBatch, eps: list[_Episode], seed: int, counts: dict) -> float:
        """The episodes through an engine that serves requests as they come (``engine.serve``): a turn is
        requested the moment its environment has answered. Returns the seconds the engine waited for one."""
        cond, ready, live, idle = threading.Condition(), collections.deque(), [len(eps)], [0.0]
        index, T = rows.index_B.cpu().tolist(), self.mcfg.max_turns

        def answered(b: int, f: cf.Future) -> None:  # on the event loop's thread
            go = False
            try:
                counts["env/calls"] += 1
                go = self._answered(eps[b], f, counts)
            finally:
                with cond:
                    if go:
                        ready.append(b)
                    else:
                        live[0] -= 1
                    cond.notify()

        def submit(b: int, fn, *args) -> None:
            self._calls.submit(fn, *args, then=lambda out: answered(b, out))

        mt = self

        class Requests:
            def take(self, n: int, wait: bool):
                with cond:
                    if wait:
                        t = time.perf_counter()
                        while not ready and live[0] > 0:
                            cond.wait()
                        idle[0] += time.perf_counter() - t
                    got = [ready.popleft() for _ in range(min(n, len(ready)))]
                return [(b, eps[b].prompt + eps[b].ids, index[b] * T + eps[b].turns) for b in got]

            def done(self, b: int, ids: list[int], logprobs: list[float]) -> None:
                submit(b, eps[b].env.step, mt.decode(mt._took_turn(eps[b], ids, logprobs)))

        for b, ep in enumerate(eps):
            submit(b, self.env_cls, ep.example)
        engine.serve(Requests(), slots=len(eps), max_len=max(len(ep.prompt) + ep.budget for ep in eps), seed=seed)
        return idle[0]

    def _took_turn(self, ep: _Episode, ids: list[int], logprobs: list[float]) -> list[int]:
        ep.ids += ids
        ep.sampled += [True] * len(ids)
        ep.logprobs += logprobs
        ep.turns += 1
        ep.last_turn = ids
        return ids

    def _waves(self, engine, rows: RolloutBatch, eps: list[_Episode], seed: int, counts: dict) -> float:
        """The episodes through an engine that generates a batch per call: each call takes every episode whose
        environment has answered. Returns the seconds the engine waited for one."""
        pending = {self._calls.submit(self.env_cls, ep.example): b for b, ep in enumerate(eps)}
        ready: list[int] = []
        idle = 0.0
        while pending or ready:
            if not ready:  # the engine has nothing to generate: it waits for the environments to answer
                t = time.perf_counter()
                _gather(pending)
                idle += time.perf_counter() - t
            for f in [f for f in pending if f.done()]:
                b = pending.pop(f)
                counts["env/calls"] += 1
                if self._answered(eps[b], f.result(), counts):
                    ready.append(b)
            if ready:
                batch, ready = sorted(ready), []
                for b, f in self._turn(engine, rows, eps, batch, seed):
                    pending[f] = b
        return idle

    def figures(self) -> tuple[dict[str, float], dict[str, float]]:
        """The last rollout's counts (``env/*``: episodes, turns, environment calls and each end) and times."""
        return dict(self._counts), dict(self._times)

    def _turn(self, engine, rows: RolloutBatch, eps: list[_Episode], batch: list[int], seed: int):
        """One generation call: a turn of each episode in ``batch``; returns (episode, its step's future)."""
        dev = rows.prompt_ids_BTp.device
        ids, mask = pad([torch.tensor(eps[b].prompt + eps[b].ids, dtype=torch.long) for b in batch], 0, left=True)
        index = rows.index_B[batch].cpu() * self.mcfg.max_turns + torch.tensor([eps[b].turns for b in batch])
        ctx = PromptBatch(prompt_ids_BTp=ids.to(dev), prompt_mask_BTp=mask.to(dev), index_B=index.to(dev),
                          group_B=rows.group_B[batch])
        out = engine.generate(ctx, group_size=1, seed=seed)
        got_ids = unpad(out.response_ids_BTr.cpu(), out.response_mask_BTr.cpu())
        got_lp = unpad(out.sample_logprobs_BTr.cpu(), out.response_mask_BTr.cpu())
        return [(b, self._calls.submit(eps[b].env.step,
                                       self.decode(self._took_turn(eps[b], t_ids.tolist(), t_lp.tolist()))))
                for b, t_ids, t_lp in zip(batch, got_ids, got_lp)]

    def _answered(self, ep: _Episode, f: cf.Future, counts: dict[str, float]) -> bool:
        """Take an environment's answer (``f``: the settled outcome of the episode's start, or of a step); True:
        the episode takes another turn."""
        try:
            got = f.result()
        except EnvTimeout as e:
            return self._stop(ep, "timeouts", str(e))
        except Exception as e:
            return self._stop(ep, "errors", f"raised {type(e).__name__}: {e}")
        if ep.env is None:  # the episode's start
            ep.env = got
            return True
        if not isinstance(got, Feedback):
            return self._stop(ep, "malformed", f"returned {type(got).__name__}, not a Feedback")
        r = got.reward
        if r is not None and not (isinstance(r, numbers.Real) and not isinstance(r, bool) and math.isfinite(r)):
            return self._stop(ep, "malformed", f"returned reward {r!r} (a finite number or None)")
        if not isinstance(got.done, bool):
            return self._stop(ep, "malformed", f"returned done={got.done!r} (a bool)")
        extra = got.counts or {}
        if not (isinstance(extra, dict) and set(extra) <= set(self.count_names)
                and all(isinstance(v, numbers.Real) and math.isfinite(v) for v in extra.values())):
            return self._stop(ep, "malformed", f"returned counts {extra!r:.100} (numbers of the names in its COUNTS "
                                               f"{self.count_names})")
        for k, v in extra.items():
            counts[f"env/{k}"] += float(v)
        if r is not None:
            ep.reward = (ep.reward or 0.0) + float(r)
        if got.done:
            return False
        if ep.turns >= self.mcfg.max_turns:
            ep.end = "max_turns"
            return False
        try:
            obs = self._observation(got.observation, closed=bool(ep.last_turn) and ep.last_turn[-1] == self.eos_id)
        except ValueError as e:
            return self._stop(ep, "malformed", str(e))
        except Exception as e:  # the template or the tokenizer refused what the environment said
            return self._stop(ep, "malformed", f"returned an observation rendering raised {type(e).__name__}: {e}")
        if len(ep.ids) + len(obs) + self.max_new_tokens > ep.budget:
            ep.end = "max_tokens"
            return False
        ep.ids += obs
        ep.sampled += [False] * len(obs)
        ep.logprobs += [0.0] * len(obs)
        return True

    def _stop(self, ep: _Episode, why: str, what: str) -> bool:
        ep.end = why
        log.warning("multi-turn: environment %s %s; the episode ends unscored", self.mcfg.env, what)
        return False

    def _observation(self, obs, closed: bool) -> list[int]:
        if obs is None or (isinstance(obs, (list, tuple)) and not obs):
            return []
        if isinstance(obs, (list, tuple)) and obs and all(isinstance(i, int) and not isinstance(i, bool) for i in obs):
            bad = [i for i in obs if not 0 <= i < self.vocab_size]
            if bad:
                raise ValueError(f"returned observation ids {bad[:8]} outside the vocabulary [0, {self.vocab_size})")
            return list(obs)
        msgs = [{"role": "user", "content": obs}] if isinstance(obs, str) else [obs] if isinstance(obs, dict) else obs
        if not (isinstance(msgs, (list, tuple)) and msgs and all(
                isinstance(m, dict) and m.get("role") in ("user", "tool") and isinstance(m.get("content"), str)
                for m in msgs)):
            raise ValueError(f"returned observation {obs!r:.100} (text, user / tool messages, token ids or None)")
        return self.render(list(msgs), closed)

    def _rows(self, rows: RolloutBatch, eps: list[_Episode]) -> RolloutBatch:
        """The episodes as rows: the response, which of its tokens were sampled, their log-probs, the reward."""
        rewards = [math.nan if ep.end in FAILURES else ep.reward for ep in eps]
        scored = [ep.end not in FAILURES for ep in eps]
        todo = [b for b, ep in enumerate(eps) if rewards[b] is None]
        if todo:  # the run's reward of the model's last turn, where the environment gave none
            got = self.reward_fn([self.decode(eps[b].last_turn) for b in todo],
                                 [rows.answers[b] if rows.answers else "" for b in todo])
            for b, v in zip(todo, got):  # None: unscored; a non-finite reward stays one (the step skips its update)
                rewards[b], scored[b] = (math.nan, False) if v is None else (float(v), True)
        dev = rows.prompt_ids_BTp.device
        T = max(1, max(len(ep.ids) for ep in eps))
        ids, mask = pad([torch.tensor(ep.ids, dtype=torch.long) for ep in eps], 0, length=T)
        sampled, _ = pad([torch.tensor(ep.sampled, dtype=torch.bool) for ep in eps], False, length=T)
        lp, _ = pad([torch.tensor(ep.logprobs, dtype=torch.float32) for ep in eps], 0.0, length=T)
        return extend(rows, RolloutBatch, response_ids_BTr=ids.to(dev), response_mask_BTr=mask.to(dev),
                      sample_logprobs_BTr=lp.to(dev), loss_mask_BTr=sampled.to(dev),
                      env_rewards_B=torch.tensor(rewards, dtype=torch.float32, device=dev),
                      env_scored_B=torch.tensor(scored, dtype=torch.bool, device=dev))


__all__ = ["ENDS", "FAILURES", "TIMES", "MultiTurn", "MultiTurnConfig", "example_of", "figure_names"]
