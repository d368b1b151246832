"""Guided decoding (structured output): a grammar compiled once per spec, one matcher per
request, and the token bitmask the sampler applies on the device.

The contract the engine relies on (workers/engine/engine.py, model_runner.py):

- `GrammarCompiler(tokenizer, vocab_size, eos_token_ids=None)` is built once per engine from its
  `Tokenizer` (workers/engine/tokenizer.py; the tiny preset's byte-level one included) and the
  model's logits width `vocab_size` (>= the tokenizer's vocabulary: ids past it are never
  allowed). `eos_token_ids`: the ids that end a sequence (the model config's; default: the
  tokenizer's eos_token, else a token named <eos>, </s>, <|endoftext|>, ...; ids past the
  tokenizer's vocabulary left out); where the grammar may end, the mask allows them all.
- `compiler.matcher(spec)` -> `Matcher` for a `schemas.sampling.GuidedDecoding`; compiled
  grammars are cached by `spec.key`. A spec the grammar engine refuses raises
  `InvalidRequestError(ErrorCode.INVALID_GRAMMAR, message)` (the message never quotes the spec at
  length: it is user data).
- `Matcher.fill_bitmask(bitmask, row)`: writes the allowed next tokens of the matcher's state into
  row `row` of a CPU int32 tensor [rows, bitmask_words(vocab_size)] (bit j of word w allows token
  32 * w + j; end-of-sequence allowed when the grammar may end there).
- `Matcher.accept(token_id) -> bool`: advance by a sampled token (False: the token is not
  allowed, which a correct mask prevents). `Matcher.done`: the grammar has ended (only the end
  of sequence may follow). `Matcher.error`: why it stopped short of its grammar (a refused token,
  or a parser limit the grammar engine hit while computing a mask), else None; such a matcher's
  masks allow only the end of sequence, never nothing.
- `compiler.fill_bitmasks([(matcher, row), ...], bitmask)`: the same for many matchers at once, in
  llguidance's thread pool (the GIL released): what one decode step's rows want on a many-core host.
- `apply_bitmask(logits, bitmask, rows)`: on the device, logits[rows[i], t] = -inf where bit t
  of bitmask[i] is clear; in place, no host sync.

The grammar engine is llguidance, chosen by measurement (bench/bench_grammar.py,
bench/results/2026-12-02-grammar-cpu.md: SmolLM2-135M's tokenizer, 16 JSON schemas, json_object, a
regex and a choice, on the 2-core development CPU, busy). The deciding number, one decode step's 64
masks (64 rows over 18 specs): llguidance p50 0.7-1.7 ms, p99 2.0-2.6 ms on the quieter runs, inside
the H200's b64 TPOT (4.4 ms FP8, 6.8 ms bf16), so the host fills them while the device runs the
forward; xgrammar 0.45-0.75 ms at p50 but 11-26 ms at p99 (numeric bounds: 10-24 ms for one mask),
outlines-core about 2 / 4-7 ms. Of the three only llguidance refuses what it cannot enforce
(uniqueItems, not, if/then: by name) rather than accepting the schema and letting invalid output
through (xgrammar: not, if/then; outlines-core: five schemas); it has no dependencies (xgrammar
needs torch, transformers and apache-tvm-ffi) and validates a grammar without a tokenizer (the
API's check, under 1.5 ms). Its cost: 0.3-0.6 s to index a 49k vocabulary once per engine
(LLTokenizer). Not measured yet on the H200 host (16 cores) nor the apply on the device.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from schemas.grammar import MAX_MESSAGE_CHARS, GrammarError, grammar_of, refusal
from schemas.job import ErrorCode
from schemas.sampling import GuidedDecoding
from workers.engine.errors import InvalidRequestError
from workers.engine.tokenizer import Tokenizer

_EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask."""
    return (vocab_size + 31) // 32


