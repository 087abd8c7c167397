"""Environments the multi-turn tests load by spec (``tests/multiturn_envs.py:Name``), as a user's file is."""

import asyncio
import time

from rlflow.envs import Feedback


class Hint:
    """Never rewards nor ends: every turn gets the observation "+="; the run's reward scores the last turn."""

    def __init__(self, example):
        pass

    def step(self, turn):
        return Feedback(observation="+=")


class AsyncHint(Hint):
    async def step(self, turn):
        await asyncio.sleep(0.001)
        return Feedback(observation="+=", reward=0.25)


class Faulty:
    """Misbehaves by the episode's answer (the task ``first_digit``'s digit): 0 raises at the start, 1 raises in
    its step, 2 sleeps past the timeout, 3 returns a dict, 4 a NaN reward, 5 done="yes", 6 ids outside the
    vocabulary, 7 text the tokenizer cannot encode; the others end rewarded."""

    def __init__(self, example):
        self.kind = int(example.answer)
        if self.kind == 0:
            raise RuntimeError("no episode for you")

    def step(self, turn):
        k = self.kind
        if k == 1:
            raise KeyError("broken step")
        if k == 2:
            time.sleep(1.0)
        bad = {3: {"observation": "x"}, 4: Feedback(reward=float("nan")), 5: Feedback(done="yes"),
               6: Feedback(observation=[5, 10_000]), 7: Feedback(observation="héllo")}
        return bad.get(k, Feedback(reward=1.0, done=True))


class SlowFirst:
    """Episode 0 (answer "0") takes 0.5 s a step, the others answer at once; always one more turn."""

    def __init__(self, example):
        self.slow = example.answer == "0"

    def step(self, turn):
        if self.slow:
            time.sleep(0.5)
        return Feedback(observation="+")


class Echo:
    """Answers every turn with the turn's own text as the observation (the token case of the tests)."""

    def __init__(self, example):
        pass

    def step(self, turn):
        return Feedback(observation=turn)


STARTS: list = []  # (answer, turn, time) of every SlowFirstLog step


class SlowFirstLog(SlowFirst):
    def __init__(self, example):
        super().__init__(example)
        self.answer, self.turn = example.answer, 0

    def step(self, turn):
        self.turn += 1
        STARTS.append((self.answer, self.turn, time.perf_counter()))
        return super().step(turn)


def spread(prompts, completions, answers, **columns):
    """A reward with spread in every group from the first step: the distinct characters of the last turn."""
    return [len(set(c)) / 4.0 for c in completions]


class Slow:
    """Every step sleeps 0.3 s (shorter than the tests' timeout), and the episode goes on."""

    def __init__(self, example):
        pass

    def step(self, turn):
        time.sleep(0.3)
        return Feedback(observation=[])


class Stubborn:
    """An async step that swallows its cancellation and never ends."""

    def __init__(self, example):
        pass

    async def step(self, turn):
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass


class Blocking:
    """Episode 0's async step blocks the event loop (time.sleep inside async def) for 0.6 s; the others await
    0.05 s and go on."""

    def __init__(self, example):
        self.blocks = example.answer == "0"

    async def step(self, turn):
        if self.blocks:
            time.sleep(0.6)
        else:
            await asyncio.sleep(0.05)
        return Feedback(observation=[])
