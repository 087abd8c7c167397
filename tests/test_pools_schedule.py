"""Separate pools' schedule under drawn timings: the real rollout loop (``producer.produce``), the real train
step (``step.step`` on a train rank) and both ends of the link (``pools.RolloutSide`` / ``TrainSide``, the push of a
real ``push_plan``) run as threads of one process, over an in-memory link whose sends complete only once
received (as gloo's do) and a model of the dock's slots; generation, scoring and the update are replaced by
sleeps of drawn length. For drawn pool sizes, staleness bounds, start steps (a resumed run), stops (an
interrupted train pool) and timings:

- no step is trained more than k versions after the weights that sampled it, and the weights a rollout rank
  generated with are bitwise the version it reports (the push never mixes versions in a buffer in use); with
  partial rollout (a newer version swapped in mid-generation), no token is: the oldest one bounds the step;
- a put never finds its slot holding another step (the dock holds at most k + 1 steps: the back-pressure);
- every produced row is trained on exactly once or counted as dropped at the stop, never both;
- the run ends (no deadlock): every thread finishes within the timeout.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.runtime import producer, step as step_mod
from rlflow.runtime.pools import Link, Pools, RolloutSide, TrainSide
from rlflow.runtime.report import Figures, RolloutReport
from rlflow.runtime.state import RunState
from rlflow.sharding import Layout, Mesh
from rlflow.sharding.layout import ParamLayout
from rlflow.sharding.plan import push_plan
from rlflow.sharding.spec import P

TIMEOUT = 5.0
ROWS = 4  # rows each rollout rank puts per step


class Hub:
    """The link's point-to-point messages: a FIFO per (src, dst, tag); a send completes once received."""

    def __init__(self):
        self.lock = threading.Lock()
        self.queues: dict[tuple, queue.Queue] = {}

    def q(self, key) -> queue.Queue:
        with self.lock:
            return self.queues.setdefault(key, queue.Queue())


class Work:
    def __init__(self, fn):
        self.fn, self.done = fn, False

    def wait(self):
        if not self.done:
            self.fn()
            self.done = True


class Group:
    def __init__(self, hub: Hub, rank: int):
        self.hub, self.rank = hub, rank

    def send(self, tensors, dst, tag):
        received = threading.Event()
        self.hub.q((self.rank, dst, tag)).put((tensors[0].clone(), received))
        return Work(lambda: _wait_event(received))

    def recv(self, tensors, src, tag):
        def take():
            t, received = self.hub.q((src, self.rank, tag)).get(timeout=TIMEOUT)
            tensors[0].copy_(t)
            received.set()
        return Work(take)


def _wait_event(e: threading.Event):
    assert e.wait(TIMEOUT), "a send was never received"


class Store:
    def __init__(self):
        self.cond, self.data = threading.Condition(), {}

    def set(self, key, value):
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def get(self, key):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.data, TIMEOUT), f"store key {key} never set"
            return self.data[key]

    def delete_key(self, key):
        with self.cond:
            del self.data[key]


class Reduce:
    """all_reduce among the rollout ranks' threads (their pool's default group)."""

    def __init__(self, n: int):
        self.n, self.barrier, self.vals = n, threading.Barrier(n, timeout=TIMEOUT), [0] * n
        self.rank = threading.local()

    def __call__(self, t, op):
        self.vals[self.rank.r] = int(t.item())
        self.barrier.wait()
        out = (min if op == torch.distributed.ReduceOp.MIN else max)(self.vals)
        self.barrier.wait()
        return torch.tensor([out])


