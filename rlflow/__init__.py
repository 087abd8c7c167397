"""rlflow: functional, distributed RL training of LLMs on PyTorch.

The public API: the pieces a GRPO loop is composed of, each a re-export of the function or class that
the library's own loop (``rlflow.runtime.loop.train``) runs. See docs/library.md for a custom loop
written with them, and the table of every name with its module.

Models (``rlflow.models``)
    ModelConfig, get_config            the one config of every family; named presets ("qwen3-moe-tiny", ...)
    init_params                        random init, as transformers does
    load_model, save_model, load_config  transformers checkpoint directories (``models.hf.load/save``)
    forward, logits, positions_from_valid  the decoder as pure functions over a params dict
Generation (``rlflow.rollout``)
    generate, SamplingConfig           batched sampling with a KV cache: PromptBatch -> RolloutBatch
Scoring (``rlflow.algos.stages``, ``rlflow.rewards``)
    score                              rewards [B] of a RolloutBatch from a batched reward function
    Reward, CombinedReward, load_reward, register_reward, per_sample  reward functions: the registry
                                       ("exact", "math"), a user's file or module, weighted sums, and a
                                       per-sample ``fn(response, answer)`` in the loop's batched form
Advantages (``rlflow.algos.estimators``, ``rlflow.algos.critic``)
    advantages, ADV_ESTIMATORS         grpo, rloo, reinforce++, reinforce++-baseline (gae: ``gae``)
    group_advantages                   GRPO's (r - group mean) / group std
    gae, Critic, CriticConfig, value_loss  PPO with a critic: per-token GAE, the value model, its loss
Policy loss (``rlflow.algos.grpo``)
    GRPOConfig, policy_loss            the clipped surrogate (PPO / GSPO ratios, KL, entropy, aggregation)
Log-probs (``rlflow.models.logprobs``, ``rlflow.algos.stages``)
    response_logprobs, batched_logprobs  log pi(response token | prefix): with grad, and no-grad micro-batched
Update (``rlflow.algos.stages``, ``rlflow.optim``)
    update, UpdateConfig               epochs x mini-batches of AdamW steps on a TrainBatch
    optim, AdamWConfig, AdamWState     functional AdamW (``optim.init(params)``, ``optim.step``)
    lr_at                              the learning rate of a step: warm-up, then constant / cosine / linear
Batches (``rlflow.batch``)
    PromptBatch, RolloutBatch, TrainBatch, extend  typed, validated rows between the stages
Data (``rlflow.data``)
    Example, PromptSource, prompt_batch, load_examples, apply_chat_template
Tokenizers (``rlflow.tokenizer``)
    CharTokenizer, HFTokenizer, ChatTemplate
The transfer dock (``rlflow.dock``, ``rlflow.runtime.graph``)
    Dock, proc_dock, ray_dock, GRPO, PPO  ``Dock.local(GRPO.schema, GRPO.consumers, ...)``, in processes, on Ray
Layouts and plans (``rlflow.sharding``, ``rlflow.models.sharding``)
    Mesh, P, Layout, layout            meshes, partition specs, a model's layout on a mesh
    Plan, plan, allgather_swap, swap_back  transition plans between two layouts
The loop (``rlflow.runtime``, ``rlflow.metrics``)
    init_state, step_context, train    a run's state, the fixed part of its steps, the whole loop
    LoopConfig                         the loop's sizes and configs
    Colocated, Disaggregated, spawn    where the stages run on a world of ranks (one set of devices taking
                                       turns, or separate pools); the ranks as local processes
    make_sinks                         where per-step metrics go: JSONL, TensorBoard, W&B

Every name is resolved on first use (PEP 562 module ``__getattr__``), so ``import rlflow`` imports neither
torch nor anything else: ``rlflow.sharding.mesh`` stays pure data (tests/test_layering.py), a Ray actor
that hosts a warehouse imports no torch, and ray / transformers / datasets load only when a name that
needs them is used. No name here is a submodule's name unless it is that submodule (``optim``), so
``from rlflow import device`` and the like keep importing the submodules.
"""

import importlib

__version__ = "0.1.0"

