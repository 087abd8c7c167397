"""Stateful and concurrency tests of the dock and the centralized buffer, in-process and on Ray.

The state machine keeps a model of every written cell and every row each consumer has taken, and
predicts each get exactly (lowest ready rows first): a row is delivered to a consumer at most once,
only when all its requested columns are written, with the values put; bad input raises and leaves the
dock's state (controllers' bits, warehouses' cells) unchanged; clear() resets.
"""

import threading

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from rlflow.dock import CentralizedBuffer, Column, Dock, Schema

CAP, G = 8, 2
SCHEMA = Schema(Column("a", torch.int64, "var", length_group="x", pad_left=True),
                Column("b", torch.float32, "var", length_group="x"),
                Column("r", torch.float32, "scalar"),
                Column("f", torch.int32, "fixed", length=2))
NAMES = SCHEMA.names
CONSUMERS = ("c0", "c1")


def cell_value(row: int, col: str, n: int, salt: int = 0):
    if col == "a":
        return torch.arange(n, dtype=torch.int64) + 10 * row + salt
    if col == "b":
        return torch.arange(n, dtype=torch.float32) / 2 - row
    if col == "r":
        return torch.tensor(row + 0.5 + salt, dtype=torch.float32)
    return torch.tensor([row, salt], dtype=torch.int32)


def as_columns(rows, cols, lens, salt=0):
    out = {}
    for c in cols:
        vals = [cell_value(r, c, lens[r], salt) for r in rows]
        out[c] = vals if SCHEMA[c].kind == "var" else torch.stack(vals)
    return out


