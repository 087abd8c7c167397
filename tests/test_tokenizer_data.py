import json

import pytest
import torch

from rlflow.data import PromptSource, load_jsonl, prompt_batch
from rlflow.tokenizer import CharTokenizer


def test_char_tokenizer_roundtrip_and_errors():
    tok = CharTokenizer()
    assert tok.vocab_size == 32
    ids = tok.encode("max:381920=")
    assert tok.decode(ids + [tok.eos_id, 40, 31999]) == "max:381920="  # specials and out-of-vocab ids dropped
    with pytest.raises(ValueError, match=r"\['Z'\]"):
        tok.encode("maxZ")


def test_prompt_batch_left_pads_with_bos_and_indices():
    tok = CharTokenizer()
    ex = PromptSource(task="max_digit", seed=1).take(2) + PromptSource(task="sum_mod10", seed=1).take(1)
    b = prompt_batch(ex, tok, first_index=10)
    assert b.prompt_ids_BTp[:, -1].eq(tok.encode("=")[0]).all()  # left padding: prompts end together
    lens = [1 + len(e.prompt) for e in ex]  # BOS + characters
    assert b.prompt_mask_BTp.sum(-1).tolist() == lens and lens[2] < lens[0]
    assert not b.prompt_mask_BTp[2, 0] and (b.prompt_ids_BTp[2][~b.prompt_mask_BTp[2]] == tok.pad_id).all()
    assert b.prompt_ids_BTp[2][b.prompt_mask_BTp[2]][0] == tok.bos_id
    assert torch.equal(b.index_B, torch.tensor([10, 11, 12]))
    assert b.answers == tuple(e.answer for e in ex)
    assert all(e.answer == max(e.prompt[4:10]) for e in ex[:2])


def test_prompt_source_is_seeded_and_datasets_cycle(tmp_path):
    assert PromptSource(task="sum_mod10", seed=3).take(5) == PromptSource(task="sum_mod10", seed=3).take(5)
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(3)) + "\n")
    ex = load_jsonl(str(f))
    src = PromptSource(examples=ex, seed=0)
    seen = src.take(6)
    assert sorted(e.prompt for e in seen[:3]) == ["q0", "q1", "q2"] == sorted(e.prompt for e in seen[3:])


def test_load_jsonl_errors_name_line_and_keys(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "a", "answer": "1"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: needs keys 'prompt'.*got \['text'\]"):
        load_jsonl(str(f))
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        PromptSource(task="nope")


@pytest.mark.parametrize("line, match", [
    (b'["a list", "of strings"]\n', r":2: expected a JSON object .* got a list"),
    (b'{"prompt": null, "answer": "1"}\n', r":2: key 'prompt' is null"),
    (b'{"prompt": "2+2", "answer": null}\n', r":2: key 'answer' is null"),
    (b'{"prompt": "caf\xe9", "answer": "1"}\n', r":2: not UTF-8"),
    (b'{"text": "x"}\n', r":2: needs keys"),
])
def test_bad_dataset_lines_name_the_file_and_line(line, match, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"prompt": "1+1", "answer": "2"}\n' + line)
    with pytest.raises(ValueError, match=str(f) + match):
        load_jsonl(str(f))


def test_a_tokenizer_without_an_eos_token_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from rlflow.tokenizer import HFTokenizer
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "a"}))
    with pytest.raises(ValueError, match="no eos_token"):  # id 0 ('a') was used
        HFTokenizer(str(tmp_path))


def test_prompts_past_max_position_embeddings_are_refused():
    from rlflow.models.config import get_config
    from rlflow.data import check_positions
    tok = CharTokenizer()
    cfg = get_config("qwen3-moe-tiny").replace(max_position_embeddings=12)
    batch = prompt_batch([PromptSource(task="max_digit", seed=0).take(1)[0]], tok)
    check_positions(batch, 1, cfg.replace(max_position_embeddings=100))
    with pytest.raises(ValueError, match="max_position_embeddings=12"):
        check_positions(batch, 8, cfg)


def test_a_tasks_held_out_split_is_never_drawn_for_training_and_is_the_same_for_every_run():
    from rlflow.data import TASKS, Example, held_out_examples
    task = TASKS["addition"]
    held = held_out_examples("addition")
    assert len(held) >= 100 and len({e.prompt for e in held}) == len(held)
    assert held == held_out_examples("addition")  # not the run's seed
    drawn = {e.prompt for seed in range(3) for e in PromptSource(task="addition", seed=seed).take(1000)}
    assert drawn and not drawn & {e.prompt for e in held}
    every = {f"What is {a} + {b}?" for a in range(25) for b in range(25)}
    assert {e.prompt for e in held} == {p for p in every if task.is_held_out(Example(p, ""))}  # the whole split
    assert all(str(eval(e.prompt.removeprefix("What is ").rstrip("?"))) == e.answer for e in held)
    assert task.reward == "math"
