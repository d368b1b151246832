"""The grammar engine's side of guided decoding (workers/engine/guided.py, schemas/grammar.py).

Seeded random walks through each spec's masks (a random allowed token each step, now and then one
that closes a string or a bracket, so walks end), on the tiny preset's byte-level tokenizer and on
SmolLM2-135M's: every walk that ends by the grammar's own end gives text in the language (JSON that
validates against its schema, a regex match, one of the choices); the masks never allow ids past
the tokenizer's vocabulary and, at the grammar's end, allow only the end-of-sequence ids. Specs the
engine cannot enforce are refused with invalid_grammar, by the engine and by the tokenizer-free
check alike. apply_bitmask against a slow reference.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from schemas.grammar import grammar_problem, regex_literal
from schemas.job import ErrorCode
from schemas.sampling import GuidedDecoding
from workers.engine.errors import InvalidRequestError
from workers.engine.guided import GrammarCompiler, Matcher, apply_bitmask, bitmask_words
from workers.engine.tokenizer import Tokenizer

SCHEMAS: dict[str, dict] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                              "ok": {"type": "boolean"}},
             "required": ["name", "age", "ok"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"id": {"type": "integer"}, "score": {"type": "number"},
                                                  "note": {"type": "string"}, "tag": {"type": "null"}},
                 "required": ["id"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}}, "required": ["user"],
        "additionalProperties": False},
    "array": {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
        "additionalProperties": False},
    "top_array": {"type": "array", "items": {"type": "number"}, "maxItems": 5},
    "enum": {"type": "object", "properties": {"status": {"enum": ["open", "closed", "on hold"]},
                                              "level": {"enum": [1, 2, 3, None]}, "kind": {"const": "ticket"}},
             "required": ["status", "level", "kind"], "additionalProperties": False},
    "formats": {"type": "object", "properties": {
        "id": {"type": "string", "format": "uuid"}, "day": {"type": "string", "format": "date"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "short": {"type": "string", "minLength": 2, "maxLength": 5}},
        "required": ["id", "day", "code", "short"], "additionalProperties": False},
    "anyof": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "integer"}, {"type": "null"}]},
        "shape": {"oneOf": [
            {"type": "object", "properties": {"r": {"type": "number"}}, "required": ["r"], "additionalProperties": False},
            {"type": "object", "properties": {"w": {"type": "integer"}, "h": {"type": "integer"}},
             "required": ["w", "h"], "additionalProperties": False}]}},
        "required": ["value", "shape"], "additionalProperties": False},
    "bounds": {"type": "object", "properties": {
        "pct": {"type": "integer", "minimum": 0, "maximum": 100},
        "temp": {"type": "number", "exclusiveMinimum": -50, "maximum": 60},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "required": ["pct", "temp", "tags"], "additionalProperties": False},
    "dict": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    "refs": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                              "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
             "required": ["a", "b"], "additionalProperties": False},
    "recursive": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
    "types": {"type": "object", "properties": {"x": {"type": ["integer", "string"]}, "s": {"type": "string"}},
              "required": ["x", "s"], "additionalProperties": False},
    "extra_allowed": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "maxProperties": 3},
    "unicode": {"type": "object", "properties": {"名前": {"type": "string"}, "emoji \U0001f600": {"type": "boolean"}},
                "required": ["名前", "emoji \U0001f600"], "additionalProperties": False},
}
REGEX = r"\(?[0-9]{3}\)? ?[0-9]{3}-[0-9]{4}( ext [0-9]{1,4})?"
CHOICES = ["positive", "negative", "neutral (see notes)", "a|b*c [x]", "naïve \\ \"quoted\""]
REFUSED = {
    "unique_items": GuidedDecoding(kind="json_schema", json_schema={"type": "array", "uniqueItems": True}),
    "not": GuidedDecoding(kind="json_schema", json_schema={"type": "object", "properties": {"x": {"not": {"type": "string"}}}}),
    "if_then": GuidedDecoding(kind="json_schema", json_schema={"if": {"type": "object"}, "then": {"required": ["a"]}}),
    "bad_type": GuidedDecoding(kind="json_schema", json_schema={"type": "objectt"}),
    "lookahead_pattern": GuidedDecoding(kind="json_schema", json_schema={"type": "string", "pattern": "(?=a)a+"}),
    "unsatisfiable": GuidedDecoding(kind="json_schema", json_schema={"type": "string", "minLength": 5, "maxLength": 2}),
    "bad_type_in_list": GuidedDecoding(kind="json_schema", json_schema={"type": ["string", "Secret"]}),
    "unclosed_regex": GuidedDecoding(kind="regex", regex="ab(c"),
    "backreference": GuidedDecoding(kind="regex", regex=r"(a)\1"),
}


def all_specs() -> list[tuple[str, GuidedDecoding]]:
    out = [(n, GuidedDecoding(kind="json_schema", json_schema=s)) for n, s in SCHEMAS.items()]
    out += [("json_object", GuidedDecoding(kind="json_object")), ("regex", GuidedDecoding(kind="regex", regex=REGEX)),
            ("choice", GuidedDecoding(kind="choice", choices=CHOICES))]
    return out


def in_language(name: str, spec: GuidedDecoding, text: str) -> bool:
    if spec.kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if spec.kind == "choice":
        return text in CHOICES
    try:
        value = json.loads(text)
    except ValueError:
        return False
    schema = {"type": "object"} if spec.kind == "json_object" else spec.json_schema
    try:
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError:
        return False
    return True


class Walk:
    """A tokenizer's walks: which ids close something (a quote, bracket, brace, comma)."""

    def __init__(self, tok: Tokenizer, compiler: GrammarCompiler) -> None:
        self.tok, self.c = tok, compiler
        n = tok.vocab_size
        self.closing = np.zeros(compiler.vocab_size, dtype=bool)
        for i, t in enumerate(tok.decode_each(list(range(n)))):
            self.closing[i] = any(ch in t for ch in '"}],')
        self.closing[compiler.eos_token_ids] = True
        self.real = np.zeros(compiler.vocab_size, dtype=bool)  # the ids a mask may allow
        self.real[:n] = True
        self.real[compiler.eos_token_ids] = True

    def allowed(self, bitmask: torch.Tensor, row: int) -> np.ndarray:
        bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")
        return bits[: self.c.vocab_size].astype(bool)

    def run(self, spec: GuidedDecoding, seed: int, max_tokens: int = 400) -> str | None:
        """One walk: the text when the grammar ended (its end-of-sequence chosen, or nothing else
        allowed), None at max_tokens. Asserts the masks' invariants on the way."""
        rng = np.random.default_rng(seed)
        m = self.c.matcher(spec)
        bm = torch.zeros((3, self.c.words), dtype=torch.int32)
        eos = set(self.c.eos_token_ids)
        out: list[int] = []
        for _ in range(max_tokens):
            m.fill_bitmask(bm, 2)
            ok = self.allowed(bm, 2)
            assert not (ok & ~self.real).any(), "an id past the tokenizer's vocabulary allowed"
            ids = np.flatnonzero(ok)
            assert len(ids), "a mask that allows nothing"
            ends = eos & set(ids.tolist())
            assert not ends or m.accepting, "the end allowed where the grammar may not end"
            assert ends in (set(), eos), "only some of the end-of-sequence ids allowed"
            if m.done:
                assert set(ids.tolist()) == eos, "the grammar ended but the mask allows more than its end"
                return self.tok.decode(out)
            if rng.random() < 0.3 and (ok & self.closing).any():
                ids = np.flatnonzero(ok & self.closing)
            t = int(ids[rng.integers(len(ids))])
            if t in eos:
                return self.tok.decode(out)
            assert m.accept(t), "the matcher refused a token its own mask allowed"
            out.append(t)
        return None


