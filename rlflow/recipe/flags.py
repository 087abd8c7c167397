"""Every flag of the recipe as a field of ``Recipe`` (its default and --help text), and the flags' choices
(``driver.parse_args`` makes the command line of them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlflow import engines, optim
from rlflow.algos import estimators, grpo
from rlflow.algos.corrections import IS_LEVELS, IS_MODES
from rlflow.runtime.config import ROUTING_REPLAY


def _f(default, help):  # a field with its --help text
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Recipe:
    model: str | None = _f(None, "Hugging Face checkpoint directory, a .gguf file (dequantized once into a cached "
                                 "directory), or a packaged model's name (smollm2-135m-instruct) (default: random "
                                 "init of --preset)")
    preset: str = _f("qwen3-moe-tiny", "named model config used when --model is not given")
    dataset: str | None = _f(None, "prompts and answers: a .jsonl, .json, .csv or .parquet file, or a Hugging Face "
                                   "datasets folder (save_to_disk, or data files) (default: the built-in --task)")
    dataset_split: str = _f("train", "split of --dataset (a data file's one split is train; slices like "
                                     "train[:100] for files read by datasets)")
    prompt_key: str = _f("prompt", "--dataset column of the prompts: text, or chat messages [{role, content}] "
                                   "(when it is missing, GSM8K's question column)")
    answer_key: str = _f("answer", "--dataset column of the reference answers")
    task: str = _f("max_digit", "built-in task: max_digit, sum_mod10, first_digit (for the built-in tokenizer), "
                                "addition (natural language, for a --model; --eval-dataset task:addition is its "
                                "held-out split)")
    env: str | None = _f(None, "multi-turn rollouts: the environment that answers the model between its turns, a "
                               "built-in one (max_digit_feedback: --task max_digit with a hint after a wrong answer; tools: --tools) "
                               "or path/to/file.py:Class (docs/agentic.md); each sample is one episode")
    max_turns: int | None = _f(None, "--env: the model's turns per episode (default 2); --max-new-tokens is each "
                                     "turn's limit")
    max_total_tokens: int | None = _f(None, "--env: response tokens per episode, the model's turns and the "
                                            "observations (default: the model's positions bound them)")
    tools: str | None = _f(None, "--env tools: the tools the model may call, comma-separated: built-in (calculator) "
                                 "and path/to/file.py (each public function a tool); the prompts show their "
                                 "schemas through --model's chat template")
    env_timeout: float | None = _f(None, "--env: seconds an environment's start or step may take before its episode "
                                         "ends unscored (default 60)")
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
    lr: float | None = _f(None, "AdamW learning rate (default: 3e-4 for a random-init --preset, 2e-5 for a "
                                "pretrained --model; LoRA's adapters 1e-3 and 2e-4)")
    warmup_lr_steps: int = _f(10, "linear LR warm-up steps")
    lr_schedule: str = _f("constant", "learning rate after the warm-up: constant, or a cosine or linear decay to "
                                      "--lr x --min-lr-ratio at the last step (see docs/logging.md)")
    min_lr_ratio: float = _f(0.0, "where --lr-schedule cosine/linear ends, as a fraction of --lr")
    lora_rank: int = _f(0, "train LoRA adapters of this rank on the frozen model instead of every weight (0: full "
                           "fine-tuning); the reference policy of --kl-coef is the model itself; checkpoints hold the "
                           "adapters as peft saves them (docs/lora.md)")
    lora_alpha: float | None = _f(None, "LoRA's alpha: the adapters' output is scaled by alpha / rank (default 2 x "
                                        "--lora-rank)")
    lora_targets: str | None = _f(None, "the modules LoRA adapts, comma-separated peft target_modules names of "
                                        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head (default: "
                                        "the projections the model has, and with no --model the untied head too; MoE "
                                        "experts, the router, a tied head and MLA projections are not adapted)")
    lora_dropout: float = _f(0.0, "dropout on the LoRA adapters' input in the update")
    lora_resume: str | None = _f(None, "start the adapters from a peft adapter directory (adapter_config.json, "
                                       "adapter_model.safetensors) of --model, e.g. an earlier run's checkpoint; "
                                       "its rank and targets are taken, the optimizer starts fresh")
    merge: bool = _f(False, "with --lora-rank: checkpoints also hold the merged model (the adapters added into the "
                            "weights) in transformers' format, which --model loads")
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
    remat: bool = _f(False, "activation checkpointing: the update's backward recomputes each layer's activations "
                            "from its input instead of keeping them (longer micro-batches per device for about a "
                            "third more compute)")
    weight_decay: float = _f(0.0, "AdamW weight decay (matrices only)")
    temperature: float = _f(1.0, "sampling temperature")
    top_p: float = _f(1.0, "nucleus sampling")
    seed: int = _f(0, "seed for init, prompts and sampling")
    dtype: str = _f("auto", "parameter dtype: float32, bfloat16, or auto: bfloat16 on a GPU or NPU (where the MoE "
                            "grouped GEMM needs it), float32 on a CPU; AdamW keeps float32 masters")
    world: int = _f(2, "ranks (one device each; on a CPU one process and one thread each): the stages run in "
                       "their layouts over all of them and take turns; 1: one process, unsharded")
    train_layout: str | None = _f(None, "layout of the update and the old/ref log-probs, e.g. tp=2, ep=2,tp=2, pp=2,tp=2, dp=4 "
                                        "(axes not named are 1, dp fills the world; default: tp=2 when world >= 2)")
    rollout_layout: str | None = _f(None, "layout of generation, e.g. dp=2, dp=2,tp=2 (default: dp over the world); "
                                          "the weights move train -> rollout layout before every rollout")
    rollout_ranks: int = _f(0, "separate device pools: the first K ranks generate and score, the other --world - K "
                               "train, and the two overlap (--max-staleness); the layouts span their pool's ranks "
                               "(default dp over it); 0: colocated, the stages take turns on every rank")
    max_staleness: int = _f(0, "with --rollout-ranks: a step's rows are generated with weights at most K updates "
                               "old (the rollout pool waits for newer ones; nothing is dropped); 0: on-policy, the "
                               "synchronous run. Stale rows are trained as on-policy unless --rollout-is corrects them")
    partial_rollout: bool = _f(False, "with --rollout-ranks: a version that lands while a step generates is swapped in "
                                      "before the next decode step and the rows in flight continue under it (each "
                                      "token records its version; --max-staleness bounds the oldest)")
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
    rollout_engine: str = _f("builtin", "what generates: builtin (rlflow's engine) or vllm (vLLM in each rank's "
                                        "process, the weights pushed into it in place every step; docs/engines.md)")
    vllm_memory_utilization: float | None = _f(None, "--rollout-engine vllm: vLLM's gpu_memory_utilization, the share "
                                                     "of the device's memory it may take (on a CPU, of host memory; "
                                                     "default 0.5 on an accelerator, 0.2 on a CPU)")
    vllm_expert_parallel: bool = _f(False, "--rollout-engine vllm with --rollout-layout tp=N: vLLM's expert "
                                           "parallelism over those ranks (each rank whole experts, E/N of them, "
                                           "instead of every expert's width split N ways); an MoE model")
    compile_decode: bool = _f(False, "compile the rollout's decode step with torch.compile (static shapes; "
                                     "pays off on long runs with fixed shapes, CUDA graphs on CUDA)")
    max_bad_steps: int = _f(3, "stop after this many steps in a row whose updates were skipped for non-finite "
                               "rewards, losses or gradients (a skipped update leaves the parameters unchanged), "
                               "or in which no row was scored (every episode ended unscored)")
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
    eval_dataset: str | None = _f(None, "held-out prompts and answers to evaluate on, in any --dataset format, or "
                                        "task:NAME, the held-out split of a built-in --task (the "
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


def choices() -> dict[str, list[str]]:
    """Each flag with a fixed set of values, and that set; read when the parser is built, so that an advantage
    estimator or policy loss a recipe registers (``estimators.register_adv_est``, ``grpo.register_policy_loss``)
    is one of them."""
    return {"dtype": ["auto", "float32", "bfloat16"], "dock_backend": ["local", "procs", "ray"], "launcher": ["local", "ray"],
            "lr_schedule": list(optim.LR_SCHEDULES), "wandb_mode": ["online", "offline"],
            "kl_estimator": list(grpo.KL_ESTIMATORS), "loss_agg": list(grpo.LOSS_AGGS),
            "policy_loss": list(grpo.POLICY_LOSSES), "adv_estimator": list(estimators.ADV_ESTIMATORS),
            "rollout_is": list(IS_LEVELS), "rollout_is_mode": list(IS_MODES), "routing_replay": list(ROUTING_REPLAY),
            "rollout_engine": list(engines.names())}


__all__ = ["Recipe", "choices"]
