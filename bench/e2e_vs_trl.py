"""End-to-end GRPO step throughput: the recipe's workload run by rlflow and by TRL's `GRPOTrainer`, same run.

Both systems get the same model (the recipe's preset, a Qwen3-MoE; TRL loads rlflow's initial weights
saved with `rlflow.models.hf.save` into transformers' `Qwen3MoeForCausalLM`), the same prompts (the built-in
task, same seed, same order), the same group size, the same fixed response length (EOS never ends a
response: rlflow gets an EOS id that cannot be sampled, TRL `min_new_tokens = max_new_tokens`), the same
batch arrangement (one AdamW step per GRPO step over prompts x group samples; same micro-batch), the same
loss (token-mean / TRL "dapo", clip 0.2 / 0.28, no KL and no reference model, no router aux loss) and the
same optimizer (AdamW, constant LR, betas 0.9/0.99, grad-norm clip 1.0). Gradient checkpointing and mixed
precision are off on both.

The two systems alternate step by step (A B B A ...) so that noise from a shared machine falls on both.
Each timed step is one call of `rlflow.runtime.loop.train` for one step (timed around the call, device
synchronized) and one `GRPOTrainer.train()` over one step's prompts (timed from `on_step_begin` to
`on_step_end`). The figure is the paper's Eq. (5), per system, on the median step time.

    python bench/e2e_vs_trl.py                                   # CPU, qwen3-moe-tiny, 32 new tokens
    python bench/e2e_vs_trl.py --model smollm2-135m-instruct --task addition --prompts-per-step 8 --lr 2e-5
    python bench/e2e_vs_trl.py --device cuda --preset qwen3-moe-0.5b --max-new-tokens 256

With ``--model`` (a checkpoint directory, a .gguf file or a packaged model's name) both systems load that
checkpoint (TRL with ``AutoModelForCausalLM`` and ``AutoTokenizer``), the prompts are chat messages rendered by
its chat template on both sides, and the reward is the task's (``rlflow.data.TASKS``). Each system's step is
split into generation, log-probs (rlflow: the old/ref log-prob stage; TRL: the log-prob forwards while it
prepares the step's inputs) and the rest (the loss's forward and backward, AdamW, scoring and advantages).
``--rollout-engine vllm`` has rlflow generate with vLLM in this process (its generation time includes the
push of the updated weights into it); TRL's side is unchanged (transformers' ``generate``).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _use_rlflow_from(src: str) -> dict:
    """Import rlflow (and later the recipe) from ``src``; returns where from, and its git commit if any."""
    if src not in sys.path:
        sys.path.insert(0, src)
    import subprocess
    info = {"src": src, "commit": None, "dirty": None}
    try:
        info["commit"] = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, check=True).stdout.strip()
        st = subprocess.run(["git", "-C", src, "status", "--porcelain", "--", "rlflow", "recipes"],
                            capture_output=True, text=True, check=True).stdout
        info["dirty"] = bool(st.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def _load_recipe(src: str):
    path = os.path.join(src, "recipes", "grpo_qwen3_moe.py")
    spec = importlib.util.spec_from_file_location("grpo_qwen3_moe_recipe", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the file executes
    spec.loader.exec_module(mod)
    return mod


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def char_tokenizer_for_transformers(tok):
    """A `PreTrainedTokenizerFast` with exactly rlflow's CharTokenizer ids: one token per character,
    <pad>/<bos>/<eos> = 0/1/2 as special tokens, BOS prepended (as rlflow's prompt_batch does)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(tok.vocab)}
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token=tok.vocab[tok.pad_id]))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    t.decoder = decoders.Fuse()
    bos = tok.vocab[tok.bos_id]
    t.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.bos_id)])
    out = PreTrainedTokenizerFast(tokenizer_object=t, pad_token=tok.vocab[tok.pad_id], bos_token=bos,
                                  eos_token=tok.vocab[tok.eos_id], padding_side="left")
    probe = "max:381920="
    assert out(text=[probe])["input_ids"][0] == [tok.bos_id] + tok.encode(probe), "tokenizer ids differ"
    assert out.decode([1, 5, 2, 0, 7], skip_special_tokens=True) == tok.decode([1, 5, 2, 0, 7])
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-moe-tiny", help="model preset (rlflow.models.config)")
    ap.add_argument("--model", default=None, help="a checkpoint both systems load instead of --preset's random init "
                    "(a directory, a .gguf file, or a packaged model's name such as smollm2-135m-instruct)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="both systems run here")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="parameter dtype on both sides (no autocast on either)")
    ap.add_argument("--task", default="max_digit", help="built-in prompt task")
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32, help="fixed response length (no early EOS)")
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help="samples per forward/backward on both sides (default: the whole step's batch)")
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (constant)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps per system (not timed)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per system (even: each order A-B / B-A "
                    "equally often)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="both systems train LoRA adapters of this rank (alpha 2 x rank, every projection the model "
                         "has) on the frozen model: rlflow's --lora-rank, TRL with peft's LoraConfig; the same initial "
                         "adapters (B = 0)")
    ap.add_argument("--compile", action="store_true",
                    help="rlflow's decode step through torch.compile (the warm-up steps absorb compilation)")
    ap.add_argument("--rollout-engine", default="builtin", choices=["builtin", "vllm"],
                    help="rlflow's rollout engine (vllm: vLLM in this process, the weights pushed into it each step)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--memory", action="store_true",
                    help="peak memory per process instead: each system runs its steps alone in a process of its own "
                         "(--only), and its peak resident set size over those steps is compared")
    ap.add_argument("--only", choices=["rlflow", "trl"], default=None,
                    help="run one system's steps alone (the other is dropped after the set-up) and print its peak "
                         "resident set size over them (Linux: VmHWM, reset before the first step)")
    ap.add_argument("--rlflow-src", default=ROOT,
                    help="directory to import rlflow and the recipe from (default: this checkout; e.g. a "
                         "`git archive` snapshot of a commit)")
    return ap.parse_args(argv)


def peak_memory(argv: list[str]) -> dict:
    """--memory: this script with --only rlflow, then --only trl, each in a process of its own; their peak resident
    set sizes over the steps and the ratio TRL / rlflow."""
    import subprocess
    args = [x for x in argv if x != "--memory"]
    got = {}
    for name in ("rlflow", "trl"):
        res = subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--only", name], capture_output=True,
                             text=True)
        if res.returncode:
            raise SystemExit(f"--only {name} failed:\n{res.stderr[-3000:]}")
        got[name] = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"  {name:<7} peak RSS {got[name]['peak_rss_mib']:8.0f} MiB over {got[name]['steps']} steps "
              f"(before the steps {got[name]['rss_before_mib']:.0f} MiB; median step {got[name]['step_s']:.3f} s)")
    ratio = got["trl"]["peak_rss_mib"] / got["rlflow"]["peak_rss_mib"]
    print(f"peak RSS: the largest resident set size of a process that runs one system's steps alone (VmHWM, reset "
          f"after the set-up); TRL / rlflow = {ratio:.2f}x")
    out = dict(rlflow_peak_rss_mib=got["rlflow"]["peak_rss_mib"], trl_peak_rss_mib=got["trl"]["peak_rss_mib"],
               trl_over_rlflow=round(ratio, 3), runs=got)
    print(json.dumps(out))
    return out


