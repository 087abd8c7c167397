"""The GRPO recipe's machinery: every flag of ``recipes/grpo_qwen3_moe.py`` (and of the recipes that reuse it with
other defaults, ``recipes/grpo_qwen25_dense.py``) as a field of ``Recipe``, the checks that refuse a value by its
flag before anything runs, and the run: the model (a checkpoint or a preset's random init), the data, the reward,
the layouts and the dock built from the flags, ``rlflow.runtime.loop.train`` on every rank, checkpoints,
evaluation, metrics sinks and the reward plot.

``main(argv, defaults, doc)`` is what a recipe script calls: ``defaults`` replace ``Recipe``'s field defaults
and ``doc`` is the --help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from rlflow import device as rl_device
from rlflow import eval as rl_eval
from rlflow import metrics, optim, rewards
from rlflow.algos import grpo
from rlflow.algos.critic import Critic, CriticConfig
from rlflow.algos.corrections import IS_LEVELS, IS_MODES, LogprobMismatchError
from rlflow.algos.estimators import ADV_ESTIMATORS
from rlflow.data import Example, PromptSource, apply_chat_template, load_examples
from rlflow.models import hf, qwen3_moe
from rlflow.models.config import get_config
from rlflow.rollout import SamplingConfig
from rlflow.runtime import checkpoint, loop
from rlflow.tokenizer import CharTokenizer, ChatTemplate, HFTokenizer, find_chat_template


def _f(default, help):  # a field with its --help text
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Recipe:
    model: str | None = _f(None, "Hugging Face checkpoint directory (default: random init of --preset)")
    preset: str = _f("qwen3-moe-tiny", "named model config used when --model is not given")
    dataset: str | None = _f(None, "prompts and answers: a .jsonl, .json, .csv or .parquet file, or a Hugging Face "
                                   "datasets folder (save_to_disk, or data files) (default: the built-in --task)")
    dataset_split: str = _f("train", "split of --dataset (a data file's one split is train; slices like "
                                     "train[:100] for files read by datasets)")
    prompt_key: str = _f("prompt", "--dataset column of the prompts: text, or chat messages [{role, content}] "
                                   "(when it is missing, GSM8K's question column)")
    answer_key: str = _f("answer", "--dataset column of the reference answers")
    task: str = _f("max_digit", "built-in task: max_digit, sum_mod10, first_digit")
    chat_template: bool = _f(True, "render each prompt with --model's chat template (chat_template.jinja or "
                                   "tokenizer_config.json's), as transformers' apply_chat_template does; "
                                   "--no-chat-template: the prompt text as it is")
    system_prompt: str | None = _f(None, "system message put before each prompt's messages (needs a chat template)")
    reward: tuple[str, ...] | None = _f(None, "reward function: exact, math, path/to/file.py:function or "
                                              "module:function; repeat for several, summed with --reward-weights "
                                              "(default: exact for tasks, math for datasets)")
    reward_weights: str | None = _f(None, "weights of the --reward functions, comma-separated, e.g. 0.5,1 "
                                          "(default: 1 each)")
    steps: int = _f(500, "GRPO steps")
    prompts_per_step: int = _f(16, "prompts per step")
    group_size: int = _f(8, "samples per prompt (G)")
    mini_batch_size: int | None = _f(None, "samples per optimizer step (default: the whole step's batch)")
    micro_batch_size: int | None = _f(None, "samples per forward/backward (default: the mini-batch)")
    epochs: int = _f(1, "passes over each step's samples")
    max_new_tokens: int = _f(3, "response length limit")
    max_prompt_len: int | None = _f(None, "truncate prompts to their last N tokens")
    lr: float = _f(3e-4, "AdamW learning rate")
    warmup_lr_steps: int = _f(10, "linear LR warm-up steps")
    lr_schedule: str = _f("constant", "learning rate after the warm-up: constant, or a cosine or linear decay to "
                                      "--lr x --min-lr-ratio at the last step (see docs/logging.md)")
    min_lr_ratio: float = _f(0.0, "where --lr-schedule cosine/linear ends, as a fraction of --lr")
    kl_coef: float = _f(0.0, "KL(pi || pi_ref) coefficient; non-zero keeps a frozen reference copy")
    kl_estimator: str = _f("low_var_kl", "KL estimator: k1, k2, k3, low_var_kl (clamped k3)")
    adv_estimator: str = _f("grpo", "advantages: grpo (group-normalized), rloo (leave-one-out), reinforce++ "
                                    "(batch-normalized), reinforce++-baseline (group mean, then batch-normalized), "
                                    "gae (PPO: per token, from a critic trained beside the policy)")
    gae_gamma: float | None = _f(None, "gae: discount (default 1.0)")
    gae_lambda: float | None = _f(None, "gae: GAE's lambda (default 1.0: the return minus the value)")
    critic_lr: float | None = _f(None, "gae: the critic's AdamW learning rate, constant (default: --lr)")
    value_clip: float | None = _f(None, "gae: the critic's new values stay within the old ones +- this in its loss "
                                        "(default 0.5)")
    scale_rewards: bool = _f(True, "grpo: divide by the group's std (--no-scale-rewards: Dr.GRPO)")
    policy_loss: str = _f("ppo", "ratio: ppo (per token), gspo (per sequence), gspo-token")
    loss_agg: str = _f("token-mean", "loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm "
                                     "(Dr.GRPO)")
    clip_low: float = _f(0.2, "lower ratio clip: ratios below 1 - clip_low are clipped")
    clip_high: float = _f(0.28, "upper ratio clip (DAPO clip-higher)")
    dual_clip: float | None = _f(None, "dual-clip PPO: for negative advantages cap the loss at -A * c (c > 1)")
    entropy_coef: float = _f(0.0, "entropy bonus coefficient")
    rollout_is: str = _f("none", "importance-sample the rollout/trainer log-prob mismatch: none, token, seq")
    rollout_is_cap: float = _f(2.0, "rollout IS: truncate weights at c, or (mask) drop those outside [1/c, c]")
    rollout_is_mode: str = _f("truncate", "rollout IS: truncate (TIS) or mask (MIS)")
    dist_timeout: float | None = _f(None, "seconds a collective, or a rank's get of the step's rows from the dock, "
                                          "waits for a peer before the run fails (a hung rank); default: torch's "
                                          "for collectives (30 min on gloo, 10 min on nccl), 30 min for the dock")
    check_logprobs: float | None = _f(None, "fail the run when the trainer's log-probs of the sampled tokens differ "
                                            "from the rollout's by more than this mean |d| per token (a consistency "
                                            "gate for CI; reports the worst rows)")
    routing_replay: str = _f("off", "MoE Rollout Routing Replay: off; measure (report the share of tokens whose "
                                    "experts differ from the rollout's); on (R3: the old log-probs and the update "
                                    "route each token to the rollout's experts)")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm to this")
    weight_decay: float = _f(0.0, "AdamW weight decay (matrices only)")
    temperature: float = _f(1.0, "sampling temperature")
    top_p: float = _f(1.0, "nucleus sampling")
    seed: int = _f(0, "seed for init, prompts and sampling")
    dtype: str = _f("float32", "parameter dtype: float32 or bfloat16 (AdamW keeps float32 masters)")
    world: int = _f(2, "ranks (one device each; on a CPU one process and one thread each): the stages run in "
                       "their layouts over all of them and take turns; 1: one process, unsharded")
    train_layout: str | None = _f(None, "layout of the update and the old/ref log-probs, e.g. tp=2, ep=2,tp=2, pp=2,tp=2, dp=4 "
                                        "(axes not named are 1, dp fills the world; default: tp=2 when world >= 2)")
    rollout_layout: str | None = _f(None, "layout of generation, e.g. dp=2, dp=2,tp=2 (default: dp over the world); "
                                          "the weights move train -> rollout layout before every rollout")
    launcher: str = _f("local", "how the ranks start: local (processes on this machine) or ray (one actor per "
                                "rank in a placement group; see --ray-address); under torchrun or Slurm the ranks "
                                "are those processes")
    dock: int | None = _f(None, "route the rows from the rollout ranks to the train ranks through a transfer dock "
                                "with this many warehouses (default: one per rank when world > 1; 0 with world 1: "
                                "batches in memory)")
    dock_backend: str | None = _f(None, "transfer dock backend: local (threads, world 1), procs (warehouses and "
                                        "controllers in processes of their own) or ray (as Ray actors spread over "
                                        "the cluster's nodes); default: local with world 1, ray with --launcher ray, "
                                        "else procs")
    ray_address: str | None = _f(None, "Ray cluster to join (e.g. auto: the one `ray start --head` runs here); "
                                       "default: start a local Ray")
    max_restarts: int = _f(0, "--launcher ray: when a rank is lost (its actor died, or it stopped answering), "
                              "restart the ranks and a fresh dock from the newest checkpoint of this run, up to K "
                              "times (needs --out and --save-every); 0: the run fails naming the rank")
    compile_decode: bool = _f(False, "compile the rollout's decode step with torch.compile (static shapes; "
                                     "pays off on long runs with fixed shapes, CUDA graphs on CUDA)")
    max_bad_steps: int = _f(3, "stop after this many steps in a row whose updates were skipped for non-finite "
                               "rewards, losses or gradients (a skipped update leaves the parameters unchanged)")
    out: str | None = _f(None, "directory for args.json, metrics.jsonl, reward.png, the --log-to files and the final "
                               "checkpoint")
    overwrite: bool = _f(False, "let --out be a directory that holds an earlier run (its files are replaced)")
    log_to: str = _f("jsonl", "metrics sinks, comma-separated: jsonl (--out/metrics.jsonl), tensorboard "
                              "(--out/tensorboard), wandb (needs the logging extra for the last two)")
    log_samples_every: int = _f(0, "every N steps log a table of rank 0's (prompt, response, reward) rows to the "
                                   "sinks (jsonl: --out/samples.jsonl); 0: never")
    wandb_project: str | None = _f(None, "W&B project of --log-to wandb (default: WANDB_PROJECT, else W&B's own)")
    wandb_mode: str | None = _f(None, "W&B mode of --log-to wandb: online, or offline (wandb sync uploads it later) "
                                      "(default: WANDB_MODE, else online)")
    eval_dataset: str | None = _f(None, "held-out prompts and answers to evaluate on, in any --dataset format (the "
                                        "same --prompt-key/--answer-key, chat template and --reward): before the "
                                        "first step, every --eval-every steps and after the last, logged as eval/* "
                                        "at the steps done")
    eval_split: str = _f("train", "split of --eval-dataset (e.g. test for a datasets folder)")
    eval_every: int = _f(0, "also evaluate every N steps (0: only before the first step and after the last)")
    eval_samples: int = _f(1, "responses per eval prompt: 1 is greedy (eval/accuracy); k > 1 are sampled at "
                              "--eval-temperature (eval/pass@1, eval/pass@k)")
    eval_max_prompts: int | None = _f(None, "evaluate on the first N prompts of --eval-dataset (default: all)")
    eval_temperature: float = _f(1.0, "sampling temperature of --eval-samples > 1")
    eval_only: bool = _f(False, "evaluate --model (or a random --preset) on --eval-dataset once, in one process, "
                                "write --out/eval.json and exit without training")
    save_every: int = _f(0, "also write a checkpoint every N steps into --out (0: only the final one)")
    keep_last: int = _f(2, "keep the newest K periodic checkpoints (the final one is always kept)")
    resume: str | None = _f(None, "continue a run: a checkpoint directory, or 'auto' (the newest good one under "
                                  "--out; a fresh start if there is none)")


def parse_args(argv=None, defaults: dict | None = None, doc: str | None = None) -> Recipe:
    """The Recipe of the command line; ``defaults`` replace Recipe's field defaults and ``doc`` the --help
    text (another recipe reusing this one, e.g. recipes/grpo_qwen25_dense.py)."""
    defaults = dict(defaults or {})
    unknown = set(defaults) - {f.name for f in dataclasses.fields(Recipe)}
    if unknown:
        raise TypeError(f"defaults: not Recipe fields: {sorted(unknown)}")
    from rlflow.runtime.launch import env_world
    started = env_world()  # this process is one rank of a world torchrun or Slurm started: its size is --world's
    if started is not None:
        defaults.setdefault("world", started[1])
    p = argparse.ArgumentParser(description=doc or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Recipe):
        default = defaults.get(f.name, f.default)
        flag, help = "--" + f.name.replace("_", "-"), f"{f.metadata['help']} (default: {default})"
        if str(f.type) == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help)
            continue
        if str(f.type) == "tuple[str, ...] | None":
            p.add_argument(flag, action="append", default=None, help=help)
            continue
        typ = {"int | None": int, "str | None": str, "float | None": float}.get(str(f.type), None) or \
            {"int": int, "float": float, "str": str}[str(f.type)]
        p.add_argument(flag, type=typ, default=default, help=help, **CHOICES.get(f.name, {}))
    args = vars(p.parse_args(argv))
    args.update({k: v for k, v in defaults.items() if args[k] is None})  # --reward: a given one replaces the default
    r = Recipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in args.items()})
    for name, why in (started_problems(r, started[1]) if started is not None else []) + problems(r):
        v = getattr(r, name)
        shown = "" if isinstance(v, bool) else " " + (" ".join(v) if isinstance(v, tuple) else str(v))
        p.error(f"--{name.replace('_', '-')}{shown}: {why}")  # one line, exit 2, nothing written
    try:
        grpo_config(r)
    except ValueError as e:  # GRPOConfig names its fields; they are the recipe's flags
        p.error(re.sub(r"GRPOConfig\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(e)))
    return r


def started_problems(r: Recipe, world: int) -> list[tuple[str, str]]:
    """(field, why) for what a rank of a torchrun / Slurm world of ``world`` ranks cannot run with."""
    out = []
    if r.world != world:
        out.append(("world", f"torchrun / Slurm started {world} ranks"))
    if r.launcher == "ray":
        out.append(("launcher", "this process is already one rank of a torchrun / Slurm world"))
    if r.max_restarts:
        out.append(("max_restarts", "the ranks are not Ray actors under torchrun / Slurm (torchrun has its own "
                                    "--max-restarts)"))
    if r.world > 1 and r.dock_backend in ("ray", "local"):
        out.append(("dock_backend", "under torchrun / Slurm the dock is procs: its servers run on the ranks' nodes"))
    return out


def grpo_config(r: Recipe) -> grpo.GRPOConfig:
    return grpo.GRPOConfig(group_size=r.group_size, clip_low=r.clip_low, clip_high=r.clip_high, dual_clip=r.dual_clip,
                           kl_coef=r.kl_coef, kl_estimator=r.kl_estimator, entropy_coef=r.entropy_coef,
                           loss_agg=r.loss_agg, scale_rewards=r.scale_rewards, epochs=r.epochs,
                           temperature=r.temperature, policy_loss=r.policy_loss, adv_estimator=r.adv_estimator,
                           rollout_is=r.rollout_is, rollout_is_cap=r.rollout_is_cap, rollout_is_mode=r.rollout_is_mode,
                           gae_gamma=1.0 if r.gae_gamma is None else r.gae_gamma,
                           gae_lambda=1.0 if r.gae_lambda is None else r.gae_lambda)


GAE_FLAGS = ("gae_gamma", "gae_lambda", "critic_lr", "value_clip")


def critic_config(r: Recipe, policy: optim.AdamWConfig) -> CriticConfig | None:
    """PPO's critic with --adv-estimator gae (the policy's AdamW but for --critic-lr), else None."""
    if r.adv_estimator != "gae":
        return None
    return CriticConfig(optim=dataclasses.replace(policy, lr=r.lr if r.critic_lr is None else r.critic_lr),
                        value_clip=0.5 if r.value_clip is None else r.value_clip)


CHOICES = {"dtype": {"choices": ["float32", "bfloat16"]}, "dock_backend": {"choices": ["local", "procs", "ray"]},
           "launcher": {"choices": ["local", "ray"]}, "lr_schedule": {"choices": list(optim.LR_SCHEDULES)},
           "wandb_mode": {"choices": ["online", "offline"]},
           "kl_estimator": {"choices": list(grpo.KL_ESTIMATORS)}, "loss_agg": {"choices": list(grpo.LOSS_AGGS)},
           "policy_loss": {"choices": list(grpo.POLICY_LOSSES)}, "adv_estimator": {"choices": list(ADV_ESTIMATORS)},
           "rollout_is": {"choices": list(IS_LEVELS)}, "rollout_is_mode": {"choices": list(IS_MODES)},
           "routing_replay": {"choices": list(loop.ROUTING_REPLAY)}}


def problems(r: Recipe) -> list[tuple[str, str]]:
    """(field, why) for every value the recipe cannot run with; a size of 0 is refused, never replaced by a
    default."""
    out = []
    for name in ("steps", "prompts_per_step", "epochs", "max_new_tokens", "world", "max_bad_steps"):
        if getattr(r, name) < 1:
            out.append((name, "must be >= 1"))
    for name in ("mini_batch_size", "micro_batch_size", "max_prompt_len", "dock"):
        if getattr(r, name) is not None and getattr(r, name) < 1:
            out.append((name, "must be >= 1 (leave it out for the default)"))
    if r.group_size < 2:
        out.append(("group_size", "must be >= 2 (GRPO compares the samples of a prompt)"))
    if r.dist_timeout is not None and not r.dist_timeout > 0:
        out.append(("dist_timeout", "must be > 0"))
    if r.check_logprobs is not None and not r.check_logprobs >= 0:
        out.append(("check_logprobs", "must be >= 0"))
    for name in ("warmup_lr_steps", "kl_coef", "clip_high", "entropy_coef", "weight_decay", "save_every",
                 "keep_last", "log_samples_every"):
        if getattr(r, name) < 0:
            out.append((name, "must be >= 0"))
    for name in ("lr", "max_grad_norm"):
        if not getattr(r, name) > 0:
            out.append((name, "must be > 0"))
    if not 0 <= r.min_lr_ratio <= 1:
        out.append(("min_lr_ratio", "must be in [0, 1]"))
    elif r.min_lr_ratio and r.lr_schedule == "constant":
        out.append(("min_lr_ratio", "needs --lr-schedule cosine or linear (constant does not decay)"))
    if not r.temperature > 0:
        out.append(("temperature", "must be > 0 (log-probs are recomputed at this temperature)"))
    if not 0 < r.top_p <= 1:
        out.append(("top_p", "must be in (0, 1]"))
    if r.adv_estimator == "gae" and r.policy_loss == "gspo":
        out.append(("policy_loss", "gspo's sequence ratio takes one advantage per sequence; with --adv-estimator gae "
                                   "(per-token advantages) use gspo-token, GSPO's token-level form"))
    for name in GAE_FLAGS:
        v = getattr(r, name)
        if v is not None and r.adv_estimator != "gae":
            out.append((name, "needs --adv-estimator gae (only PPO's GAE has a critic)"))
        elif v is not None and name in ("gae_gamma", "gae_lambda") and not 0 <= v <= 1:
            out.append((name, "must be in [0, 1]"))
        elif v is not None and name in ("critic_lr", "value_clip") and not v > 0:
            out.append((name, "must be > 0"))
    if (r.save_every or r.resume == "auto") and not r.out:
        out.append(("save_every" if r.save_every else "resume", "needs --out (where checkpoints go)"))
    if r.world > 1 and r.dock == 0:
        out.append(("dock", "must be >= 1 with --world > 1 (the stages' rows go through the dock)"))
    if r.world > 1 and r.dock_backend == "local":
        out.append(("dock_backend", "local keeps the dock in one process; with --world > 1 use procs or ray"))
    if r.launcher == "ray" and r.dock_backend == "procs":
        out.append(("dock_backend", "procs serves local processes; the Ray launcher's ranks use --dock-backend ray"))
    if r.max_restarts < 0:
        out.append(("max_restarts", "must be >= 0"))
    elif r.max_restarts and r.launcher != "ray":
        out.append(("max_restarts", "needs --launcher ray (a local run stops when a rank is lost; continue it with "
                                    "--resume auto)"))
    elif r.max_restarts and r.world == 1:
        out.append(("max_restarts", "needs --world > 1 (one rank runs in this process, not as a Ray actor)"))
    elif r.max_restarts and not (r.out and r.save_every):
        out.append(("max_restarts", "needs --out and --save-every N (a restart resumes from the newest checkpoint)"))
    if r.world == 1 and (r.train_layout or r.rollout_layout):
        out.append(("train_layout" if r.train_layout else "rollout_layout", "needs --world > 1"))
    if r.world > 1 and not out:
        for name, spec in (("train_layout", r.train_layout), ("rollout_layout", r.rollout_layout)):
            try:
                mesh_of(r, spec, name)
            except ValueError as e:
                out.append((name, str(e)))
    return out + log_problems(r) + data_problems(r) + eval_problems(r)


def log_problems(r: Recipe) -> list[tuple[str, str]]:
    """(field, why) for --log-to and the flags that go with it: a sink's missing package is named before
    training, not after."""
    try:
        names = metrics.sink_names(r.log_to)
    except ValueError as e:
        return [("log_to", str(e))]
    out = [("log_to", f"{n} needs the {pkg} package, which is not installed: {metrics.INSTALL_HINT}")
           for n in names if (pkg := metrics.missing_package(n))]
    if "tensorboard" in names and not r.out:
        out.append(("log_to", "tensorboard needs --out (where its event files go)"))
    if r.log_samples_every and not ("wandb" in names or (r.out and names)):
        out.append(("log_samples_every", "needs a sink to write to: --out with --log-to jsonl or tensorboard, or "
                                         "--log-to wandb"))
    for name in ("wandb_project", "wandb_mode"):
        if getattr(r, name) is not None and "wandb" not in names:
            out.append((name, "needs --log-to wandb"))
    return out


def sink_spec(r: Recipe) -> str:
    """--log-to less jsonl when there is no --out (nothing is written then, as the default run does)."""
    return ",".join(n for n in metrics.sink_names(r.log_to) if r.out or n != "jsonl")


def data_problems(r: Recipe) -> list[tuple[str, str]]:
    """(field, why) for the dataset, the chat template and the reward functions: each is loaded, the first
    prompt rendered and the reward functions' signatures checked against the dataset's columns."""
    out = []
    if r.dataset is None:
        out += [("dataset_split", "needs --dataset")] if r.dataset_split != "train" else []
        if r.eval_dataset is None:  # the keys name the eval set's columns too
            out += [(name, "needs --dataset or --eval-dataset") for name, default in (("prompt_key", "prompt"),
                                                                                     ("answer_key", "answer"))
                    if getattr(r, name) != default]
    specs = reward_specs(r)
    if r.reward_weights is not None:
        try:
            weights = reward_weights(r)
        except ValueError:
            out.append(("reward_weights", "expected comma-separated numbers, e.g. 0.5,1"))
        else:
            if len(weights) != len(specs):
                out.append(("reward_weights", f"gives {len(weights)} weights for {len(specs)} --reward functions "
                                              f"({', '.join(specs)})"))
            elif not all(math.isfinite(w) for w in weights):
                out.append(("reward_weights", "weights must be finite"))
    reward = None
    try:
        reward = rewards.CombinedReward.load(specs, None)
    except ValueError as e:
        out.append(("reward", str(e)))
    try:
        examples = load_examples(r.dataset, prompt_key=r.prompt_key, answer_key=r.answer_key,
                                 split=r.dataset_split) if r.dataset else [PromptSource(task=r.task).take(1)[0]]
    except ValueError as e:
        return out + [("dataset" if r.dataset else "task", str(e))]
    try:
        chat = chat_template(r)
    except ValueError as e:
        return out + [("model", str(e))]
    if chat is None:
        if r.system_prompt is not None:
            out.append(("system_prompt", "needs a chat template: a --model that has one, without --no-chat-template "
                                         "(the built-in tasks use none)"))
        chats = [i for i, ex in enumerate(examples) if ex.messages is not None]
        if chats:
            out.append(("dataset", f"its prompts are chat messages (row {chats[0]}, {len(chats)} in all); they need a "
                                   "chat template: a --model that has one, without --no-chat-template"))
    else:
        try:
            apply_chat_template(examples[:1], chat, system_prompt=r.system_prompt)
        except ValueError as e:
            out.append(("system_prompt" if r.system_prompt is not None else "dataset" if r.dataset else "model",
                        str(e)))
    if reward is not None:
        try:
            reward.check_columns(list(examples[0].extra))
        except ValueError as e:
            out.append(("reward", str(e)))
    return out


def eval_problems(r: Recipe) -> list[tuple[str, str]]:
    """(field, why) for the --eval-* flags; the eval set is checked as --dataset is (loaded, its first prompt
    rendered, the reward functions' signatures against its columns)."""
    out = []
    if r.eval_samples < 1:
        out.append(("eval_samples", "must be >= 1"))
    if r.eval_max_prompts is not None and r.eval_max_prompts < 1:
        out.append(("eval_max_prompts", "must be >= 1 (leave it out for all)"))
    if r.eval_every < 0:
        out.append(("eval_every", "must be >= 0"))
    if not r.eval_temperature > 0:
        out.append(("eval_temperature", "must be > 0 (--eval-samples 1 is the greedy evaluation)"))
    if r.eval_dataset is None:
        return out + [(f.name, "needs --eval-dataset") for f in dataclasses.fields(Recipe)
                      if f.name.startswith("eval_") and f.name != "eval_dataset" and getattr(r, f.name) != f.default]
    if r.eval_only and r.resume:
        out.append(("resume", "--eval-only trains nothing; evaluate a checkpoint with --model DIR"))
    try:
        examples = load_examples(r.eval_dataset, prompt_key=r.prompt_key, answer_key=r.answer_key,
                                 split=r.eval_split)
    except ValueError as e:
        return out + [("eval_dataset", str(e))]
    try:
        reward, chat = rewards.CombinedReward.load(reward_specs(r), None), chat_template(r)
    except ValueError:  # a bad --reward or --model: data_problems names it
        return out
    chats = [i for i, ex in enumerate(examples) if ex.messages is not None]
    if chat is None and chats:
        out.append(("eval_dataset", f"its prompts are chat messages (row {chats[0]}, {len(chats)} in all); they need "
                                    "a chat template: a --model that has one, without --no-chat-template"))
    try:
        if chat is not None:
            apply_chat_template(examples[:1], chat, system_prompt=r.system_prompt)
        reward.check_columns(list(examples[0].extra))
    except ValueError as e:
        out.append(("eval_dataset", str(e)))
    return out


def reward_specs(r: Recipe) -> list[str]:
    """--reward, else the default: math for datasets (the eval set of --eval-only is one), exact for the tasks."""
    return list(r.reward) if r.reward else ["math" if r.dataset or (r.eval_only and r.eval_dataset) else "exact"]


def reward_weights(r: Recipe) -> list[float] | None:
    return None if r.reward_weights is None else [float(w) for w in r.reward_weights.split(",")]


def chat_template(r: Recipe) -> ChatTemplate | None:
    """--model's chat template, unless --no-chat-template or the model has none."""
    if not (r.model and r.chat_template and find_chat_template(r.model) is not None):
        return None
    return ChatTemplate(r.model)


def prompts_and_reward(r: Recipe) -> tuple[PromptSource, rewards.RewardFn]:
    """The prompt source (each batch rendered by the chat template, carrying what the reward functions are
    called with) and the loop's reward (``CombinedReward.score``: one call per scorer's rows)."""
    reward = rewards.CombinedReward.load(reward_specs(r), reward_weights(r))
    prepare = prompt_transform(r, reward)
    if r.dataset:
        examples = load_examples(r.dataset, prompt_key=r.prompt_key, answer_key=r.answer_key, split=r.dataset_split)
        source = PromptSource(examples=examples, seed=r.seed, transform=prepare)
    else:
        source = PromptSource(task=r.task, seed=r.seed, transform=prepare)
    return source, reward.score


def prompt_transform(r: Recipe, reward: rewards.CombinedReward) -> Callable[[list[Example]], list[Example]]:
    """Examples as the model and the reward functions see them: rendered by the chat template, carrying what
    the reward functions are called with."""
    chat = chat_template(r)

    def prepare(batch: list[Example]) -> list[Example]:
        if chat is not None:
            batch = apply_chat_template(batch, chat, system_prompt=r.system_prompt)
        return reward.carry(batch)
    return prepare


def eval_examples(r: Recipe) -> list[Example]:
    """The first --eval-max-prompts examples of --eval-dataset, prepared as the training prompts are."""
    examples = load_examples(r.eval_dataset, prompt_key=r.prompt_key, answer_key=r.answer_key, split=r.eval_split)
    return prompt_transform(r, rewards.CombinedReward.load(reward_specs(r), reward_weights(r)))(
        examples[:r.eval_max_prompts])


def mesh_of(r: Recipe, spec: str | None, name: str):
    """The mesh of --train-layout / --rollout-layout (their defaults: tp=2, and dp over the world)."""
    from rlflow.sharding import Mesh
    if spec is None:
        spec = "tp=2" if name == "train_layout" else ""
    return Mesh.parse(spec, r.world)


def train_layout_name(r: Recipe) -> str:
    """The train layout's mesh as a checkpoint's manifest names it (one process: the trivial mesh)."""
    from rlflow.sharding import Mesh
    return str(mesh_of(r, r.train_layout, "train_layout") if r.world > 1 else Mesh())


def placement(r: Recipe, cfg, dtype):
    """The train and rollout layouts of a --world > 1 run (ValueError naming what the model cannot run)."""
    from rlflow.models.sharding import layout
    from rlflow.parallel.context import check_layout
    lays = {}
    for name in ("train_layout", "rollout_layout"):
        mesh = mesh_of(r, getattr(r, name), name)
        try:
            lays[name] = layout(cfg, mesh, dtype=dtype)
            check_layout(lays[name], cfg)
        except ValueError as e:
            given = getattr(r, name) or f"{mesh} (the default)"
            raise ValueError(f"--{name.replace('_', '-')} {given}: {e}") from None
    critic = layout(cfg, lays["train_layout"].mesh, dtype=dtype, head="value") if r.adv_estimator == "gae" else None
    return loop.Placement(lays["train_layout"], lays["rollout_layout"], critic=critic)


def load_model(r: Recipe):
    """(cfg, params, tokenizer, device) of --model, or a random init of --preset with the built-in tokenizer, on
    this process's device (``process_device``: under torchrun on several nodes or on Ray the global rank is no
    device index)."""
    dev = rl_device.process_device()
    if dev.type == "cpu":
        rl_device.keep_host_memory()  # activations reuse freed memory instead of fresh pages every step
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[r.dtype]
    if r.model:
        cfg, params = hf.load(r.model, dtype=dtype, device=dev)
        tok = HFTokenizer(r.model)
    else:
        tok = CharTokenizer()
        cfg = get_config(r.preset)
        if cfg.vocab_size < tok.vocab_size:
            raise ValueError(f"--preset {r.preset}: vocab_size {cfg.vocab_size} < built-in tokenizer's {tok.vocab_size}")
        cfg = cfg.replace(eos_token_id=tok.eos_id)
        params = qwen3_moe.init_params(cfg, seed=r.seed, dtype=dtype, device=dev)
    return cfg, params, tok, dev


DOCK_TIMEOUT_S = 1800.0  # without --dist-timeout: as long as gloo's collectives wait


def build(r: Recipe):
    cfg, params, tok, dev = load_model(r)
    source, reward_fn = prompts_and_reward(r)
    gb = r.prompts_per_step * r.group_size
    mini = r.mini_batch_size or gb
    ocfg = optim.AdamWConfig(lr=r.lr, betas=(0.9, 0.99), weight_decay=r.weight_decay)
    lcfg = loop.LoopConfig(
        steps=r.steps, prompts_per_step=r.prompts_per_step, mini_batch_size=mini,
        micro_batch_size=r.micro_batch_size or mini,
        grpo=grpo_config(r), optim=ocfg,
        max_grad_norm=r.max_grad_norm,
        sampling=SamplingConfig(max_new_tokens=r.max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id,
                                temperature=r.temperature, top_p=r.top_p),
        max_prompt_len=r.max_prompt_len, warmup_lr_steps=r.warmup_lr_steps, lr_schedule=r.lr_schedule,
        min_lr_ratio=r.min_lr_ratio, log_samples_every=r.log_samples_every, seed=r.seed,
        compile_decode=r.compile_decode, max_bad_steps=r.max_bad_steps, routing_replay=r.routing_replay,
        check_logprobs=r.check_logprobs, critic=critic_config(r, ocfg),
        dock_timeout_s=r.dist_timeout if r.dist_timeout is not None else DOCK_TIMEOUT_S)
    return cfg, params, tok, source, reward_fn, lcfg, dev


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


def make_dock(r: Recipe, capacity: int, local_rank: int | None = None):
    """The transfer dock the stages exchange rows through, or None (in memory). Made by the driver; the ranks
    are handed it (its processes or actors outlive them). With ``local_rank`` (under torchrun / Slurm, where
    no driver exists) every rank calls it: the ranks start the dock's servers together."""
    from rlflow.runtime.graph import graph_for
    g = graph_for(r.adv_estimator)
    warehouses = r.dock if r.dock is not None else (r.world if r.world > 1 else 0)
    backend = r.dock_backend or ("local" if r.world == 1 else "ray" if r.launcher == "ray" else "procs")
    if not warehouses:
        return None
    if backend == "local":
        from rlflow.dock import Dock
        return Dock.local(g.schema, g.consumers, capacity=capacity, warehouses=warehouses, group_size=r.group_size)
    if backend == "procs" and local_rank is not None:
        from rlflow.dock.proc_backend import node_dock
        return node_dock(g.schema, g.consumers, capacity=capacity, warehouses=warehouses, local_rank=local_rank,
                         group_size=r.group_size)
    if backend == "procs":
        from rlflow.dock.proc_backend import proc_dock
        return proc_dock(g.schema, g.consumers, capacity=capacity, warehouses=warehouses, group_size=r.group_size)
    from rlflow.runtime.launch import ray_init
    ray_init(r.ray_address)
    from rlflow.dock.ray_backend import ray_dock
    # every train rank may wait in the controller at once (take_share) while the others' puts still need threads
    return ray_dock(g.schema, g.consumers, capacity=capacity, warehouses=warehouses, group_size=r.group_size,
                    max_concurrency=max(64, 2 * r.world + 16))


def plot_rewards(history: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    evals = [m for m in history if "eval/reward_mean" in m]
    history = [m for m in history if "reward_mean" in m]
    steps = [m["step"] for m in history]
    r = [m["reward_mean"] for m in history]
    k = 10
    smooth = [sum(r[max(0, i - k + 1):i + 1]) / len(r[max(0, i - k + 1):i + 1]) for i in range(len(r))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, r, alpha=0.35, label="reward (step mean)")
    ax.plot(steps, smooth, label=f"reward ({k}-step moving mean)")
    if evals:
        ax.plot([m["step"] for m in evals], [m["eval/reward_mean"] for m in evals], "o-", label="eval reward (mean)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


RUN_FILES = ("args.json", "metrics.jsonl", "samples.jsonl", "tensorboard", "reward.png", "checkpoint-final",
             "eval.json")


def prepare_out(r: Recipe) -> None:
    """Check --out before anything is trained or written: an earlier run there is refused unless
    --overwrite, and the directory must be writable (a run that cannot save would lose its weights at the end)."""
    if not r.out:
        return
    earlier = [n for n in RUN_FILES if os.path.exists(os.path.join(r.out, n))]
    earlier += sorted(n for n in (os.listdir(r.out) if os.path.isdir(r.out) else ()) if n.startswith("checkpoint-")
                      and n not in earlier)
    if earlier and not (r.overwrite or r.resume):
        raise SystemExit(f"error: --out {r.out} holds an earlier run ({', '.join(earlier)}); choose another "
                         "directory or pass --overwrite")
    try:
        os.makedirs(r.out, exist_ok=True)
        with tempfile.TemporaryFile(dir=r.out):
            pass
    except OSError as e:
        raise SystemExit(f"error: --out {r.out}: cannot write there ({e.strerror or e})") from None


def main(argv=None, defaults: dict | None = None, doc: str | None = None) -> list[dict]:
    r = parse_args(argv, defaults, doc)
    from rlflow.runtime import launch
    where = launch.env_world()  # started by torchrun / Slurm: this process is one rank (parse_args checked --world)
    cfg = hf.load_config(r.model) if r.model else get_config(r.preset)
    if r.model:
        check_tokenizer(r, cfg)
    if r.eval_only:  # in this process (under torchrun / Slurm: rank 0's): no layouts, no dock
        if where is not None and where[0] != 0:
            return []
        prepare_out(r)
        return [evaluate_only(r)]
    try:  # what the model and the layouts cannot run is refused here, once, before any process starts
        pp = placement(r, cfg, torch.float32).train.mesh.pp if r.world > 1 else 1
        loop.check_features(cfg, pp, routing_replay=r.routing_replay, check_logprobs=r.check_logprobs,
                            adv_estimator=r.adv_estimator)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if where is None or where[0] == 0:
        prepare_out(r)
    if r.resume and r.resume != "auto":  # a damaged checkpoint is refused before any rank starts
        try:
            checkpoint.verify(r.resume)
        except (checkpoint.CheckpointError, FileNotFoundError) as e:
            raise SystemExit(f"error: --resume {r.resume}: {e}") from None
    on_ray = where is None and r.world > 1 and r.launcher == "ray"  # run_on_ray makes a dock per attempt
    dock = make_dock(r, r.prompts_per_step * r.group_size) if (where is None or r.world == 1) and not on_ray else None
    try:
        if where is not None and r.world > 1:  # no driver: the ranks start the dock's servers themselves
            return launch.from_env(run_started, r, where[2], timeout_s=r.dist_timeout)
        if where is not None:
            return launch.from_env(run, r, dock, timeout_s=r.dist_timeout)
        if r.world == 1:
            return run(0, 1, r, dock)
        if on_ray:
            return run_on_ray(r)
        return launch.spawn(run, r.world, r, dock, timeout_s=r.dist_timeout)[0]  # torch.distributed: gloo on CPU, nccl on CUDA, hccl on NPU
    finally:
        if dock is not None:
            dock.close()


def run_started(rank: int, world: int, r: Recipe, local_rank: int) -> list[dict]:
    """``run`` on a rank of a world torchrun or Slurm started: the ranks make the dock together
    (``proc_backend.node_dock``: each node's first rank serves that node's warehouses), and each stops the
    servers it started once every rank is done with them."""
    dock = make_dock(r, r.prompts_per_step * r.group_size, local_rank=local_rank)
    try:
        out = run(rank, world, r, dock)
        torch.distributed.barrier()  # no rank reads the dock any more
        return out
    finally:
        dock.close()


def run_on_ray(r: Recipe) -> list[dict]:
    """--launcher ray: the ranks as actors of a placement group, the dock's warehouses and controllers as actors
    too. When a rank is lost (``launch.RankLost``: its actor died, or it stopped answering) the actors and the
    placement group are gone and the dock is closed (its rows are the interrupted step's); with --max-restarts K
    the run starts again, up to K times, with new actors and a fresh dock from the newest checkpoint this run
    wrote under --out (none yet: from where it started). Other failures (an exception in the ranks' code, a
    rank's exit) would repeat, and end the run."""
    from rlflow.runtime import launch
    earlier = checkpoints_in(r.out)  # an earlier run's (--overwrite) are not this run's to resume from
    attempt = r
    for restart in range(r.max_restarts + 1):
        dock = make_dock(attempt, r.prompts_per_step * r.group_size)
        try:
            return launch.ray_spawn(run, r.world, attempt, dock, address=r.ray_address, timeout_s=r.dist_timeout)[0]
        except launch.RankLost as e:
            if restart == r.max_restarts:
                tried = f" (after {restart} restart{'s' * (restart > 1)}, --max-restarts {r.max_restarts})"
                raise SystemExit(f"error: {e}{tried if restart else ''}") from None
            ck = newest_checkpoint(r.out, earlier)
            attempt = dataclasses.replace(r, resume=ck or r.resume)
            start = ck or (f"--resume {r.resume}" if r.resume else "the start (no checkpoint yet)")
            print(f"restart {restart + 1} of {r.max_restarts}: {e}; restarting from {start}", file=sys.stderr,
                  flush=True)
        finally:
            dock.close()


def checkpoints_in(root: str) -> dict[str, int]:
    """{name: its manifest's mtime} of the checkpoints under ``root``."""
    found = {}
    for n in os.listdir(root) if root and os.path.isdir(root) else ():
        m = os.path.join(root, n, checkpoint.MANIFEST)
        if n.startswith("checkpoint-") and os.path.isfile(m):
            found[n] = os.stat(m).st_mtime_ns
    return found


def newest_checkpoint(root: str, earlier: dict[str, int]) -> str | None:
    """The newest checkpoint under ``root`` that verifies and is not one of ``earlier`` (``checkpoints_in``)."""
    ours = [n for n, t in checkpoints_in(root).items() if earlier.get(n) != t]
    for n in sorted(ours, key=lambda n: (n == "checkpoint-final", n), reverse=True):
        try:
            checkpoint.verify(os.path.join(root, n))
            return os.path.join(root, n)
        except checkpoint.CheckpointError:
            continue
    return None


def eval_settings(r: Recipe) -> dict:
    """``rl_eval.evaluate``'s settings: the training's response budget and prompt truncation, a step's prompts
    per generate call."""
    return dict(samples=r.eval_samples, temperature=r.eval_temperature, max_new_tokens=r.max_new_tokens,
                batch_size=r.prompts_per_step, seed=r.seed, max_prompt_len=r.max_prompt_len)


def eval_line(m: dict) -> str:
    shown = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.items()
                      if k not in ("eval/prompts", "eval/unscored"))
    unscored = f", {m['eval/unscored']} samples unscored" if m["eval/unscored"] else ""
    return f"{shown} ({m['eval/prompts']} prompts{unscored})"


def evaluate_only(r: Recipe) -> dict[str, float]:
    """--eval-only: the eval/* metrics of --model (or a random --preset), printed and written to --out/eval.json."""
    torch.manual_seed(r.seed)
    cfg, params, tok, _ = load_model(r)
    reward = rewards.CombinedReward.load(reward_specs(r), reward_weights(r))
    m = rl_eval.evaluate(params, cfg, tok, eval_examples(r), reward.score, **eval_settings(r))
    print(f"eval of {r.model or r.preset} on {r.eval_dataset}: {eval_line(m)}")
    if r.out:
        path = os.path.join(r.out, "eval.json")
        with open(path, "w") as f:
            json.dump(m, f, indent=2)
        print(f"wrote {path}")
    return m


def resume_point(r: Recipe, cfg, source, dev, dtype, say, rank: int = 0, where=None):
    """(checkpoint or None) for --resume: the directory given, or under --out the newest one that verifies; with
    ``where`` (the run's placement, world > 1) rank ``rank``'s shards of its train layout, resharded when the
    checkpoint was written in another; else whole tensors."""
    if not r.resume:
        return None
    path, verified = r.resume, r.resume == "auto"
    if r.resume == "auto":
        path, skipped = checkpoint.find_resumable(r.out)  # verifies it
        for line in skipped:
            say(f"resume: {line}")
        if path is None:
            say(f"resume: no checkpoint under {r.out}; starting from scratch")
            return None
    try:
        if hf.load_config(path) != cfg:  # before any shard is cut to this run's layout
            raise SystemExit(f"error: --resume {path}: its model config differs from this run's (--model/--preset)")
        wrote = checkpoint.read_args(path).get("dtype")
        if wrote not in (None, r.dtype):  # the optimizer's float32 masters exist only for a low-precision run
            raise SystemExit(f"error: --dtype {r.dtype}: --resume {path} was trained in {wrote}; resume it with "
                             f"--dtype {wrote}, or start from its weights with --model (a fresh optimizer)")
        ck = checkpoint.load(path, dtype=dtype, device=dev, rank=rank, verified=verified,
                             layout=None if where is None else where.train,
                             critic_layout=None if where is None else where.critic)
    except (checkpoint.CheckpointError, FileNotFoundError) as e:
        raise SystemExit(f"error: --resume {r.resume}: {e}") from None
    checkpoint.restore_source(source, ck.source_state)
    was = ck.resharded_from
    say(f"resumed from {path} after {ck.steps_done} steps" + ("" if was is None else
        f" (resharded from train {was['train_layout']} on {was['world']} ranks)"))
    return ck


class Interrupt:
    """SIGINT / SIGTERM (Ctrl-C, a scheduler's preemption) ask the run to stop after the current step; a
    second one stops at once."""

    def __init__(self):
        self.signal, self._old = None, {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, sig, _frame):
        if self.signal is not None:
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)
        self.signal = sig

    def __call__(self) -> bool:
        return self.signal is not None


def run(rank: int, world: int, r: Recipe, dock=None) -> list[dict]:
    """The recipe on rank ``rank`` of ``world`` (rank 0 prints and writes the outputs); ``dock``: the
    transfer dock the driver made (None: in memory, one process)."""
    torch.manual_seed(r.seed)
    cfg, params, tok, source, reward_fn, lcfg, dev = build(r)
    interrupt = Interrupt()
    dtype = next(iter(params.values())).dtype
    where = None if world == 1 else placement(r, cfg, dtype)
    lead = rank == 0
    say = print if lead else (lambda *a, **k: None)
    n = sum(p.numel() for p in params.values())
    moe = f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}" if cfg.num_experts else "dense"
    say(f"model: {r.model or r.preset} ({cfg.model_type}, {n / 1e6:.2f}M params, {moe}) on {dev} x {world}; "
        f"task: {r.dataset or r.task}")
    say(f"sizes: {r.prompts_per_step} prompts x {r.group_size} samples = {lcfg.global_batch} per step, "
        f"mini-batch {lcfg.mini_batch_size}, micro-batch {lcfg.micro_batch_size}")
    if where is not None:
        say(f"layouts: train {where.train.mesh}, rollout {where.rollout.mesh} on {world} ranks; transfer dock "
            f"{type(dock.transport).__name__.removesuffix('Transport').lower()} with {len(dock.warehouses)} "
            "warehouses")
    say(loop.TPS_DEFINITION)
    init = {k: v.clone() for k, v in params.items()} if r.kl_coef else None  # the reference: the run's start
    ck = resume_point(r, cfg, source, dev, dtype, say, rank, where)
    done = 0 if ck is None else ck.steps_done
    opt_state = None if ck is None else ck.opt_state
    if ck is not None:
        params = ck.params
    critic = None if ck is None else ck.critic  # PPO's critic; a fresh one is made below from the policy's shards
    if lcfg.critic is not None and ck is not None and ck.critic is None:
        raise SystemExit(f"error: --resume {ck.path}: the checkpoint has no critic (a run without "
                         "--adv-estimator gae); it cannot continue as a PPO run")
    if where is not None:  # this rank's shards of the train layout (a sharded checkpoint holds them as they are)
        from rlflow.parallel.context import shard_params
        mine = lambda full: shard_params(full, where.train, rank)  # noqa: E731
        init = None if init is None else mine(init)
    if where is not None and (ck is None or ck.sharded is None):
        params = mine(params)
        if opt_state is not None:
            opt_state = optim.map_state(opt_state, mine)
        if critic is not None:
            ours = lambda full: shard_params(full, where.critic, rank)  # noqa: E731
            critic = Critic(params=ours(critic.params), opt_state=optim.map_state(critic.opt_state, ours))
    if lcfg.critic is not None and critic is None:  # the critic's shards are the policy's, with its value head
        critic = Critic.from_policy(params, cfg, seed=r.seed)
    if done >= r.steps:
        say(f"nothing to do: {done} of {r.steps} steps are done")
        return []
    lcfg = dataclasses.replace(lcfg, steps=r.steps - done)
    sinks: list[metrics.Sink] = []
    if lead:
        if r.out:
            with open(os.path.join(r.out, "args.json"), "w") as f:
                json.dump(dataclasses.asdict(r), f, indent=2)
        # a resumed run does the steps after its checkpoint again: the sinks drop what they logged from there on
        sinks = metrics.make_sinks(sink_spec(r), r.out, dataclasses.asdict(r), first_step=done,
                                   wandb_project=r.wandb_project, wandb_mode=r.wandb_mode)

    def save(name, steps_done, p, state, keep=None):
        """Every rank calls it: with several ranks each writes its own shards, the weights are gathered for
        the consolidated export (a collective), and the lead writes the rest."""
        kw = dict(steps_done=steps_done, cfg=cfg, source=source, args=dataclasses.asdict(r), tokenizer=tok,
                  keep_last=keep)
        if where is None:
            return checkpoint.save(r.out, name, params=p, opt_state=state, critic=critic, **kw)
        got = [checkpoint.begin(r.out, name) if lead else None]
        torch.distributed.broadcast_object_list(got, src=0)
        failed = None
        try:
            checkpoint.write_shard(got[0], rank, world, params=p, opt_state=state, critic=critic)
        except Exception as e:  # noqa: BLE001 -- every rank must still reach the collectives below
            failed = e
        full = full_params(cfg, where, p)
        from rlflow.sharding.dist import all_reduce
        if float(all_reduce(torch.tensor([failed is not None], dtype=torch.float64))[0]):  # any rank's file missing
            if lead:
                shutil.rmtree(got[0], ignore_errors=True)
            if failed is not None:
                raise failed
            raise checkpoint.CheckpointError(f"{name}: another rank could not write its shards; nothing was saved")
        if not lead:
            return None
        return checkpoint.save(r.out, name, params=full, opt_state=None, tmp=got[0], **kw,
                               sharded={"world": world, "train_layout": train_layout_name(r)})

    evals = eval_examples(r) if r.eval_dataset else None

    def evaluate_at(steps_done, p):
        """Every rank calls it (the weights and the shares' scores are gathered: collectives); the lead logs
        the eval/* row at the steps done."""
        m = evaluation(r, cfg, tok, evals, reward_fn, p, where, rank, world)
        for s in sinks:
            s.log(steps_done, {"step": steps_done, **m})
        (bar.write if bar is not None else say)(f"eval after {steps_done} steps: {eval_line(m)}")

    def after_step(steps_done, p, state):
        if evals is not None and (steps_done == r.steps or (r.eval_every and steps_done % r.eval_every == 0)):
            evaluate_at(steps_done, p)
        if r.out and r.save_every and steps_done % r.save_every == 0 and steps_done < r.steps:
            save(f"checkpoint-{steps_done:06d}", steps_done, p, state, keep=r.keep_last)
    bar = None
    if lead:
        try:
            from tqdm import tqdm
            bar = tqdm(total=r.steps, initial=done, unit="step", file=sys.stdout, mininterval=0.5,
                       dynamic_ncols=True)
        except ImportError:
            pass
    t0 = time.perf_counter()

    def on_step(m):
        for s in sinks:
            s.log(m["step"], m)
        if bar is not None:
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", tps=f"{m['tps']:.0f}", step_s=f"{m['step_time_s']:.2f}",
                            refresh=False)
            bar.update(1)

    def on_samples(step, rows):
        for s in sinks:
            s.log_samples(step, rows)

    try:
        if evals is not None:
            evaluate_at(done, params)
        params, opt_state, history = loop.train(
            params, cfg, tok, source, reward_fn, lcfg, on_step=on_step, device=dev, dock=dock, placement=where,
            opt_state=opt_state, first_step=done, ref_params=init, after_step=after_step, should_stop=interrupt,
            on_samples=on_samples if lead else None, critic=critic)
    except (loop.NonFiniteError, LogprobMismatchError) as e:  # the run's verdict, not a crash: no traceback;
        raise SystemExit(f"error: {e}" if lead else 1) from None  # every rank reaches it, the lead says it
    finally:
        interrupt.restore()
        for s in sinks:
            s.close()
    if bar is not None:
        bar.close()
    steps_done = done + len(history)
    if steps_done < r.steps:  # interrupted: keep what was done, say how to go on
        path = save(f"checkpoint-{steps_done:06d}", steps_done, params, opt_state) if r.out else None
        if path is not None:
            print(f"interrupted after step {steps_done - 1}: wrote {path}; continue with --resume auto "
                  f"(or --resume {path})", file=sys.stderr)
        raise SystemExit(128 + int(interrupt.signal or 0))
    wall = time.perf_counter() - t0
    first = sum(m["reward_mean"] for m in history[:10]) / len(history[:10])
    last = sum(m["reward_mean"] for m in history[-10:]) / len(history[-10:])
    tps = sum(m["prompt_tokens"] + m["response_tokens"] for m in history) / sum(m["step_time_s"] for m in history)
    say(f"done: {len(history)} steps in {wall:.1f}s; mean reward first 10 steps {first:.3f} -> last 10 "
        f"{last:.3f} (+{last - first:.3f}); mean TPS {tps / world:.0f}")
    mean = lambda k: sum(m.get(k, 0.0) for m in history) / len(history)  # noqa: E731
    if where is not None and not _same_layouts(where):
        say(f"weights train -> rollout layout (allgather-swap): {mean('transition_out_s') * 1e3:.1f} ms per step, "
            f"{mean('transition_recv_bytes') / 2**20:.2f} MiB received by rank 0; back (swap-in): "
            f"{mean('transition_back_s') * 1e3:.1f} ms")
    if dock is not None:
        say(f"transfer dock: {len(dock.warehouses)} warehouses, busiest dock process moved "
            f"{sum(m.get('dock_busiest_bytes', 0.0) for m in history) / 2**20:.1f} MiB in all "
            f"({mean('dock_busiest_bytes') / 2**10:.1f} KiB per step)")
    if r.out:
        names = metrics.sink_names(r.log_to)
        if lead:  # metrics.jsonl holds a resumed run's earlier steps too; without it, this call's steps
            jsonl = os.path.join(r.out, "metrics.jsonl")
            plot_rewards([json.loads(ln) for ln in open(jsonl)] if "jsonl" in names else history,
                         os.path.join(r.out, "reward.png"))
        path = save("checkpoint-final", steps_done, params, opt_state)
        shown = ["args.json", *("metrics.jsonl" if n == "jsonl" else "tensorboard/" for n in names if n != "wandb"),
                 "reward.png"]
        say(f"wrote {', '.join(f'{r.out}/{n}' for n in shown)}, {path}/ (--model {path} loads it)")
    return history


