"""Which rows a get takes, and how they are split across DP ranks. Pure functions on numpy arrays.

- ``pick_rows``: the first ``n`` eligible rows (lowest index first, so selection is deterministic).
- ``pick_groups``: the first ``n // G`` GRPO groups all of whose ``G`` rows are eligible. Group ``g``
  is rows ``g*G .. g*G+G-1`` (``PromptBatch.repeat`` numbers samples this way).
- ``balance``: split units (rows or groups) into ``k`` parts of equal count (differing by at most
  one) whose total costs (sequence lengths) are as even as a greedy longest-first assignment makes
  them. The cost of a part is the sum of its units' costs.
"""

from __future__ import annotations

import numpy as np


def pick_rows(eligible: np.ndarray, n: int) -> np.ndarray:
    """Indices of the first ``n`` True entries of ``eligible`` (fewer if there are fewer)."""
    return np.flatnonzero(eligible)[:n].astype(np.int64)


def whole_groups(eligible: np.ndarray, group_size: int) -> np.ndarray:
    """Group ids all of whose rows are eligible."""
    return np.flatnonzero(eligible.reshape(-1, group_size).all(axis=1))


def pick_groups(eligible: np.ndarray, group_size: int, n: int) -> np.ndarray:
    """Rows of the first ``n // group_size`` whole eligible groups (``n`` a multiple of the group size)."""
    if n % group_size:
        raise ValueError(f"pick_groups: n={n} is not a multiple of group_size={group_size}")
    groups = whole_groups(eligible, group_size)[: n // group_size]
    return (groups[:, None] * group_size + np.arange(group_size)).reshape(-1).astype(np.int64)


def balance(costs: np.ndarray, k: int) -> list[np.ndarray]:
    """Partition positions ``0..len(costs)-1`` into ``k`` parts: equal counts (+-1), even total cost.

    Greedy: units in decreasing cost go to the part with the least total cost among parts that still
    have room; then single swaps between the heaviest and the lightest part while the gap narrows.
    Each part's positions are returned sorted.
    """
    if k <= 0:
        raise ValueError(f"balance: k must be positive, got {k}")
    costs = np.asarray(costs, dtype=np.float64)
    m = len(costs)
    room = np.full(k, m // k, dtype=np.int64)
    room[: m % k] += 1
    load = np.zeros(k)
    parts: list[list[int]] = [[] for _ in range(k)]
    for u in np.argsort(-costs, kind="stable").tolist():
        open_ = np.flatnonzero(room > 0)
        p = int(open_[np.argmin(load[open_])])
        parts[p].append(u)
        load[p] += costs[u]
        room[p] -= 1
    _refine(costs, parts, load)
    return [np.array(sorted(p), dtype=np.int64) for p in parts]


def _refine(costs: np.ndarray, parts: list[list[int]], load: np.ndarray, rounds: int = 64) -> None:
    """Swap one unit between the heaviest and the lightest part while that narrows their gap."""
    for _ in range(rounds):
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = load[hi] - load[lo]
        if gap <= 0 or not parts[lo]:
            return
        lo_units = np.array(parts[lo])
        lo_costs = costs[lo_units]
        order = np.argsort(lo_costs)
        best, pick = gap, None
        for i, u in enumerate(parts[hi]):  # want c_u - c_v close to gap / 2, 0 < c_u - c_v < gap
            j = np.searchsorted(lo_costs[order], costs[u] - gap / 2)
            for jj in (j - 1, j):
                if 0 <= jj < len(order):
                    d = costs[u] - lo_costs[order[jj]]
                    if 0 < d < gap and abs(gap - 2 * d) < best:
                        best, pick = abs(gap - 2 * d), (i, int(order[jj]))
        if pick is None:
            return
        i, j = pick
        u, v = parts[hi][i], parts[lo][j]
        parts[hi][i], parts[lo][j] = v, u
        load[hi] += costs[v] - costs[u]
        load[lo] += costs[u] - costs[v]


def imbalance(costs: np.ndarray, parts: list[np.ndarray]) -> float:
    """max part cost / mean part cost (1.0 is perfect)."""
    totals = np.array([np.asarray(costs)[p].sum() for p in parts], dtype=np.float64)
    return float(totals.max() / totals.mean()) if totals.mean() > 0 else 1.0