@pytest.fixture(scope="module")
def tiny() -> tuple[Tokenizer, GrammarCompiler]:
    tok = Tokenizer.byte_level(256, 257)
    return tok, GrammarCompiler(tok, 512)  # the tiny preset's logits are 512 wide


@pytest.fixture(scope="module")
def smollm2() -> tuple[Tokenizer, GrammarCompiler]:
    from workers.engine.downloads import ensure_model

    path = ensure_model("smollm2-135m")
    tok = Tokenizer.from_dir(path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return tok, GrammarCompiler(tok, vocab)


def _walk_all(tok: Tokenizer, compiler: GrammarCompiler, walks: int) -> None:
    w = Walk(tok, compiler)
    ended = 0
    for k, (name, spec) in enumerate(all_specs()):
        texts = [w.run(spec, seed=100 * k + j) for j in range(walks)]
        done = [t for t in texts if t is not None]
        assert done, f"{name}: no walk of {walks} reached the grammar's end"
        for t in done:
            assert in_language(name, spec, t), (name, t)
        ended += len(done)
    assert ended >= 0.8 * walks * len(all_specs())


def test_walks_end_in_the_language_byte_level(tiny):
    _walk_all(*tiny, walks=4)


def test_a_preset_byte_level_tokenizer_under_a_real_models_ends():
    """llama3-8b's preset: the byte-level tokenizer (no special tokens) under Llama-3's logits and
    end ids (past the tokenizer's 256): the walks end in their language, only by those ends."""
    tok = Tokenizer.byte_level(None, None)
    compiler = GrammarCompiler(tok, 128256, eos_token_ids=[128001, 128008, 128009])
    assert compiler.eos_token_ids == [128001, 128008, 128009] and compiler.words == 4008
    _walk_all(tok, compiler, walks=2)
    # a byte-level tokenizer with the ends inside it keeps its own JSON (the tiny preset's <eos>)
    assert GrammarCompiler(Tokenizer.byte_level(256, 257), 512, eos_token_ids=[257]).eos_token_ids == [257]


@pytest.mark.slow
def test_walks_end_in_the_language_smollm2(smollm2):
    tok, compiler = smollm2
    assert compiler.eos_token_ids == [tok._tok.token_to_id("<|im_end|>")]
    _walk_all(tok, compiler, walks=4)


@pytest.mark.slow
def test_a_parser_limit_mid_walk_leaves_only_the_end(smollm2):
    """A regex whose lexer grows past llguidance's limits a few tokens in: the matcher errs, its
    masks allow only the end (never nothing: the sampler would have no token), and its error is
    one short line without the tokens or the grammar."""
    tok, compiler = smollm2
    w = Walk(tok, compiler)
    m = compiler.matcher(GuidedDecoding(kind="regex", regex="(([a-z]{1,50}){1,50}){1,50}"))
    bm = torch.zeros((1, compiler.words), dtype=torch.int32)
    rng = np.random.default_rng(0)
    for _ in range(40):
        m.fill_bitmask(bm, 0)
        if m.error is not None:
            break
        ids = np.flatnonzero(w.allowed(bm, 0))
        assert m.accept(int(ids[rng.integers(len(ids))]))
    assert m.error is not None and "too many" in m.error, m.error
    assert "\n" not in m.error and "[a-z]" not in m.error and len(m.error) < 200
    assert np.flatnonzero(w.allowed(bm, 0)).tolist() == compiler.eos_token_ids
    par = torch.zeros((2, compiler.words), dtype=torch.int32)
    compiler.fill_bitmasks([(m, 1)], par)
    assert torch.equal(par[1], bm[0])


def test_choice_and_regex_texts_are_exact(tiny):
    """The walk reaches each choice, special characters literal (regex_literal)."""
    tok, compiler = tiny
    w = Walk(tok, compiler)
    spec = GuidedDecoding(kind="choice", choices=CHOICES)
    seen = {w.run(spec, seed=s) for s in range(60)}
    assert seen == set(CHOICES)
    for c in CHOICES:
        assert re.fullmatch(regex_literal(c), c)


def test_forced_text_through_accept(tiny):
    """Tokens of a valid output are all accepted and end the grammar; a wrong one is refused, and
    the refused matcher's mask allows only the end."""
    tok, compiler = tiny
    spec = GuidedDecoding(kind="json_schema", json_schema=SCHEMAS["flat"])
    m = compiler.matcher(spec)
    ids = tok.encode('{"name": "Ada", "age": 36, "ok": true}', add_special_tokens=False)
    assert all(m.accept(t) for t in ids)
    assert m.done and m.accepting
    m = compiler.matcher(spec)
    assert m.accept(ord("{")) and m.error is None
    assert not m.accept(ord("x"))  # a key must start with its quote
    assert m.error and m.done
    bm = torch.zeros((1, compiler.words), dtype=torch.int32)
    m.fill_bitmask(bm, 0)
    allowed = np.flatnonzero(np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little"))
    assert allowed.tolist() == [257]
    # compact JSON, one space after ':' and ',' (no free whitespace)
    m = compiler.matcher(spec)
    assert all(m.accept(t) for t in tok.encode('{"name":', add_special_tokens=False))
    assert not m.accept(ord("\n"))


def test_several_end_ids_and_a_wider_vocabulary():
    tok = Tokenizer.byte_level(256, 257)
    compiler = GrammarCompiler(tok, 300, eos_token_ids=[256, 257])  # <bos> ends it too, here
    assert compiler.words == bitmask_words(300) == 10
    m = compiler.matcher(GuidedDecoding(kind="choice", choices=["ok"]))
    bm = torch.zeros((1, 10), dtype=torch.int32)
    for t in tok.encode("ok", add_special_tokens=False):
        m.fill_bitmask(bm, 0)
        assert (np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little")[256:] == 0).all()
        assert m.accept(t)
    m.fill_bitmask(bm, 0)
    assert np.flatnonzero(np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little")).tolist() == [256, 257]
    with pytest.raises(ValueError, match="below the tokenizer"):
        GrammarCompiler(tok, 200)
    # an end past the byte-level tokenizer's ids (a model's): a special token of its own
    wide = GrammarCompiler(tok, 300, eos_token_ids=[299, 256, 900])  # 900: past the logits, left out
    assert wide.eos_token_ids == [299, 256]
    m = wide.matcher(GuidedDecoding(kind="choice", choices=["ok"]))
    assert m.accept(ord("o")) and m.accept(ord("k"))
    m.fill_bitmask(bm, 0)
    assert np.flatnonzero(np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little")).tolist() == [256, 299]
    assert GrammarCompiler(tok, 300, eos_token_ids=[900]).eos_token_ids == [257]  # none left: the tokenizer's <eos>
    with pytest.raises(ValueError, match="a token bitmask row has 10"):
        m.fill_bitmask(torch.zeros((1, 9), dtype=torch.int32), 0)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_specs_are_invalid_grammar(tiny, name):
    spec = REFUSED[name]
    with pytest.raises(InvalidRequestError) as exc:
        tiny[1].matcher(spec)
    assert exc.value.code is ErrorCode.INVALID_GRAMMAR
    assert exc.value.message.startswith("the grammar engine cannot enforce this")
    assert len(exc.value.message) < 420
    for text in (spec.regex, spec.json_schema and json.dumps(spec.json_schema)):
        if text and len(text) > 3:
            assert text not in exc.value.message  # the spec is user data
    if name == "lookahead_pattern":
        assert "(?=a)" not in exc.value.message and "look-around" in exc.value.message
    if name == "unclosed_regex":
        assert "unclosed group" in exc.value.message
    if name == "unsatisfiable":  # the schema's own words (types) are kept: the reason reads whole
        assert "minLength (5) is greater than maxLength (2)" in exc.value.message
    if name == "bad_type_in_list":
        assert "Secret" not in exc.value.message and "Invalid type" in exc.value.message
    problem = grammar_problem(spec)  # the API's check, no tokenizer: the same answer
    assert problem == exc.value.message
    with pytest.raises(InvalidRequestError):  # refused again from the cache
        tiny[1].matcher(spec)


def test_accepted_specs_pass_the_tokenizer_free_check():
    for name, spec in all_specs():
        assert grammar_problem(spec) is None, name


def test_a_refusal_holds_none_of_the_spec():
    spec = GuidedDecoding(kind="regex", regex="secret-(" * 200)
    problem = grammar_problem(spec)
    assert problem is not None and len(problem) <= 400 and "secret" not in problem
    spec = GuidedDecoding(kind="json_schema", json_schema={"properties": {"a": {"type": "Confidential", "pattern": "x"}}})
    problem = grammar_problem(spec)
    assert problem is not None and "Confidential" not in problem and "<...>" in problem


def test_compiled_once_per_key_least_recent_out():
    tok = Tokenizer.byte_level(256, 257)
    c = GrammarCompiler(tok, 512, cache_size=2)
    a1 = GuidedDecoding(kind="json_schema", json_schema={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    a2 = GuidedDecoding(kind="json_schema", json_schema={"required": ["a"], "properties": {"a": {"type": "integer"}}, "type": "object"})
    b = GuidedDecoding(kind="regex", regex="b+")
    d = GuidedDecoding(kind="choice", choices=["d"])
    c.matcher(a1)
    c.matcher(a2)  # the same spec in another key order: the same key
    assert c.compiled == 1
    c.matcher(b)
    c.matcher(a1)  # a is the most recent now
    c.matcher(d)  # b goes
    assert c.compiled == 3
    c.matcher(a1)
    assert c.compiled == 3
    c.matcher(b)
    assert c.compiled == 4
    # matchers of one grammar are independent
    m1, m2 = c.matcher(b), c.matcher(b)
    assert m1.accept(ord("b")) and not m2.done and m1.accepting and not m2.accepting


def test_parallel_fill_equals_row_by_row(tiny):
    tok, compiler = tiny
    specs = [s for _, s in all_specs()]
    rng = np.random.default_rng(5)
    w = Walk(tok, compiler)
    matchers: list[Matcher] = []
    one = torch.zeros((1, compiler.words), dtype=torch.int32)
    for k, spec in enumerate(specs):  # each a few random tokens into its grammar
        m = compiler.matcher(spec)
        for _ in range(k % 5):
            m.fill_bitmask(one, 0)
            ids = np.flatnonzero(w.allowed(one, 0) & w.real & ~np.isin(np.arange(512), [257]))
            if len(ids) == 0:
                break
            assert m.accept(int(ids[rng.integers(len(ids))]))
        matchers.append(m)
    refused = compiler.matcher(specs[0])
    assert not refused.accept(ord("x"))
    matchers.append(refused)
    rows = list(range(len(matchers)))[::-1]  # row order apart from list order
    par = torch.zeros((len(matchers) + 1, compiler.words), dtype=torch.int32)
    compiler.fill_bitmasks(list(zip(matchers, rows)), par)
    seq = torch.zeros_like(par)
    for m, r in zip(matchers, rows):
        m.fill_bitmask(seq, r)
    assert torch.equal(par, seq)
    assert par[: len(matchers)].any(dim=1).all()
    compiler.fill_bitmasks([], torch.zeros((0, compiler.words), dtype=torch.int32))  # no rows: nothing to do
    with pytest.raises(ValueError, match="CPU int32"):
        compiler.fill_bitmasks(list(zip(matchers, rows)), par.to(torch.int64))


def _reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.tolist()
    for i, r in enumerate(rows):
        for t in range(logits.shape[1]):
            w = t // 32
            if w >= len(words[i]) or not (words[i][w] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,words", [(300, 10), (300, 9), (64, 2), (37, 3)])
def test_apply_bitmask_against_a_slow_reference(dtype, vocab, words):
    g = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(7, vocab, generator=g).to(dtype)
    rows = [5, 0, 3]
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # all allowed (words past the vocabulary included)
    bitmask[2, 0] = -2**31  # bit 31 alone: the sign bit
    want = _reference_apply(logits, bitmask, rows)
    got = logits.clone()
    apply_bitmask(got, bitmask, torch.tensor(rows))
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 2, 4, 6]], logits[[1, 2, 4, 6]])  # rows not guided: untouched
    apply_bitmask(got, bitmask[:0], torch.tensor([], dtype=torch.int64))  # no guided rows
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_apply_bitmask_on_cuda():
    logits = torch.randn(64, 49152, device="cuda")
    bitmask = torch.randint(-2**31, 2**31 - 1, (16, 1536), dtype=torch.int64).to(torch.int32)
    rows = torch.arange(0, 64, 4)
    want = logits.cpu().clone()
    apply_bitmask(want, bitmask, rows)
    got = logits.clone()
    apply_bitmask(got, bitmask.cuda(), rows.cuda())
    assert torch.equal(got.cpu(), want)