def default_eos_ids(tokenizer: Tokenizer) -> list[int]:
    """The tokenizer's end-of-sequence id: its eos_token, else the first of the usual names it has."""
    names = [tokenizer.special["eos_token"]] if "eos_token" in tokenizer.special else list(_EOS_NAMES)
    for name in names:
        i = tokenizer._tok.token_to_id(name)
        if i is not None:
            return [i]
    raise ValueError("guided decoding: the tokenizer names no end-of-sequence token; pass eos_token_ids")


class Matcher:
    """One request's place in its grammar: the mask of its next tokens, advanced token by token."""

    __slots__ = ("_eos", "_m", "_words")

    def __init__(self, m: Any, eos: Sequence[int], words: int) -> None:
        self._m = m  # llguidance.LLMatcher
        self._eos = tuple(eos)
        self._words = words

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` (CPU int32 [rows, words]): the tokens allowed next."""
        # bitmask: [R, W] int32 on the CPU; row: [W] written in place
        v = _row(bitmask, row, self._words)
        if not self._m.is_error():
            self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)  # GIL released while it runs
            if not self._m.is_error():
                return
        # refused a token before, or the engine gave up on this step (a parser limit): only the end,
        # never a mask of nothing (the engine fails the request: see `error`)
        _only_end(v, self._eos)

    @property
    def error(self) -> str | None:
        """Why the matcher stopped short of its grammar (a refused token, a parser limit hit), or
        None: the engine's first line, bounded (no tokens, no grammar)."""
        if not self._m.is_error():
            return None
        first = (self._m.get_error() or "the grammar engine stopped").strip().split("\n", 1)[0]
        return first[:MAX_MESSAGE_CHARS]

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it (the matcher then
        stays refused: its masks allow only the end)."""
        return bool(self._m.consume_token(token_id))

    @property
    def done(self) -> bool:
        """The grammar has ended: only the end of sequence may follow."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """The output so far is a whole sentence of the grammar (it may end here)."""
        return bool(self._m.is_accepting())


def _only_end(v: torch.Tensor, eos: Sequence[int]) -> None:
    v.zero_()
    for t in eos:
        v[t // 32] |= _bit(t % 32)


def _bit(j: int) -> int:
    """Bit j of an int32 word, as a Python int that fits an int32 (bit 31 is the sign)."""
    return -(1 << 31) if j == 31 else 1 << j


def _row(bitmask: torch.Tensor, row: int, words: int) -> torch.Tensor:
    return _checked(bitmask, words)[row]


def _checked(bitmask: torch.Tensor, words: int) -> torch.Tensor:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError(f"a token bitmask is a CPU int32 [rows, words] tensor, not {bitmask.dtype} {tuple(bitmask.shape)} "
                         f"on {bitmask.device}")
    if bitmask.shape[1] != words or not bitmask.is_contiguous():
        raise ValueError(f"a token bitmask row has {words} contiguous words here, not {bitmask.shape[1]}")
    return bitmask


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    """The random presets' tokenizer (Tokenizer.byte_level): ids 0-255 are the 256 bytes."""
    from workers.engine.tokenizer import _bytes_to_unicode

    chars = _bytes_to_unicode()
    return tokenizer.vocab_size <= 258 and all(tokenizer._tok.id_to_token(b) == chars[b] for b in range(256))


class _ByteVocab:
    """A byte-level vocabulary as llguidance's TokenizerWrapper reads one: token i < 256 is byte i,
    every other id up to the logits' width a special token (the ends among them)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, ends: Sequence[int]) -> None:
        self.tokens = [bytes([b]) for b in range(256)] + [b"\xff<|special_%d|>" % i for i in range(256, vocab_size)]
        for t in ends:
            self.tokens[t] = b"\xff<|end_%d|>" % t
        self.eos_token_id = ends[0]
        self.bos_token_id = tokenizer._tok.token_to_id("<bos>")
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


class GrammarCompiler:
    """Compiles guided-decoding specs against one tokenizer; the compiled grammars are kept, least
    recently used first out, by the spec's key."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int] | None = None,
                 *, cache_size: int = 256, threads: int | None = None) -> None:
        import llguidance

        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"guided decoding: the logits' width ({vocab_size}) is below the tokenizer's "
                             f"vocabulary ({tokenizer.vocab_size})")
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        ends = [t for t in eos_token_ids or () if 0 <= t < vocab_size]
        if any(t >= tokenizer.vocab_size for t in ends) and _is_byte_level(tokenizer):
            # a random preset's byte-level tokenizer under a real model's ends (llama3-8b: 128001...):
            # its 256 bytes, and every other id a special token, the ends among them
            self.eos_token_ids = ends
            self._tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(tokenizer, vocab_size, ends)),
                                               eos_token=ends)
        else:
            # llguidance reads the tokenizer's own JSON (0.3-0.6 s for SmolLM2's 49k tokens on the
            # 2-core CPU) and knows its ids only: an end past them is left out (none left: the
            # tokenizer's own); ids past the tokenizer's up to vocab_size are never allowed
            self.eos_token_ids = [t for t in ends if t < tokenizer.vocab_size] or default_eos_ids(tokenizer)
            self._tok = llguidance.LLTokenizer(tokenizer._tok.to_str(), n_vocab=vocab_size,
                                               eos_token=self.eos_token_ids)
        # a parser limit hit in a step (a pathological regex) errs the matcher with a short message:
        # the verbose one quotes the tokens so far and the grammar (user data)
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key -> an LLMatcher at its start, or a refusal
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._threads = threads or max(1, min(8, (os.cpu_count() or 2) - 1))
        self._executor: Any = None
        self.compiled = 0  # grammars compiled (cache misses)

    def matcher(self, spec: GuidedDecoding) -> Matcher:
        """A matcher at the start of the spec's grammar. Raises InvalidRequestError(invalid_grammar)."""
        key = spec.key
        with self._lock:
            start = self._cache.get(key)
            if start is not None:
                self._cache.move_to_end(key)
        if start is None:
            start = self._compile(spec)
            with self._lock:
                self._cache[key] = start
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(start, str):
            raise InvalidRequestError(ErrorCode.INVALID_GRAMMAR, start)
        return Matcher(start.deep_copy(), self.eos_token_ids, self.words)

    def _compile(self, spec: GuidedDecoding) -> Any:
        import llguidance

        self.compiled += 1
        try:
            grammar = grammar_of(spec)
        except GrammarError as exc:
            return str(exc)
        m = llguidance.LLMatcher(self._tok, grammar, log_level=0, limits=self._limits)
        if m.is_error():
            return refusal(spec, m.get_error())
        return m

    def fill_bitmasks(self, matchers: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """Each (matcher, row)'s mask into its row of `bitmask`, in parallel threads."""
        import llguidance

        _checked(bitmask, self.words)
        live = [(m._m, r) for m, r in matchers if not m._m.is_error()]
        if live:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=self._threads)
            self._executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), self.words * 4, bitmask.shape[0])
        for m, r in matchers:  # refused before, or now: only the end
            if m._m.is_error():
                _only_end(bitmask[r], self.eos_token_ids)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf wherever bit t of bitmask[i] is clear, in place, on the logits'
    device with no host sync (pure torch: the bits unpacked there). Token ids past the bitmask's
    words are masked too."""
    # logits: [N, V] float; bitmask: [G, W] int32 (on logits' device); rows: [G] int64
    if rows.numel() == 0:
        return
    g, w = bitmask.shape
    v = logits.shape[1]
    bits = torch.arange(8, device=logits.device, dtype=torch.uint8)
    # int32 words as little-endian bytes (x86 and CUDA): token 32w + 8b + j is bit j of byte 4w + b
    by = bitmask.contiguous().view(torch.uint8)  # [G, 4W]
    allowed = ((by.unsqueeze(-1) >> bits) & 1).view(g, 32 * w)  # [G, 32W] uint8
    if 32 * w >= v:
        allowed = allowed[:, :v]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, v - 32 * w))
    sub = logits.index_select(0, rows)  # [G, V]
    sub.masked_fill_(allowed == 0, float("-inf"))
    logits.index_copy_(0, rows, sub)