class Slots:
    """The dock's slots as the pools use them: a slot holds one step's rows (every rollout rank's share) from
    its put until every train rank has ended the step."""

    def __init__(self, rollout: int, train: int):
        self.cond = threading.Condition()
        self.rollout, self.train = rollout, train
        self.slots: dict[int, dict] = {}
        self.produced: Counter = Counter()  # step -> rows put
        self.trained: Counter = Counter()  # step -> rows trained on
        self.problems: list[str] = []

    def put(self, slot: int, step: int, version: tuple[int, int]):
        """``version``: (the first, the last) version a rollout rank's rows of the step were sampled with."""
        with self.cond:
            held = self.slots.setdefault(slot, {"step": step, "versions": [], "taken": set(), "ended": []})
            if held["step"] != step:
                self.problems.append(f"step {step}'s put found slot {slot} holding step {held['step']}")
            held["versions"].append(version)
            self.produced[step] += ROWS
            self.cond.notify_all()

    def get(self, slot: int, rank: int) -> dict:
        """The rows in ``slot`` that train rank ``rank`` has not taken yet, once every rollout rank put its share."""
        with self.cond:
            ok = self.cond.wait_for(lambda: slot in self.slots and len(self.slots[slot]["versions"]) == self.rollout
                                    and rank not in self.slots[slot]["taken"], TIMEOUT)
            assert ok, f"slot {slot} never filled"
            self.slots[slot]["taken"].add(rank)
            return dict(self.slots[slot])

    def end(self, slot: int):
        with self.cond:
            held = self.slots[slot]
            if len(held["taken"]) == self.train and len(held["ended"]) == self.train - 1:
                self.trained[held["step"]] += ROWS * self.rollout
                del self.slots[slot]
                self.cond.notify_all()
            else:
                held["ended"].append(1)


class Flow:
    def __init__(self, slots: Slots):
        self.slots, self.slot = slots, None

    def begin(self, prompts, group_size, slot=None):
        self.slot = slot

    def get(self, consumer, columns, mesh, rank):
        held = self.slots.get(self.slot, rank)
        versions = torch.tensor(held["versions"], dtype=torch.long)  # [rollout ranks, 2]: as tokens of rows
        return SimpleNamespace(**held, versions_BTr=versions, loss_mask=torch.ones_like(versions, dtype=torch.bool)), \
            {"rewards": torch.zeros(1)}

    def end(self):
        self.slots.end(self.slot)


@st.composite
def schedules(draw):
    k = draw(st.integers(0, 2))
    rollout, train = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    steps = draw(st.integers(1, 6))
    start = draw(st.integers(0, steps - 1))
    stop_at = draw(st.integers(start + 1, steps))  # the train pool's last step + 1 (< steps: interrupted)
    ms = st.lists(st.floats(0, 3), min_size=steps, max_size=steps)
    rollout_tp = draw(st.booleans())
    return dict(k=k, rollout=rollout, train=train, steps=steps, start=start, stop_at=stop_at,
                gen=[draw(ms) for _ in range(rollout)], upd=[draw(ms) for _ in range(train)],
                rollout_tp=rollout_tp, partial=draw(st.booleans()) and not (rollout_tp and rollout > 1))


def _layouts(rollout: int, train: int, rollout_tp: bool):
    common = dict(name="w", shape=(4, 4), view=(4, 4), merge=(1, 1), stage=0)
    t = Layout(Mesh(tp=train), (ParamLayout(spec=P("tp", None) if train > 1 else P(None, None),
                                            dtype=torch.float32, **common),))
    rm = Mesh(tp=rollout) if rollout_tp else Mesh(dp=rollout)
    r = Layout(rm, (ParamLayout(spec=P(None, "tp") if rollout_tp and rollout > 1 else P(None, None),
                                dtype=torch.float32, **common),))
    return t, r


