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
