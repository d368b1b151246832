"""What a guided-decoding spec means as a grammar of the grammar engine (llguidance), and whether
the engine takes it. The engine compiles this grammar against its tokenizer
(workers/engine/guided.py); the API and the batch submission check it with no tokenizer at all
(`grammar_problem`, a fraction of a millisecond), so a spec the engine would refuse is a 400 at once.

JSON is generated compactly with one space after `,` and `:` (no free whitespace: a small model
left free to emit whitespace can fill max_tokens with newlines); properties in the schema's order.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from schemas.job import ErrorCode
from schemas.sampling import GuidedDecoding, SamplingParams

# llguidance's JSON options (JsonCompileOptions), applied over the schema's own "x-guidance"
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# the characters that are special in llguidance's regex syntax (Rust's regex-syntax: escaping each is allowed)
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
# JSON Schema's own words a schema's values often are (types, drafts' formats): not user data
_SCHEMA_WORDS = frozenset({"string", "integer", "number", "object", "array", "boolean", "null", "date", "date-time",
                           "time", "email", "uuid", "uri", "ipv4", "ipv6", "hostname", "duration"})
MAX_MESSAGE_CHARS = 300  # a refusal's message is cut here: it may quote the spec, which is user data


class GrammarError(ValueError):
    """The grammar engine refuses a spec (unsupported JSON-schema keywords, a bad regex, ...)."""


def regex_literal(text: str) -> str:
    """A regex matching `text` exactly."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def grammar_of(spec: GuidedDecoding) -> str:
    """The spec as an llguidance grammar (serialized). Not checked: see grammar_problem. Raises
    GrammarError when the spec cannot even be translated."""
    from llguidance import LLMatcher

    try:
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        if spec.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(spec.json_schema or {}, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.regex or "")
        return LLMatcher.grammar_from_regex("(" + "|".join(regex_literal(c) for c in spec.choices or ()) + ")")
    except (ValueError, TypeError) as exc:
        raise GrammarError(refusal(spec, str(exc))) from None


def refusal(spec: GuidedDecoding, why: str) -> str:
    """The message of a refused spec: its kind and the engine's reason, bounded, without the spec's
    own strings (a regex, a pattern, an enum value: user data, which the job's error row and logs
    must not carry). A regex syntax error keeps the parser's reason ("unclosed group")."""
    what = {"json_object": "JSON object", "json_schema": "JSON schema", "regex": "regex", "choice": "choice"}[spec.kind]
    if "regex parse error" in why and "error: " in why:  # the parser's report quotes the pattern
        reason = why.rsplit("error: ", 1)[1].split("\n", 1)[0]
        why = f"a regular expression the engine cannot take ({reason})"
    for text in sorted(_strings(spec), key=len, reverse=True):
        why = why.replace(text, "<...>")
    why = " ".join(why.split())  # one line
    if len(why) > MAX_MESSAGE_CHARS:
        why = why[:MAX_MESSAGE_CHARS] + "..."
    return f"the grammar engine cannot enforce this {what}: {why}"


def job_grammar_problem(sampling: SamplingParams) -> tuple[ErrorCode, str] | None:
    """A job's guided spec, checked: None when it has none or the engine takes it, else
    (invalid_grammar, why): the shape of a submission check (pipeline.producer.JobCheck)."""
    if sampling.guided is None:
        return None
    problem = grammar_problem(sampling.guided)
    return None if problem is None else (ErrorCode.INVALID_GRAMMAR, problem)


def _strings(spec: GuidedDecoding) -> set[str]:
    """The strings a spec holds (its regex, choices, and the schema's string values), 3 characters
    and up (shorter ones would blank the engine's own words)."""
    out: set[str] = set()

    def walk(x: object) -> None:
        if isinstance(x, str):
            out.add(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk([spec.regex, spec.choices, spec.json_schema])
    return {t for t in out if len(t) >= 3} - _SCHEMA_WORDS


def grammar_problem(spec: GuidedDecoding) -> str | None:
    """None when the grammar engine takes the spec, else why not (a bounded message). Needs no
    tokenizer; the answers are kept by the spec's key (a batch file of one schema checks it once)."""
    from llguidance import LLMatcher

    key = spec.key
    with _lock:
        if key in _answers:
            _answers.move_to_end(key)
            return _answers[key]
    try:
        err = LLMatcher.validate_grammar(grammar_of(spec))
        problem = refusal(spec, err) if err else None
    except GrammarError as exc:
        problem = str(exc)
    with _lock:
        _answers[key] = problem
        while len(_answers) > _MAX_ANSWERS:
            _answers.popitem(last=False)
    return problem


_MAX_ANSWERS = 1024
_answers: OrderedDict[str, str | None] = OrderedDict()
_lock = threading.Lock()
