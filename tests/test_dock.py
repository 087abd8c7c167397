"""Transfer dock: put/get semantics, options, bad input, samplers, the cost model; in-process and with the
warehouses and controllers in processes of their own (``proc_dock``, what the distributed runtime uses)."""

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlflow.dock import CentralizedBuffer, Column, Dock, Schema
from rlflow.dock.proc_backend import node_dock, proc_dock
from rlflow.dock.cost import Shape, centralized_bytes, dock_bytes, stage_bytes
from rlflow.runtime.graph import GRPO
from rlflow.dock.samplers import balance, imbalance, pick_groups
from rlflow.dock.schema import Packed, take_rows

CAP, G = 16, 4
MAKERS = {
    "dock1": lambda: Dock.local(GRPO.schema, GRPO.flow_consumers, capacity=CAP, warehouses=1, group_size=G),
    "dock3": lambda: Dock.local(GRPO.schema, GRPO.flow_consumers, capacity=CAP, warehouses=3, group_size=G),
    "central": lambda: CentralizedBuffer.local(GRPO.schema, GRPO.flow_consumers, capacity=CAP, group_size=G),
    "procs2": lambda: proc_dock(GRPO.schema, GRPO.flow_consumers, capacity=CAP, warehouses=2, group_size=G),
}


@pytest.fixture(params=list(MAKERS))
def dock(request):
    d = MAKERS[request.param]()
    yield d
    d.close()


def prompts(rows, seed=0):
    return [torch.full((1 + (r * 7 + seed) % 5,), r, dtype=torch.long) for r in rows]


