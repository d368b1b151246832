"""JobRequest / JobResult validation: each rule fails with an error naming the field and the rule."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schemas.job import (
    ErrorCode,
    FinishReason,
    JobRequest,
    JobResult,
    JobStatus,
    JobTimings,
    Usage,
    describe_validation_error,
    error_code_for,
)


def _fail(data: dict) -> tuple[ErrorCode, str]:
    with pytest.raises(ValidationError) as info:
        JobRequest.model_validate(data)
    return error_code_for(info.value), describe_validation_error(info.value)


def test_minimal_prompt_job_gets_an_id_and_defaults():
    job = JobRequest(prompt="hello")
    assert len(job.id) == 32
    assert job.sampling.max_tokens == 256
    assert job.priority == 0 and job.metadata == {} and job.submitted_at is None


def test_chat_job_and_text_content_parts():
    job = JobRequest.model_validate(
        {
            "id": "c",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
        }
    )
    assert job.messages is not None and job.messages[0].content == "ab"
    assert job.prefix_text() == "<user>ab"


@pytest.mark.parametrize(
    ("data", "code", "needle"),
    [
        ({}, ErrorCode.INVALID_REQUEST, "prompt/messages: exactly one of 'prompt', 'prompts' or 'messages'"),
        (
            {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
            ErrorCode.INVALID_REQUEST,
            "exactly one of",
        ),
        ({"prompt": ""}, ErrorCode.INVALID_REQUEST, "prompt: String should have at least 1 character"),
        ({"messages": []}, ErrorCode.INVALID_REQUEST, "messages: List should have at least 1 item"),
        ({"messages": [{"role": "robot", "content": "x"}]}, ErrorCode.INVALID_REQUEST, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            ErrorCode.INVALID_REQUEST,
            "messages.0.content: only text content parts",
        ),
        (
            {"prompt": "a", "sampling": {"max_tokens": -1}},
            ErrorCode.INVALID_SAMPLING,
            "sampling.max_tokens: Input should be greater than or equal to 0",
        ),
        (
            {"prompt": "a", "sampling": {"max_tokens": 0}},
            ErrorCode.INVALID_SAMPLING,
            "sampling: Value error, max_tokens must be at least 1 (0 only with echo",
        ),
        (
            {"prompts": ["a", []]},
            ErrorCode.INVALID_REQUEST,
            "prompts: prompt 1: an empty token list",
        ),
        (
            {"prompts": []},
            ErrorCode.INVALID_REQUEST,
            "prompts: List should have at least 1 item",
        ),
        (
            {"prompts": [[1, -2]]},
            ErrorCode.INVALID_REQUEST,
            "prompts: prompt 0: token id -2 is out of range",
        ),
        (
            {"prompt": "a", "prompts": ["b"]},
            ErrorCode.INVALID_REQUEST,
            "exactly one of 'prompt', 'prompts' or 'messages'",
        ),
        (
            {"prompts": ["a", "b"], "sampling": {"n": 65}},
            ErrorCode.INVALID_REQUEST,
            "2 prompts times 65 samples each is 130 sequences; the limit is 128",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "sampling": {"n": 2, "best_of": 3}},
            ErrorCode.INVALID_REQUEST,
            "best_of: text completions only",
        ),
        (
            {"prompt": "a", "sampling": {"top_p": 0}},
            ErrorCode.INVALID_SAMPLING,
            "sampling.top_p: Input should be greater than 0",
        ),
        (
            {"prompt": "a", "sampling": {"temperature": -0.5}},
            ErrorCode.INVALID_SAMPLING,
            "sampling.temperature",
        ),
        (
            {"prompt": "a", "sampling": {"stop": [""]}},
            ErrorCode.INVALID_SAMPLING,
            "sampling.stop: Value error, stop strings must be non-empty",
        ),
        (
            {"prompt": "a", "sampling": {"beam": 2}},
            ErrorCode.INVALID_SAMPLING,
            "sampling.beam: Extra inputs are not permitted",
        ),
        ({"prompt": "a\udc80"}, ErrorCode.UNDECODABLE, "prompt:"),
        (
            {"id": " padded", "prompt": "a"},
            ErrorCode.INVALID_REQUEST,
            "id: must be 1 to 200 printable characters",
        ),
        ({"id": "x" * 201, "prompt": "a"}, ErrorCode.INVALID_REQUEST, "id: must be"),
        (
            {"prompt": "a", "priority": 2**31},
            ErrorCode.INVALID_REQUEST,
            "priority: Input should be less than",
        ),
        ({"prompt": "a", "metadata": {"k": object()}}, ErrorCode.INVALID_REQUEST, "metadata.k"),
        (
            {"prompt": "a", "submitted_at": -1},
            ErrorCode.INVALID_REQUEST,
            "submitted_at: Input should be greater than or equal to 0",
        ),
        (
            {"prompt": "a", "colour": "red"},
            ErrorCode.INVALID_REQUEST,
            "colour: Extra inputs are not permitted",
        ),
    ],
)
def test_each_rule_names_its_field(data, code, needle):
    got_code, message = _fail(data)
    assert got_code is code
    assert needle in message


def test_undecodable_json_bytes_map_to_undecodable():
    with pytest.raises(ValidationError) as info:
        JobRequest.model_validate_json(b'{"prompt": "a\\udc80"}')
    assert error_code_for(info.value) is ErrorCode.UNDECODABLE


def test_submitted_sets_once():
    job = JobRequest(prompt="a").submitted(10.0)
    assert job.submitted_at == 10.0
    assert job.submitted(20.0).submitted_at == 10.0


def test_json_round_trip():
    job = JobRequest(prompt="a", batch_id="b", prefix_key="k", metadata={"n": [1, 2]}, sampling={"seed": 3})
    assert JobRequest.model_validate_json(job.model_dump_json()) == job


def test_timings_from_instants():
    t = JobTimings.from_instants(
        submitted_at=100.0,
        admitted_at=100.010,
        first_token_at=100.050,
        finished_at=100.250,
        completion_tokens=5,
    )
    assert t.queue_ms == pytest.approx(10.0)
    assert t.ttft_ms == pytest.approx(50.0)
    assert t.engine_ttft_ms == pytest.approx(40.0)
    assert t.tpot_ms == pytest.approx(50.0)
    assert t.e2e_ms == pytest.approx(250.0)
    measured = JobTimings.from_instants(
        submitted_at=1.0,
        admitted_at=2.0,
        first_token_at=3.0,
        finished_at=4.0,
        engine_ttft_ms=7.5,
        tpot_ms=1.25,
    )
    assert measured.engine_ttft_ms == 7.5 and measured.tpot_ms == 1.25


def test_usage_cached_cannot_exceed_prompt():
    with pytest.raises(
        ValidationError, match="cached_prompt_tokens \\(5\\) must not exceed prompt_tokens \\(3\\)"
    ):
        Usage(prompt_tokens=3, cached_prompt_tokens=5)
    assert Usage(prompt_tokens=3, completion_tokens=4).total_tokens == 7


def test_result_rules():
    with pytest.raises(ValidationError, match="must be succeeded, failed or cancelled, not queued"):
        JobResult(id="a", status=JobStatus.QUEUED)
    with pytest.raises(ValidationError, match="a failed result needs an error_code"):
        JobResult(id="a", status=JobStatus.FAILED)
    with pytest.raises(ValidationError, match="must not have an error_code"):
        JobResult(id="a", status=JobStatus.SUCCEEDED, error_code=ErrorCode.ENGINE_ERROR)
    failed = JobResult.failure(
        "a", ErrorCode.PROMPT_TOO_LONG, "prompt of 9000 tokens > 4096", submitted_at=1.0, finished_at=2.0
    )
    assert failed.status is JobStatus.FAILED and failed.finish_reason is FinishReason.ERROR
    assert failed.timings.e2e_ms == pytest.approx(1000.0)
    cancelled = JobResult.failure("a", ErrorCode.CANCELLED, "by user")
    assert cancelled.status is JobStatus.CANCELLED and cancelled.status.terminal
