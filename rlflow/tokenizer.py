"""Tokenizers behind one small interface: a Hugging Face ``tokenizer.json`` (through the ``tokenizers``
library) for real checkpoints, and a built-in character tokenizer for the built-in tasks."""

from __future__ import annotations

import json
import os
import shutil

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class CharTokenizer:
    """One token per character of ``CHARS``; ids 0..2 are <pad>, <bos>, <eos>. Vocab size 32."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789+-*=:,;?#()afimrstx"  # digits, operators and the letters the task names use

    def __init__(self):
        self.vocab = list(self.SPECIALS) + list(self.CHARS)
        self._ids = {c: i for i, c in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        bad = sorted(set(text) - set(self.CHARS))
        if bad:
            raise ValueError(f"CharTokenizer.encode: characters {bad} are not in the vocabulary {self.CHARS!r}")
        return [self._ids[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        """Specials and ids outside the vocabulary (a model with a larger vocab can sample them) are
        dropped, as transformers' tokenizers drop unknown ids."""
        n = len(self.vocab)
        return "".join(self.vocab[i] for i in ids if len(self.SPECIALS) <= i < n)

    def save(self, path: str) -> None:
        """``tokenizer.json`` and ``tokenizer_config.json`` in ``path``: the same tokenizer for
        ``HFTokenizer`` and transformers (one token per character, the same ids and specials)."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(self.vocab)}, unk_token="<pad>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens(list(self.SPECIALS))
        tok.save(os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<bos>",
                       "eos_token": "<eos>"}, f, indent=2)


class HFTokenizer:
    """A transformers-style tokenizer directory (tokenizer.json [+ tokenizer_config.json])."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer
        f = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.exists(f):
            raise FileNotFoundError(f"HFTokenizer: {f} does not exist")
        self._tok = Tokenizer.from_file(f)
        self._files = [p for p in (os.path.join(os.path.dirname(f), n) for n in TOKENIZER_FILES) if os.path.exists(p)]
        conf = {}
        cfile = os.path.join(os.path.dirname(f), "tokenizer_config.json")
        if os.path.exists(cfile):
            with open(cfile) as fh:
                conf = json.load(fh)

        def tid(key, default):
            name = conf.get(key)
            if isinstance(name, dict):
                name = name.get("content")
            i = self._tok.token_to_id(name) if name else None
            return default if i is None else i

        eos = tid("eos_token", self._tok.token_to_id("<|endoftext|>"))
        if eos is None:  # id 0 was used: generation then stops at whatever token 0 is
            raise ValueError(f"HFTokenizer: {cfile} names no eos_token known to {f} (and the vocabulary has no "
                             "<|endoftext|>); set eos_token in tokenizer_config.json")
        self.eos_id = eos
        self.pad_id = tid("pad_token", self.eos_id)
        self.bos_id = tid("bos_token", None)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def save(self, path: str) -> None:
        """Copy the tokenizer's files into ``path``."""
        for f in self._files:
            shutil.copy(f, path)


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def find_chat_template(path: str) -> str | None:
    """The chat template of a model directory, found where transformers looks: ``chat_template.jinja``, the
    ``default`` of ``chat_templates/*.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a string, or
    a list of {name, template}); None when it has none."""
    f = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(f):
        with open(f, encoding="utf-8") as fh:
            return fh.read()
    f = os.path.join(path, "chat_templates", "default.jinja")
    if os.path.isfile(f):
        with open(f, encoding="utf-8") as fh:
            return fh.read()
    t = _tokenizer_config(path).get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) else None


def _tokenizer_config(path: str) -> dict:
    f = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(f):
        return {}
    with open(f, encoding="utf-8") as fh:
        return json.load(fh)


class ChatTemplate:
    """A model directory's chat template, rendered as transformers' ``apply_chat_template(messages,
    tokenize=False, add_generation_prompt=True)`` renders it: by transformers when it is installed, else by
    jinja2 in the environment transformers builds (sandboxed; trim_blocks, lstrip_blocks, loopcontrols;
    ``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML) with the directory's special
    tokens (``bos_token``, ``eos_token``, ...) as variables and messages' None-valued keys dropped."""

    def __init__(self, path: str):
        self.path = path
        text = find_chat_template(path)
        if text is None:
            raise ValueError(f"{path}: no chat template (chat_template.jinja, or chat_template in "
                             "tokenizer_config.json)")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            self._hf = None
            self._template, self._tokens = _jinja_template(path, text), _special_tokens(path)
            return
        try:
            self._hf = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: transformers cannot load the tokenizer to render its chat template "
                             f"({e})") from None

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The text of one conversation, ending with the assistant's generation prompt (unless
        ``add_generation_prompt`` is False); ``tools``: the schemas of the tools the model may call
        (``envs.tools.schema``), which the template shows it."""
        import jinja2
        try:
            if self._hf is not None:
                return self._hf.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt)
            chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
            return self._template.render(messages=chat, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._tokens)
        except jinja2.TemplateError as e:
            raise ValueError(f"{self.path}: the chat template refused messages {list(messages)!r:.300}: {e}") from None

    def continuation(self, messages: list[dict], *, closed: bool) -> str:
        """The text that follows a finished assistant turn to add ``messages`` (an environment's user or tool
        messages) and open the next assistant turn, as the template renders a whole conversation: what follows
        an assistant message's content in a conversation that goes on with ``messages`` (the incremental form:
        the history is never rendered again, so a template that renders earlier turns otherwise once others
        follow, as Qwen3's drops their reasoning, cannot change tokens already sampled). ``closed``: the turn
        ended with the end-of-sequence token the model samples, which is where the template's end of an assistant
        message starts; that text is then not repeated."""
        marker = "\u2063a"
        conv = [{"role": "user", "content": "\u2063u"}, {"role": "assistant", "content": marker}, *messages]
        text = self.render(conv, add_generation_prompt=True)
        if text.count(marker) != 1:
            raise ValueError(f"{self.path}: the chat template does not render an assistant message's content once "
                             "as it is; its incremental form is undefined")
        tail = text[text.index(marker) + len(marker):]  # e.g. "<|im_end|>\n<|im_start|>user\n...<|im_start|>assistant\n"
        if closed and self.eos_token and tail.startswith(self.eos_token):
            tail = tail[len(self.eos_token):]
        return tail

    @property
    def eos_token(self) -> str | None:
        return self._hf.eos_token if self._hf is not None else self._tokens.get("eos_token")


def _special_tokens(path: str) -> dict[str, str]:
    """The named special tokens as strings (tokenizer_config.json, then special_tokens_map.json for those it lacks)."""
    conf = _tokenizer_config(path)
    f = os.path.join(path, "special_tokens_map.json")
    if os.path.isfile(f):
        with open(f, encoding="utf-8") as fh:
            conf = {**json.load(fh), **{k: v for k, v in conf.items() if v is not None}}
    out = {}
    for k in SPECIAL_TOKENS:
        v = conf.get(k)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[k] = v
    return out


def _jinja_template(path: str, text: str):
    """``text`` compiled in transformers' chat template environment (``chat_template_utils``)."""
    from datetime import datetime
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError(f"{path}: rendering its chat template needs transformers or jinja2 "
                         "(pip install jinja2)") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{path}: the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