def _same_layouts(where) -> bool:
    from rlflow.runtime.weights import same_layout
    return same_layout(where.train, where.rollout)


def full_params(cfg, where, ts: dict) -> dict:
    """Every rank's copy of the whole tensors from its train shards ``ts`` (a collective)."""
    from rlflow.models.sharding import RULES, layout
    from rlflow.runtime.weights import gather_full
    from rlflow.sharding import Mesh
    if not ts:
        return {}
    dt = next(iter(ts.values())).dtype
    mesh = where.train.mesh  # the whole model on every rank: no pp stages, nothing split
    return gather_full(ts, layout(cfg, mesh, dtype=dt), layout(cfg, Mesh(dp=mesh.size), {k: None for k in RULES},
                                                               dtype=dt))


def evaluation(r: Recipe, cfg, tok, examples: list[Example], reward_fn, params, where, rank: int,
               world: int) -> dict[str, float]:
    """The eval/* metrics of the policy whose train shards this rank holds (``where`` None: one process, the
    whole weights). With several ranks every rank gathers the whole weights (as checkpoints do) and scores a
    contiguous share of the prompts on its own, unsharded; the shares' per-sample scores are gathered on every
    rank and summed up there. Every rank makes the same two collective calls, whatever its share; a prompt
    samples what it would in one process (its noise is keyed by its index in the eval set)."""
    if where is not None:
        params = full_params(cfg, where, params)
    lo, hi = rank * len(examples) // world, (rank + 1) * len(examples) // world
    part = rl_eval.sample_scores(params, cfg, tok, examples[lo:hi], reward_fn, first_index=lo,
                                 **eval_settings(r)) if hi > lo else None
    parts = [part]
    if where is not None:
        parts = [None] * world
        torch.distributed.all_gather_object(parts, part)
    return rl_eval.summarize(rl_eval.cat([p for p in parts if p is not None]))
