"""Transition plans: ``plan(src, dst)`` -> a frozen, printable sequence of steps, from shapes alone.

Every parameter gets a strategy (``strategy``: slice, all_gather, broadcast or p2p, chosen per family of
parameters that differ only by pp stage); parameters
with the same strategy are packed into buckets of at most ``bucket_bytes`` of temporary buffer per
rank, taken one layer per stage in turn so that every stage sends at once. Each bucket is one
collective on one flat byte buffer. Steps:

``swap_out grads|optim`` (allgather-swap only, first), then per bucket
``<collective> b`` (``all_gather``, ``broadcast``, ``all_to_all`` or ``send_recv``: into a temporary
buffer), ``slice b`` (copy each destination shard out), ``swap_out train b`` (allgather-swap only),
``free tmp b``. The way back (``swap_back``) is ``swap_in train``, ``free rollout``, ``swap_in grads``,
``swap_in optim``: the train state never changed on the host, so nothing moves between ranks.

``push_plan(train, rollout)`` is the transition between separate device pools (the train layout on one rank
set, the rollout layout on another): point-to-point pieces only, each distinct block of a train shard sent
by one of its holders (replicas take turns) to every rollout rank whose shard overlaps it; the train state
stays where it is.

Run ``python -m rlflow.sharding.cli --help`` for the command line.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from rlflow.sharding import geometry as geo
from rlflow.sharding.layout import _LAYER, Layout, fmt_bytes
from rlflow.sharding.strategy import candidates, choose_family, pick

DEFAULT_BUCKET_BYTES = 512 << 20
COLLECTIVES = ("all_gather", "broadcast", "all_to_all", "send_recv")


@dataclass(frozen=True, eq=False)
class Bucket:
    index: int
    kind: str  # slice | all_gather | broadcast | all_to_all | send_recv
    params: tuple[str, ...]
    axes: tuple[str, ...]  # source axes all-gathered first (all_gather, broadcast)
    stage: int | None  # broadcast: the source stage (its ranks are the roots)
    group: tuple[int, ...]  # all_to_all / send_recv: the ranks taking part
    recv: np.ndarray  # [world] bytes received
    sent: np.ndarray  # [world] bytes sent
    tmp: np.ndarray  # [world] bytes of temporary buffers during the collective
    keep: np.ndarray  # [world] bytes of them held until ``free tmp`` (p2p frees its send buffer at once)
    src_bytes: np.ndarray  # [world] bytes of source shards of these params
    dst_bytes: np.ndarray  # [world] bytes of destination shards
    alt: str = ""  # the all-gather-based alternative not taken
    alt_recv: np.ndarray | None = None

    @property
    def label(self) -> str:
        ax = f"({','.join(self.axes)})" if self.axes else ""
        st = f"[stage {self.stage}]" if self.kind == "broadcast" else ""
        return f"{self.kind}{ax}{st}"

    def describe(self) -> str:
        names = self.params[0] + (f" +{len(self.params) - 1}" if len(self.params) > 1 else "")
        s = (f"b{self.index} {self.label}: {len(self.params)} params ({names}); recv max "
             f"{fmt_bytes(self.recv.max(initial=0))}/rank, tmp max {fmt_bytes(self.tmp.max(initial=0))}")
        if self.alt:
            s += f"; chosen over {self.alt} (recv max {fmt_bytes(self.alt_recv.max(initial=0))})"
        return s


@dataclass(frozen=True)
class Step:
    op: str  # swap_out | swap_in | all_gather | broadcast | all_to_all | send_recv | slice | free
    bucket: int | None = None  # None: every parameter
    what: str = ""  # swap/free: train | grads | optim | rollout | tmp


@dataclass(frozen=True, eq=False)
class Plan:
    src: Layout
    dst: Layout
    kind: str  # reshard | allgather_swap | swap_back
    buckets: tuple[Bucket, ...]
    steps: tuple[Step, ...]
    bucket_bytes: int
    choices: tuple[tuple[str, str, str], ...] = field(default=())  # (param, label, alternative)

    @property
    def world(self) -> int:
        return self.src.mesh.size

    def bytes_received(self) -> np.ndarray:
        out = np.zeros(self.world, dtype=np.int64)
        for b in self.buckets:
            out += b.recv
        return out

    def bytes_sent(self) -> np.ndarray:
        out = np.zeros(self.world, dtype=np.int64)
        for b in self.buckets:
            out += b.sent
        return out

    def format_step(self, i: int) -> str:
        s = self.steps[i]
        if s.op in COLLECTIVES:
            return f"{i:4d} {self.buckets[s.bucket].describe()}"
        tgt = "all params" if s.bucket is None else f"b{s.bucket}"
        return f"{i:4d} {s.op} {s.what} {tgt}".replace("  ", " ")

    def header(self) -> str:
        return (f"plan {self.kind}: {self.src.mesh} -> {self.dst.mesh} on {self.world} ranks, "
                f"{len(self.src.params)} params, {len(self.buckets)} buckets of <= "
                f"{fmt_bytes(self.bucket_bytes)} tmp/rank, {len(self.steps)} steps")

    def __str__(self) -> str:
        return "\n".join([self.header()] + [self.format_step(i) for i in range(len(self.steps))])

    def summary(self) -> str:
        """Steps grouped by collective, and one line per parameter family with its strategy."""
        lines = [self.header()]
        ops = Counter(s.op + (" " + s.what if s.what else "") for s in self.steps)
        lines.append("  steps: " + ", ".join(f"{n} {op}" for op, n in ops.items()))
        by_kind = defaultdict(list)
        for b in self.buckets:
            by_kind[b.kind].append(b)
        for k, bs in by_kind.items():
            recv = sum(b.recv for b in bs)
            lines.append(f"  {k:>10}: {len(bs)} buckets, {sum(len(b.params) for b in bs)} params, "
                         f"recv {fmt_bytes(recv.max())}/rank max, {fmt_bytes(recv.mean())} mean")
        fam = defaultdict(Counter)
        for name, label, alt in self.choices:
            fam[_LAYER.sub(".layers.*.", name)][(label, alt)] += 1
        lines.append("  per parameter family (chosen collective; all-gather alternative not taken):")
        for key, cnt in fam.items():
            parts = [f"{lab} x{n}" + (f" (over {alt})" if alt else "") for (lab, alt), n in cnt.items()]
            lines.append(f"    {key}: " + "; ".join(parts))
        return "\n".join(lines)


def _check_pair(src: Layout, dst: Layout) -> None:
    if src.mesh.size != dst.mesh.size:
        raise ValueError(f"cannot plan {src.mesh} ({src.mesh.size} ranks) -> {dst.mesh} "
                         f"({dst.mesh.size} ranks): layouts must cover the same ranks")
    a, b = set(src.names), set(dst.names)
    if a != b:
        raise ValueError(f"layouts differ in params: only in src {sorted(a - b)[:5]}, only in dst "
                         f"{sorted(b - a)[:5]}")
    for p in src.params:
        q = dst[p.name]
        if (p.shape, p.view, p.dtype) != (q.shape, q.view, q.dtype):
            raise ValueError(f"param {p.name}: src is {p.dtype} {p.shape} (view {p.view}) but dst is "
                             f"{q.dtype} {q.shape} (view {q.view})")


def _order(src: Layout) -> list[str]:
    """One param per stage in turn: (position within its stage, stage)."""
    pos: dict[int, int] = {}
    keyed = []
    for p in src.params:
        k = pos.get(p.stage, 0)
        pos[p.stage] = k + 1
        keyed.append((k, p.stage, p.name))
    return [n for _, _, n in sorted(keyed)]


def plan(src: Layout, dst: Layout, *, swap: bool = False,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Plan:
    """Plan moving every parameter from layout ``src`` to layout ``dst`` (same ranks, any meshes).

    ``swap=True`` gives the allgather-swap variant (train -> rollout): grads and optimizer state are
    swapped out first, and each bucket's train shards right after that bucket is sliced."""
    _check_pair(src, dst)
    world = src.mesh.size
    pp_src, pp_dst = src.mesh.coord_array[:, 0], dst.mesh.coord_array[:, 0]
    names = _order(src)
    place = {n: (geo.placement(src, n), geo.placement(dst, n)) for n in names}
    families: dict[tuple, dict[tuple, int]] = {}
    for n in names:
        s, d = place[n]
        members = families.setdefault((s[0], s[1], s[3], d[0], d[1]), {})
        members[(s, d)] = members.get((s, d), 0) + src[n].itemsize
    chosen = {f: choose_family([(candidates(*sd), w) for sd, w in m.items()]) for f, m in families.items()}
    open_: dict[tuple, dict] = {}
    done: list[dict] = []
    choices = []
    for name in names:
        p, q = src[name], dst[name]
        s, d = place[name]
        fc = chosen[(s[0], s[1], s[3], d[0], d[1])]
        cands = candidates(s, d)
        c, isz = pick(cands, fc.key), p.itemsize
        alt = pick(cands, fc.alt) if fc.alt else None
        kind = "p2p" if c.kind == "p2p" else c.kind
        key = (kind, c.axes, c.stage if kind == "broadcast" else None)
        choices.append((name, c.label, alt.label if alt else ""))
        tmp = c.tmp * isz
        b = open_.get(key)
        if b is not None and b["params"] and (b["tmp"] + tmp).max() > bucket_bytes:
            done.append(open_.pop(key))
            b = None
        if b is None:
            zeros = {k: np.zeros(world, np.int64) for k in ("tmp", "keep", "src", "dst", "alt_recv")}
            b = open_[key] = dict(key=key, params=[], recv=0, sent=0, alt=set(), **zeros)
        b["params"].append(name)
        b["recv"] = b["recv"] + c.recv * isz
        b["sent"] = b["sent"] + c.sent * isz
        b["tmp"] = b["tmp"] + tmp
        b["keep"] = b["keep"] + c.keep * isz
        b["src"] = b["src"] + np.where(pp_src == p.stage, p.local_bytes(src.mesh), 0)
        b["dst"] = b["dst"] + np.where(pp_dst == q.stage, q.local_bytes(dst.mesh), 0)
        b["alt"].add(alt.label if alt else "")
        b["alt_recv"] = b["alt_recv"] + (alt.recv * isz if alt else c.recv * isz)
    done.extend(open_.values())
    order = {name: i for i, name in enumerate(names)}
    done.sort(key=lambda b: order[b["params"][0]])
    buckets = tuple(_finish(i, b, src, dst) for i, b in enumerate(done))
    steps = []
    if swap:
        steps += [Step("swap_out", None, "grads"), Step("swap_out", None, "optim")]
    for b in buckets:
        if b.kind != "slice":
            steps.append(Step(b.kind, b.index))
        steps.append(Step("slice", b.index))
        if swap:
            steps.append(Step("swap_out", b.index, "train"))
        if b.kind != "slice":
            steps.append(Step("free", b.index, "tmp"))
    return Plan(src=src, dst=dst, kind="allgather_swap" if swap else "reshard", buckets=buckets,
                steps=tuple(steps), bucket_bytes=bucket_bytes, choices=tuple(choices))