def _rss_mib(field: str) -> float:
    """VmRSS / VmHWM of this process in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.memory:
        return peak_memory(sys.argv[1:] if argv is None else list(argv))
    src = _use_rlflow_from(os.path.abspath(a.rlflow_src))
    import rlflow
    from rlflow.data import PromptSource, prompt_batch
    from rlflow.models import decoder, hf
    from rlflow.runtime import loop
    if not os.path.abspath(rlflow.__file__).startswith(src["src"] + os.sep):
        raise SystemExit(f"rlflow imported from {rlflow.__file__}, not from --rlflow-src {src['src']}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    os.environ["RLFLOW_DEVICE"] = a.device  # the recipe's build() places params through rlflow.device
    if a.threads:
        torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("trl").setLevel(logging.ERROR)
    logging.getLogger("accelerate").setLevel(logging.ERROR)

    P, G, T = a.prompts_per_step, a.group_size, a.max_new_tokens
    B = P * G
    micro = a.micro_batch_size or B
    if B % micro:
        raise SystemExit(f"--micro-batch-size {micro} does not divide the step's batch {B}")
    n_total = a.warmup + a.steps

    # ---- rlflow: the recipe's build(), with a fixed response length and a constant LR ----
    recipe = _load_recipe(src["src"])
    model_dir = None
    if a.model:
        from rlflow.models import gguf
        model_dir = gguf.resolve(a.model)
    lora_kw = {}
    if a.lora_rank:  # the projections the model has on both sides: TRL refuses an adapted lm_head (rlflow's
        # default for a random-init preset)
        from rlflow.models.config import get_config
        from rlflow.models.lora import LoraConfig
        base = hf.load_config(model_dir) if model_dir else get_config(a.preset)
        lora_kw = {"lora_rank": a.lora_rank, "lora_targets": ",".join(
            base.replace(lora=LoraConfig(a.lora_rank, 2.0 * a.lora_rank)).lora.targets)}
    r = recipe.Recipe(preset=a.preset, model=model_dir, task=a.task, prompts_per_step=P, group_size=G,
                      max_new_tokens=T, micro_batch_size=micro, lr=a.lr, warmup_lr_steps=0, seed=a.seed, dtype=a.dtype,
                      steps=1, compile_decode=a.compile,
                      **({"rollout_engine": a.rollout_engine} if a.rollout_engine != "builtin" else {}),
                      **lora_kw)
    torch.manual_seed(a.seed)
    built = recipe.build(r)  # a RunSpec (a tuple in rlflow snapshots before it)
    cfg, params, tok, source, reward_fn, lcfg, dev = built if isinstance(built, tuple) else (
        built.cfg, built.params, built.tokenizer, built.source, built.reward_fn, built.config, built.device)
    # build() tunes the host allocator on CPU (rlflow.device.keep_host_memory); process-wide, so TRL, run in
    # this process, gets it too. Recorded as build() left it (None: an rlflow snapshot without it).
    from rlflow import device as rl_device
    kept = getattr(rl_device, "keep_host_memory", None)
    host_memory_kept = None if kept is None or dev.type != "cpu" else kept()
    lcfg = dataclasses.replace(lcfg, sampling=dataclasses.replace(lcfg.sampling, eos_id=-1))  # never sampled
    n_params = sum(p.numel() for k, p in params.items() if ".lora_" not in k)

    # ---- TRL: the same initial weights, tokenizer ids, prompts, reward ----
    tmp = tempfile.TemporaryDirectory(prefix="e2e_vs_trl_")
    ckpt = os.path.join(tmp.name, "init")
    lora_cfg = getattr(cfg, "lora", None)
    adapted = {k: v for k, v in params.items() if ".lora_" in k}
    hf.save(ckpt, cfg if lora_cfg is None else cfg.replace(lora=None),
            {k: v for k, v in params.items() if k not in adapted})
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    dtype_kw = hf.dtype_kwarg(dtype) if hasattr(hf, "dtype_kwarg") else {"dtype": dtype}  # an older --rlflow-src
    model = AutoModelForCausalLM.from_pretrained(ckpt, **dtype_kw).to(dev)
    if lora_cfg is not None:  # peft's adapters on the same targets, started from rlflow's (A drawn, B = 0)
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, target_modules=list(lora_cfg.targets), lora_dropout=0.0,
            bias="none", task_type="CAUSAL_LM"))
        with torch.no_grad():
            named = dict(model.named_parameters())
            for k, v in adapted.items():
                named["base_model.model." + k.replace(".weight", ".default.weight")].copy_(v)
    if model_dir is None:
        hf_tok = char_tokenizer_for_transformers(tok)
    else:
        hf_tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    # the stream rlflow's source yields, rendered as its source renders it (a chat template with --model)
    examples = PromptSource(task=a.task, seed=a.seed).take(P * n_total)
    if source.transform:
        examples = source.transform(examples)

    # same initial weights: logits of the first step's prompts from both implementations
    pb = prompt_batch(examples[:P], tok).to(dev)
    with torch.no_grad():
        pos = decoder.positions_from_valid(pb.prompt_mask_BTp)
        h, _, _ = decoder.forward(params, cfg, pb.prompt_ids_BTp, pos, valid_BT=pb.prompt_mask_BTp)
        ours = decoder.logits(params, cfg, h)
        theirs = model(input_ids=pb.prompt_ids_BTp, attention_mask=pb.prompt_mask_BTp.long(),
                       position_ids=pos).logits
        init_diff = float((ours - theirs.to(ours.dtype))[pb.prompt_mask_BTp].abs().max())
    if dtype == torch.float32 and init_diff > 1e-3:  # bf16 rounding differs by op order: reported, not checked
        raise SystemExit(f"initial weights differ: max |logits diff| = {init_diff:.3g}")

    from rlflow import data, rewards
    task = getattr(data, "TASKS", {}).get(a.task)
    verify = rewards.get(getattr(task, "reward", "exact"))  # the task's verifier, per sample in every rlflow version

    def task_reward(completions, answer, **_):
        # a conversational prompt's completion is TRL's [{"role": "assistant", "content": ...}]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(verify(c, ans)) for c, ans in zip(texts, answer)]

    targs = GRPOConfig(
        output_dir=os.path.join(tmp.name, "trl"), seed=a.seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=B // micro,  # one optimizer step / step
        num_generations=G, max_completion_length=T, num_iterations=1, beta=0.0,
        generation_kwargs={"min_new_tokens": T},  # EOS cannot be sampled before T tokens: fixed length
        temperature=1.0, top_p=1.0, top_k=0,
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group", mask_truncated_completions=False,
        router_aux_loss_coef=0.0,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=(a.device == "cpu"),
        num_train_epochs=1, shuffle_dataset=False, dataloader_num_workers=0,
        report_to="none", save_strategy="no", eval_strategy="no", logging_strategy="no",
        disable_tqdm=True, log_completions=False,
    )

    def step_dataset(i):
        ex = examples[i * P:(i + 1) * P]
        # chat messages: TRL renders them with the same template (rlflow rendered ``e.prompt`` from them)
        prompts = [list(e.messages) if e.messages is not None else e.prompt for e in ex]
        return Dataset.from_dict({"prompt": prompts, "answer": [e.answer for e in ex]})

    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=targs, train_dataset=step_dataset(0),
                          processing_class=hf_tok)

    class StepClock(TrainerCallback):
        """Wall time of each optimizer step: on_step_begin -> on_step_end (device synchronized)."""

        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, args, state, control, **kw):
            _sync(dev)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync(dev)
            self.times.append(time.perf_counter() - self.t0)

    clock = StepClock()
    trainer.add_callback(clock)
    trainer.remove_callback(PrinterCallback)  # train() would print its metrics dict
    trl_tokens, trl_gen_time, trl_lp_time = [], [], []
    orig_generate, orig_single = trainer._generate, trainer._generate_single_turn
    orig_prepare, orig_logps = trainer._generate_and_score_completions, trainer._get_per_token_logps_and_entropies
    preparing = [False]

    def timed_prepare(*args, **kw):  # the log-prob forwards of the step's preparation (old / ref log-probs)
        trl_lp_time.append(0.0)
        preparing[0] = True
        try:
            return orig_prepare(*args, **kw)
        finally:
            preparing[0] = False

    def timed_logps(*args, **kw):
        if not preparing[0]:
            return orig_logps(*args, **kw)
        _sync(dev)
        t = time.perf_counter()
        out = orig_logps(*args, **kw)
        _sync(dev)
        trl_lp_time[-1] += time.perf_counter() - t
        return out

    def counted_generate(prompts):  # counts tokens: unpadded prompt ids + completion ids, as rlflow's masks
        out = orig_generate(prompts)
        prompt_ids, completion_ids = out[0], out[1]
        trl_tokens.append((sum(len(p) for p in prompt_ids), sum(len(c) for c in completion_ids)))
        return out

    def timed_single_turn(*args, **kw):  # the generation itself (model.generate), for the rollout split
        _sync(dev)
        t = time.perf_counter()
        out = orig_single(*args, **kw)
        _sync(dev)
        trl_gen_time.append(time.perf_counter() - t)
        return out

    trainer._generate, trainer._generate_single_turn = counted_generate, timed_single_turn
    trainer._generate_and_score_completions, trainer._get_per_token_logps_and_entropies = timed_prepare, timed_logps

    rows = {"rlflow": [], "trl": []}

    opt_state = None  # carried across steps, as TRL's Trainer keeps its optimizer across train() calls
    try:  # the run state and the step context (an rlflow snapshot without them: the loop's older call)
        from rlflow.runtime import state as run_state, step as run_step
    except ImportError:
        run_state = None
    else:
        state = run_state.init(params, source)

    def run_rlflow(i):
        nonlocal params, opt_state, state
        _sync(dev)
        t = time.perf_counter()
        if run_state is None:
            params, opt_state, hist = loop.train(params, cfg, tok, source, reward_fn,
                                                 dataclasses.replace(lcfg, seed=a.seed + i), device=dev,
                                                 opt_state=opt_state)
        else:  # one more step (LoopConfig.steps counts the run's steps)
            state, hist = loop.train(state, run_step.context(cfg, tok, reward_fn, dataclasses.replace(
                lcfg, seed=a.seed + i, steps=i + 1), device=dev))
        _sync(dev)
        wall = time.perf_counter() - t
        m = hist[0]
        rows["rlflow"].append(dict(step=i, wall_s=wall, loop_step_s=m["step_time_s"],
                                   rollout_s=m["rollout_time_s"], logprob_s=m.get("logprob_time_s", 0.0),
                                   update_s=m.get("update_time_s", 0.0), prompt_tokens=m["prompt_tokens"],
                                   response_tokens=m["response_tokens"], reward=m["reward_mean"]))

    def run_trl(i):
        n_before = len(clock.times)
        trainer.train_dataset = step_dataset(i)
        trainer.train()
        if len(clock.times) != n_before + 1 or trainer.state.global_step != 1:
            raise RuntimeError(f"TRL did {len(clock.times) - n_before} steps for one step's prompts")
        p_tok, c_tok = trl_tokens[-1]
        rows["trl"].append(dict(step=i, wall_s=clock.times[-1], rollout_s=trl_gen_time[-1], logprob_s=trl_lp_time[-1],
                                prompt_tokens=p_tok,
                                response_tokens=c_tok))

    print(f"model: {a.model or a.preset} ({cfg.model_type}, {n_params / 1e6:.2f}M params, {cfg.num_experts} experts "
          f"top-{cfg.num_experts_per_tok}, {a.dtype}) on {dev}; initial logits max |rlflow - transformers| = "
          f"{init_diff:.2e}")
    print(f"workload: task {a.task}, {P} prompts x {G} samples = {B} per step, {T} new tokens per sample (fixed), "
          f"micro-batch {micro} ({B // micro} per optimizer step), 1 AdamW step per GRPO step, lr {a.lr}, no KL, "
          + (f"LoRA rank {a.lora_rank} on {','.join(lora_cfg.targets)} (peft on TRL's side), " if a.lora_rank else "") +
          f"{a.warmup} warm-up + {a.steps} timed steps per system, alternating A B B A")
    print(f"rlflow from {src['src']} (commit {src['commit']}{', uncommitted changes' if src['dirty'] else ''})")
    print(f"TRL {trl.__version__} GRPOTrainer (transformers {transformers.__version__}, "
          f"experts_implementation={getattr(model.config, '_experts_implementation', None)}, "
          f"attn={model.config._attn_implementation}); torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(loop.TPS_DEFINITION + ", devices = 1; per system: tokens of a step (the median step's, when prompts "
          "vary) / median step wall time")
    sys.stdout.flush()

    if a.only:  # the other system dropped (its closures' cells too), then the peak counted from here
        import gc
        ours = theirs = h = None  # the initial-logits check's
        if a.only == "rlflow":  # the wrapped bound methods hold the trainer too
            trainer = model = orig_generate = orig_single = orig_prepare = orig_logps = None
        else:
            params = state = built = opt_state = None
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before = _rss_mib("VmRSS")
        run = run_rlflow if a.only == "rlflow" else run_trl
        for i in range(n_total):
            run(i)
        timed = rows[a.only][a.warmup:]
        out = dict(system=a.only, peak_rss_mib=round(_rss_mib("VmHWM"), 1), rss_before_mib=round(before, 1),
                   steps=n_total, step_s=round(statistics.median(x["wall_s"] for x in timed), 4))
        print(json.dumps(out))
        return out

    for i in range(n_total):
        order = (run_rlflow, run_trl) if i % 2 == 0 else (run_trl, run_rlflow)
        for f in order:
            f(i)
        tag = "warm-up" if i < a.warmup else "timed"
        print(f"  step {i} ({tag}): rlflow {rows['rlflow'][-1]['wall_s']:.3f}s  TRL {rows['trl'][-1]['wall_s']:.3f}s")
        sys.stdout.flush()

    res = {}
    per_step = {name: [(x["prompt_tokens"], x["response_tokens"]) for x in rs[a.warmup:]] for name, rs in rows.items()}
    if per_step["rlflow"] != per_step["trl"]:
        raise RuntimeError(f"systems processed different tokens: rlflow {per_step['rlflow']}, trl {per_step['trl']}")
    for name, rs in rows.items():
        timed = rs[a.warmup:]
        # a task's prompts of varying length: each step's own tokens; the step's median, as with fixed prompts
        pt, rt = (round(statistics.median(t[k] for t in per_step[name])) for k in (0, 1))
        step_s = statistics.median(x["wall_s"] for x in timed)
        roll_s = statistics.median(x["rollout_s"] for x in timed)
        lp_s = statistics.median(x["logprob_s"] for x in timed)
        loop_s = statistics.median(x.get("loop_step_s", x["wall_s"]) for x in timed)
        res[name] = dict(prompt_tokens=pt, response_tokens=rt, step_s=step_s, rollout_s=roll_s, loop_step_s=loop_s,
                         logprob_s=lp_s, rest_s=step_s - roll_s - lp_s, tps=(pt + rt) / step_s,
                         rollout_tps=(pt + rt) / roll_s,
                         step_times_s=[round(x["wall_s"], 4) for x in timed])
    ratio = res["rlflow"]["tps"] / res["trl"]["tps"]

    print(f"\n{'system':<8} {'tokens/step':>12} {'step s':>8} {'TPS':>9} {'rollout s':>10} {'logprob s':>10} "
          f"{'rest s':>8} {'rollout %':>9}")
    for name in ("rlflow", "trl"):
        x = res[name]
        print(f"{name:<8} {x['prompt_tokens'] + x['response_tokens']:>12} {x['step_s']:>8.3f} {x['tps']:>9.0f} "
              f"{x['rollout_s']:>10.3f} {x['logprob_s']:>10.3f} {x['rest_s']:>8.3f} "
              f"{100 * x['rollout_s'] / x['step_s']:>8.0f}%")
    print(f"ratio rlflow / TRL TPS = {ratio:.2f}x   (rollout: rlflow loop's generate(); TRL model.generate in "
          f"_generate_single_turn; logprob: rlflow's old/ref log-prob stage, TRL's log-prob forwards while it "
          f"prepares the inputs; rest: scoring, advantages, the loss's forward+backward, AdamW)")

    out = dict(
        rlflow_tps=round(res["rlflow"]["tps"], 1), trl_tps=round(res["trl"]["tps"], 1), ratio=round(ratio, 3),
        rlflow_step_s=round(res["rlflow"]["step_s"], 4), trl_step_s=round(res["trl"]["step_s"], 4),
        rlflow_rollout_s=round(res["rlflow"]["rollout_s"], 4), trl_rollout_s=round(res["trl"]["rollout_s"], 4),
        rlflow_logprob_s=round(res["rlflow"]["logprob_s"], 4), trl_logprob_s=round(res["trl"]["logprob_s"], 4),
        rlflow_rest_s=round(res["rlflow"]["rest_s"], 4), trl_rest_s=round(res["trl"]["rest_s"], 4),
        rlflow_loop_step_s=round(res["rlflow"]["loop_step_s"], 4),  # loop.train's own step_time_s (Eq. 5 timer)
        rlflow_step_times_s=res["rlflow"]["step_times_s"], trl_step_times_s=res["trl"]["step_times_s"],
        tokens_per_step=res["rlflow"]["prompt_tokens"] + res["rlflow"]["response_tokens"],
        workload=dict(preset=a.preset, model=a.model, params_m=round(n_params / 1e6, 3), dtype=a.dtype, task=a.task,
                      prompts_per_step=P, group_size=G, samples_per_step=B, max_new_tokens=T, fixed_length=True,
                      rlflow_compile_decode=a.compile, rlflow_rollout_engine=a.rollout_engine,
                      micro_batch_size=micro, optimizer_steps_per_step=1, lr=a.lr, kl=0.0, warmup_steps=a.warmup,
                      lora_rank=a.lora_rank,
                      timed_steps=a.steps, seed=a.seed),
        torch_threads=torch.get_num_threads(), device=str(dev), host_memory_kept=host_memory_kept,
        machine=f"{platform.machine()} {os.cpu_count()} CPUs" if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        versions=dict(torch=torch.__version__, transformers=transformers.__version__, trl=trl.__version__),
        rlflow=src, init_logits_max_abs_diff=init_diff, date=datetime.date.today().isoformat(),
    )
    tmp.cleanup()
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