def run_schedule(s: dict, monkeypatch) -> dict:
    k, R, T, steps = s["k"], s["rollout"], s["train"], s["steps"]
    pools, hub, store, slots = Pools(R, R + T), Hub(), Store(), Slots(R, T)
    rollout_tp = s["rollout_tp"] and R > 1
    plan = push_plan(*_layouts(R, T, s["rollout_tp"]))
    reduce = Reduce(R)
    conf = SimpleNamespace(max_staleness=k, prompts_per_step=1, grpo=SimpleNamespace(group_size=1), steps=steps)
    seen: dict = {"trained": [], "staleness": [], "errors": [], "dropped": {}}

    def rollout_rank(r):
        reduce.rank.r = r
        try:
            side = RolloutSide(Link(pools, r, Group(hub, r), store), r, R, plan, partial=s["partial"])
            loaded = {}

            def half(j, version):  # half the generation, with weights that must stay the version's
                w = loaded["w"]
                if not bool((w == version).all()):
                    seen["errors"].append(f"rollout rank {r} step {j}: weights {w.flatten()[0]} for version {version}")
                time.sleep(s["gen"][r][j] / 2e3)
                if not bool((w == version).all()):
                    seen["errors"].append(f"rollout rank {r} step {j}: its weights changed while it generated")

            def generate(j, version, newer):
                first = version
                half(j, version)
                if newer is not None and (got := newer()) is not None:  # partial rollout: the rest under them
                    version = got[0]
                    loaded.update(got[1])
                half(j, version)
                return first, version

            engine = SimpleNamespace(load=loaded.update, figures=dict)
            ctx = SimpleNamespace(config=conf, flow=Flow(slots), engine=engine, generate=generate, multiturn=None,
                                  pool=side)
            producer.produce(SimpleNamespace(take=lambda n: None), ctx)
        except Exception as e:  # noqa: BLE001 -- the test reports it
            seen["errors"].append(f"rollout rank {r}: {e!r}")

    def train_rank(t):
        try:
            g = R + t
            side = TrainSide(Link(pools, g, Group(hub, g), store), t, plan)
            ctx = SimpleNamespace(config=conf, seats=SimpleNamespace(mesh=lambda _: None, rank=t), flow=Flow(slots),
                                  pool=side, graph={"update": SimpleNamespace(runs_on="train")}, dock_columns=[])
            w = torch.full((4 // T, 4), float(s["start"]))
            state = RunState(policy={"w": w}, opt_state=None, source=None, steps_done=s["start"])
            for _ in range(s["start"], s["stop_at"]):
                state, out = step_mod.step(state, None, ctx)
                if t == 0:
                    seen["staleness"].append(out.figures.times["staleness"])
            seen["dropped"][t] = side.stop()
        except Exception as e:  # noqa: BLE001
            seen["errors"].append(f"train rank {t}: {e!r}")

    def train_on(state, held, c, ctx, clock):
        index, t = state.steps_done, ctx.seats.rank
        if held.step != index:
            seen["errors"].append(f"train step {index} got the rows of step {held.step}")
        seen["trained"].append((t, index, held.versions))
        time.sleep(s["upd"][t][index] / 1e3)
        state.policy["w"].fill_(index + 1)  # in place, while the previous push may still travel
        return state, {}, 0.0

    def score_and_put(version, j, ctx, clock):  # ``version``: the fake generate's (first, last)
        slots.put(ctx.flow.slot, j, version)
        return RolloutReport(j, Figures(), rows=ROWS), None, None

    monkeypatch.setattr("rlflow.sharding.dist.all_reduce", reduce)
    monkeypatch.setattr(producer, "generate",
                        lambda prompts, j, ctx, version, newer: ctx.generate(j, version, newer))
    monkeypatch.setattr(producer, "score_and_put", score_and_put)
    monkeypatch.setattr(producer, "prompts_at", lambda source, j, ctx: None)
    monkeypatch.setattr(step_mod, "train_on", train_on)
    monkeypatch.setattr(step_mod, "_nonfinite", lambda state: 0.0)
    threads = [threading.Thread(target=rollout_rank, args=(r,), daemon=True) for r in range(R)]
    threads += [threading.Thread(target=train_rank, args=(t,), daemon=True) for t in range(T)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 2 * TIMEOUT
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    seen["alive"] = [th.name for th in threads if th.is_alive()]
    seen["slots"] = slots
    return seen


@settings(max_examples=40, deadline=None)
@given(schedules())
def test_drawn_schedules_keep_the_staleness_bound_lose_no_row_and_end(s):
    with pytest.MonkeyPatch.context() as mp:
        _check(s, run_schedule(s, mp))


@pytest.mark.parametrize("rollout", [1, 2])
@pytest.mark.parametrize("gen,upd", [(8.0, 0.0), (0.0, 8.0)])
def test_partial_rollout_swaps_versions_mid_generation_within_the_bound(rollout, gen, upd):
    """Partial rollout at k = 1. Generation slower than the update: the next version lands while a step
    generates, and it is swapped in there (each rank on its own). Faster: the rollout pool waits for versions."""
    s = dict(k=1, rollout=rollout, train=1, steps=6, start=0, stop_at=6, gen=[[gen] * 6] * rollout, upd=[[upd] * 6],
             rollout_tp=False, partial=True)
    with pytest.MonkeyPatch.context() as mp:
        seen = run_schedule(s, mp)
    _check(s, seen)
    spans = [i for _, i, vs in seen["trained"] if any(a != b for a, b in vs)]
    if gen > upd:
        assert len(spans) >= 2, seen["trained"]  # steps whose rows span two versions


def _check(s: dict, seen: dict) -> None:
    assert seen["alive"] == [], f"deadlock: {seen['alive']} still running ({s})"
    assert seen["errors"] == [], seen["errors"]
    slots: Slots = seen["slots"]
    assert slots.problems == [], slots.problems
    steps = list(range(s["start"], s["stop_at"]))
    for t in range(s["train"]):  # every train rank trained each step once, in order, on rows of one version
        mine = [(i, vs) for r, i, vs in seen["trained"] if r == t]
        assert [i for i, _ in mine] == steps
        assert all(0 <= i - v <= s["k"] for i, vs in mine for pair in vs for v in pair), (s["k"], mine)
        if not s["partial"]:  # the rollout ranks generated with one version
            assert all(len({v for pair in vs for v in pair}) == 1 for _, vs in mine), mine
    lead = [(i, min(first for first, _ in vs)) for r, i, vs in seen["trained"] if r == 0]
    assert seen["staleness"] == [float(i - v) for i, v in lead]  # the reports name the oldest version
    assert all(slots.trained[i] == slots.produced[i] == ROWS * s["rollout"] for i in steps)
    untrained = {i: n for i, n in slots.produced.items() if i not in slots.trained}
    assert all(i >= s["stop_at"] for i in untrained), untrained  # only what the stop made useless
    assert seen["dropped"] == {0: sum(untrained.values()), **{t: 0 for t in range(1, s["train"])}}


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_step_j_is_generated_only_with_version_j_minus_k_or_newer_driven_by_hand(k, partial):
    """The staleness rule with the schedule driven step by step, no timing: with version v pushed, the rollout
    side hands out weights at once for every step up to v + k, and for step v + k + 1 only once version v + 1
    lands. (A rule loosened to k + 1 passed the drawn schedules above unless their timing hit it.)"""
    pools, hub, store = Pools(1, 2), Hub(), Store()
    plan = push_plan(*_layouts(1, 1, False))
    rollout = RolloutSide(Link(pools, 0, Group(hub, 0), store), 0, 1, plan, partial=partial)
    train = TrainSide(Link(pools, 1, Group(hub, 1), store), 0, plan)
    v = 3
    train.push({"w": torch.full((4, 4), float(v))}, v)
    assert rollout.first_version() == v
    for step in range(v, v + k + 1):
        got = rollout.weights_for(step, k)
        assert got[0] == v and bool((got[1]["w"] == v).all()), (step, got[0])
    waiter: dict = {}
    th = threading.Thread(target=lambda: waiter.update(got=rollout.weights_for(v + k + 1, k)), daemon=True)
    th.start()
    th.join(0.3)
    assert "got" not in waiter, f"step {v + k + 1} was handed version {waiter['got'][0]}, {k + 1} versions old"
    train.push({"w": torch.full((4, 4), float(v + 1))}, v + 1)
    th.join(TIMEOUT)
    assert waiter["got"][0] == v + 1 and bool((waiter["got"][1]["w"] == v + 1).all())
