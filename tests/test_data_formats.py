"""Datasets in every format the recipe reads, and chat templates rendered exactly as transformers renders them."""

import json
import os
import sys

import pytest
from helpers import recipe_module

from rlflow.data import Example, PromptSource, apply_chat_template, load_examples, load_jsonl, prompt_batch
from rlflow.tokenizer import ChatTemplate, HFTokenizer, find_chat_template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
ROWS = [{"prompt": "2+2=", "answer": "4", "level": 1}, {"prompt": CHAT, "answer": "2", "level": 3}]
WANT = [Example("2+2=", "4", None, {"level": 1}), Example("", "2", tuple(CHAT), {"level": 3})]


@pytest.fixture
def datasets(tmp_path, monkeypatch):
    """The datasets package, its cache (load_dataset converts data files into it) fresh for the test."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return datasets


def test_jsonl_keeps_extra_columns_and_chat_messages(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + json.dumps({"prompt": "3+3=", "answer": 6}) + "\n")
    got = load_examples(str(f))
    assert got[:2] == WANT and got[2] == Example("3+3=", "6", None, {"level": None})  # a missing column is null
    assert load_jsonl(str(f)) == got
    with pytest.raises(ValueError, match=f"{f}: unknown split 'test'; a JSONL file has one split, 'train'"):
        load_examples(str(f), split="test")


def test_parquet_round_trip_through_datasets(datasets, tmp_path):
    f = tmp_path / "d.parquet"
    datasets.Dataset.from_list([ROWS[1], {**ROWS[1], "answer": "3"}]).to_parquet(str(f))
    assert load_examples(str(f)) == [WANT[1], Example("", "3", tuple(CHAT), {"level": 3})]
    assert load_examples(str(f), split="train[:1]") == [WANT[1]]
    with pytest.raises(ValueError, match=f"{f}: Unknown split \"test\""):
        load_examples(str(f), split="test")


def test_parquet_answers_that_are_numbers_convert_by_the_rule_and_lists_are_refused(datasets, tmp_path):
    """A Parquet answer column of numbers or lists was stringified ("[1.0]", "3.0") and scored against that:
    numbers are written in decimal (an integral float as the integer), a list is refused naming the row."""
    f = tmp_path / "n.parquet"
    datasets.Dataset.from_list([{"prompt": "a", "answer": 3.0}, {"prompt": "b", "answer": 2.5}]).to_parquet(str(f))
    assert [e.answer for e in load_examples(str(f))] == ["3", "2.5"]
    g = tmp_path / "l.parquet"
    datasets.Dataset.from_list([{"prompt": "a", "answer": [1.0]}]).to_parquet(str(g))
    with pytest.raises(ValueError, match=f"{g}: row 0: key 'answer' is a list \\(\\[1.0\\]\\); answers are text or a number"):
        load_examples(str(g))
    h = tmp_path / "b.jsonl"
    h.write_text(json.dumps({"prompt": "a", "answer": True}) + "\n")
    with pytest.raises(ValueError, match=f"{h}:1: key 'answer' is a bool"):
        load_examples(str(h))


def test_json_array_and_csv(datasets, tmp_path):
    f = tmp_path / "d.json"
    f.write_text(json.dumps([{"question": "q1", "answer": 7}, {"question": "q2", "answer": 8}]))
    assert load_examples(str(f)) == [Example("q1", "7"), Example("q2", "8")]  # GSM8K's question column
    c = tmp_path / "d.csv"
    c.write_text("prompt,answer,n\n1+1=,02,NA\n")
    assert load_examples(str(c)) == [Example("1+1=", "02", None, {"n": "NA"})]  # cells stay text


def test_save_to_disk_folders_and_a_folder_of_data_files(datasets, tmp_path):
    ds = datasets.Dataset.from_list([ROWS[0]])
    ds.save_to_disk(str(tmp_path / "one"))
    assert load_examples(str(tmp_path / "one")) == [WANT[0]]
    datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_list([{**ROWS[0], "answer": "5"}])}).save_to_disk(
        str(tmp_path / "two"))
    assert load_examples(str(tmp_path / "two"), split="test")[0].answer == "5"
    with pytest.raises(ValueError, match=r"two: unknown split 'dev'; splits: \['test', 'train'\]"):
        load_examples(str(tmp_path / "two"), split="dev")
    with pytest.raises(ValueError, match="one: unknown split 'dev'; this save_to_disk folder holds one split"):
        load_examples(str(tmp_path / "one"), split="dev")
    (tmp_path / "files" / "data").mkdir(parents=True)
    for split, answer in (("train", "4"), ("test", "9")):
        (tmp_path / "files" / "data" / f"{split}.jsonl").write_text(json.dumps({**ROWS[0], "answer": answer}) + "\n")
    assert load_examples(str(tmp_path / "files"), split="test") == [Example("2+2=", "9", None, {"level": 1})]


@pytest.mark.parametrize("name, content, kw, match", [
    ("d.csv", "prompt,answer\n1+1=,2\n2+2=,\n", {}, r"d.csv: row 1: key 'answer' is null"),
    ("d.csv", "prompt,answer\n1+1=,2\n", {"answer_key": "solution"},
     r"d.csv: split 'train': needs columns 'prompt' \(or 'question'\) and 'solution'; got \['prompt', 'answer'\]"),
    ("d.json", json.dumps([{"prompt": "a", "answer": "1"}, {"prompt": "b"}]), {},
     r"d.json: row 1: key 'answer' is null"),
    ("d.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": "b", "solution": "2"}\n', {},
     r"d.jsonl:2: needs keys 'prompt' \(or 'question'\) and 'answer'; got \['prompt', 'solution'\]"),
    ("d.jsonl", json.dumps({"prompt": [{"role": "user"}], "answer": "1"}) + "\n", {},
     r"d.jsonl:1: key 'prompt': message 0 is \{'role': 'user'\}; chat messages are"),
    ("d.json", "[{\"prompt\": \"a\",", {}, r"d.json: cannot read it as json"),
    ("d.txt", "hello", {}, r"d.txt: unknown dataset format '.txt'"),
])
def test_bad_datasets_name_the_file_the_row_and_the_key(name, content, kw, match, datasets, tmp_path):
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_examples(str(f), **kw)


def test_a_missing_path_is_named():
    with pytest.raises(ValueError, match="nope.parquet: no such file or directory"):
        load_examples("nope.parquet")


QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}")
# block tags without '-': the output depends on trim_blocks / lstrip_blocks; tojson must not escape HTML
PLAIN = """{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if loop.index > 4 %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if message.role == 'system' %}
<<SYS>>{{ message.content | tojson }}<</SYS>>
    {% else %}
{{ message.role }}: {{ message.content }}
    {% endif %}
{% endfor %}
({{ ns.n }} messages)
{% if add_generation_prompt %}
assistant:
{% endif %}"""
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    CHAT,
    [{"role": "user", "content": "<b>café</b> & \"quotes\""},
     {"role": "assistant", "content": "ok", "tool_calls": None},
     {"role": "user", "content": "again\nwith a newline"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "",
      "tool_calls": [{"function": {"name": "get", "arguments": {"city": "Zürich"}}}]},
     {"role": "tool", "content": "sunny"}, {"role": "user", "content": "thanks"}],
]


def model_dir(path, template: str, *, in_config: bool = False) -> str:
    """A tokenizer directory as transformers saves it, with ``template`` in chat_template.jinja (or, as older
    checkpoints have it, in tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + ["hi", "user", "1+1="])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = template
    fast.save_pretrained(str(path))
    if in_config:
        os.remove(path / "chat_template.jinja")
        conf = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": template}))
    return str(path)


