"""The run's pieces of the flags: the model (a checkpoint or a preset's random init), the configs of
``loop.train``, the prompts and the reward, the layouts and the transfer dock."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from rlflow import device as rl_device
from rlflow import optim, rewards
from rlflow.algos import grpo
from rlflow.algos.critic import CriticConfig
from rlflow.data import TASKS, Example, eval_task, PromptSource, apply_chat_template, load_examples
from rlflow.dock import Dock
from rlflow.dock.proc_backend import node_dock, proc_dock
from rlflow.models import adapters, decoder, hf, lora, shapes
from rlflow.models.lora import LoraConfig
from rlflow.models.config import ModelConfig, get_config
from rlflow.models.sharding import layout
from rlflow.envs.tools import load_tools, schema
from rlflow.multiturn import MultiTurnConfig
from rlflow.parallel.context import check_layout
from rlflow.rollout import SamplingConfig
from rlflow.recipe.flags import Recipe
from rlflow.runtime.config import LoopConfig
from rlflow.runtime.graph import graph_for
from rlflow.runtime.launch import ray_init
from rlflow.runtime.placement import Colocated, Disaggregated, Placement
from rlflow.sharding import Mesh
from rlflow.tokenizer import CharTokenizer, ChatTemplate, HFTokenizer, find_chat_template



def grpo_config(r: Recipe) -> grpo.GRPOConfig:
    return grpo.GRPOConfig(group_size=r.group_size, clip_low=r.clip_low, clip_high=r.clip_high, dual_clip=r.dual_clip,
                           kl_coef=r.kl_coef, kl_estimator=r.kl_estimator, entropy_coef=r.entropy_coef,
                           loss_agg=r.loss_agg, scale_rewards=r.scale_rewards, epochs=r.epochs,
                           temperature=r.temperature, policy_loss=r.policy_loss, adv_estimator=r.adv_estimator,
                           rollout_is=r.rollout_is, rollout_is_cap=r.rollout_is_cap, rollout_is_mode=r.rollout_is_mode,
                           gae_gamma=1.0 if r.gae_gamma is None else r.gae_gamma,
                           gae_lambda=1.0 if r.gae_lambda is None else r.gae_lambda)


# --lr's defaults, (every weight, LoRA's adapters), for a random-init --preset and a pretrained --model: a
# pretrained model's weights take a small step; adapters (B starting at zero) a larger one
LR_DEFAULTS = {"preset": (3e-4, 1e-3), "model": (2e-5, 2e-4)}


def learning_rate(r: Recipe) -> float:
    if r.lr is not None:
        return r.lr
    full, adapters_lr = LR_DEFAULTS["model" if r.model else "preset"]
    return adapters_lr if r.lora_rank or r.lora_resume is not None else full


def optim_config(r: Recipe) -> optim.AdamWConfig:
    return optim.AdamWConfig(lr=learning_rate(r), betas=(0.9, 0.99), weight_decay=r.weight_decay)


def lora_config(r: Recipe, cfg: ModelConfig | None = None) -> LoraConfig | None:
    """--lora-rank's adapters (None: every weight trains) for the model ``cfg`` (None: the flags' rules only);
    --lora-resume's rank, alpha and targets win. With no --lora-targets they are peft's "all-linear" (every
    projection the model has), and for a random-init --preset with an untied head the head too: nothing
    pretrained maps its hidden states to tokens yet, and rank-r updates of the projections alone barely move
    that map (docs/lora.md, "Learning")."""
    if not r.lora_rank and r.lora_resume is None:
        return None
    if r.lora_resume is not None:
        return adapters.read_config(r.lora_resume)
    targets = None if r.lora_targets is None else tuple(t.strip() for t in r.lora_targets.split(",") if t.strip())
    lc = LoraConfig(rank=r.lora_rank, alpha=2.0 * r.lora_rank if r.lora_alpha is None else r.lora_alpha,
                    targets=targets, dropout=r.lora_dropout)
    if targets is None and cfg is not None and r.model is None and not cfg.tie_word_embeddings:
        lc = dataclasses.replace(lc, targets=cfg.replace(lora=lc).lora.targets + (lora.HEAD,))
    return lc


def critic_config(r: Recipe, policy: optim.AdamWConfig) -> CriticConfig | None:
    """PPO's critic with --adv-estimator gae (the policy's AdamW but for --critic-lr), else None."""
    if r.adv_estimator != "gae":
        return None
    return CriticConfig(optim=dataclasses.replace(policy, lr=learning_rate(r) if r.critic_lr is None else r.critic_lr),
                        value_clip=0.5 if r.value_clip is None else r.value_clip)


def sampling_config(r: Recipe, eos_id: int, pad_id: int) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=r.max_new_tokens, eos_id=eos_id, pad_id=pad_id, temperature=r.temperature,
                          top_p=r.top_p)


DOCK_TIMEOUT_S = 1800.0  # without --dist-timeout: as long as gloo's collectives wait


def loop_config(r: Recipe, eos_id: int, pad_id: int) -> LoopConfig:
    """``loop.train``'s config of the flags (``eos_id``, ``pad_id``: the tokenizer's). Each config it is made
    of checks its own fields (a ValueError naming them: ``checks.config_problems`` maps it onto the flags)."""
    gb = r.prompts_per_step * r.group_size
    mini = r.mini_batch_size or gb
    ocfg = optim_config(r)
    return LoopConfig(
        steps=r.steps, prompts_per_step=r.prompts_per_step, mini_batch_size=mini,
        micro_batch_size=r.micro_batch_size or mini,
        grpo=grpo_config(r), optim=ocfg,
        max_grad_norm=r.max_grad_norm, remat=r.remat,
        sampling=sampling_config(r, eos_id, pad_id),
        max_prompt_len=r.max_prompt_len, warmup_lr_steps=r.warmup_lr_steps, lr_schedule=r.lr_schedule,
        min_lr_ratio=r.min_lr_ratio, seed=r.seed,
        compile_decode=r.compile_decode, rollout_engine=r.rollout_engine,
        vllm_memory_utilization=r.vllm_memory_utilization, vllm_expert_parallel=r.vllm_expert_parallel,
        max_bad_steps=r.max_bad_steps,
        routing_replay=r.routing_replay,
        check_logprobs=r.check_logprobs, critic=critic_config(r, ocfg), max_staleness=r.max_staleness,
        partial_rollout=r.partial_rollout,
        multiturn=multiturn_config(r),
        dock_timeout_s=r.dist_timeout if r.dist_timeout is not None else DOCK_TIMEOUT_S)


def multiturn_config(r: Recipe) -> MultiTurnConfig | None:
    if r.env is None:
        return None
    given = {"max_turns": r.max_turns, "max_total_tokens": r.max_total_tokens, "timeout_s": r.env_timeout,
             "tools": r.tools}
    return MultiTurnConfig(env=r.env, **{k: v for k, v in given.items() if v is not None})


def concrete(r: Recipe) -> Recipe:
    """``r`` with --dtype auto resolved for this process's device kind (each rank resolves it where it runs:
    a Ray driver may have no accelerator)."""
    if r.dtype != "auto":
        return r
    return dataclasses.replace(r, dtype="float32" if rl_device.kind() == "cpu" else "bfloat16")


def load_model(r: Recipe):
    """(cfg, params, tokenizer, device) of --model, or a random init of --preset with the built-in tokenizer, on
    this process's device (``process_device``: under torchrun on several nodes or on Ray the global rank is no
    device index)."""
    dev = rl_device.process_device()
    if dev.type == "cpu":
        rl_device.keep_host_memory()  # activations reuse freed memory instead of fresh pages every step
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[concrete(r).dtype]
    if r.model:
        try:
            cfg, params = hf.load(r.model, dtype=dtype, device=dev)
            tok = HFTokenizer(r.model)
        except (ValueError, OSError) as e:  # a damaged or foreign checkpoint, one line naming the flag and file
            raise SystemExit(f"error: --model {r.model}: {e}") from None
    else:
        tok = CharTokenizer()
        cfg = get_config(r.preset)
        if cfg.vocab_size < tok.vocab_size:
            raise ValueError(f"--preset {r.preset}: vocab_size {cfg.vocab_size} < built-in tokenizer's {tok.vocab_size}")
        cfg = cfg.replace(eos_token_id=tok.eos_id)
        params = decoder.init_params(cfg, seed=r.seed, dtype=dtype, device=dev)
    if (lc := lora_config(r, cfg)) is not None:  # the adapters beside the frozen weights, in forward order
        cfg = cfg.replace(lora=lc)
        fresh = lora.init(cfg, shapes.param_shapes(cfg), seed=r.seed, device=dev) if r.lora_resume is None else \
            adapters.load(r.lora_resume, cfg, device=dev)
        for n in [n for n in fresh if not lora.is_adapter(n)]:  # peft's copy of an adapted head: the model's own
            if not torch.equal(fresh.pop(n).to(params[n].dtype), params[n]):
                raise SystemExit(f"error: --lora-resume {r.lora_resume}: its {n} (peft's copy of the adapted head) "
                                 f"is not the model's: adapters of another model")
        params = {n: fresh[n] if n in fresh else params[n] for n in lora.with_adapters(cfg, shapes.param_shapes(cfg))}
    return cfg, params, tok, dev


@dataclass(frozen=True)
class RunSpec:
    """What a run is made of, from the flags: the model (its config, the whole initial weights on this
    process's device), the tokenizer, the prompt source, the reward and the loop's config."""
    cfg: ModelConfig
    params: dict
    tokenizer: object
    source: PromptSource
    reward_fn: Callable
    config: LoopConfig
    device: torch.device
    template: ChatTemplate | None = None  # --model's chat template, for multi-turn observations (--env)


def build(r: Recipe) -> RunSpec:
    cfg, params, tok, dev = load_model(r)
    chat = chat_template(r)
    source, reward_fn = prompts_and_reward(r, chat)
    return RunSpec(cfg=cfg, params=params, tokenizer=tok, source=source, reward_fn=reward_fn,
                   config=loop_config(r, tok.eos_id, tok.pad_id), device=dev, template=chat if r.env else None)


def check_tokenizer(r: Recipe, cfg) -> None:
    """--model's tokenizer must fit its model's vocabulary (SystemExit naming the flag)."""
    tok = HFTokenizer(r.model)
    if tok.vocab_size > cfg.vocab_size:
        raise SystemExit(f"error: --model {r.model}: the tokenizer has {tok.vocab_size} tokens but the model's "
                         f"vocab_size is {cfg.vocab_size}")
    for name in ("eos_id", "pad_id"):
        if not 0 <= getattr(tok, name) < cfg.vocab_size:
            raise SystemExit(f"error: --model {r.model}: the tokenizer's {name} {getattr(tok, name)} is outside "
                             f"the model's vocabulary [0, {cfg.vocab_size})")


def reward_specs(r: Recipe) -> list[str]:
    """--reward, else the default: math for datasets (the eval set of --eval-only is one), a built-in task's own
    (``data.TASKS``; for --eval-only that of ``--eval-dataset task:NAME``)."""
    if r.reward:
        return list(r.reward)
    if r.eval_only and r.eval_dataset:
        task = eval_task(r.eval_dataset)
    else:
        task = None if r.dataset else r.task
    return [TASKS[task].reward if task in TASKS else "math"]


def reward_weights(r: Recipe) -> list[float] | None:
    return None if r.reward_weights is None else [float(w) for w in r.reward_weights.split(",")]


def has_chat_template(r: Recipe) -> bool:
    """--model has a chat template and --no-chat-template is not given."""
    return bool(r.model and r.chat_template and find_chat_template(r.model) is not None)


def chat_template(r: Recipe) -> ChatTemplate | None:
    """--model's chat template, unless --no-chat-template or the model has none."""
    return ChatTemplate(r.model) if has_chat_template(r) else None


def prompts_and_reward(r: Recipe, chat: ChatTemplate | None) -> tuple[PromptSource, rewards.RewardFn]:
    """The prompt source (each batch rendered by ``chat``, the run's chat template, carrying what the reward
    functions are called with) and the loop's reward (``CombinedReward.score``: one call per scorer's rows)."""
    # an environment starts its episodes from the whole example: the answers carry the prompts and extra columns
    reward = rewards.CombinedReward.load(reward_specs(r), reward_weights(r), context=r.env is not None)
    prepare = prompt_transform(r, reward, chat)
    if r.dataset:
        examples = load_examples(r.dataset, prompt_key=r.prompt_key, answer_key=r.answer_key, split=r.dataset_split)
        source = PromptSource(examples=examples, seed=r.seed, transform=prepare)
    else:
        source = PromptSource(task=r.task, seed=r.seed, transform=prepare)
    return source, reward.score


def prompt_transform(r: Recipe, reward: rewards.CombinedReward,
                     chat: ChatTemplate | None) -> Callable[[list[Example]], list[Example]]:
    """Examples as the model and the reward functions see them: rendered by ``chat`` (the run's chat template),
    carrying what the reward functions are called with."""
    tools = [schema(fn) for fn in load_tools(r.tools).values()] if r.tools else None

    def prepare(batch: list[Example]) -> list[Example]:
        if chat is not None:
            batch = apply_chat_template(batch, chat, system_prompt=r.system_prompt, tools=tools)
        return reward.carry(batch)
    return prepare


def mesh_of(r: Recipe, spec: str | None, name: str):
    """The mesh of --train-layout / --rollout-layout over the ranks it spans: the world, or with --rollout-ranks
    its pool (defaults: tp=2 for the train layout of a colocated world, else dp over the ranks)."""
    ranks = r.world if not r.rollout_ranks else r.rollout_ranks if name == "rollout_layout" else r.world - r.rollout_ranks
    if spec is None:
        spec = "tp=2" if name == "train_layout" and not r.rollout_ranks else ""
    return Mesh.parse(spec, ranks)


def layouts(r: Recipe, cfg, dtype) -> dict:
    """{train_layout, rollout_layout, critic} of a --world > 1 run (ValueError naming what the model cannot run)."""
    lays = {}
    for name in ("train_layout", "rollout_layout"):
        mesh = mesh_of(r, getattr(r, name), name)
        try:
            lays[name] = layout(cfg, mesh, dtype=dtype)
            check_layout(lays[name], cfg)
            if name == "train_layout" and cfg.lora is not None and (why := lora.stages_problem(lays[name], cfg)):
                raise ValueError(why)
        except ValueError as e:
            given = getattr(r, name) or f"{mesh} (the default)"
            raise ValueError(f"--{name.replace('_', '-')} {given}: {e}") from None
    lays["critic"] = layout(cfg, lays["train_layout"].mesh, dtype=dtype, head="value") if r.adv_estimator == "gae" \
        else None
    return lays


def placement(r: Recipe, cfg, dtype) -> Placement | None:
    """Where the stages of a --world > 1 run go (ValueError naming what the model cannot run): colocated, or with
    --rollout-ranks the separate pools; None: one process."""
    if r.world == 1:
        return None
    lays = layouts(r, cfg, dtype)
    if r.rollout_ranks:
        return Disaggregated(rollout=lays["rollout_layout"], train=lays["train_layout"], critic=lays["critic"])
    return Colocated(lays["train_layout"], lays["rollout_layout"], critic=lays["critic"])


def make_dock(r: Recipe, capacity: int, local_rank: int | None = None):
    """The transfer dock the stages exchange rows through, or None (in memory). Made by the driver; the ranks
    are handed it (its processes or actors outlive them). With ``local_rank`` (under torchrun / Slurm, where
    no driver exists) every rank calls it: the ranks start the dock's servers together."""
    g = graph_for(r.adv_estimator)
    warehouses = r.dock if r.dock is not None else (r.world if r.world > 1 else 0)
    backend = r.dock_backend or ("local" if r.world == 1 else "ray" if r.launcher == "ray" else "procs")
    if not warehouses:
        return None
    if backend == "local":
        return Dock.local(g.schema, g.consumers, capacity=capacity, warehouses=warehouses, group_size=r.group_size)
    if backend == "procs" and local_rank is not None:
        return node_dock(g.schema, g.consumers, capacity=capacity, warehouses=warehouses, local_rank=local_rank,
                         group_size=r.group_size)
    if backend == "procs":
        return proc_dock(g.schema, g.consumers, capacity=capacity, warehouses=warehouses, group_size=r.group_size)
    ray_init(r.ray_address)
    from rlflow.dock.ray_backend import ray_dock
    # every train rank may wait in the controller at once (take_share) while the others' puts still need threads
    return ray_dock(g.schema, g.consumers, capacity=capacity, warehouses=warehouses, group_size=r.group_size,
                    max_concurrency=max(64, 2 * r.world + 16))