def _finish(index: int, b: dict, src: Layout, dst: Layout) -> Bucket:
    kind, axes, stage = b["key"]
    world = src.mesh.size
    recv = np.zeros(world, np.int64) + b["recv"]
    sent = np.zeros(world, np.int64) + b["sent"]
    group: tuple[int, ...] = ()
    if kind == "p2p":
        senders, receivers = sent > 0, recv > 0
        group = tuple(np.flatnonzero(senders | receivers).tolist())
        both = np.any(senders & receivers)
        kind = "all_to_all" if both and len(group) > 2 else "send_recv"
    alts = sorted(a for a in b["alt"] if a)
    alt = "+".join(alts) if alts and "" not in b["alt"] else ""
    arrays = [recv, sent, b["tmp"], b["keep"], b["src"], b["dst"], b["alt_recv"]]
    for a in arrays:
        a.setflags(write=False)
    return Bucket(index=index, kind=kind, params=tuple(b["params"]), axes=axes, stage=stage, group=group,
                  recv=recv, sent=sent, tmp=b["tmp"], keep=b["keep"], src_bytes=b["src"],
                  dst_bytes=b["dst"], alt=alt,
                  alt_recv=b["alt_recv"] if alt else None)


@dataclass(frozen=True, eq=False)
class PushPlan:
    """The weights of the train layout ``src`` (ranks ``0..src.mesh.size-1`` of the train pool) to the rollout
    layout ``dst`` (ranks of the rollout pool, from 0): per parameter (in ``src``'s order) the pieces of
    ``geometry.transfers(..., apart=True)``; piece ``k`` of a parameter goes from train rank ``send[k]`` to
    rollout rank ``recv[k]`` and covers ``boxes[k]`` of its view. Sent in ``dst``'s dtype."""

    src: Layout
    dst: Layout
    pieces: tuple[tuple[str, geo.Transfers], ...]

    def bytes_sent(self) -> np.ndarray:
        """[train ranks] bytes each train rank sends."""
        out = np.zeros(self.src.mesh.size, dtype=np.int64)
        for name, t in self.pieces:
            out += np.bincount(t.send, weights=t.numel, minlength=len(out)).astype(np.int64) * self.dst[name].itemsize
        return out

    def bytes_received(self) -> np.ndarray:
        """[rollout ranks] bytes each rollout rank receives."""
        out = np.zeros(self.dst.mesh.size, dtype=np.int64)
        for name, t in self.pieces:
            out += np.bincount(t.recv, weights=t.numel, minlength=len(out)).astype(np.int64) * self.dst[name].itemsize
        return out

    def messages(self) -> int:
        return sum(len(t.recv) for _, t in self.pieces)

    def describe(self) -> str:
        sent, recv = self.bytes_sent(), self.bytes_received()
        return (f"push: train {self.src.mesh} ({self.src.mesh.size} ranks) -> rollout {self.dst.mesh} "
                f"({self.dst.mesh.size} ranks), {len(self.pieces)} params in {self.messages()} point-to-point pieces; "
                f"sent max {fmt_bytes(sent.max(initial=0))}/train rank, received {fmt_bytes(recv.max(initial=0))}"
                f"/rollout rank")


