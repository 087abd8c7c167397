"""What the first CUDA / NCCL run would hit, caught on this CPU: the pipeline's point-to-point programs under
NCCL's rendezvous semantics (no deadlock at any size), ...
"""

from __future__ import annotations

from collections import deque

import pytest

from rlflow.parallel import pp


# ---- pipeline point-to-point under rendezvous semantics ----
def _ops_of(stage: int, steps) -> list[tuple[tuple, bool]]:
    """``pp.program``'s exchanges as (ops, blocking) units; an op is (send | recv, peer stage, message id)
    with the message id (what, micro-batch, sending stage)."""
    units = []
    for op, arg in steps:
        if op != "X":
            continue
        ops = []
        for d, what, m in arg:
            peer = stage + pp.PEER[(d, what)]
            ops.append((d, peer, (what, m, stage if d == "send" else peer)))
        units.append((tuple(ops), True))
    return units


def rendezvous(programs: list[list]) -> list[int]:
    """Run every stage's units under NCCL's point-to-point semantics: a rank's ops with one peer run in order
    on one queue (a unit, one ``batch_isend_irecv``, at a time: its ops progress together); an op completes
    only when the peer's matching op is running (a send waits for its receive, no buffering); a blocking
    unit holds its host until done; ``"wait_all"`` holds it until all its units are done. Returns how far
    each host got (a deadlock leaves one short)."""
    n = len(programs)
    host = [0] * n
    queues = {}  # (rank, peer) -> deque of [ops, done-set]
    posted = [set() for _ in range(n)]
    units_of = [[] for _ in range(n)]

    def unit_done(u) -> bool:
        return len(u[1]) == len(u[0])

    progress = True
    while progress:
        progress = False
        for r in range(n):
            while host[r] < len(programs[r]):
                item = programs[r][host[r]]
                if item == "wait_all":
                    if not all(unit_done(u) for u in units_of[r]):
                        break
                else:
                    ops, blocking = item
                    if host[r] not in posted[r]:
                        peers = {p for _, p, _ in ops}
                        assert len(peers) == 1, f"stage {r}: one exchange with several peers {peers}"
                        u = [ops, set()]
                        queues.setdefault((r, peers.pop()), deque()).append(u)
                        units_of[r].append(u)
                        posted[r].add(host[r])
                        progress = True
                    if blocking and not unit_done(units_of[r][-1]):
                        break
                host[r] += 1
                progress = True
        for (r, peer), q in queues.items():
            if not q:
                continue
            other = queues.get((peer, r))
            head = q[0]
            for i, (d, p, msg) in enumerate(head[0]):
                if i in head[1] or not other:
                    continue
                want = ("recv" if d == "send" else "send", r, msg)
                theirs = other[0]
                for j, op in enumerate(theirs[0]):
                    if op == want and j not in theirs[1]:
                        head[1].add(i)
                        theirs[1].add(j)
                        progress = True
                        break
        for q in queues.values():
            while q and unit_done(q[0]):
                q.popleft()
                progress = True
    return host


@pytest.mark.parametrize("kind", [*pp.SCHEDULES, "forward"])
def test_every_pipeline_program_completes_under_rendezvous_semantics(kind):
    for n_stages in range(1, 7):
        for n_micro in range(1, 10):
            progs = [pp.program("gpipe" if kind == "forward" else kind, n_micro, s, n_stages,
                                backward=kind != "forward") for s in range(n_stages)]
            for s, steps in enumerate(progs):  # each message sent once and received once, in order
                sends = [(w, m) for op, a in steps if op == "X" for d, w, m in a if d == "send"]
                assert len(sends) == len(set(sends))
                want_f = list(range(n_micro))
                assert [m for op, m in steps if op == "F"] == want_f
            units = [_ops_of(s, steps) for s, steps in enumerate(progs)]
            got = rendezvous(units)
            assert got == [len(u) for u in units], f"{kind}: {n_stages} stages, {n_micro} micro-batches: stuck at {got}"


def test_the_checker_finds_the_deadlock_of_sends_queued_before_receives():
    """The schedule's 1F1B with non-blocking sends (waited at the end) and blocking receives, the way gloo
    tolerates: two stages, two micro-batches deadlock (stage 0 sends h1 then needs g0, stage 1 sends g0's
    input gradient then needs h1), and a blocked exchange would show the same."""
    def queued(stage, n_stages, n_micro):
        units = []
        for op, m in pp.schedule("1f1b", n_micro, stage, n_stages):
            if op == "F" and stage > 0:
                units.append(((("recv", stage - 1, ("act", m, stage - 1)),), True))
            if op == "B" and stage < n_stages - 1:
                units.append(((("recv", stage + 1, ("grad", m, stage + 1)),), True))
            if op == "F" and stage < n_stages - 1:
                units.append(((("send", stage + 1, ("act", m, stage)),), False))
            if op == "B" and stage > 0:
                units.append(((("send", stage - 1, ("grad", m, stage)),), False))
        return units + ["wait_all"]
    progs = [queued(s, 2, 2) for s in range(2)]
    assert rendezvous(progs) != [len(p) for p in progs]
    one = [queued(s, 2, 1) for s in range(2)]  # one micro-batch has nothing to cross: it completes
    assert rendezvous(one) == [len(p) for p in one]
