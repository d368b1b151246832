"""Guided decoding (structured output): a grammar compiled once per spec, one matcher per
request, and the token bitmask the sampler applies on the device.

The contract the engine relies on (workers/engine/engine.py, model_runner.py):

- `GrammarCompiler(tokenizer, vocab_size)` is built once per engine from its `Tokenizer`
  (workers/engine/tokenizer.py; the tiny preset's byte-level one included) and the model's logits
  width `vocab_size` (>= the tokenizer's vocabulary: ids past it are never allowed).
- `compiler.matcher(spec)` -> `Matcher` for a `schemas.sampling.GuidedDecoding`; compiled
  grammars are cached by `spec.key`. A spec the grammar engine refuses raises
  `InvalidRequestError(ErrorCode.INVALID_GRAMMAR, message)` (the message never quotes the spec at
  length: it is user data).
- `Matcher.fill_bitmask(bitmask, row)`: writes the allowed next tokens of the matcher's state into
  row `row` of a CPU int32 tensor [rows, bitmask_words(vocab_size)] (bit j of word w allows token
  32 * w + j; end-of-sequence allowed when the grammar may end there).
- `Matcher.accept(token_id) -> bool`: advance by a sampled token (False: the token is not
  allowed, which a correct mask prevents). `Matcher.done`: the grammar has ended (only the end
  of sequence may follow).
- `apply_bitmask(logits, bitmask, rows)`: on the device, logits[rows[i], t] = -inf where bit t
  of bitmask[i] is clear; in place, no host sync.

The grammar engine is llguidance, chosen by measurement (bench/bench_grammar.py,
bench/results/2026-12-02-grammar-cpu.md: SmolLM2-135M's tokenizer, 16 JSON schemas, json_object, a
regex and a choice, on the 2-core development CPU). The deciding number, one decode step's 64 masks
(64 rows over 18 specs): llguidance p50 1.0 ms, p99 2.0 ms, inside the H200's b64 TPOT (4.4 ms FP8,
6.8 ms bf16) even at p99, so the host fills them while the device runs the forward; xgrammar 0.4-0.8
ms at p50 but 11-16 ms at p99 (numeric bounds: 10 ms for one mask), outlines-core 1.9 / 4.0 ms. Of
the three only llguidance refuses what it cannot enforce (uniqueItems, not, if/then: by name) rather
than accepting the schema and letting invalid output through (xgrammar: not, if/then; outlines-core:
five schemas); it has no dependencies (xgrammar needs torch, transformers and apache-tvm-ffi) and
validates a grammar without a tokenizer (the API's cheap check). Its cost: 2.7 s to index a 49k
vocabulary once per engine (LLTokenizer).
"""

from __future__ import annotations


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask."""
    return (vocab_size + 31) // 32
