"""Structured output in OpenAI request bodies: `response_format` (OpenAI's: text, json_object,
json_schema) and vLLM's `guided_json`, `guided_regex`, `guided_choice` (and their newer form,
`structured_outputs` with one of `json`, `regex`, `choice`, `json_object`), as the
`SamplingParams.guided` spec (schemas.sampling.GuidedDecoding). Raises LineError."""

from __future__ import annotations

import json
from typing import Any

from schemas.job import ErrorCode, LineError

# the body fields that ask for structured output (at most one of them, text apart)
GUIDED_FIELDS = frozenset({"response_format", "guided_json", "guided_regex", "guided_choice", "structured_outputs"})
# vLLM's newer form: structured_outputs {json | regex | choice | json_object: true}, one of them
_STRUCTURED = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice"}
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})


def _bad(where: str, what: str) -> LineError:
    return LineError(ErrorCode.INVALID_REQUEST, f"body.{where}: {what}")


def openai_guided(fields: dict[str, Any]) -> dict[str, Any] | None:
    """The GuidedDecoding fields of a body's structured-output fields (those of GUIDED_FIELDS it
    has, None values left out); None: free text."""
    specs = [(k, spec) for k, v in fields.items() if v is not None
             for spec in [_one(k, v)] if spec is not None]
    if len(specs) > 1:
        raise LineError(ErrorCode.INVALID_REQUEST,
                        f"body: {' and '.join(k for k, _ in specs)} both constrain the output; give one")
    return specs[0][1] if specs else None


def _one(key: str, value: Any) -> dict[str, Any] | None:
    if key == "response_format":
        return response_format(value)
    if key == "structured_outputs":
        given = {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else None
        if not given or len(given) != 1 or set(given) - {*_STRUCTURED, "json_object"}:
            raise _bad(key, 'an object with one of "json", "regex", "choice" or "json_object": true')
        (k, v), = given.items()
        if k == "json_object":
            if v is not True:
                raise _bad(f"{key}.json_object", "true")
            return {"kind": "json_object"}
        try:
            return _one(_STRUCTURED[k], v)
        except LineError as exc:
            raise _bad(f"{key}.{k}", exc.message.split(": ", 1)[1]) from None
    if key == "guided_json":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except ValueError:
                raise _bad(key, "a JSON schema (an object, or its JSON text)") from None
        if not isinstance(value, dict):
            raise _bad(key, "a JSON schema (an object, or its JSON text)")
        return {"kind": "json_schema", "json_schema": value}
    if key == "guided_regex":
        if not isinstance(value, str) or not value:
            raise _bad(key, "a regular expression (a non-empty string)")
        return {"kind": "regex", "regex": value}
    if key == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise _bad(key, "a non-empty list of non-empty strings")
        return {"kind": "choice", "choices": value}
    raise AssertionError(key)


def response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name", "description"?, "schema"?, "strict"?}} (a
    json_schema without `schema` is any JSON object). The schema is enforced whatever `strict` says."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad("response_format", 'an object with "type": "text", "json_object" or "json_schema"')
    kind = value["type"]
    extra = set(value) - ({"type", "json_schema"} if kind == "json_schema" else {"type"})
    if extra:
        raise _bad(f"response_format.{sorted(extra)[0][:40]}", "unknown field")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object"}
    if kind != "json_schema":
        raise _bad("response_format.type", '"text", "json_object" or "json_schema"')
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise _bad("response_format.json_schema", 'required with type "json_schema": {"name": ..., "schema": {...}}')
    extra = set(js) - _JSON_SCHEMA_KEYS
    if extra:
        raise _bad(f"response_format.json_schema.{sorted(extra)[0][:40]}", "unknown field")
    name = js.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 64 or not all(c.isascii() and (c.isalnum() or c in "_-")
                                                                      for c in name):
        raise _bad("response_format.json_schema.name", "required: 1 to 64 letters, digits, _ or -")
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise _bad("response_format.json_schema.description", "a string")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise _bad("response_format.json_schema.strict", "true or false")
    schema = js.get("schema")
    if schema is None:
        return {"kind": "json_object"}
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema", "a JSON schema (an object)")
    return {"kind": "json_schema", "json_schema": schema}
