"""Tools on a chat job: what is accepted and refused (names, schemas, tool_choice, tool turns,
sizes), the guided decoding required / a named function get, and tool calls read out of the
model's text, whole and streamed (every split of the text joins into the plain answer)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from pydantic import ValidationError

from schemas.job import (
    ErrorCode,
    FinishReason,
    JobInput,
    JobResult,
    JobStatus,
    describe_validation_error,
    error_code_for,
)
from schemas.openai import LineFormat, format_output_line, openai_body_request, openai_response
from schemas.openai.tool_calls import ToolCallParser, call_id, delta_of, join_events, parse_tool_calls
from schemas.tools import NO_PARAMETERS, ToolUse

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _job(**kw) -> JobInput:
    return JobInput.model_validate({"messages": ASK, "tools": TOOLS, **kw})


def _refused(**kw) -> tuple[ErrorCode, str]:
    with pytest.raises(ValidationError) as info:
        JobInput.model_validate({"messages": ASK, **kw})
    return error_code_for(info.value), describe_validation_error(info.value)


@pytest.mark.parametrize("name", ["get weather", "x" * 65, "", "naïve", "a.b"])
def test_function_names_follow_openais_rule(name):
    code, msg = _refused(tools=[{"type": "function", "function": {"name": name}}])
    assert code is ErrorCode.INVALID_REQUEST and "name" in msg
    assert _job(tools=[{"type": "function", "function": {"name": "A-z_09" + "x" * 58}}]).tools


@pytest.mark.parametrize("params, needle", [
    ([1, 2], "dictionary"),
    ({"type": "string"}, "JSON object"),
    ({"type": "object", "properties": {"a": {"type": 5}}}, "valid JSON schema"),
    ({"type": "object", "required": "city"}, "valid JSON schema"),
    ({"type": "object", "properties": {"a": {"pattern": "[a-"}}}, "valid JSON schema"),
    ({"$schema": 5, "type": "object"}, "valid JSON schema"),  # jsonschema fails on it with an AttributeError
])
def test_parameters_must_be_a_json_schema_of_an_object(params, needle):
    code, msg = _refused(tools=[{"type": "function", "function": {"name": "f", "parameters": params}}])
    assert code is ErrorCode.INVALID_REQUEST and needle in msg, msg


def test_a_bad_schemas_message_names_the_rule_not_the_schemas_strings():
    params = {"type": "object", "properties": {"secret_field": {"type": "string", "pattern": "[hunter2-"}}}
    _code, msg = _refused(tools=[{"type": "function", "function": {"name": "f", "parameters": params}}])
    assert "'format' rule fails at properties/*/pattern" in msg
    assert "secret" not in msg and "hunter2" not in msg


def test_tool_choice_and_tool_turns_are_checked():
    assert _refused(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})[1].endswith(
        "tool_choice names function nope, not among the tools")
    assert "only with tools" in _refused(tool_choice="required")[1]
    assert "declared twice" in _refused(tools=[TOOLS[1], TOOLS[1]])[1]
    assert "tool_choice" in _refused(tools=TOOLS, tool_choice="sometimes")[1]
    with pytest.raises(ValidationError, match="chat turns only"):
        JobInput.model_validate({"prompt": "x", "tools": TOOLS})
    # a tool turn answers a call; an assistant turn may carry calls and no content
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ok = _job(messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert ok.messages[1].turn() == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert ok.messages[2].turn() == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert "tool_call_id" in _refused(messages=[*ASK, {"role": "tool", "content": "sunny"}])[1]
    assert "content" in _refused(messages=[*ASK, {"role": "assistant", "content": None}])[1]
    assert "assistant turns only" in _refused(messages=[{"role": "user", "content": "x", "tool_calls": [call]}])[1]
    assert not _job(tools=[]).tools and _job(tools=[]).tool_use is None  # [] is no tools


def test_sizes_are_bounded():
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    assert "128" in _refused(tools=many)[1]
    deep: dict = {"type": "object"}
    for _ in range(30):
        deep = {"type": "object", "properties": {"a": deep}}
    assert "deeper" in _refused(tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}])[1]
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(700)}}
    _code, msg = _refused(tools=[{"type": "function", "function": {"name": "f", "parameters": huge}}])
    assert "limit is 65536" in msg
    long_desc = {"type": "function", "function": {"name": "f", "description": "d" * 9000}}
    assert "description" in _refused(tools=[long_desc])[1]


def test_required_and_named_choices_constrain_the_output():
    named = _job(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.sampling.guided.kind == "json_schema" and named.sampling.guided.json_schema == WEATHER
    assert named.tool_use == ToolUse("named", frozenset({"get_weather", "now"}), "get_weather")
    assert _job(tool_choice={"type": "function", "function": {"name": "now"}}).sampling.guided.json_schema == NO_PARAMETERS
    required = _job(tool_choice="required").sampling.guided.json_schema
    ok = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(ok, required)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {"days": 2}}],
                [{"name": "now", "parameters": {"x": 1}}], [{"name": "now", "parameters": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = _job(tool_choice="required", parallel_tool_calls=False).sampling.guided.json_schema
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, single)
    # auto and none leave the output free; response_format cannot be combined with a constraint
    assert _job().sampling.guided is None and _job().tool_use.mode == "auto"
    assert _job(tool_choice="none").sampling.guided is None and _job(tool_choice="none").tool_use is None
    guided = {"kind": "json_object"}
    assert _job(tool_choice="auto", sampling={"guided": guided}).sampling.guided.kind == "json_object"
    with pytest.raises(ValidationError, match="not with response_format"):
        _job(tool_choice="required", sampling={"guided": guided})
    # a stored job read back (its sampling holds the guide already) validates again
    again = JobInput.model_validate(named.model_dump(mode="json"))
    assert again.sampling.guided == named.sampling.guided


def test_openai_bodies_take_tools_on_chat_only():
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    job = JobInput.model_validate(openai_body_request(body, LineFormat.OPENAI_CHAT))
    assert job.tool_use == ToolUse("required", frozenset({"get_weather", "now"}), None, parallel=False)
    from schemas.job import LineError

    with pytest.raises(LineError, match=r"body\.tools"):
        openai_body_request({"prompt": "x", "tools": TOOLS}, LineFormat.OPENAI_COMPLETIONS)


AUTO = ToolUse("auto", frozenset({"get_weather", "now"}))
REQUIRED = ToolUse("required", frozenset({"get_weather", "now"}))
NAMED = ToolUse("named", frozenset({"get_weather", "now"}), "get_weather")


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
     '<tool_call>{"name": "now", "arguments": {}}</tool_call>', "Let me check.",
     [("get_weather", {"city": "Paris"}), ("now", {})]),
    ('{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}', None, [("get_weather", {"city": "Oslo", "days": 2})]),
    (' [{"name": "now", "arguments": "{}"}, {"name": "now"}]', None, [("now", {}), ("now", {})]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}', None, [("get_weather", {"city": "Rome"})]),
])
def test_auto_reads_the_calls_the_model_wrote(text, content, calls):
    got_content, got = parse_tool_calls(AUTO, text, "job-1")
    assert got_content == content and _calls(got) == calls
    assert [c["id"] for c in got] == [call_id("job-1", 0, i) for i in range(len(calls))]
    assert all(c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29 for c in got)


@pytest.mark.parametrize("text", [
    "Paris is sunny today.",
    '{"city": "Paris"}',  # JSON, but no call
    '{"name": "delete_everything", "arguments": {}}',  # not a declared function
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> never mind',  # broken
    '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',  # arguments not an object
    'Use <tool_ and <tool_call without closing',
    "  \n",
    "",
])
def test_auto_text_with_no_call_stays_a_message(text):
    assert parse_tool_calls(AUTO, text, "j") == (text, [])


def test_parallel_false_keeps_the_first_written_call():
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "get_weather"}</tool_call>'
    assert _calls(parse_tool_calls(ToolUse("auto", AUTO.names, parallel=False), text, "j")[1]) == [("now", {})]


REQ_TEXTS = [
    '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]',
    '[ {"name":"now","parameters":{}} , {"name": "get_weather", "parameters": {"city": "a \\"}{[ b"}}]',
    '[{"parameters": {"city": "Lima"}, "name": "get_weather"}]',  # parameters before the name
    '[{"name": "get_weather", "parameters": {"city": {"nested": [1, {"x": "}"}]}}}]',
]


def test_required_gives_each_elements_parameters_as_written():
    content, calls = parse_tool_calls(REQUIRED, REQ_TEXTS[0], "j")
    assert content is None and calls[0]["function"] == {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 3}'}
    assert _calls(parse_tool_calls(REQUIRED, REQ_TEXTS[1], "j")[1]) == [("now", {}), ("get_weather", {"city": 'a "}{[ b'})]
    assert _calls(parse_tool_calls(REQUIRED, REQ_TEXTS[2], "j")[1]) == [("get_weather", {"city": "Lima"})]
    assert _calls(parse_tool_calls(REQUIRED, REQ_TEXTS[3], "j")[1]) == [
        ("get_weather", {"city": {"nested": [1, {"x": "}"}]}})]
    # cut off by max_tokens: the call so far (its arguments incomplete), as OpenAI's length answers are
    cut = parse_tool_calls(REQUIRED, '[{"name": "get_weather", "parameters": {"city": "Par', "j")[1]
    assert cut[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    assert parse_tool_calls(REQUIRED, '[{"na', "j") == ('[{"na', [])  # no call at all: the text


def test_named_gives_the_text_as_the_arguments():
    content, calls = parse_tool_calls(NAMED, ' \n{"city": "Paris"}', "j", 2)
    assert content is None and calls == [{"id": call_id("j", 2, 0), "type": "function",
                                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]


STREAMED = [(AUTO, t) for t in (
    "Paris is sunny today.", '{"city": "Paris"}', "  \n", 'Use <tool_ and <tool_call without closing',
    'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    'ok <tool_call>{"name": "nope", "arguments": {}}</tool_call> tail',
    '\n\n{"name": "now", "arguments": {}}')] + [(REQUIRED, t) for t in REQ_TEXTS] + [
    (REQUIRED, '[{"name": "get_weather", "parameters": {"city": "Par'), (NAMED, '\n {"city": "Paris"}'), (NAMED, "")]


@pytest.mark.parametrize("use, text", STREAMED)
def test_a_stream_joins_into_the_plain_answer_however_the_text_is_split(use, text):
    plain = parse_tool_calls(use, text, "j")
    rng = random.Random(0)
    splits = [[text[i:i + 1] for i in range(len(text))]]  # a character at a time
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in splits:
        parser = ToolCallParser(use, "j")
        events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
        content, calls = join_events(events)
        assert (content, calls) == plain or (not calls and content == text and plain == (text, [])), pieces
        # a call's header comes before its arguments, each call once, in order
        heads = [e[1] for e in events if e[0] == "call"]
        assert heads == list(range(len(heads)))
        for i, e in enumerate(events):
            if e[0] == "args":
                assert ("call", e[1]) in [(x[0], x[1]) for x in events[:i]]


def test_required_arguments_stream_before_the_array_ends():
    parser = ToolCallParser(REQUIRED, "j")
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    seen = []
    for ch in text[: text.index("Paris") + 3]:
        seen += parser.feed(ch)
    assert seen[0] == ("call", 0, call_id("j", 0, 0), "get_weather")
    assert "".join(e[2] for e in seen[1:]) == '{"city": "Par'
    assert delta_of(seen[0]) == {"tool_calls": [{"index": 0, "id": call_id("j", 0, 0), "type": "function",
                                                 "function": {"name": "get_weather", "arguments": ""}}]}
    assert delta_of(seen[1]) == {"tool_calls": [{"index": 0, "function": {"arguments": seen[1][2]}}]}


def test_auto_content_streams_before_a_call_and_a_partial_tag_waits():
    parser = ToolCallParser(AUTO, "j")
    assert parser.feed("Checking") == [("content", "Checking")]
    assert parser.feed(" now <tool") == [("content", " now")]  # the blank and "<tool" may begin a tag
    assert parser.feed("box> done") == [("content", " <toolbox> done")]
    assert parser.feed("{") == [("content", "{")]


def _result(text: str, finish: FinishReason = FinishReason.STOP, **kw) -> JobResult:
    return JobResult(id="job-9", custom_id="line-1", status=JobStatus.SUCCEEDED, text=text, finish_reason=finish, **kw)


def test_responses_and_batch_lines_carry_the_calls():
    text = '[{"name": "now", "parameters": {}}]'
    status, body = openai_response(_result(text), LineFormat.OPENAI_CHAT, "m", tools=REQUIRED)
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id("job-9", 0, 0), "type": "function", "function": {"name": "now", "arguments": "{}"}}]}
    cut = openai_response(_result('[{"name": "now", "parameters": {', FinishReason.LENGTH), LineFormat.OPENAI_CHAT,
                          tools=REQUIRED)[1]["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"][0]["function"]["arguments"] == "{"
    # no call in an auto answer: a plain message; tool_choice none (no ToolUse): never read
    plain = openai_response(_result("Hello"), LineFormat.OPENAI_CHAT, tools=AUTO)[1]["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "Hello"} and plain["finish_reason"] == "stop"
    assert openai_response(_result(text), LineFormat.OPENAI_CHAT)[1]["choices"][0]["message"]["content"] == text
    line = json.loads(format_output_line(_result(text), LineFormat.OPENAI_CHAT, tools=REQUIRED))
    assert line["response"]["body"]["choices"][0] == choice
    plain_line = json.loads(format_output_line(_result(text), LineFormat.PLAIN, tools=REQUIRED))
    assert plain_line["text"] == text and plain_line["tool_calls"] == choice["message"]["tool_calls"]
