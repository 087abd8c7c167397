"""The checks that refuse a value by its flag before anything runs: each returns (field, why) pairs, which
``parse_args`` turns into one argparse line, ``--field value: why``. A rule is checked once, where its config
is defined: the rules of the configs the flags make (``GRPOConfig``, ``AdamWConfig``, ``SamplingConfig``,
``CriticConfig``, ``loop.LoopConfig``: their ``__post_init__``) are theirs, and ``config_problems`` builds them
and maps their ValueErrors onto the flags; the rules here are the ones no config owns."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re

from rlflow import device, engines, metrics
from rlflow.decoding import compile_problem
from rlflow.envs import load_env
from rlflow.envs.tools import load_tools
from rlflow.models import adapters, hf, lora
from rlflow.models.sharding import layout
from rlflow.models.config import get_config
from rlflow.recipe.data_checks import data_problems, eval_problems
from rlflow.recipe.flags import Recipe
from rlflow.recipe.pieces import (critic_config, grpo_config, has_chat_template, lora_config, loop_config, mesh_of,
                                  optim_config, sampling_config)
from rlflow.runtime.config import decodes_in_lockstep, placement_problems, share_problems
from rlflow.runtime.pools import split_problem



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


def pool_problems(r: Recipe) -> list[tuple[str, str]]:
    """(field, why) for --rollout-ranks and --max-staleness: what separate pools cannot run (yet)."""
    if r.rollout_ranks < 0:
        return [("rollout_ranks", "must be >= 0 (0: colocated)")]
    if r.max_staleness > r.steps:  # the dock holds max_staleness + 1 steps' rows: bound it by the run
        return [("max_staleness", f"must be <= --steps {r.steps} (the rollout pool can be no more steps ahead "
                                  f"than the run has; the dock holds --max-staleness + 1 steps' rows)")]
    if not r.rollout_ranks:
        return []
    if (why := split_problem(r.rollout_ranks, r.world)) is not None:  # the library's rule, on the flags
        return [("rollout_ranks", why.replace("a world of", "--world"))]
    return [("dock_backend", "separate pools need a dock of processes (procs) or actors (ray)")] \
        if r.dock_backend not in (None, "procs", "ray") else []


def placement_checks(r: Recipe) -> list[tuple[str, str]]:
    """(field, why) of the library's rules for the placement the flags make (``config.placement_problems``), on
    the flags (the multi-turn rule's: --rollout-layout, the value it cannot run with). Nothing when the configs
    or the rollout layout do not build: that is their own problem, said by their flags."""
    try:
        conf = loop_config(r, eos_id=0, pad_id=0)
        mesh = mesh_of(r, r.rollout_layout, "rollout_layout") if r.world > 1 else None
    except ValueError:
        return []
    pools = bool(r.rollout_ranks)
    hint = "" if pools else "; --rollout-ranks K makes them"  # the separate pools' settings, without them
    return [("rollout_layout" if name == "multiturn" else name,
             why + hint if name in ("max_staleness", "partial_rollout") else why)
            for name, why in placement_problems(conf, mesh, pools=pools)]


def lockstep_rollout(r: Recipe):
    """The rollout layout's mesh when its ranks decode in lockstep (tp or ep > 1), else None (also when
    --rollout-layout does not parse: that is its own problem)."""
    try:
        mesh = mesh_of(r, r.rollout_layout, "rollout_layout")
    except ValueError:
        return None
    return mesh if decodes_in_lockstep(mesh) else None


def env_problems(r: Recipe) -> list[tuple[str, str]]:
    """(field, why) for --env and its flags: the environment loads, and what multi-turn rollouts cannot run with
    (yet). Their ranges are MultiTurnConfig's."""
    if r.env is None:
        return [(name, "needs --env (multi-turn rollouts)") for name in ("max_turns", "max_total_tokens", "env_timeout",
                                                                          "tools") if getattr(r, name) is not None]
    try:
        env = load_env(r.env)
    except ValueError as e:
        return [("env", str(e))]
    try:
        if r.tools is not None:
            load_tools(r.tools)
    except ValueError as e:
        return [("tools", str(e))]
    runs_tools = "tools" in inspect.signature(env).parameters
    if runs_tools and r.tools is None:
        return [("env", "this environment runs tools: name them with --tools (e.g. --tools calculator)")]
    if r.tools is not None and not runs_tools:
        return [("tools", f"--env {r.env} runs no tools (its class takes no tools keyword)")]
    if r.tools is not None and not has_chat_template(r):
        return [("tools", "needs --model with a chat template (the prompts show the model the tools' schemas)")]
    refused = [("env", r.env == "max_digit_feedback" and (bool(r.dataset) or r.task != "max_digit"),
                "max_digit_feedback is --task max_digit's environment (its hint is a half of the prompt's digits)"),
               ("env", r.env == "max_digit_feedback" and r.model is not None and has_chat_template(r),
                "max_digit_feedback reads the built-in task's plain prompts; --model's chat template renders them "
                "otherwise and every episode would fail at its start (--no-chat-template, or another --env)"),
               ("eval_dataset", bool(r.eval_dataset), "with --env is not built yet (evaluation generates one turn)")]
    out = [(name, why) for name, bad, why in refused if bad]
    budget = r.max_total_tokens or _positions(r)
    if r.max_turns is not None and budget is not None and r.max_turns > budget:
        out.append(("max_turns", f"is more turns than an episode's {budget} tokens can hold (--max-total-tokens, "
                                 f"else the model's positions; a turn takes a token at least)"))
    return out


