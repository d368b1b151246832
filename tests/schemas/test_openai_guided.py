"""Structured output in OpenAI bodies (schemas/openai/guided.py): response_format and vLLM's
guided_json / guided_regex / guided_choice become SamplingParams.guided, on chat and text
completions, live bodies and batch lines alike; malformed ones are invalid_request."""

from __future__ import annotations

import json

import pytest

from schemas.batchfile import BatchLineError, ParsedLine, parse_line
from schemas.grammar import job_grammar_problem
from schemas.job import ErrorCode, JobInput, LineError
from schemas.openai import LineFormat
from schemas.openai.requests import openai_body_request
from schemas.sampling import GuidedDecoding, SamplingParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "pop": {"type": "integer"}},
          "required": ["city", "pop"], "additionalProperties": False}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TEXT = {"prompt": "hi"}


def _guided(body: dict, fmt: LineFormat) -> GuidedDecoding | None:
    return JobInput.model_validate(openai_body_request(body, fmt)).sampling.guided


@pytest.mark.parametrize("fmt,base", [(LineFormat.OPENAI_CHAT, CHAT), (LineFormat.OPENAI_COMPLETIONS, TEXT)])
@pytest.mark.parametrize(
    "fields,want",
    [
        ({}, None),
        ({"response_format": None}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, GuidedDecoding(kind="json_object")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "city_info", "schema": SCHEMA, "strict": True}}},
         GuidedDecoding(kind="json_schema", json_schema=SCHEMA)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "c-1", "description": "a city",
                                                                     "schema": SCHEMA, "strict": False}}},
         GuidedDecoding(kind="json_schema", json_schema=SCHEMA)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "anything"}}},  # no schema: any object
         GuidedDecoding(kind="json_object")),
        ({"guided_json": SCHEMA}, GuidedDecoding(kind="json_schema", json_schema=SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, GuidedDecoding(kind="json_schema", json_schema=SCHEMA)),
        ({"guided_regex": r"[0-9]{3}-[a-z]+"}, GuidedDecoding(kind="regex", regex=r"[0-9]{3}-[a-z]+")),
        ({"guided_choice": ["yes", "no"]}, GuidedDecoding(kind="choice", choices=["yes", "no"])),
        ({"structured_outputs": {"json": SCHEMA}}, GuidedDecoding(kind="json_schema", json_schema=SCHEMA)),
        ({"structured_outputs": {"regex": "a+", "choice": None}}, GuidedDecoding(kind="regex", regex="a+")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, GuidedDecoding(kind="choice", choices=["x", "y"])),
        ({"structured_outputs": {"json_object": True}}, GuidedDecoding(kind="json_object")),
        # text alongside a guided field: the guided one
        ({"response_format": {"type": "text"}, "guided_choice": ["a"]}, GuidedDecoding(kind="choice", choices=["a"])),
        ({"guided_regex": None, "guided_choice": ["a"]}, GuidedDecoding(kind="choice", choices=["a"])),
    ],
)
def test_bodies_map_to_the_guided_spec(fmt, base, fields, want):
    assert _guided({**base, **fields, "max_tokens": 5}, fmt) == want


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"response_format": "json_object"}, "body.response_format: an object"),
        ({"response_format": {"type": "xml"}}, "body.response_format.type"),
        ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "body.response_format.schema: unknown field"),
        ({"response_format": {"type": "json_schema"}}, "body.response_format.json_schema: required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "json_schema.name: required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}}},
         "json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": SCHEMA}}}, "json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": "yes"}}},
         "json_schema.strict"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}}}, "json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schemas": SCHEMA}}},
         "json_schema.schemas: unknown field"),
        ({"guided_json": "{not json"}, "body.guided_json"),
        ({"guided_json": [SCHEMA]}, "body.guided_json"),
        ({"guided_regex": ""}, "body.guided_regex"),
        ({"guided_regex": 5}, "body.guided_regex"),
        ({"guided_choice": []}, "body.guided_choice"),
        ({"guided_choice": ["a", ""]}, "body.guided_choice"),
        ({"guided_choice": "a"}, "body.guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format and guided_regex"),
        ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "give one"),
        ({"structured_outputs": {}}, "body.structured_outputs: an object with one of"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "body.structured_outputs: an object with one of"),
        ({"structured_outputs": {"grammar": "start: x"}}, "body.structured_outputs: an object with one of"),
        ({"structured_outputs": {"json_object": 1}}, "body.structured_outputs.json_object: true"),
        ({"structured_outputs": {"choice": []}}, "body.structured_outputs.choice: a non-empty list"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "give one"),
    ],
)
def test_malformed_structured_output_fields_are_invalid_request(fields, message):
    for fmt, base in ((LineFormat.OPENAI_CHAT, CHAT), (LineFormat.OPENAI_COMPLETIONS, TEXT)):
        with pytest.raises(LineError) as exc:
            openai_body_request({**base, **fields}, fmt)
        assert exc.value.code is ErrorCode.INVALID_REQUEST
        assert message in exc.value.message, exc.value.message


def test_batch_lines_carry_the_spec_beside_the_other_sampling_fields():
    body = {**CHAT, "max_tokens": 40, "temperature": 0.2, "n": 2, "logit_bias": {"5": -100},
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}}
    p = parse_line(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}), 1)
    assert isinstance(p, ParsedLine)
    sp = p.job.sampling
    assert sp.guided == GuidedDecoding(kind="json_schema", json_schema=SCHEMA)
    assert (sp.max_tokens, sp.temperature, sp.n, sp.logit_bias) == (40, 0.2, 2, {5: -100.0})
    # the job's message round-trips it (what the worker reads off the queue)
    req = p.request("b")
    assert type(req).model_validate_json(req.model_dump_json()).sampling.guided == sp.guided
    p = parse_line(json.dumps({"custom_id": "t", "method": "POST", "url": "/v1/completions",
                               "body": {**TEXT, "guided_choice": ["red", "blue"]}}), 2)
    assert isinstance(p, ParsedLine) and p.job.sampling.guided == GuidedDecoding(kind="choice", choices=["red", "blue"])
    bad = parse_line(json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions",
                                 "body": {**TEXT, "response_format": {"type": "yaml"}}}), 3)
    assert isinstance(bad, BatchLineError) and bad.code is ErrorCode.INVALID_REQUEST
    # a spec the schema bounds refuse (an empty choice): invalid_sampling, as the other sampling fields
    bad = parse_line(json.dumps({"id": "p", "prompt": "x", "sampling": {"guided": {"kind": "choice", "choices": []}}}), 4)
    assert isinstance(bad, BatchLineError) and bad.code is ErrorCode.INVALID_SAMPLING


def test_the_submission_check_refuses_what_the_grammar_engine_cannot_enforce():
    assert job_grammar_problem(SamplingParams()) is None
    assert job_grammar_problem(SamplingParams(guided={"kind": "json_schema", "json_schema": SCHEMA})) is None
    code, message = job_grammar_problem(SamplingParams(guided={"kind": "json_schema", "json_schema": {
        "type": "array", "uniqueItems": True}}))
    assert code is ErrorCode.INVALID_GRAMMAR and "uniqueItems" in message
    code, message = job_grammar_problem(SamplingParams(guided={"kind": "regex", "regex": "secret(["}))
    assert code is ErrorCode.INVALID_GRAMMAR and "secret" not in message
