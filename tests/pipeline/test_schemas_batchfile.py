"""Batch-file lines: plain and OpenAI Batch API input, output lines in both formats."""

from __future__ import annotations

import json

import pytest

from schemas.batchfile import (
    BatchLineError,
    LineFormat,
    ParsedLine,
    format_output_line,
    parse_line,
    parse_lines,
)
from schemas.job import ErrorCode, FinishReason, JobResult, JobStatus, JobTimings, Usage


def _ok(line: str | bytes, **kw) -> ParsedLine:
    parsed = parse_line(line, 1, **kw)
    assert isinstance(parsed, ParsedLine), parsed
    return parsed


def _err(line: str | bytes, **kw) -> BatchLineError:
    parsed = parse_line(line, 7, **kw)
    assert isinstance(parsed, BatchLineError), parsed
    return parsed


def test_plain_line_with_top_level_sampling_and_batch():
    p = _ok('{"id": "a1", "prompt": "hi", "max_tokens": 4, "temperature": 0, "priority": 2}', batch_id="b1")
    assert p.format is LineFormat.PLAIN
    assert p.job.id == "a1" and p.job.batch_id == "b1" and p.job.priority == 2
    assert p.job.sampling.max_tokens == 4 and p.job.sampling.greedy


def test_plain_line_nested_sampling_and_default_id():
    p = _ok('{"prompt": "hi", "sampling": {"seed": 5}}', default_id="b1-3")
    assert p.job.id == "b1-3" and p.job.sampling.seed == 5


def test_plain_line_sampling_given_twice():
    e = _err('{"id": "x", "prompt": "hi", "seed": 1, "sampling": {"seed": 2}}')
    assert (
        e.code is ErrorCode.INVALID_REQUEST and e.message.startswith("seed: given both") and e.job_id == "x"
    )


def test_openai_chat_line():
    line = json.dumps(
        {
            "custom_id": "req-1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                "max_completion_tokens": 8,
                "temperature": 0.5,
                "n": 1,
                "stream": False,
                "user": "u",
            },
        }
    )
    p = _ok(line, batch_id="b")
    assert p.format is LineFormat.OPENAI_CHAT
    assert p.job.id == "req-1" and p.job.batch_id == "b"
    assert p.job.messages is not None and [m.role for m in p.job.messages] == ["system", "user"]
    assert p.job.sampling.max_tokens == 8 and p.job.sampling.temperature == 0.5
    assert p.job.metadata == {"model": "tiny"}


def test_openai_completions_line_prompt_list_of_one():
    line = '{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": ["x"], "stop": "\\n"}}'
    p = _ok(line)
    assert p.format is LineFormat.OPENAI_COMPLETIONS and p.job.prompt == "x" and p.job.sampling.stop == ["\n"]