def _positions(r: Recipe) -> int | None:
    """The model's positions, when its config reads (``model_problems`` says why it does not)."""
    try:
        return (hf.load_config(r.model) if r.model else get_config(r.preset)).max_position_embeddings
    except Exception:  # noqa: BLE001 -- any reason is model_problems' to tell
        return None


GAE_FLAGS = ("gae_gamma", "gae_lambda", "critic_lr", "value_clip")


def problems(r: Recipe) -> list[tuple[str | None, str]]:
    """(field, why) for every value the recipe cannot run with; a size of 0 is refused, never replaced by a
    default. The configs' own rules come from ``config_problems``."""
    out = []
    if r.world < 1:
        out.append(("world", "must be >= 1"))
    if r.compile_decode and (why := compile_problem(device.kind())) is not None:
        out.append(("compile_decode", why))
    for name in ("mini_batch_size", "micro_batch_size", "max_prompt_len", "dock"):
        if getattr(r, name) is not None and getattr(r, name) < 1:
            out.append((name, "must be >= 1 (leave it out for the default)"))
    for name in ("kl_coef", "entropy_coef", "weight_decay", "save_every", "keep_last", "log_samples_every"):
        if getattr(r, name) < 0:
            out.append((name, "must be >= 0"))
    if not r.max_grad_norm > 0:
        out.append(("max_grad_norm", "must be > 0"))
    if 0 < r.min_lr_ratio <= 1 and r.lr_schedule == "constant":  # its range is LoopConfig's
        out.append(("min_lr_ratio", "needs --lr-schedule cosine or linear (constant does not decay)"))
    for name in GAE_FLAGS:  # their ranges are GRPOConfig's, AdamWConfig's and CriticConfig's
        if getattr(r, name) is not None and r.adv_estimator != "gae":
            out.append((name, "needs --adv-estimator gae (only PPO's GAE has a critic)"))
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
    out += pool_problems(r)
    out += env_problems(r)
    out += config_problems(r)
    out += lora_problems(r)
    if r.world > 1 and not out:
        for name, spec in (("train_layout", r.train_layout), ("rollout_layout", r.rollout_layout)):
            try:
                mesh_of(r, spec, name)
            except ValueError as e:  # the default layout's problem is --world's
                out.append((name, str(e)) if spec else
                           ("world", f"the default --{name.replace('_', '-')}: {e}; pass --{name.replace('_', '-')}"))
    if not out:
        out += placement_checks(r)
    if r.world > 1 and not out and not r.eval_only:  # each rank's share of the step, checked before any starts
        out += share_problems(loop_config(r, eos_id=0, pad_id=0), r.rollout_ranks or r.world,
                              mesh_of(r, r.train_layout, "train_layout"))
    if r.resume not in (None, "auto") and not os.path.isdir(r.resume):
        out.append(("resume", "no such checkpoint directory" if not os.path.exists(r.resume) else "not a directory"))
    model = model_problems(r)
    if model:  # the data checks read the model's tokenizer and chat template
        return out + model
    return out + engine_problems(r) + log_problems(r) + data_problems(r) + eval_problems(r)