def put_prompts(d, rows):
    d.put(rows, {"prompt_ids": prompts(rows), "group": torch.tensor(rows) // G})


def put_responses(d, rows):
    resp = [torch.arange(1 + r % 3) + 100 * r for r in rows]
    d.put(rows, {"response_ids": resp, "sample_logprobs": [-(x.float()) for x in resp]})


# ---- the basic flow ----
def test_put_get_roundtrip_padded_and_packed(dock):
    put_prompts(dock, list(range(CAP)))
    b = dock.get("rollout", ["prompt_ids", "group"], 8)
    assert b.index_B.tolist() == list(range(8))
    assert [r.tolist() for r in b.rows("prompt_ids")] == [p.tolist() for p in prompts(range(8))]
    m = b.mask["prompt_ids"]
    assert m[:, -1].all(), "prompts are left-padded: the last position is always real"
    assert b["group"].tolist() == [r // G for r in range(8)]
    c = dock.get("rollout", ["prompt_ids"], 8, packed=True)
    assert c.index_B.tolist() == list(range(8, 16))
    assert c.lengths("prompt_ids").tolist() == [len(p) for p in prompts(range(8, 16))]
    assert torch.equal(c["prompt_ids"], torch.cat(prompts(range(8, 16))))


def test_get_waits_for_every_requested_column(dock):
    put_prompts(dock, list(range(CAP)))
    put_responses(dock, [1, 3, 5])
    b = dock.get("score", ["prompt_ids", "response_ids"], 3, timeout=0)
    assert b.index_B.tolist() == [1, 3, 5]
    assert [r.tolist() for r in b.rows("response_ids")] == [[100, 101], [300], [500, 501, 502]]
    assert dock.get("score", ["prompt_ids", "response_ids"], 2, timeout=0, partial=True).size == 0
    # another consumer still sees the same rows: consumption is per consumer
    assert dock.get("update", ["response_ids"], 3, timeout=0).index_B.tolist() == [1, 3, 5]


def test_whole_groups_only(dock):
    put_prompts(dock, list(range(CAP)))
    put_responses(dock, [0, 1, 2, 4, 5, 6, 7, 9])  # group 1 complete, group 0 misses row 3
    b = dock.get("score", ["response_ids"], G, groups=True, timeout=0)
    assert b.index_B.tolist() == [4, 5, 6, 7]
    with pytest.raises(TimeoutError):
        dock.get("score", ["response_ids"], G, groups=True, timeout=0)
    assert dock.get("score", ["response_ids"], 2, timeout=0).index_B.tolist() == [0, 1]


def test_get_dp_balances_length_with_equal_counts(dock):
    rows = list(range(CAP))
    dock.put(rows, {"prompt_ids": [torch.zeros(1 + 10 * (r % 2) + r, dtype=torch.long) for r in rows]})
    parts = dock.get_dp("rollout", ["prompt_ids"], CAP, 4)
    assert sorted(sum((p.index_B.tolist() for p in parts), [])) == rows
    assert [p.size for p in parts] == [4, 4, 4, 4]
    tot = [int(p.lengths("prompt_ids").sum()) for p in parts]
    assert max(tot) - min(tot) <= 2, tot


def test_get_dp_groups_stay_whole(dock):
    put_prompts(dock, list(range(CAP)))
    parts = dock.get_dp("rollout", ["prompt_ids"], CAP, 2, groups=True)
    for p in parts:
        gs = (p.index_B // G).tolist()
        assert all(gs.count(g) == G for g in set(gs))


def test_blocking_get_wakes_when_rows_arrive(dock):
    put_prompts(dock, list(range(CAP)))
    out = {}

    def consumer():
        out["b"] = dock.get("score", ["response_ids"], 4, timeout=10)

    t = threading.Thread(target=consumer)
    t.start()
    time.sleep(0.05)
    assert "b" not in out
    put_responses(dock, [2, 3])
    time.sleep(0.05)
    assert "b" not in out, "must wait for 4 rows"
    put_responses(dock, [8, 9])
    t.join(5)
    assert out["b"].index_B.tolist() == [2, 3, 8, 9]


def test_clear_resets_everything(dock):
    put_prompts(dock, list(range(CAP)))
    dock.get("rollout", ["prompt_ids"], 4)
    dock.clear()
    assert dock.pending("rollout", ["prompt_ids"]) == (CAP, 0)
    put_prompts(dock, [0])  # the same cell can be written again after clear
    assert dock.get("rollout", ["prompt_ids"], 1, timeout=0).index_B.tolist() == [0]


def test_blocked_get_on_impossible_request_raises(dock):
    put_prompts(dock, list(range(CAP)))
    dock.get("rollout", ["prompt_ids"], 12)
    with pytest.raises(ValueError, match="only 4 remain"):
        dock.get("rollout", ["prompt_ids"], 8)


def test_bfloat16_and_fixed_columns():
    schema = Schema(Column("h", torch.bfloat16, "var"), Column("f", torch.int32, "fixed", length=3))
    for d in (Dock.local(schema, ["c"], capacity=4, warehouses=2), CentralizedBuffer.local(schema, ["c"], capacity=4)):
        h = [torch.randn(n).bfloat16() for n in (1, 3, 2, 4)]
        f = torch.arange(12, dtype=torch.int32).reshape(4, 3)
        d.put([0, 1, 2, 3], {"h": h, "f": f})
        b = d.get("c", ["h", "f"], 4)
        assert b["h"].dtype == torch.bfloat16 and all(torch.equal(x, y) for x, y in zip(b.rows("h"), h))
        assert torch.equal(b["f"], f)


def test_puts_spread_rows_round_robin_by_group():
    d = Dock.local(GRPO.schema, GRPO.flow_consumers, capacity=CAP, warehouses=2, group_size=G)
    put_prompts(d, list(range(CAP)))
    held = [w["prompt_ids"] for w in d.snapshot()["warehouses"]]
    assert held == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    put_responses(d, [4])  # later columns follow the row to its warehouse
    assert d.snapshot()["warehouses"][1]["response_ids"] == [4]


def test_a_packed_put_stores_what_the_per_row_put_stores(dock):
    """``Packed.from_padded`` of left-padded prompts and right-padded responses (and [B, T, K] routes) puts
    the same cells as a tensor per row."""
    rows = list(range(8))
    want = prompts(rows)
    T = max(len(p) for p in want)
    pad = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, p in enumerate(want):
        pad[i, T - len(p):], mask[i, T - len(p):] = p, True
    resp = torch.arange(8 * 3).view(8, 3)
    rmask = torch.arange(3)[None, :] < torch.tensor([1, 2, 3, 0, 3, 2, 1, 3])[:, None]
    routes = torch.arange(8 * 3 * 2, dtype=torch.int16).view(8, 3, 2)
    dock.put(rows, {"prompt_ids": Packed.from_padded(pad, mask), "group": torch.tensor(rows) // G,
                    "response_ids": Packed.from_padded(resp, rmask),
                    "sample_logprobs": Packed.from_padded(-resp.float(), rmask),
                    "response_routes": Packed.from_padded(routes, rmask)})
    b = dock.get("update", ["prompt_ids", "response_ids", "sample_logprobs", "response_routes"], 8)
    assert [r.tolist() for r in b.rows("prompt_ids")] == [p.tolist() for p in want]
    assert [r.tolist() for r in b.rows("response_ids")] == [resp[i][rmask[i]].tolist() for i in rows]
    assert [r.tolist() for r in b.rows("sample_logprobs")] == [(-resp[i][rmask[i]].float()).tolist() for i in rows]
    assert [r.tolist() for r in b.rows("response_routes")] == [routes[i][rmask[i]].reshape(-1).tolist() for i in rows]


def test_bad_packed_put(dock):
    put_prompts(dock, [0, 1])
    v = torch.arange(5)
    _unchanged(dock, lambda: dock.put([2, 3], {"prompt_ids": Packed(v, torch.tensor([2, 2]))}), ValueError,
               r"column 'prompt_ids': Packed lengths \(sum 4, min 2\) do not cover the \(5,\) values")
    _unchanged(dock, lambda: dock.put([2, 3], {"prompt_ids": Packed(v, torch.tensor([2, 2, 1]))}), ValueError,
               "Packed lengths must be 2 integers")
    _unchanged(dock, lambda: dock.put([2, 3], {"prompt_ids": Packed(v.float(), torch.tensor([2, 3]))}), ValueError,
               "column 'prompt_ids' expects dtype int64, got float32")
    _unchanged(dock, lambda: dock.put([2, 3], {"prompt_ids": Packed(v, torch.tensor([6, -1]))}), ValueError,
               "do not cover")


@pytest.mark.parametrize("make", ["dock3", "procs2"])
def test_a_shared_take_hands_each_part_its_rows_once(make):
    """``take_share``: ranks asking concurrently, before the rows are ready, each get their part of one take;
    the parts cover every row once, keep groups whole and balance the lengths; a peer asking for the same
    part gets the same rows; another routing of the same take, or a part out of range, is refused."""
    d = MAKERS[make]()
    try:
        got, errors = {}, []

        def ask(part, tag):
            try:
                t = d.take_share("update", ["prompt_ids"], CAP, key=7, parts=2, part=part, cost=("prompt_ids",),
                                 groups=True, timeout=10)
                got[(part, tag)] = (t.index.tolist(), t.lengths["prompt_ids"].tolist())
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=ask, args=(p, tag)) for p in (0, 1) for tag in ("a", "b")]
        for t in threads:
            t.start()
        time.sleep(0.2)  # every rank is waiting: the rows come after
        put_prompts(d, list(range(CAP)))
        for t in threads:
            t.join()
        assert not errors, errors
        assert got[(0, "a")] == got[(0, "b")] and got[(1, "a")] == got[(1, "b")]  # peers read the same rows
        rows = got[(0, "a")][0] + got[(1, "a")][0]
        assert sorted(rows) == list(range(CAP))
        for part in (0, 1):
            assert len({r // G for r in got[(part, "a")][0]}) * G == len(got[(part, "a")][0])  # whole groups
        lens = [sum(got[(p, "a")][1]) for p in (0, 1)]
        assert abs(lens[0] - lens[1]) <= max(len(x) for x in prompts(range(CAP))) * G
        with pytest.raises(ValueError, match=r"take 7 was made for .* 2, \('prompt_ids',\), True, None\), not .* 4,"):
            d.take_share("update", ["prompt_ids"], CAP, key=7, parts=4, part=0, cost=("prompt_ids",), groups=True)
        with pytest.raises(ValueError, match=r"part must be in \[0, 2\), got 2"):
            d.take_share("update", ["prompt_ids"], CAP, key=7, parts=2, part=2, groups=True)
        with pytest.raises(ValueError, match="was made for"):  # the same key, another request
            d.take_share("update", ["prompt_ids"], G, key=7, parts=2, part=0, cost=("prompt_ids",), groups=True)
        with pytest.raises(ValueError, match=r"cost columns \['group'\] are not among"):
            d.take_share("update", ["prompt_ids"], CAP, key=8, parts=2, part=0, cost=("group",), groups=True)
        d.clear()  # forgets the take: the same key takes again, the new rows
        put_prompts(d, list(range(2 * G)))
        parts = [d.take_share("update", ["prompt_ids"], 2 * G, key=7, parts=2, part=p, groups=True, timeout=0)
                 for p in (0, 1)]
        assert sorted(parts[0].index.tolist() + parts[1].index.tolist()) == list(range(2 * G))
        assert len(parts[0]) == len(parts[1]) == G
    finally:
        d.close()


def test_a_clear_fails_a_shared_take_still_waiting():
    """A rank waiting in ``take_share`` when the dock is cleared (the step it waited for is gone) fails with a
    clear error instead of taking the next step's rows; a timeout ends a wait for rows that never come."""
    d = MAKERS["dock3"]()
    err = []

    def wait():
        try:
            d.take_share("update", ["prompt_ids"], CAP, key=1, parts=1, part=0, groups=True, timeout=10)
        except Exception as e:  # noqa: BLE001 - checked below
            err.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.2)
    d.clear()
    t.join(5)
    assert not t.is_alive() and len(err) == 1 and "cleared while take 1 waited" in str(err[0]), err
    with pytest.raises(TimeoutError, match="waited 0.1 s"):
        d.take_share("update", ["prompt_ids"], CAP, key=2, parts=1, part=0, groups=True, timeout=0.1)


def node_worker(rank: int, world: int, node_of: list, local_of: list, unreachable: bool = False,
                other_host: bool = False):
    """One rank of a torchrun-style world: ``node_of[rank]`` is its node (torchrun's GROUP_RANK);
    ``unreachable``: rank 1 cannot connect to any dock server; ``other_host``: rank 1 is on another host."""
    import os
    import pickle
    import socket
    os.environ["GROUP_RANK"] = str(node_of[rank])
    if other_host and rank == 1:
        socket.gethostname = lambda: "another-host"
    if unreachable and rank == 1:
        def refuse(*a, **k):
            raise ConnectionRefusedError(111, "Connection refused")
        pickle.loads = refuse  # unpickling the servers' proxies is where a rank connects to them
    try:
        d = node_dock(GRPO.schema, GRPO.flow_consumers, capacity=CAP, warehouses=3, local_rank=local_of[rank],
                      group_size=G)
    except RuntimeError as e:
        return str(e)
    try:
        mine = list(range(rank * 2 * G, (rank + 1) * 2 * G))
        put_prompts(d, mine)
        torch.distributed.barrier()
        got = None
        if rank == 1:  # reads every rank's rows, its own node's and the other's
            (t,) = d.take("rollout", ["prompt_ids"], CAP, groups=True, timeout=10)
            b = d.read(t)
            got = (t.index.tolist(), t.warehouse.tolist(), [r.tolist() for r in b.rows("prompt_ids")])
        torch.distributed.barrier()
        return d.transport.nodes, d.transport.here(), got
    finally:
        d.close()


@pytest.mark.slow
def test_a_dock_the_ranks_start_themselves_serves_every_rank_from_its_nodes_warehouses():
    """``node_dock`` (torchrun / Slurm, no driver): two nodes of one rank each; warehouse i runs on node
    i % 2, a rank's rows go to its own node's warehouses, and every rank reads every row; two ranks that both
    claim local rank 0 on one node are refused on every rank, and so is a rank that cannot reach another's servers
    (no rank goes on with a dock another could not build), and a world over two hosts whose servers would listen
    on loopback (MASTER_ADDR resolving to 127.x on a host)."""
    from rlflow.runtime import launch
    res = launch.spawn(node_worker, 2, [0, 1], [0, 0])
    (nodes, here0, _), (nodes1, here1, (index, wh, rows)) = res
    assert nodes == nodes1 and len(set(nodes)) == 2 and nodes[0] == nodes[2] == here0 and nodes[1] == here1
    assert index == list(range(CAP)) and rows == [p.tolist() for p in prompts(range(CAP))]
    assert set(wh[:2 * G]) == {0, 2} and set(wh[2 * G:]) == {1}  # rank 0's rows on node 0's two, rank 1's on its one
    bad = launch.spawn(node_worker, 2, [0, 0], [0, 0])
    assert all("has 2 ranks with local rank 0" in m for m in bad), bad
    cut = launch.spawn(node_worker, 2, [0, 1], [0, 0], True)
    assert all(m.startswith("node_dock: rank 1 could not reach the dock's servers: rank 0's, at [(") and
               "ConnectionRefusedError" in m for m in cut), cut
    hosts = launch.spawn(node_worker, 2, [0, 1], [0, 0], False, True)
    assert all("the world spans hosts another-host, " in m and "would listen on 127.0.0.1 (MASTER_ADDR=127.0.0.1"
               in m for m in hosts), hosts


# ---- bad input: a clear error, and the dock unchanged ----
def _unchanged(d, fn, exc, match):
    before = d.snapshot()
    with pytest.raises(exc, match=match):
        fn()
    assert d.snapshot() == before


def test_bad_unknown_column(dock):
    put_prompts(dock, [0, 1])
    _unchanged(dock, lambda: dock.put([2], {"prompt_ids": prompts([2]), "nope": torch.zeros(1)}), ValueError,
               "unknown column 'nope'")
    _unchanged(dock, lambda: dock.get("rollout", ["prompt_ids", "nope"], 1), ValueError, "unknown column 'nope'")


def test_bad_unknown_consumer(dock):
    put_prompts(dock, [0, 1])
    _unchanged(dock, lambda: dock.get("critic", ["prompt_ids"], 1), ValueError, "unknown consumer 'critic'")
    _unchanged(dock, lambda: dock.pending("critic"), ValueError, "unknown consumer 'critic'")


def test_bad_dtype(dock):
    put_prompts(dock, [0, 1])
    _unchanged(dock, lambda: dock.put([2, 3], {"rewards": torch.tensor([1, 2])}), ValueError,
               "column 'rewards' expects dtype float32, got int64")
    _unchanged(dock, lambda: dock.put([2], {"prompt_ids": [torch.zeros(3)]}), ValueError,
               "column 'prompt_ids' expects dtype int64, got float32")


def test_bad_shape(dock):
    put_prompts(dock, [0, 1])
    _unchanged(dock, lambda: dock.put([2, 3], {"rewards": torch.zeros(3)}), ValueError,
               r"'rewards' expects shape \[2\], got \[3\]")
    _unchanged(dock, lambda: dock.put([2], {"prompt_ids": [torch.zeros(2, 2, dtype=torch.long)]}), ValueError,
               "expected a 1-D tensor")
    _unchanged(dock, lambda: dock.put([2, 3], {"prompt_ids": prompts([2])}), ValueError, "has 1 rows, indices has 2")
    # the log-probs of a response have its length, in the same put or against the stored response
    _unchanged(dock, lambda: dock.put([0], {"response_ids": [torch.zeros(3, dtype=torch.long)],
                                            "sample_logprobs": [torch.zeros(2)]}), ValueError, "length group")
    put_responses(dock, [0])
    _unchanged(dock, lambda: dock.put([0], {"old_logprobs": [torch.zeros(5)]}), ValueError, "length group")


def test_bad_second_put_of_a_cell(dock):
    put_prompts(dock, [0, 1, 4, 5])
    # rows 4, 5 live in another warehouse than 0, 1 when S > 1: the whole put must still be refused
    _unchanged(dock, lambda: dock.put([2, 5], {"group": torch.tensor([0, 1])}), ValueError,
               r"cell \(row 5, column 'group'\) already written")
    b = dock.get("rollout", ["group"], 4, timeout=0)
    assert b["group"].tolist() == [0, 0, 1, 1]


def test_bad_index(dock):
    _unchanged(dock, lambda: dock.put([CAP], {"group": torch.tensor([0])}), ValueError,
               rf"index {CAP} out of range \[0, {CAP}\)")
    _unchanged(dock, lambda: dock.put([-1], {"group": torch.tensor([0])}), ValueError, "index -1 out of range")
    _unchanged(dock, lambda: dock.put([1, 1], {"group": torch.tensor([0, 0])}), ValueError, "more than once")


def test_bad_get_larger_than_capacity(dock):
    put_prompts(dock, list(range(CAP)))
    _unchanged(dock, lambda: dock.get("rollout", ["prompt_ids"], CAP + 1), ValueError, "exceeds the dock's capacity")
    _unchanged(dock, lambda: dock.get("rollout", ["prompt_ids"], 3, groups=True), ValueError, "not a multiple")


def test_timeout_leaves_dock_unchanged(dock):
    put_prompts(dock, [0, 1])
    _unchanged(dock, lambda: dock.get("rollout", ["prompt_ids"], 3, timeout=0.05), TimeoutError, "2 are ready")


def test_bad_schema_declarations():
    with pytest.raises(ValueError, match="duplicate column names"):
        Schema(Column("a", torch.long), Column("a", torch.long))
    with pytest.raises(ValueError, match="length is required"):
        Column("a", torch.long, "fixed")
    with pytest.raises(ValueError, match="capacity=10 must be a positive multiple of group_size=4"):
        Dock.local(GRPO.schema, GRPO.flow_consumers, capacity=10, group_size=4)


# ---- samplers and wire helpers ----
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=40), st.integers(1, 6))
def test_balance_partitions_evenly(costs, k):
    parts = balance(np.array(costs), k)
    flat = sorted(np.concatenate(parts).tolist())
    assert flat == list(range(len(costs)))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    totals = [sum(costs[i] for i in p) for p in parts]  # no part exceeds the mean by more than the largest unit
    assert max(totals) <= sum(costs) / k + max(costs) + 1e-9, (totals, imbalance(np.array(costs), parts))


@given(st.lists(st.booleans(), min_size=8, max_size=8), st.sampled_from([2, 4, 8]))
def test_pick_groups_takes_whole_groups(bits, n):
    rows = pick_groups(np.array(bits), 2, n)
    assert len(rows) % 2 == 0 and all(bits[r] for r in rows)
    assert all(r % 2 == 0 and r + 1 == s for r, s in zip(rows[::2], rows[1::2]))


@given(st.lists(st.integers(0, 5), min_size=1, max_size=12), st.data())
def test_take_rows_matches_python(lens, data):
    rows = data.draw(st.lists(st.integers(0, len(lens) - 1), max_size=12))
    lens = np.array(lens)
    values = np.arange(lens.sum())
    split = np.split(values, np.cumsum(lens)[:-1])
    got, glens = take_rows((values, lens), np.array(rows, dtype=np.int64))
    assert got.tolist() == [x for r in rows for x in split[r].tolist()]
    assert glens.tolist() == [int(lens[r]) for r in rows]


# ---- cost model against bytes measured in-process ----
def run_grpo(d, shape: Shape, mb: int):
    """One GRPO-shaped iteration in this process; fixed lengths so the model is exact up to headers."""
    R, PL, SL = shape.rows, int(shape.prompt_len), int(shape.response_len)
    d.put(range(R), {"prompt_ids": [torch.zeros(PL, dtype=torch.long)] * R, "group": torch.arange(R) // G,
                     "answer": [torch.zeros(int(shape.answer_len), dtype=torch.uint8)] * R})
    for s in GRPO.flow[1:]:
        for _ in range(R // mb):
            b = d.get(s.name, list(s.reads), mb, groups=True, timeout=0)
            k = b.size
            out = {"response_ids": [torch.zeros(SL, dtype=torch.long)] * k,
                   "sample_logprobs": [torch.zeros(SL)] * k, "ref_logprobs": [torch.zeros(SL)] * k,
                   "old_logprobs": [torch.zeros(SL)] * k, "rewards": torch.zeros(k), "advantages": torch.zeros(k)}
            if s.writes:
                d.put(b.index_B, {c: out[c] for c in s.writes})


@pytest.mark.parametrize("S", [1, 2, 4])
def test_cost_model_matches_measured_bytes(S):
    shape = Shape(prompts=8, group_size=G, prompt_len=512, response_len=1024)
    d = Dock.local(GRPO.schema, GRPO.flow_consumers, capacity=shape.rows, warehouses=S, group_size=G)
    run_grpo(d, shape, mb=8)
    t = d.traffic()
    wh = max(v["bytes_in"] + v["bytes_out"] for k, v in t.items() if k.startswith("warehouse"))
    model = dock_bytes(shape, S, GRPO.flow, GRPO.schema)
    assert abs(wh - model["warehouse"]) / model["warehouse"] < 0.02, (wh, model)
    ctl = max(v["bytes_in"] + v["bytes_out"] for k, v in t.items() if k.startswith("controller"))
    assert ctl < wh / 10, "controllers carry metadata only"
    c = CentralizedBuffer.local(GRPO.schema, GRPO.flow_consumers, capacity=shape.rows, group_size=G)
    run_grpo(c, shape, mb=8)
    cb = sum(c.traffic()["central"][k] for k in ("bytes_in", "bytes_out"))
    central = centralized_bytes(shape, GRPO.flow, GRPO.schema)
    assert abs(cb - central) / central < 0.02
    assert sum(stage_bytes(shape, s, GRPO.schema) for s in GRPO.flow) == central


# ---- the streaming case (separate pools) against bytes measured in-process ----
@pytest.mark.parametrize("S,k,parts,readers", [(1, 0, 1, 1), (2, 1, 2, 1), (4, 2, 2, 2), (2, 1, 1, 3)])
def test_streaming_cost_model_matches_measured_bytes_and_the_rows_held(S, k, parts, readers):
    """The pools' pattern as DockFlow drives it: step j's rows put into slot j % (k + 1), taken k steps later
    within that slot by ``parts`` data-parallel parts, each read by ``readers`` ranks (a part's tp x pp ranks),
    the slot released. Per steady step the busiest warehouse moves what ``streaming`` says (within the pickle
    headers: under 2%), and the warehouses hold at most k + 1 steps' rows: exactly the model's bytes."""
    from rlflow.dock.cost import streaming
    from rlflow.runtime.graph import ROWS, VERSIONS
    shape = Shape(prompts=4, group_size=G, prompt_len=256, response_len=512)
    R, PL, SL = shape.rows, 256, 512
    put = list(ROWS) + ["rewards", "advantages", VERSIONS]
    taken = list(ROWS) + ["rewards", "advantages", VERSIONS]  # ROWS + step.dock_columns(GRPO, "off", pools=True)
    d = Dock.local(GRPO.schema, GRPO.consumers, capacity=(k + 1) * R, warehouses=S, group_size=G)
    cells = {"prompt_ids": [torch.zeros(PL, dtype=torch.long)] * R, "group": torch.arange(R) // G,
             "answer": [torch.zeros(int(shape.answer_len), dtype=torch.uint8)] * R,
             "response_ids": [torch.zeros(SL, dtype=torch.long)] * R, "sample_logprobs": [torch.zeros(SL)] * R,
             "rewards": torch.zeros(R), "advantages": torch.zeros(R), VERSIONS: [torch.zeros(SL, dtype=torch.long)] * R}
    model = streaming(shape, S, put, taken, GRPO.schema, k, readers=readers)
    per_step, held = [], []
    for j in range(k + 4):
        before = {n: v["bytes_in"] + v["bytes_out"] for n, v in d.traffic().items()}
        slot = j % (k + 1)
        d.put(range(slot * R, (slot + 1) * R), cells)
        held.append(max(w.held_bytes() for w in d.warehouses))
        if j >= k:  # the train pool takes step j - k from its slot, then releases the slot
            first = (j - k) % (k + 1) * R
            for part in range(parts):
                for _ in range(readers):  # every rank of the part asks for the step's one take, and reads it
                    t = d.take_share("train", taken, R, key=j, parts=parts, part=part, groups=True, timeout=0,
                                     within=(first, first + R))
                    d.read(t)
            d.release(first, first + R)
        after = {n: v["bytes_in"] + v["bytes_out"] for n, v in d.traffic().items()}
        per_step.append(max(after[n] - before[n] for n in after if n.startswith("warehouse")))
    steady = per_step[k:]
    assert all(abs(b - model["warehouse"]) / model["warehouse"] < 0.02 for b in steady), (steady, model)
    assert max(held) == model["held_per_warehouse"], (held, model)  # k + 1 slots full, never more


# ---- the cost model against a hand-worked figure and the bytes counted at the transport ----
class CountingTransport:
    """Wraps a dock's transport and adds up, per dock process (warehouse or centralized store), the bytes of
    the cells that cross it: the ``(values, lengths)`` arrays of every Wire a put sends and a get returns.
    Counted from the arrays themselves, so it shares no code with ``rlflow.dock.cost`` or the processes'
    own meters."""

    def __init__(self, inner, names: dict):
        self.inner, self.names = inner, names  # names: id(target) -> label
        self.bytes = {n: 0 for n in names.values()}

    def __getattr__(self, attr):  # nodes, here(), close(): the wrapped transport's
        return getattr(self.inner, attr)

    @staticmethod
    def cells(obj) -> int:
        if isinstance(obj, dict) and obj and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], np.ndarray)
                                                 for v in obj.values()):
            return sum(v.nbytes + (0 if n is None else n.nbytes) for v, n in obj.values())
        if isinstance(obj, (tuple, list)):
            return sum(CountingTransport.cells(x) for x in obj)
        return 0

    def _count(self, target, method, args, result) -> None:
        name = self.names.get(id(target))
        if name is not None and method in ("put", "get"):
            self.bytes[name] += self.cells(args) + (self.cells(result) if method == "get" else 0)

    def call(self, target, method, *args):
        out = self.inner.call(target, method, *args)
        self._count(target, method, args, out)
        return out

    def call_many(self, calls) -> list:
        calls = list(calls)
        outs = self.inner.call_many(calls)
        for (target, method, args), out in zip(calls, outs):
            if not isinstance(out, BaseException):
                self._count(target, method, args, out)
        return outs


