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
"""

from __future__ import annotations


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask."""
    return (vocab_size + 31) // 32