def push_plan(train: Layout, rollout: Layout) -> PushPlan:
    """The push from the train pool's layout to the rollout pool's (see ``PushPlan``); the layouts' meshes
    are separate rank sets, of any sizes."""
    a, b = set(train.names), set(rollout.names)
    if a != b:
        raise ValueError(f"layouts differ in params: only in train {sorted(a - b)[:5]}, only in rollout "
                         f"{sorted(b - a)[:5]}")
    if rollout.mesh.pp > 1:
        raise ValueError(f"push_plan: rollout layout {rollout.mesh}: generation runs every layer on each rank (no pp)")
    pieces = []
    for p in train.params:
        q = rollout[p.name]
        if (p.shape, p.view) != (q.shape, q.view):
            raise ValueError(f"param {p.name}: train is {p.shape} (view {p.view}) but rollout is {q.shape} "
                             f"(view {q.view})")
        pieces.append((p.name, geo.transfers(geo.placement(train, p.name), geo.placement(rollout, p.name),
                                             apart=True)))
    return PushPlan(train, rollout, tuple(pieces))


def allgather_swap(train: Layout, rollout: Layout, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Plan:
    """The train -> rollout transition with swap (see the module docstring)."""
    return plan(train, rollout, swap=True, bucket_bytes=bucket_bytes)


def swap_back(forward: Plan) -> Plan:
    """The way back from an allgather-swap plan: swap the train state in, free the rollout weights."""
    if forward.kind != "allgather_swap":
        raise ValueError(f"swap_back needs an allgather_swap plan, got kind={forward.kind!r}")
    steps = (Step("swap_in", None, "train"), Step("free", None, "rollout"), Step("swap_in", None, "grads"),
             Step("swap_in", None, "optim"))
    return Plan(src=forward.dst, dst=forward.src, kind="swap_back", buckets=(), steps=steps,
                bucket_bytes=forward.bucket_bytes)