# public name -> (module, attribute in it); attribute None: the module itself
_EXPORTS = {
    # models
    "ModelConfig": ("rlflow.models.config", "ModelConfig"),
    "get_config": ("rlflow.models.config", "get_config"),
    "init_params": ("rlflow.models.decoder", "init_params"),
    "forward": ("rlflow.models.decoder", "forward"),
    "logits": ("rlflow.models.decoder", "logits"),
    "positions_from_valid": ("rlflow.models.decoder", "positions_from_valid"),
    "load_model": ("rlflow.models.hf", "load"),
    "save_model": ("rlflow.models.hf", "save"),
    "load_config": ("rlflow.models.hf", "load_config"),
    # generation
    "generate": ("rlflow.rollout", "generate"),
    "SamplingConfig": ("rlflow.rollout", "SamplingConfig"),
    # scoring
    "score": ("rlflow.algos.stages", "score"),
    "Reward": ("rlflow.rewards", "Reward"),
    "CombinedReward": ("rlflow.rewards", "CombinedReward"),
    "load_reward": ("rlflow.rewards", "load_reward"),
    "register_reward": ("rlflow.rewards", "register"),
    "per_sample": ("rlflow.rewards", "per_sample"),
    # advantages
    "advantages": ("rlflow.algos.estimators", "advantages"),
    "ADV_ESTIMATORS": ("rlflow.algos.estimators", "ADV_ESTIMATORS"),
    "group_advantages": ("rlflow.algos.estimators", "group_advantages"),
    "gae": ("rlflow.algos.estimators", "gae"),
    "Critic": ("rlflow.algos.critic", "Critic"),
    "CriticConfig": ("rlflow.algos.critic", "CriticConfig"),
    "value_loss": ("rlflow.algos.critic", "value_loss"),
    # policy loss
    "GRPOConfig": ("rlflow.algos.grpo", "GRPOConfig"),
    "policy_loss": ("rlflow.algos.grpo", "policy_loss"),
    # log-probs
    "response_logprobs": ("rlflow.models.logprobs", "response_logprobs"),
    "batched_logprobs": ("rlflow.algos.stages", "batched_logprobs"),
    # update
    "update": ("rlflow.algos.stages", "update"),
    "UpdateConfig": ("rlflow.algos.stages", "UpdateConfig"),
    "optim": ("rlflow.optim", None),
    "AdamWConfig": ("rlflow.optim", "AdamWConfig"),
    "AdamWState": ("rlflow.optim", "AdamWState"),
    "lr_at": ("rlflow.optim", "lr_at"),
    # batches
    "PromptBatch": ("rlflow.batch", "PromptBatch"),
    "RolloutBatch": ("rlflow.batch", "RolloutBatch"),
    "TrainBatch": ("rlflow.batch", "TrainBatch"),
    "extend": ("rlflow.batch", "extend"),
    # data
    "Example": ("rlflow.data", "Example"),
    "PromptSource": ("rlflow.data", "PromptSource"),
    "prompt_batch": ("rlflow.data", "prompt_batch"),
    "load_examples": ("rlflow.data", "load_examples"),
    "apply_chat_template": ("rlflow.data", "apply_chat_template"),
    # tokenizers
    "CharTokenizer": ("rlflow.tokenizer", "CharTokenizer"),
    "HFTokenizer": ("rlflow.tokenizer", "HFTokenizer"),
    "ChatTemplate": ("rlflow.tokenizer", "ChatTemplate"),
    # the transfer dock
    "Dock": ("rlflow.dock.client", "Dock"),
    "proc_dock": ("rlflow.dock.proc_backend", "proc_dock"),
    "ray_dock": ("rlflow.dock.ray_backend", "ray_dock"),  # imports ray, on first use only
    "GRPO": ("rlflow.runtime.graph", "GRPO"),
    "PPO": ("rlflow.runtime.graph", "PPO"),
    # layouts and plans
    "Mesh": ("rlflow.sharding.mesh", "Mesh"),
    "P": ("rlflow.sharding.spec", "P"),
    "Layout": ("rlflow.sharding.layout", "Layout"),
    "layout": ("rlflow.models.sharding", "layout"),
    "Plan": ("rlflow.sharding.plan", "Plan"),
    "plan": ("rlflow.sharding.plan", "plan"),
    "allgather_swap": ("rlflow.sharding.plan", "allgather_swap"),
    "swap_back": ("rlflow.sharding.plan", "swap_back"),
    # the loop
    "init_state": ("rlflow.runtime.state", "init"),
    "step_context": ("rlflow.runtime.step", "context"),
    "train": ("rlflow.runtime.loop", "train"),
    "LoopConfig": ("rlflow.runtime.config", "LoopConfig"),
    "Colocated": ("rlflow.runtime.placement", "Colocated"),
    "Disaggregated": ("rlflow.runtime.placement", "Disaggregated"),
    "spawn": ("rlflow.runtime.launch", "spawn"),
    "make_sinks": ("rlflow.metrics", "make_sinks"),  # TensorBoard / W&B imported only when a sink needs them
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'rlflow' has no attribute {name!r}") from None
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value  # resolved once
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