# 4 prompts x G=4 = 16 rows; prompts of 3 tokens, responses of 5, answers of 2 bytes.
SMALL = Shape(prompts=4, group_size=G, prompt_len=3, response_len=5, answer_len=2)
# Bytes of one cell (a var cell also carries its int64 length, 8 bytes):
#   prompt_ids int64 var   3*8 + 8 = 32     group      int64 scalar  8
#   answer     uint8 var   2*1 + 8 = 10     rewards, advantages float32 scalar  4 each
#   response_ids int64 var 5*8 + 8 = 48     sample_/old_/ref_logprobs float32 var  5*4 + 8 = 28 each
# What each stage of GRPO.flow moves per row (reads + writes):
#   prompts (puts prompt_ids, group, answer)              32+8+10            =  50
#   rollout (reads those; writes response_ids, sample_lp)  50 + 48+28         = 126
#   score (reads those 5 columns; writes rewards)          126 + 4            = 130
#   advantage (reads rewards, group; writes advantages)    4+8 + 4            =  16
#   ref_logprob / old_logprob (read the 5; write one lp)   126 + 28           = 154 each
#   update (reads the 5, rewards, advantages, old, ref)    126 + 4+4 + 28+28  = 190
#   sum 50+126+130+16+154+154+190 = 820 bytes per row, x 16 rows:
SMALL_CENTRAL_BYTES = 820 * 16  # = 13120: every one of them passes through the centralized store