@pytest.mark.parametrize("template", [QWEN25, MISTRAL, PLAIN], ids=["qwen2.5", "mistral", "plain-blocks"])
@pytest.mark.parametrize("in_config", [False, True], ids=["jinja-file", "tokenizer-config"])
def test_chat_template_renders_as_transformers_with_and_without_it(template, in_config, tmp_path, monkeypatch):
    from transformers import AutoTokenizer
    d = model_dir(tmp_path / "m", template, in_config=in_config)
    assert find_chat_template(d) == template
    hf = AutoTokenizer.from_pretrained(d)
    convs = [c for c in CONVERSATIONS if template != MISTRAL or [m["role"] for m in c] == ["user"]]
    want = [hf.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    ours = ChatTemplate(d)
    monkeypatch.setitem(sys.modules, "transformers", None)  # jinja2 alone, in transformers' environment
    alone = ChatTemplate(d)
    assert ours._hf is not None and alone._hf is None
    assert [ours.render(c) for c in convs] == want == [alone.render(c) for c in convs]
    if template == QWEN25:
        assert want[0] == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                           "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    if template == MISTRAL:
        for t in (ours, alone):
            with pytest.raises(ValueError, match=f"{d}: the chat template refused messages .*Conversation roles must "
                                                 "alternate"):
                t.render(CHAT)


def test_examples_get_the_system_prompt_and_one_bos(tmp_path):
    d = model_dir(tmp_path / "m", MISTRAL.replace("(message['role'] == 'user') != (loop.index0 % 2 == 0)", "false")
                  .replace("{% if message['role'] == 'user' %}", "{% if message['role'] != 'assistant' %}"))
    t = ChatTemplate(d)
    got = apply_chat_template([Example("hi", "1"), WANT[1]], t, system_prompt="Sys")
    assert got[0].messages == ({"role": "system", "content": "Sys"}, {"role": "user", "content": "hi"})
    assert got[0].prompt == "<s>[INST] Sys [/INST][INST] hi [/INST]"
    assert got[1].messages == tuple(CHAT)  # its own system message is kept
    assert apply_chat_template(got, t) == got  # rendering again changes nothing
    tok = HFTokenizer(d)
    ids = prompt_batch(got[:1], tok).prompt_ids_BTp[0].tolist()
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id  # the template wrote it; no second one
    assert prompt_batch([Example("hi", "1")], tok).prompt_ids_BTp[0, 0] == tok.bos_id  # no template: BOS first
    qwen = ChatTemplate(model_dir(tmp_path / "q", QWEN25))
    assert tok.bos_id not in prompt_batch(apply_chat_template(got[:1], qwen), tok).prompt_ids_BTp[0].tolist()
    with pytest.raises(ValueError, match="an example in chat form has no prompt text"):
        prompt_batch([WANT[1]], tok)


def test_a_source_renders_each_batch_it_hands_out(tmp_path):
    t = ChatTemplate(model_dir(tmp_path / "m", QWEN25))
    src = PromptSource(examples=WANT, seed=0, transform=lambda b: apply_chat_template(b, t))
    got = sorted(src.take(2), key=lambda e: e.answer)
    assert [e.prompt for e in got] == [t.render(CHAT), t.render([{"role": "user", "content": "2+2="}])]


def test_recipe_renders_a_chat_dataset_with_the_models_template(tmp_path):
    """--model's chat template with --system-prompt on a messages dataset: the prompts the model is given are
    transformers' renderings."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM
    d = model_dir(tmp_path / "model", QWEN25)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=8, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                       num_experts=2, num_experts_per_tok=1, eos_token_id=2)).save_pretrained(d)
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": p}], "answer": "2"}) + "\n"
                         for p in ("hi", "1+1= hi")))
    recipe = recipe_module()
    flags = ["--model", d, "--dataset", str(f), "--world", "1", "--steps", "1", "--prompts-per-step", "2",
             "--group-size", "2", "--max-new-tokens", "2"]
    (m,) = recipe.main(flags + ["--system-prompt", "hi"])
    hf = AutoTokenizer.from_pretrained(d)
    n = sum(len(hf.apply_chat_template([{"role": "system", "content": "hi"}, {"role": "user", "content": p}],
                                       add_generation_prompt=True, return_dict=False)) for p in ("hi", "1+1= hi"))
    assert m["prompt_tokens"] == 2 * n  # G samples of each prompt
    with pytest.raises(SystemExit):
        recipe.parse_args(flags + ["--no-chat-template"])




@pytest.mark.parametrize("flags, line", [
    (["--prompt-key", "q"], "--prompt-key q: needs --dataset"),
    (["--system-prompt", "Be brief."], "--system-prompt Be brief.: needs a chat template"),
    (["--dataset", "{chat}"], "--dataset {chat}: its prompts are chat messages (row 0, 1 in all); they need a chat template"),
    (["--dataset", "{chat}", "--answer-key", "solution"], "--dataset {chat}: {chat}:1: needs keys"),
])
def test_bad_data_flags_are_one_line_naming_the_flag(flags, line, tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": CHAT, "answer": "2"}) + "\n")
    with pytest.raises(SystemExit) as e:
        recipe_module().parse_args([f.format(chat=chat) for f in flags])
    assert e.value.code == 2
    assert line.format(chat=chat) in capsys.readouterr().err.strip().splitlines()[-1]