def lora_problems(r: Recipe) -> list[tuple[str, str]]:
    """(field, why) for the --lora-* flags and --merge (the adapters' own rules are ``LoraConfig``'s; whether the
    targets and --lora-resume's tensors fit the model is checked against its config)."""
    if r.lora_rank < 0:
        return [("lora_rank", "must be >= 1 (0: every weight trains)")]
    if not r.lora_rank and r.lora_resume is None:
        return [(n, "needs --lora-rank") for n in ("lora_alpha", "lora_targets", "merge") if getattr(r, n)] + \
            ([("lora_dropout", "needs --lora-rank")] if r.lora_dropout else [])
    if r.lora_resume is not None:
        try:
            got = adapters.read_config(r.lora_resume)
        except ValueError as e:
            return [("lora_resume", str(e))]
        if r.lora_rank and r.lora_rank != got.rank:
            return [("lora_rank", f"--lora-resume {r.lora_resume} holds rank-{got.rank} adapters")]
        for n in ("lora_alpha", "lora_targets", "lora_dropout"):  # the directory's adapter_config.json sets them
            if getattr(r, n):
                return [(n, f"--lora-resume {r.lora_resume}'s adapter_config.json sets it")]
    try:
        lc = lora_config(r)
    except ValueError as e:  # LoraConfig's rules: "LoraConfig.<field>[=value]: why"
        m = re.match(r"LoraConfig\.(\w+)(=\S+)?: (.*)", str(e), re.S)
        return [("lora_" + m[1].removesuffix("s") + ("s" if m[1] == "targets" else ""), m[3]) if m else
                ("lora_resume", str(e))]
    if model_problems(r):
        return []
    base = hf.load_config(r.model) if r.model else get_config(r.preset)
    try:
        cfg = base.replace(lora=lc)
    except ValueError as e:
        return [("lora_resume" if r.lora_resume else "lora_targets", str(e).removeprefix("LoraConfig.targets: "))]
    if r.lora_resume is not None:
        try:
            adapters.load(r.lora_resume, cfg, device="meta")
        except ValueError as e:
            return [("lora_resume", str(e))]
    if r.world > 1:  # every pipeline stage of the train layout holds adapters
        try:
            mesh = mesh_of(r, r.train_layout, "train_layout")
        except ValueError:
            return []  # --train-layout's own problem
        cfg = base.replace(lora=lora_config(r, base))
        if why := lora.stages_problem(layout(cfg, mesh), cfg):
            return [("lora_targets" if r.lora_targets else "train_layout", why)]
    return []


def model_problems(r: Recipe) -> list[tuple[str, str]]:
    """(field, why) for --model (a transformers checkpoint directory whose config rlflow runs) or --preset."""
    if r.model is None:
        try:
            get_config(r.preset)
        except KeyError as e:
            return [("preset", e.args[0])]
        return []
    if not os.path.isdir(r.model):
        return [("model", "no such directory" if not os.path.exists(r.model) else "not a directory")]
    if not os.path.isfile(os.path.join(r.model, "config.json")):
        return [("model", "has no config.json (not a transformers checkpoint directory)")]
    try:
        hf.load_config(r.model)
    except (ValueError, OSError, KeyError, TypeError) as e:  # a JSON error is a ValueError; a missing key
        why = str(e) if not isinstance(e, KeyError) else f"has no {e.args[0]!r}"
        return [("model", why if why.startswith("config.json") else f"config.json: {why}")]
    if not os.path.isfile(os.path.join(r.model, "tokenizer.json")):
        return [("model", "has no tokenizer.json (the fast tokenizer's file, which rlflow reads; "
                          "tokenizer.save_pretrained writes it)")]
    return []