class DockMachine(RuleBasedStateMachine):
    dock = None  # set by machine_for

    def __init__(self):
        super().__init__()
        self.dock.clear()
        self.cells: dict[tuple[int, str], torch.Tensor] = {}
        self.xlen: dict[int, int] = {}
        self.taken = {c: set() for c in CONSUMERS}

    def unchanged(self, fn, exc, match):
        before = self.dock.snapshot()
        try:
            fn()
        except exc as e:
            assert match in str(e), (match, str(e))
        else:
            raise AssertionError(f"expected {exc.__name__} matching {match!r}")
        assert self.dock.snapshot() == before

    @rule(data=st.data())
    def put(self, data):
        rows = data.draw(st.lists(st.integers(0, CAP - 1), min_size=1, max_size=4, unique=True))
        cols = data.draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
        lens = {r: self.xlen.get(r, data.draw(st.integers(0, 3))) for r in rows}
        if any((r, c) in self.cells for r in rows for c in cols):
            self.unchanged(lambda: self.dock.put(rows, as_columns(rows, cols, lens, salt=7)), ValueError,
                           "already written")
            return
        vcols = [c for c in cols if c in ("a", "b")]
        if vcols and any(r in self.xlen for r in rows) and data.draw(st.booleans()):
            bad = {r: (lens[r] + 1 if r in self.xlen else lens[r]) for r in rows}
            self.unchanged(lambda: self.dock.put(rows, as_columns(rows, cols, bad)), ValueError, "length group")
            return
        self.dock.put(rows, as_columns(rows, cols, lens))
        for r in rows:
            if vcols:
                self.xlen[r] = lens[r]
            for c in cols:
                self.cells[(r, c)] = cell_value(r, c, lens[r])

    @rule(data=st.data())
    def get(self, data):
        consumer = data.draw(st.sampled_from(CONSUMERS))
        cols = data.draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
        groups = data.draw(st.booleans())
        n = data.draw(st.integers(1, CAP // G)) * G if groups else data.draw(st.integers(1, CAP))
        partial, packed, dp = data.draw(st.booleans()), data.draw(st.booleans()), data.draw(st.integers(1, 2))
        taken = self.taken[consumer]
        ok = np.array([all((r, c) in self.cells for c in cols) and r not in taken for r in range(CAP)])
        free = np.array([r not in taken for r in range(CAP)])
        if groups:
            whole = ok.reshape(-1, G).all(1)
            sel = [g * G + k for g in np.flatnonzero(whole)[: n // G] for k in range(G)]
            left = int(free.reshape(-1, G).all(1).sum()) * G
        else:
            sel, left = np.flatnonzero(ok)[:n].tolist(), int(free.sum())
        get = lambda: self.dock.get_dp(consumer, cols, n, dp, groups=groups, timeout=0, partial=partial,  # noqa: E731
                                       packed=packed)
        if not partial and left < n:
            return self.unchanged(get, ValueError, "remain unconsumed")
        if not partial and len(sel) < n:
            return self.unchanged(get, TimeoutError, f"{len(sel)} are ready")
        parts = get()
        got = sorted(i for p in parts for i in p.index_B.tolist())
        assert got == sorted(sel), (got, sel)
        assert abs(parts[0].size - parts[-1].size) <= (G if groups else 1)
        for p in parts:
            for c in cols:
                vals = p.rows(c) if SCHEMA[c].kind == "var" else list(p[c])
                for i, v in zip(p.index_B.tolist(), vals):
                    assert torch.equal(v, self.cells[(i, c)]), (i, c, v, self.cells[(i, c)])
        taken.update(got)

    @rule(data=st.data())
    def bad_input(self, data):
        d, k = self.dock, data.draw(st.integers(0, 6))
        cases = [
            (lambda: d.put([0], {"zz": torch.zeros(1)}), ValueError, "unknown column 'zz'"),
            (lambda: d.get("c0", ["a", "zz"], 1, timeout=0), ValueError, "unknown column 'zz'"),
            (lambda: d.get("nobody", ["a"], 1, timeout=0), ValueError, "unknown consumer 'nobody'"),
            (lambda: d.put([0, 1], {"r": torch.zeros(2, dtype=torch.float64)}), ValueError,
             "column 'r' expects dtype float32, got float64"),
            (lambda: d.put([0, 1], {"f": torch.zeros(2, 3, dtype=torch.int32)}), ValueError, "expects shape [2, 2]"),
            (lambda: d.put([CAP], {"r": torch.zeros(1)}), ValueError, f"index {CAP} out of range"),
            (lambda: d.get("c1", ["r"], CAP + 1, timeout=0), ValueError, "exceeds the dock's capacity"),
        ]
        self.unchanged(*cases[k])

    @rule()
    def clear(self):
        self.dock.clear()
        self.cells.clear()
        self.xlen.clear()
        self.taken = {c: set() for c in CONSUMERS}

    @invariant()
    def pending_matches_model(self):
        for c in CONSUMERS:
            assert self.dock.pending(c, ["r"]) == (
                CAP - len(self.taken[c]), sum((r, "r") in self.cells and r not in self.taken[c] for r in range(CAP)))


def run_machine(dock, examples: int, steps: int):
    machine = type("Machine", (DockMachine,), {"dock": dock})
    run_state_machine_as_test(machine, settings=settings(max_examples=examples, stateful_step_count=steps))


@pytest.mark.parametrize("S", [1, 3])
def test_stateful_dock_in_process(S):
    run_machine(Dock.local(SCHEMA, CONSUMERS, capacity=CAP, warehouses=S, group_size=G), 60, 25)


def test_stateful_centralized_in_process():
    run_machine(CentralizedBuffer.local(SCHEMA, CONSUMERS, capacity=CAP, group_size=G), 40, 25)


# ---- concurrency: producers and consumers at once, nothing lost, nothing twice ----
N_ROWS = 64


def produce(dock, rows):
    for i in range(0, len(rows), 4):
        chunk = rows[i:i + 4]
        dock.put(chunk, {"a": [torch.full((1 + r % 5,), r, dtype=torch.int64) for r in chunk]})


def consume(dock, consumer, cols, writes_b: bool):
    got = []
    while dock.pending(consumer)[0] > 0:
        b = dock.get(consumer, cols, 4, timeout=2, partial=True)
        for i, a in zip(b.index_B.tolist(), b.rows("a")):
            assert a.tolist() == [i] * (1 + i % 5)
        if writes_b and b.size:
            dock.put(b.index_B, {"b": [a.float() for a in b.rows("a")]})
        got += b.index_B.tolist()
    return got


def check_exactly_once(results):
    for consumer, lists in results.items():
        flat = [i for xs in lists for i in xs]
        assert sorted(flat) == list(range(N_ROWS)), f"{consumer}: lost or duplicated rows"


@pytest.mark.parametrize("central", [False, True])
def test_concurrent_threads(central):
    d = (CentralizedBuffer.local(SCHEMA, CONSUMERS, capacity=N_ROWS, group_size=G) if central
         else Dock.local(SCHEMA, CONSUMERS, capacity=N_ROWS, warehouses=2, group_size=G))
    results = {"c0": [[], []], "c1": [[], []]}
    threads = [threading.Thread(target=produce, args=(d, list(range(k, N_ROWS, 2)))) for k in range(2)]
    for c, cols, wb in (("c0", ["a"], True), ("c1", ["a", "b"], False)):
        for k in range(2):
            threads.append(threading.Thread(target=lambda c=c, cols=cols, wb=wb, k=k: results[c].__setitem__(
                k, consume(d, c, cols, wb))))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    check_exactly_once(results)


# ---- the same on Ray: actors for the dock, Ray tasks for producers and consumers ----
@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this test module
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_stateful_ray(ray_session):
    from rlflow.dock.ray_backend import ray_centralized, ray_dock

    d = ray_dock(SCHEMA, CONSUMERS, capacity=CAP, warehouses=2, group_size=G)
    run_machine(d, 20, 20)
    d.close()
    c = ray_centralized(SCHEMA, CONSUMERS, capacity=CAP, group_size=G)
    run_machine(c, 10, 20)
    c.close()


@pytest.mark.slow
def test_concurrent_ray(ray_session):
    from rlflow.dock.ray_backend import ray_dock

    ray = ray_session
    d = ray_dock(SCHEMA, CONSUMERS, capacity=N_ROWS, warehouses=2, group_size=G)
    prod = ray.remote(num_cpus=0)(produce)
    cons = ray.remote(num_cpus=0)(consume)
    refs = [prod.remote(d, list(range(k, N_ROWS, 2))) for k in range(2)]
    out = {c: [cons.remote(d, c, cols, wb) for _ in range(2)] for c, cols, wb in (("c0", ["a"], True),
                                                                                 ("c1", ["a", "b"], False))}
    ray.get(refs, timeout=120)
    check_exactly_once({c: ray.get(r, timeout=120) for c, r in out.items()})
    d.close()


@pytest.mark.slow
def test_ray_reads_are_zero_copy_from_the_object_store(ray_session):
    from rlflow.dock.ray_backend import ray_dock

    d = ray_dock(SCHEMA, CONSUMERS, capacity=CAP, warehouses=1, group_size=G)
    d.put([0], {"a": [torch.arange(50_000)]})  # 400 kB: travels through the object store
    (tk,) = d.take("c0", ["a"], 1)
    wire = d.transport.call(d.warehouses[0], "get", tk.index, ["a"])
    assert not wire["a"][0].flags.writeable, "a same-node read maps the object store's buffer"
    assert torch.equal(d.read(tk).rows("a")[0], torch.arange(50_000))
    d.close()
