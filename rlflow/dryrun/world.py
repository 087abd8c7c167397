"""The world check of a dry run: every rank's trace against its groups' other members'."""

from __future__ import annotations

from rlflow.dryrun.trace import P2P, Collective, RankTrace


def _signature(c: Collective) -> tuple:
    """What every member of the group must issue alike: the op and dtypes, and the shapes except for an
    all-to-all, whose members' sizes differ by design (``_splits_agree`` checks those)."""
    return (c.op, c.dtypes) if c.splits else (c.op, c.shapes, c.dtypes)


def _splits_agree(group: tuple[int, ...], calls: dict[int, Collective]) -> bool:
    """An all-to-all's sizes fit together: what member i sends to member j is what j receives from i."""
    for i, a in enumerate(group):
        for j, b in enumerate(group):
            if calls[a].splits[1][j] != calls[b].splits[0][i]:
                return False
    return True


def _unpaired(by_rank: dict[int, RankTrace]) -> list[str]:
    """Point-to-point: what rank a sends to rank b, in order, must be what b receives from a (shapes, dtypes)."""
    sent, got = {}, {}
    for r, t in by_rank.items():
        for c in t.collectives:
            if c.op == "send":
                sent.setdefault((r, c.peer), []).append((c.shapes, c.dtypes))
            elif c.op == "recv_":
                got.setdefault((c.peer, r), []).append((c.shapes, c.dtypes))
    return [f"ranks {a} -> {b}: {len(sent.get((a, b), []))} sends, {len(got.get((a, b), []))} receives, or their "
            "sizes differ" for a, b in sorted(set(sent) | set(got))
            if a in by_rank and b in by_rank and sent.get((a, b)) != got.get((a, b))]


def mismatched(traces: list[RankTrace]) -> list[str]:
    """Where a world's traces disagree: for every group, each member's sequence of that group's collectives
    (op, shapes, dtypes) must be the group's first member's, and each all-to-all's split sizes must fit
    together over its members. Empty: they agree."""
    by_rank = {t.rank: t for t in traces}
    groups = {c.group for t in traces for c in t.collectives if len(c.group) > 1 and c.op not in P2P}
    out = _unpaired(by_rank)
    for g in sorted(groups):
        calls = {r: [c for c in by_rank[r].collectives if c.group == g and c.op not in P2P] for r in g if r in by_rank}
        seqs = {r: [_signature(c) for c in cs] for r, cs in calls.items()}
        first = next(iter(seqs))
        for r, s in seqs.items():
            if s != seqs[first]:
                i = next((k for k, (a, b) in enumerate(zip(s, seqs[first])) if a != b), min(len(s), len(seqs[first])))
                out.append(f"group {g}: rank {r}'s collective {i} {s[i] if i < len(s) else 'missing'} against rank "
                           f"{first}'s {seqs[first][i] if i < len(seqs[first]) else 'missing'}")
        if not out and len(calls) == len(g):
            for i, c in enumerate(calls[first]):
                if c.splits and not _splits_agree(g, {r: cs[i] for r, cs in calls.items()}):
                    out.append(f"group {g}: all-to-all {i}: what a member sends is not what its peer receives")
    return out


__all__ = ["mismatched"]
