"""What a dry run executes for one rank: the transition alone (``transition``), or one whole RL step of the real
schedule (``step``: ``runtime.step.step``) on meta tensors in a fake world of the full size.

The step runs as the recipe's colocated run does, with three stand-ins where a real run has data: the prompts
(ids 0.., every token real), the sampled tokens and the router's choices (``values.Choices``: balanced routing,
every response ending after ``response_tokens`` draws) and the dock (``DryFlow``: every peer alike, this rank's
part of the step's rows made of its own rows, each response at the full ``response_len``: the update's worst
case). The reward reads the decoded text's length.
"""

from __future__ import annotations

import dataclasses
import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from rlflow.batch import PromptBatch, RolloutBatch
from rlflow.dryrun.trace import META, MetaHost, RankTrace, Watch, fake_world
from rlflow.dryrun.values import Choices, Values
from rlflow.ops.registry import posing
from rlflow.optim import AdamWState
from rlflow.sharding import dist as sdist, execute
from rlflow.sharding.execute import TrainState
from rlflow.sharding.memory import StateBytes, ledger
from rlflow.sharding.mesh import Mesh
from rlflow.sharding.plan import allgather_swap


def meta_shards(layout, rank: int, device: torch.device = META) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shards of ``layout`` (those of its pipeline stage) as meta tensors (or on ``device``)."""
    stage = layout.mesh.coords(rank)["pp"]
    return {p.name: torch.empty(p.local_shape(layout.mesh), dtype=p.dtype, device=device)
            for p in layout.params if p.stage == stage}


def transition(train, rollout, rank: int, *, state: StateBytes = StateBytes(grad_bytes=0, optim_bytes=12)
               ) -> RankTrace:
    """Rank ``rank``'s allgather-swap from layout ``train`` to ``rollout`` (``runtime.weights``' forward way) on
    meta tensors in a fake world of the layouts' size: its train shards and AdamW state (``state``'s bytes per
    element: 12 is float32 moments and a master) swapped out, its rollout shards built. The ledger's peak for
    the rank is computed from the same plan and ``state``."""
    plan = allgather_swap(train, rollout)
    led = ledger(plan, state)
    trace = RankTrace(rank, ledger_peak_bytes=int(led.peak[rank]), ledger_steps=led.total[1:, rank].tolist())
    with fake_world(rank, train.mesh.size), Watch(trace) as watch:
        shards = meta_shards(train, rank)
        optim = None
        if state.optim_bytes:
            f32 = lambda: {n: torch.empty(t.shape, dtype=torch.float32, device=META)  # noqa: E731
                           for n, t in shards.items()}
            optim = AdamWState(step=1, m=f32(), v=f32(), master=f32() if state.optim_bytes > 8 else {})
        held = list(shards.values()) + ([] if optim is None else [*optim.m.values(), *optim.v.values(),
                                                                   *optim.master.values()])
        watch.hold(held)
        del held
        st = TrainState(optim=optim)
        st.arena = MetaHost(watch)
        del optim
        out = sdist.execute(plan, shards, st, device=META, on_step=lambda i: trace.steps.append(watch.live_bytes()))
        trace.peak_bytes = max(trace.peak_bytes, watch.live_bytes())
        del out
    return trace




@dataclass(frozen=True)
class StepCase:
    """One colocated RL step to dry-run: the model, the world, the layouts' meshes and the step's sizes (global,
    as the recipe's flags)."""
    model: str
    world: int
    train: str  # the train layout's mesh, "tp=2,ep=8"
    rollout: str
    prompts: int  # per step
    group_size: int
    prompt_len: int
    response_len: int  # the longest response: the KV cache's length and the update's rows
    response_tokens: int = 4  # tokens each row samples before its EOS (the decode steps executed)
    micro_batch: int = 0  # samples per forward / backward (global); 0: one per data-parallel rank
    kl: bool = True  # a reference policy (its log-probs every step)
    remat: bool = False  # the update's activation checkpointing (``LoopConfig.remat``)
    eos: int = 1
    kernels: str = "meta"  # the device kind whose program the meta tensors run (``ops.registry.posing``): meta is
    # an accelerator's kernels in shapes; "cpu" this machine's, to compare a dry run's cost with a real one
    device: str = "meta"  # the dry tensors': meta, or "npu": fake tensors of a fake NPU running the NPU backend's
    # entries (``dryrun.npu``; it renames the process's PrivateUse1 device: a process of its own)

    @property
    def dry_device(self) -> torch.device:
        """The dry tensors' device (``npu``: this process's fake one made first, ``dryrun.npu.fake_device``)."""
        if self.device not in ("meta", "npu"):
            raise ValueError(f"StepCase.device {self.device!r}: expected 'meta' or 'npu'")
        if self.device == "npu":
            from rlflow.dryrun.npu import fake_device
            fake_device()
        return torch.device(self.device)

    def layouts(self):
        from rlflow.models.sharding import layout
        return tuple(layout(self.model, Mesh.parse(m, self.world), dtype=torch.bfloat16)
                     for m in (self.train, self.rollout))

    def shape_classes(self) -> list[int]:
        """One rank per (train pipeline stage, rollout pipeline stage): layouts split every dim evenly, so those
        ranks' shards have the same shapes (and under balanced routing run the same shapes)."""
        train, rollout = (Mesh.parse(m, self.world) for m in (self.train, self.rollout))
        seen: dict = {}
        for r in range(self.world):
            seen.setdefault((train.coords(r)["pp"], rollout.coords(r)["pp"]), r)
        return list(seen.values())

    @property
    def micro_batches(self) -> int:
        """Micro-batches a data-parallel rank's rows run in (the run's ``micro_batch_size`` samples each over the
        data-parallel ranks)."""
        return max(self.prompts * self.group_size // self.loop_config().micro_batch_size, 1)

    def placement(self):
        """Where the step runs: one process runs it alone (the recipe's world 1), else colocated."""
        from rlflow.runtime.placement import Colocated
        return None if self.world == 1 else Colocated(*self.layouts())

    def loop_config(self):
        """The run's ``LoopConfig``: GRPO, one optimizer step on the step's rows."""
        from rlflow.algos.grpo import GRPOConfig
        from rlflow.optim import AdamWConfig
        from rlflow.rollout import SamplingConfig
        from rlflow.runtime.config import LoopConfig
        n, dp = self.prompts * self.group_size, Mesh.parse(self.train, self.world).data_parallel_size
        return LoopConfig(steps=1, prompts_per_step=self.prompts, mini_batch_size=n,
                          micro_batch_size=self.micro_batch or dp, optim=AdamWConfig(),
                          grpo=GRPOConfig(group_size=self.group_size, kl_coef=0.001 if self.kl else 0.0),
                          sampling=SamplingConfig(max_new_tokens=self.response_len, eos_id=self.eos),
                          max_prompt_len=self.prompt_len, remat=self.remat)

    def prompt_batch(self, vocab: int) -> PromptBatch:
        """The step's prompts (on the CPU): ids 0, 1, .. (mod ``vocab``), every token real."""
        ids = torch.arange(self.prompts * self.prompt_len).reshape(self.prompts, self.prompt_len) % vocab
        return PromptBatch(prompt_ids_BTp=ids, prompt_mask_BTp=torch.ones_like(ids, dtype=torch.bool),
                           index_B=torch.arange(self.prompts), group_B=torch.arange(self.prompts),
                           answers=("",) * self.prompts)


class _Text:
    """The dry run's tokenizer: one character per token (a prompt's ids 1.., a response's text "x"s)."""
    bos_id, pad_id = None, 0

    def encode(self, text: str) -> list[int]:
        return list(range(1, len(text) + 1))

    def decode(self, ids) -> str:
        return "x" * len(ids)


def _reward(texts, answers) -> list[float]:
    return [float(len(t) % 2) for t in texts]


class _NoDock:
    def clear(self) -> None:
        pass


class DryFlow:
    """The dock of a dry run, every peer alike: a rank's part of the step's rows for the train group (the step's
    rows over the train mesh's data-parallel parts) is made of the rows it put itself, each response padded to
    ``response_len`` and every token real."""

    def __init__(self, response_len: int, device: torch.device = META):
        self.response_len, self.device = response_len, device

    def begin(self, prompts: PromptBatch, group_size: int, slot: int | None = None) -> None:
        self.n, self.G = prompts.size * group_size, group_size

    def put_rows(self, rows: RolloutBatch, **cols: torch.Tensor) -> None:
        self.rows, self.cols = rows, cols

    def get(self, consumer: str, columns: list[str], mesh, rank: int):
        n = self.n // (1 if mesh is None else mesh.data_parallel_size)
        pick = torch.arange(n, device=self.device) % self.rows.size
        rows = self.rows.select(pick)
        pad = self.response_len - rows.response_ids_BTr.shape[1]
        full = {k: torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, pad))
                for k, v in rows.tensors().items() if k.endswith(("_BTr", "_BTrMK"))}
        full["response_mask_BTr"] = torch.ones(n, self.response_len, dtype=torch.bool, device=self.device)
        index = torch.arange(n, device=self.device)  # the picked rows come in whole groups of G: row i is of
        # prompt i // G
        rows = rows.replace(**full, index_B=index, group_B=index // self.G)
        return rows, {c: self.cols[c][pick] for c in columns if c in self.cols}

    def end(self) -> None:
        pass


@contextmanager
def _uploads(watch: Watch):
    """A swap-in copies host memory to the device; on meta both are meta and ``Tensor.to`` would hand back the
    host tensor itself, uncounted: in the dry run the copy is a fresh device tensor (on a fake NPU, of its device;
    ``sharding.execute`` and the critic's swap move tensors back through ``execute.to_device``)."""
    from rlflow.algos import critic
    real = execute.to_device

    def to_device(t, device):
        if t.device == META and StorageWeakRef(t.untyped_storage()) in watch.host:
            watch.host_copy(t)
            return t.clone() if torch.device(device) == META else torch.empty(t.shape, dtype=t.dtype, device=device)
        return real(t, device)
    execute.to_device = critic.to_device = to_device
    try:
        yield
    finally:
        execute.to_device = critic.to_device = real


def _marked(watch: Watch, name: str, fn):
    def run(*args, **kwargs):
        watch.stage(name)
        return fn(*args, **kwargs)
    return run


@contextmanager
def decode_marked(watch: Watch, advance: int = 0):
    """Generation's decode steps counted apart from its prefill: from the first, stage "decode", each counted in
    ``RankTrace.decode_steps`` (a dry run executes a few of a response's tokens; the cost model scales them to the
    whole length). ``advance``: before the first, every slot's cache is advanced by that many tokens (stand-ins,
    never written), so that the executed steps attend over as many columns as the whole response's do on average."""
    from rlflow import rollout
    plain = rollout.decode_step

    def marked(*args, **kwargs):
        watch.stage("decode")
        if not watch.trace.decode_steps and advance:
            cache = inspect.signature(plain).bind(*args, **kwargs).arguments["cache"]
            cache.lengths_B += advance
            cache.bound += advance
        watch.trace.decode_steps += 1
        return plain(*args, **kwargs)
    rollout.decode_step = marked
    try:
        yield
    finally:
        rollout.decode_step = plain


def staged(ctx, watch: Watch):
    """``ctx`` (a ``runtime.step.StepContext``) with its stages' starts marked in ``watch`` (``Watch.stage``):
    each stage of its graph by name, the engine's generation from its ``load`` and the swap back from its
    ``release``. The caller marks the transition (the step's start)."""
    graph = dataclasses.replace(ctx.graph, stages=tuple(
        s if s.fn is None else dataclasses.replace(s, fn=_marked(watch, s.name, s.fn)) for s in ctx.graph.stages))
    eng = ctx.engine
    eng.load, eng.release = _marked(watch, "generate", eng.load), _marked(watch, "swap back", eng.release)
    return dataclasses.replace(ctx, graph=graph)


def step(case: StepCase, rank: int) -> RankTrace:
    """Rank ``rank``'s one RL step of ``case`` (``runtime.step.step``, colocated, GRPO) on meta tensors (or a fake
    NPU's: ``case.device``) in a fake world of ``case.world``: the transition, generation (prefill and
    ``response_tokens`` draws), the swap back, scoring, the dock, the reference and old log-probs and the update
    with its AdamW step. Its trace has the collectives, the peak of live device bytes per stage (``stage_peaks``)
    and the host reads no value knew."""
    from rlflow.models.config import get_config
    from rlflow.runtime import state as runstate, step as steps

    cfg = get_config(case.model)
    train = case.layouts()[0]
    trace = RankTrace(rank)
    choices = Choices(cfg.vocab_size, case.eos, case.response_tokens)
    dev = case.dry_device
    watch = Watch(trace, device=dev.type)
    # the watch inside the values: it sees the ops the step issues, and the dry outputs the values made
    with _fake_device(dev), fake_world(rank, case.world, dev.type), Values(choices, device=dev.type) as values, \
            _uploads(watch), posing(case.kernels):
        ctx = steps.context(cfg, _Text(), _reward, case.loop_config(), device=dev, dock=_NoDock(),
                            placement=case.placement())
        ctx = dataclasses.replace(staged(ctx, watch), flow=DryFlow(case.response_len, dev))
        ctx.weights.state.arena = MetaHost(watch)
        # the executed steps at the response's middle: the whole response's decode steps attend over Tp + 1 ..
        # Tp + Tr - 1 columns, response_tokens - 1 executed ones from Tp + 1 + advance
        with watch, decode_marked(watch, advance=(case.response_len - case.response_tokens) // 2):
            watch.stage("state")
            policy = meta_shards(train, rank, dev)
            state = runstate.init(policy, None, kl=case.kl)
            del policy
            prompts = case.prompt_batch(cfg.vocab_size).to(dev)
            watch.stage("transition")
            state, _ = steps.step(state, prompts, ctx)
            watch.stage("end")
    trace.unknown_reads = dict(values.unknown_reads)
    return trace


def _fake_device(dev: torch.device):
    """A fake NPU's tensors within the block (``dryrun.npu.program``), or none for meta ones."""
    if dev.type == "meta":
        return nullcontext()
    from rlflow.dryrun.npu import program
    return program()