def engine_problems(r: Recipe) -> list[tuple[str, str]]:
    """(field, why) for the rollout engine: whether it is installed, and what it cannot do of what the run asks
    (its capabilities, ``engines.unsupported``; its options are LoopConfig's to check)."""
    if (why := engines.kind(r.rollout_engine).missing()) is not None:
        return [("rollout_engine", why)]
    mesh = lockstep_rollout(r) if r.world > 1 and r.rollout_layout else None
    cfg = hf.load_config(r.model) if r.model else get_config(r.preset)  # model_problems passed
    out = [("preset" if k == "model" and r.model is None else k, why)
           for k, why in engines.unsupported(r.rollout_engine, cfg, sharded=mesh is not None,
                                             tp_only=mesh is not None and mesh.ep == 1 and mesh.pp == 1,
                                             compile_decode=r.compile_decode, record_routes=r.routing_replay != "off",
                                             partial_rollout=r.partial_rollout)]
    if mesh is not None and r.rollout_ranks and engines.kind(r.rollout_engine).capabilities.tensor_parallel:
        out.append(("rollout_layout", f"{mesh}: the {r.rollout_engine} engine's tensor parallelism spans the whole "
                                      "world (every rank starts it together), not a pool of it: use a dp rollout "
                                      "layout with --rollout-ranks"))
    if r.vllm_expert_parallel and "vllm_expert_parallel" in engines.kind(r.rollout_engine).options:
        if mesh is None or mesh.tp == 1 or mesh.ep > 1:
            out.append(("vllm_expert_parallel", "splits the experts over the ranks of a tp rollout layout: give "
                                                "--rollout-layout tp=N (N > 1)"))
        elif not cfg.is_moe:
            out.append(("vllm_expert_parallel", f"{cfg.model_type} has no experts to split"))
    return out


# the config fields a config's ValueError names: qualified (GRPOConfig.group_size, sampling.temperature,
# GRPOConfig.clip_low/clip_high), before their value (LoopConfig's min_lr_ratio=1.5), any snake_case name
# (validate_sizes' "mini_batch_size 8 is not divisible by micro_batch_size 3") and the message's subject
# (its first word: "steps must be a positive integer")
_NAMED = re.compile(r"\b[A-Za-z_]\w*\.(?P<q>[a-z_]\w*(?:/[a-z_]\w*)*)|(?<![\w.(-])(?P<b>[a-z_]\w*)(?==)"
                    r"|(?<![\w.(-])(?P<u>[a-z]\w*_\w*)\b|^(?P<s>[a-z]\w*)\b")


def flagged(r: Recipe, e: ValueError, renames: dict[str, str] | None = None) -> tuple[str | None, str]:
    """(field, why) of a config's ValueError: the config fields it names become the flags (``renames``: a
    config field that holds another flag's value, e.g. LoopConfig's dock_timeout_s is --dist-timeout). When
    it names one flag, that is the field, and a leading ``field=value`` leaves the message (the line starts
    with ``--field value:``); when it names none, or several (``clip_low/clip_high``, ``mini_batch_size`` and
    ``micro_batch_size``), the field is None: the line is the message itself, its flags named there."""
    renames = renames or {}
    fields = {f.name for f in dataclasses.fields(r)}
    named: list[str] = []

    def as_flags(m: re.Match) -> str:
        names = [renames.get(n, n) for n in (m["q"] or m["b"] or m["u"] or m["s"]).split("/")]
        if not all(n in fields for n in names):
            return m[0]  # a word of the message, or a field of no flag
        named.extend(n for n in names if n not in named)
        return "/".join("--" + n.replace("_", "-") for n in names)
    why = _NAMED.sub(as_flags, str(e))
    if len(named) != 1:
        return None, why
    flag = "--" + named[0].replace("_", "-")
    return named[0], re.sub(rf"^{re.escape(flag)}=('[^']*'|[^\s:]+):?\s+", "", why)


def config_problems(r: Recipe) -> list[tuple[str | None, str]]:
    """(field, why) of the first config of ``loop_config`` the flags cannot make, built in its order: its
    ``__post_init__`` owns the rule (``flagged`` names the flag). The tokenizer's ids are no flag's and no
    rule's: 0 stands in for them."""
    try:
        grpo_config(r)
        policy = optim_config(r)
        sampling_config(r, eos_id=0, pad_id=0)
    except ValueError as e:
        return [flagged(r, e)]
    try:
        critic_config(r, policy)
    except ValueError as e:  # its AdamW's learning rate is --critic-lr
        return [flagged(r, e, {"lr": "critic_lr"})]
    try:
        loop_config(r, eos_id=0, pad_id=0)
    except ValueError as e:
        return [flagged(r, e, {"dock_timeout_s": "dist_timeout", "timeout_s": "env_timeout"})]
    return []


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