@pytest.mark.parametrize(
    ("line", "code", "message", "job_id"),
    [
        ("not json", ErrorCode.INVALID_REQUEST, "not valid JSON", None),
        ("[1, 2]", ErrorCode.INVALID_REQUEST, "a line must be a JSON object", None),
        (b'{"id": "u", "prompt": "\xff"}', ErrorCode.UNDECODABLE, "not valid UTF-8", None),
        ('{"id": "u", "prompt": "a\\udc80"}', ErrorCode.UNDECODABLE, "prompt:", "u"),
        (
            '{"id": "p", "prompt": "a", "max_tokens": 0}',
            ErrorCode.INVALID_SAMPLING,
            "sampling.max_tokens",
            "p",
        ),
        ('{"id": "p", "prompt": "a", "colour": 1}', ErrorCode.INVALID_REQUEST, "colour: unknown field", "p"),
        ('{"id": "p"}', ErrorCode.INVALID_REQUEST, "exactly one of 'prompt' or 'messages'", "p"),
        (
            '{"custom_id": "o", "method": "GET", "url": "/v1/completions", "body": {}}',
            ErrorCode.INVALID_REQUEST,
            "method: must be POST",
            "o",
        ),
        (
            '{"custom_id": "o", "method": "POST", "url": "/v1/embeddings", "body": {}}',
            ErrorCode.INVALID_REQUEST,
            "url: must be one of",
            "o",
        ),
        (
            '{"custom_id": "o", "method": "POST", "url": "/v1/chat/completions", "body": {"prompt": "x"}}',
            ErrorCode.INVALID_REQUEST,
            "body.prompt: unknown or unsupported",
            "o",
        ),
        (
            '{"custom_id": "o", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}',
            ErrorCode.INVALID_REQUEST,
            "body.messages: required",
            "o",
        ),
        (
            '{"custom_id": "o", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 3}}',
            ErrorCode.INVALID_REQUEST,
            "body.n: not supported",
            "o",
        ),
        (
            '{"custom_id": "o", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "temperature": -1}}',
            ErrorCode.INVALID_SAMPLING,
            "body.temperature: Input should be greater than or equal to 0",
            "o",
        ),
        (
            '{"custom_id": "o", "method": "POST", "url": "/v1/completions", "body": {"prompt": [1, 2]}}',
            ErrorCode.INVALID_REQUEST,
            "body.prompt: must be a string",
            "o",
        ),
    ],
)
def test_bad_lines(line, code, message, job_id):
    e = _err(line)
    assert e.line_no == 7
    assert e.code is code
    assert message in e.message
    assert e.job_id == job_id


def test_bad_line_becomes_failed_result():
    e = _err('{"id": "p", "prompt": "a", "max_tokens": 0}')
    r = e.result(batch_id="b")
    assert r is not None and r.status is JobStatus.FAILED and r.error_code is ErrorCode.INVALID_SAMPLING
    assert r.error_message is not None and r.error_message.startswith("line 7: ")
    assert _err("nope").result() is None
    assert _err("nope").result(fallback_id="b-7").id == "b-7"


def test_parse_lines_skips_blanks_and_numbers_lines():
    out = list(parse_lines(['{"prompt": "a"}', "", "  ", '{"prompt": "b"}'], id_prefix="b-"))
    assert [p.job.id for p in out if isinstance(p, ParsedLine)] == ["b-1", "b-4"]


def _result(status=JobStatus.SUCCEEDED, **kw) -> JobResult:
    return JobResult(
        id="r1",
        status=status,
        text="hello",
        finish_reason=FinishReason.LENGTH,
        usage=Usage(prompt_tokens=5, cached_prompt_tokens=2, completion_tokens=3),
        timings=JobTimings(finished_at=1700000000.5),
        model="tiny",
        **kw,
    )


def test_output_plain():
    out = json.loads(format_output_line(_result(), LineFormat.PLAIN))
    assert out["id"] == "r1" and out["text"] == "hello" and out["usage"]["cached_prompt_tokens"] == 2
    assert JobResult.model_validate(out) == _result()


def test_output_openai_chat_and_completions():
    chat = json.loads(format_output_line(_result(), LineFormat.OPENAI_CHAT))
    assert chat["custom_id"] == "r1" and chat["error"] is None
    body = chat["response"]["body"]
    assert chat["response"]["status_code"] == 200
    assert body["object"] == "chat.completion" and body["created"] == 1700000000
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    comp = json.loads(format_output_line(_result(), LineFormat.OPENAI_COMPLETIONS))
    assert comp["response"]["body"]["choices"][0]["text"] == "hello"


def test_output_openai_failure():
    failed = JobResult.failure("r2", ErrorCode.PROMPT_TOO_LONG, "too long")
    out = json.loads(format_output_line(failed, LineFormat.OPENAI_CHAT))
    assert out["response"]["status_code"] == 400
    assert out["response"]["body"]["error"] == {
        "message": "too long",
        "type": "prompt_too_long",
        "code": "prompt_too_long",
    }
