"""The recipe's user path with flags: a Hugging Face checkpoint directory (transformers' own
save_pretrained, with a tokenizer.json) and a JSONL dataset scored by the math verifier."""

import json
import os
import subprocess
import sys

import transformers  # noqa: F401  (a declared test dependency: imported, not skipped)
from tokenizers import Tokenizer, models, pre_tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_recipe_with_hf_checkpoint_and_jsonl_dataset(tmp_path):
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<|im_end|>", *"0123456789+-=#?", "what", "is"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="removed")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    model_dir = tmp_path / "model"
    cfg = Qwen3MoeConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, eos_token_id=vocab["<|im_end|>"])
    Qwen3MoeForCausalLM(cfg).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"question": f"what is {a} + {b} = ?", "answer": f"#### {a + b}"}) + "\n"
                            for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]))
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--model", str(model_dir),
           "--dataset", str(data), "--steps", "2", "--prompts-per-step", "2", "--group-size", "4",
           "--max-new-tokens", "4", "--kl-coef", "0.01", "--out", str(out)]
    # the default train layout (tp=2) cannot split this model's 19-token vocabulary: refused naming the flag
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].startswith("error: --train-layout mesh(pp=1,dp=1,ep=1,tp=2) (the default)")
    assert "size 19 does not divide by tp=2" in res.stderr and not out.exists()
    cmd += ["--train-layout", "ep=2"]  # experts over 2 ranks for the update, dp=2 generation
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "task: " + str(data) in res.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("kl" in r and 0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    ckpt = out / "checkpoint-final"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "tokenizer.json").exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(ckpt)  # the trained checkpoint loads in transformers
    assert AutoTokenizer.from_pretrained(ckpt).eos_token == "<|im_end|>"


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused_naming_the_flag(tmp_path):
    """It ended in an IndexError deep in the rollout."""
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<|im_end|>", *"0123456789+-=#?"])}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>")),
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    model_dir = tmp_path / "model"
    Qwen3ForCausalLM(Qwen3Config(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--model", str(model_dir), "--steps", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (f"error: --model {model_dir}: the tokenizer has {len(vocab)} tokens "
                                                   "but the model's vocab_size is 8")


def test_the_real_user_path_parquet_reward_file_eval_and_tensorboard(tmp_path):
    """The command a user coming from TRL runs: a checkpoint directory, a Parquet dataset, their own reward
    function in a file, a held-out eval set every 5 steps, TensorBoard and JSONL curves; the default 2
    processes (train tp=2, rollout dp=2)."""
    import datasets
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<|im_end|>", *"0123456789+-=#?", "what", "is", "x"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="removed")
    model_dir = tmp_path / "model"
    Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        eos_token_id=vocab["<|im_end|>"])).save_pretrained(model_dir)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>").save_pretrained(
        model_dir)
    rows = [{"prompt": f"what is {a} + {b} = ?", "answer": str(a + b), "level": a % 3} for a in range(6) for b in (1, 2)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "data.parquet"))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    (tmp_path / "my_reward.py").write_text(
        "def score(prompts, completions, answers, level, **kwargs):\n"
        "    return [float(a in c) + 0.1 * lv for c, a, lv in zip(completions, answers, level)]\n")
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_qwen3_moe.py"), "--model", str(model_dir),
           "--dataset", str(tmp_path / "data.parquet"), "--reward", f"{tmp_path / 'my_reward.py'}:score",
           "--eval-dataset", str(tmp_path / "eval.jsonl"), "--eval-every", "5", "--log-to", "jsonl,tensorboard",
           "--steps", "10", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "3", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "reward_mean" in r]
    evals = [r for r in lines if "eval/reward_mean" in r]
    assert [r["step"] for r in train] == list(range(10)) and [r["step"] for r in evals] == [0, 5, 10]
    assert all(0.0 <= r["reward_mean"] <= 1.2 for r in train)  # the file's reward: 0 or 1, plus 0.1 x level
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "reward_mean" in tags and "eval/reward_mean" in tags
    assert [e.step for e in acc.Scalars("eval/reward_mean")] == [0, 5, 10]
