"""Tokenizers: a checkpoint's own `tokenizer.json`, or a byte-level one for random presets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from workers.engine.chat_template import ChatTemplateError, render_chat
from workers.engine.errors import CheckpointError


class Tokenizer:
    """Text <-> token ids through the `tokenizers` library."""

    def __init__(self, tok: HFTokenizer, chat_template: str | None = None,
                 special: dict[str, Any] | None = None) -> None:
        self._tok = tok
        self.chat_template = chat_template
        self.special = special or {}

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        p = Path(path)
        f = p / "tokenizer.json"
        if not f.is_file():
            raise CheckpointError(f"{p}: no tokenizer.json (only fast tokenizers are supported)")
        cfg_f = p / "tokenizer_config.json"
        cfg = json.loads(cfg_f.read_text()) if cfg_f.is_file() else {}
        template = cfg.get("chat_template")
        tmpl_f = p / "chat_template.jinja"
        if template is None and tmpl_f.is_file():
            template = tmpl_f.read_text()
        special = {}
        for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = cfg.get(k)
            if isinstance(v, dict):  # a serialized AddedToken
                v = v.get("content")
            if isinstance(v, str):
                special[k] = v
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return cls(HFTokenizer.from_file(str(f)), template, special)

    @classmethod
    def byte_level(cls, bos_id: int | None = 256, eos_id: int | None = 257) -> Tokenizer:
        """A tokenizer of the 256 byte values (ids 0..255), plus <bos> and <eos> special tokens."""
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        byte_chars = _bytes_to_unicode()
        vocab = {byte_chars[b]: b for b in range(256)}
        assert set(vocab) == set(alphabet)
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        specials = []
        if bos_id is not None:
            specials.append(("<bos>", bos_id))
        if eos_id is not None:
            specials.append(("<eos>", eos_id))
        for name, want in specials:
            tok.add_special_tokens([name])
            got = tok.token_to_id(name)
            if got != want:
                raise RuntimeError(f"byte-level tokenizer: {name} got id {got}, wanted {want}")
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_each(self, ids: list[int]) -> list[str]:
        """Each id decoded alone, special tokens included (log-probabilities name their tokens)."""
        return self._tok.decode_batch([[i] for i in ids], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render chat messages (and the tools the model may call) with the checkpoint's own Jinja
        chat template, in a sandbox.

        The text already holds the template's special tokens (a BOS, for Llama and Mistral):
        encode it with `add_special_tokens=False`, as transformers does. Raises ChatTemplateError.
        """
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt")
        return render_chat(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, special_tokens=self.special,
            tools=tools,
        )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters (ByteLevel's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, tok: Tokenizer, prompt_ids: list[int]) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        # a few prompt tokens of context make the first output token decode with its leading space
        self._ctx = prompt_ids[-4:]
        self.prefix_offset = 0
        self.read_offset = len(self._ctx)
        self.ids = list(self._ctx)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (may be empty)."""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""