def test_centralized_bytes_equal_a_hand_worked_figure_and_the_bytes_counted_at_the_store():
    assert centralized_bytes(SMALL, GRPO.flow, GRPO.schema) == SMALL_CENTRAL_BYTES
    c = CentralizedBuffer.local(GRPO.schema, GRPO.flow_consumers, capacity=SMALL.rows, group_size=G)
    c.transport = CountingTransport(c.transport, {id(c.store): "central"})
    run_grpo(c, SMALL, mb=8)
    assert c.transport.bytes == {"central": SMALL_CENTRAL_BYTES}


@pytest.mark.parametrize("S, procs", [(1, False), (2, False), (4, False), (2, True)])
def test_each_warehouse_carries_the_central_figure_over_S(S, procs):
    """4 groups placed round-robin over S warehouses: each holds 4/S of them and moves 13120 / S bytes."""
    make = proc_dock if procs else Dock.local
    d = make(GRPO.schema, GRPO.flow_consumers, capacity=SMALL.rows, warehouses=S, group_size=G)
    try:
        d.transport = CountingTransport(d.transport, {id(w): f"w{i}" for i, w in enumerate(d.warehouses)})
        run_grpo(d, SMALL, mb=8)
        assert d.transport.bytes == {f"w{i}": SMALL_CENTRAL_BYTES // S for i in range(S)}
        model = dock_bytes(SMALL, S, GRPO.flow, GRPO.schema)
        assert model["warehouse"] == SMALL_CENTRAL_BYTES / S
        assert max(d.transport.bytes.values()) == model["warehouse"]
    finally:
        d.close()


def test_ctrl_c_while_the_dock_starts_leaves_no_server_behind(monkeypatch):
    """Ctrl-C between a server's fork and the read of its address (the dock starting as the run starts): that
    server had no shutdown of its own, and the run's exit waited for it forever."""
    import multiprocessing
    from multiprocessing import managers

    real, calls = managers.connection.Pipe, []

    def pipe(duplex=True):
        r, w = real(duplex)
        calls.append(1)
        if len(calls) != 2:
            return r, w

        class Interrupted:  # the second server's address is being read when the signal comes
            def recv(self):
                raise KeyboardInterrupt

            def close(self):
                r.close()
        return Interrupted(), w
    monkeypatch.setattr(managers.connection, "Pipe", pipe)
    with pytest.raises(KeyboardInterrupt):
        proc_dock(GRPO.schema, GRPO.flow_consumers, capacity=CAP, warehouses=2, group_size=G)
    assert len(calls) == 2 and multiprocessing.active_children() == []


def test_a_local_docks_servers_admit_only_their_own_processes():
    """One host: each dock server listens on a Unix socket in a directory only this user can enter (0700),
    and a client without the run's key is refused before anything is unpickled."""
    import os
    import stat
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    d = proc_dock(GRPO.schema, GRPO.flow_consumers, capacity=CAP, warehouses=2, group_size=G)
    try:
        servers = d.transport._servers
        assert len(servers) == 3
        for s in servers:
            assert isinstance(s.address, str) and os.path.exists(s.address), s.address  # a Unix socket's path
            assert stat.S_ISSOCK(os.stat(s.address).st_mode)
            assert stat.S_IMODE(os.stat(os.path.dirname(s.address)).st_mode) == 0o700
            with pytest.raises(AuthenticationError):
                Client(s.address, authkey=os.urandom(32))
    finally:
        d.close()


def test_a_grouped_take_that_no_rows_can_complete_raises_at_once(dock):
    """Enough rows left, but no whole group: every group lost one row to an ungrouped take and nothing more
    can come (the dock is full). A grouped take must say so at once instead of waiting (its timeout here is
    long: a wait shows as the test's time)."""
    put_prompts(dock, list(range(CAP)))
    put_responses(dock, [0, 4, 8, 12])  # one row of each group ready first
    assert sorted(dock.get("score", ["response_ids"], 4, timeout=0).index_B.tolist()) == [0, 4, 8, 12]
    put_responses(dock, [r for r in range(CAP) if r % G])
    t0 = time.monotonic()
    with pytest.raises(ValueError):
        dock.get("score", ["response_ids"], G, groups=True, timeout=30)
    assert time.monotonic() - t0 < 5


def test_a_dock_process_that_died_is_named_not_a_broken_pipe():
    """A warehouse's process killed mid-run surfaced as a bare BrokenPipeError / ConnectionResetError from
    deep in multiprocessing; now ``DockLost`` naming the process and what to do."""
    import os
    import signal

    from rlflow.dock.proc_backend import DockLost

    d = proc_dock(GRPO.schema, GRPO.flow_consumers, capacity=CAP, warehouses=2, group_size=G)
    try:
        put_prompts(d, [0, 1])
        dead = d.transport._servers[0]._process
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(10)
        with pytest.raises(DockLost, match=rf"serving a warehouse at .* \(pid {dead.pid}\) is gone .*--resume auto"):
            put_prompts(d, list(range(2, CAP)))
    finally:
        d.close()


# ---- the streaming case: rows of several steps in one dock, each step a range of rows ----
@pytest.mark.parametrize("make", ["dock1", "dock3", "procs2"])
def test_a_step_takes_its_own_rows_and_releases_them_for_the_next(make):
    """Two steps' rows share the dock: a take ``within`` one step's range gets those rows only, even when the
    other step's rows are ready first; ``release`` frees a range for new puts (cells dropped, bits reset),
    leaving the other range as it was."""
    d = MAKERS[make]()
    try:
        half = CAP // 2
        put_prompts(d, list(range(half, CAP)))  # the later step's rows are ready first
        waiter = {}
        th = threading.Thread(target=lambda: waiter.update(t=d.take_share(
            "update", ["prompt_ids"], half, key=1, parts=1, part=0, groups=True, within=(0, half), timeout=5)))
        th.start()
        time.sleep(0.2)
        assert "t" not in waiter, "a take within rows [0, 8) must wait for them, not take the ready rows of [8, 16)"
        put_prompts(d, list(range(half)))
        th.join(5)
        assert sorted(waiter["t"].index.tolist()) == list(range(half))
        with pytest.raises(ValueError, match="already written"):
            put_prompts(d, [0])
        d.release(0, half)
        assert d.pending("update", ["prompt_ids"]) == (CAP, half)  # [0, 8) free again, [8, 16) untouched
        put_prompts(d, list(range(half)))  # the next step's rows reuse the range
        t = d.take_share("update", ["prompt_ids"], half, key=2, parts=1, part=0, groups=True, within=(half, CAP))
        assert sorted(t.index.tolist()) == list(range(half, CAP))
        assert [r.tolist() for r in d.read(t).rows("prompt_ids")] == [p.tolist() for p in prompts(sorted(t.index))]
        with pytest.raises(ValueError, match="whole groups"):
            d.take_share("update", ["prompt_ids"], 2, key=3, parts=1, part=0, within=(1, 3))
    finally:
        d.close()


def test_a_grouped_take_past_the_whole_groups_left_is_refused_though_as_many_rows_are(dock):
    """Rows taken one by one from two groups leave their other rows free: as many rows remain as a grouped take
    of one more group than remain whole asks for, but that take can never complete. It is refused at once
    (counting free rows instead of whole free groups, it waited forever; the state machine did not reach this)."""
    consumer = GRPO.flow_consumers[0]
    put_prompts(dock, [0, G])  # one row of each of the first two groups is ready
    got = dock.get_dp(consumer, ["prompt_ids"], 2, 1, groups=False, timeout=0)
    assert sorted(i for p in got for i in p.index_B.tolist()) == [0, G]
    whole = CAP // G - 2  # the groups nothing was taken from
    n = (whole + 1) * G  # <= the rows left: CAP - 2
    with pytest.raises(ValueError, match="in whole groups but only"):
        dock.get_dp(consumer, ["prompt_ids"], n, 1, groups=True, timeout=0)
