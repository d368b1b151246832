"""Batch-file lines: parsing input JSONL into JobRequests and writing result lines.

Two input formats, told apart line by line:

- plain: `{"id": "a1", "prompt": "..."}` or `{"id": ..., "messages": [...]}`, with optional
  `sampling` (an object) or sampling fields at the top level (`"max_tokens": 16`), `priority`,
  `prefix_key`, `metadata`, `batch_id`;
- OpenAI Batch API: `{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
  "body": {"model": ..., "messages": [...], "max_tokens": 16, ...}}` (or `/v1/completions` with
  `"prompt"`).

A line that cannot become a JobRequest gives a `BatchLineError` with an ErrorCode, a message
naming the field and rule, and the job id the line claims when it has a usable one, so that the
caller can record a `failed` row for it instead of stopping.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from schemas.job import (
    ErrorCode,
    JobRequest,
    JobResult,
    JobStatus,
    describe_validation_error,
    error_code_for,
    job_id_hint,
)
from schemas.sampling import SamplingParams


class LineFormat(StrEnum):
    """The format of one input line, and so of its output line."""

    PLAIN = "plain"
    OPENAI_CHAT = "openai_chat"  # url /v1/chat/completions
    OPENAI_COMPLETIONS = "openai_completions"  # url /v1/completions


OPENAI_URLS = {
    "/v1/chat/completions": LineFormat.OPENAI_CHAT,
    "/v1/completions": LineFormat.OPENAI_COMPLETIONS,
}

_SAMPLING_FIELDS = frozenset(SamplingParams.model_fields)
_PLAIN_FIELDS = frozenset(JobRequest.model_fields)

# OpenAI body fields taken as they are, renamed, or accepted only at their default (no-op) value.
_OPENAI_SAMPLING = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
}
_OPENAI_IGNORED = frozenset({"model", "user", "store", "metadata", "service_tier", "stream_options"})
_OPENAI_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "n": (1, None),
    "best_of": (1, None),
    "stream": (False, None),
    "echo": (False, None),
    "logprobs": (False, None),
    "top_logprobs": (0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": ({}, None),
    "suffix": (None, ""),
    "response_format": ({"type": "text"}, None),
    "tools": ([], None),
    "tool_choice": ("none", None),
}


@dataclass(frozen=True)
class ParsedLine:
    """A batch-file line that became a job."""

    line_no: int  # 1-based line number in the file
    format: LineFormat
    job: JobRequest


@dataclass(frozen=True)
class BatchLineError:
    """A batch-file line that did not become a job."""

    line_no: int
    format: LineFormat | None  # None when the line is not even a JSON object
    code: ErrorCode
    message: str
    job_id: str | None  # the id the line claims, when it has a usable one

    def result(self, *, batch_id: str | None = None, fallback_id: str | None = None) -> JobResult | None:
        """A `failed` result for this line, under its own id or `fallback_id`; None if it has neither."""
        job_id = self.job_id or fallback_id
        if job_id is None:
            return None
        return JobResult.failure(job_id, self.code, f"line {self.line_no}: {self.message}", batch_id=batch_id)


class _LineError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _plain_request(obj: dict[str, Any]) -> dict[str, Any]:
    # one pass over the line's keys (this runs for every line of a bulk submission)
    request: dict[str, Any] = {}
    sampling_top: dict[str, Any] = {}
    unknown: list[str] = []
    for k, v in obj.items():
        if k in _PLAIN_FIELDS:
            request[k] = v
        elif k in _SAMPLING_FIELDS:
            sampling_top[k] = v
        else:
            unknown.append(k)
    if unknown:
        raise _LineError(ErrorCode.INVALID_REQUEST, f"{min(unknown)}: unknown field (plain line)")
    if sampling_top:
        nested = request.get("sampling") or {}
        if not isinstance(nested, dict):
            raise _LineError(ErrorCode.INVALID_REQUEST, "sampling: must be an object")
        both = sorted(set(nested) & set(sampling_top))
        if both:
            raise _LineError(
                ErrorCode.INVALID_REQUEST, f"{both[0]}: given both at the top level and in 'sampling'"
            )
        request["sampling"] = {**nested, **sampling_top}
    return request


def _openai_request(obj: dict[str, Any]) -> tuple[LineFormat, dict[str, Any]]:
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise _LineError(ErrorCode.INVALID_REQUEST, f"{unknown[0]}: unknown field (OpenAI batch line)")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _LineError(ErrorCode.INVALID_REQUEST, "custom_id: must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise _LineError(ErrorCode.INVALID_REQUEST, "method: must be POST")
    url = obj.get("url")
    if url not in OPENAI_URLS:
        raise _LineError(ErrorCode.INVALID_REQUEST, f"url: must be one of {sorted(OPENAI_URLS)}, got {url!r}")
    fmt = OPENAI_URLS[url]
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _LineError(ErrorCode.INVALID_REQUEST, "body: must be an object")

    request: dict[str, Any] = {"id": custom_id}
    sampling: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    for key, value in body.items():
        if key == "messages" and fmt is LineFormat.OPENAI_CHAT:
            request["messages"] = value
        elif key == "prompt" and fmt is LineFormat.OPENAI_COMPLETIONS:
            if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
                value = value[0]
            if not isinstance(value, str):
                raise _LineError(
                    ErrorCode.INVALID_REQUEST, "body.prompt: must be a string (or a list of one string)"
                )
            request["prompt"] = value
        elif key in _OPENAI_SAMPLING:
            if value is not None:
                name = _OPENAI_SAMPLING[key]
                if name in sampling:
                    raise _LineError(
                        ErrorCode.INVALID_REQUEST,
                        f"body.{key}: given twice (max_tokens/max_completion_tokens)",
                    )
                sampling[name] = value
        elif key in _OPENAI_IGNORED:
            if key == "model" and isinstance(value, str):
                metadata["model"] = value
            elif key == "metadata" and isinstance(value, dict):
                metadata.update(value)
        elif key in _OPENAI_DEFAULT_ONLY:
            if value not in _OPENAI_DEFAULT_ONLY[key]:
                raise _LineError(
                    ErrorCode.INVALID_REQUEST, f"body.{key}: not supported (only its default value)"
                )
        else:
            raise _LineError(ErrorCode.INVALID_REQUEST, f"body.{key}: unknown or unsupported field")
    if fmt is LineFormat.OPENAI_CHAT and "messages" not in request:
        raise _LineError(ErrorCode.INVALID_REQUEST, "body.messages: required for /v1/chat/completions")
    if fmt is LineFormat.OPENAI_COMPLETIONS and "prompt" not in request:
        raise _LineError(ErrorCode.INVALID_REQUEST, "body.prompt: required for /v1/completions")
    request["sampling"] = sampling
    if metadata:
        request["metadata"] = metadata
    return fmt, request


def _describe(exc: ValidationError, fmt: LineFormat) -> str:
    if fmt is LineFormat.PLAIN:
        return describe_validation_error(exc)
    # OpenAI lines: the fields sit in `body`, sampling fields directly in it.
    return describe_validation_error(exc, prefix="body.").replace("body.sampling.", "body.")


def parse_line(
    line: str | bytes,
    line_no: int,
    *,
    batch_id: str | None = None,
    default_id: str | None = None,
) -> ParsedLine | BatchLineError | None:
    """Parse one batch-file line. Blank lines give None.

    `batch_id` is set on the job unless the line has its own; `default_id` is the job id of a
    plain line without an `id` (a fresh uuid when None).
    """
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            return BatchLineError(
                line_no, None, ErrorCode.UNDECODABLE, f"line is not valid UTF-8 (byte {exc.start})", None
            )
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return BatchLineError(
            line_no, None, ErrorCode.INVALID_REQUEST, f"not valid JSON: {exc.msg} at column {exc.colno}", None
        )
    if not isinstance(obj, dict):
        return BatchLineError(line_no, None, ErrorCode.INVALID_REQUEST, "a line must be a JSON object", None)

    fmt = LineFormat.PLAIN
    try:
        if "custom_id" in obj:
            fmt = OPENAI_URLS.get(obj.get("url"), LineFormat.OPENAI_CHAT)  # type: ignore[arg-type]
            fmt, request = _openai_request(obj)
        else:
            request = _plain_request(obj)
            if "id" not in request and default_id is not None:
                request["id"] = default_id
        if batch_id is not None and request.get("batch_id") is None:
            request["batch_id"] = batch_id
        job = JobRequest.model_validate(request)
    except _LineError as exc:
        return BatchLineError(line_no, fmt, exc.code, exc.message, job_id_hint(obj))
    except ValidationError as exc:
        return BatchLineError(line_no, fmt, error_code_for(exc), _describe(exc, fmt), job_id_hint(obj))
    return ParsedLine(line_no, fmt, job)


def parse_lines(
    lines: Iterable[str | bytes], *, batch_id: str | None = None, id_prefix: str | None = None
) -> Iterator[ParsedLine | BatchLineError]:
    """Parse every non-blank line; plain lines without an id get `{id_prefix}{line_no}` when given."""
    for line_no, line in enumerate(lines, start=1):
        default_id = None if id_prefix is None else f"{id_prefix}{line_no}"
        parsed = parse_line(line, line_no, batch_id=batch_id, default_id=default_id)
        if parsed is not None:
            yield parsed


# --- output ----------------------------------------------------------------------------------------

_HTTP_STATUS = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.PROMPT_TOO_LONG: 400,
    ErrorCode.INVALID_SAMPLING: 400,
    ErrorCode.UNDECODABLE: 400,
    ErrorCode.CANCELLED: 499,
    ErrorCode.ENGINE_ERROR: 500,
    ErrorCode.INTERNAL_ERROR: 500,
}


def plain_output(result: JobResult) -> dict[str, Any]:
    """The plain output object of one result: the JobResult's fields, JSON-ready."""
    return result.model_dump(mode="json")


def openai_output(result: JobResult, fmt: LineFormat) -> dict[str, Any]:
    """The OpenAI Batch API output object of one result (`custom_id` = job id)."""
    if fmt is LineFormat.PLAIN:
        raise ValueError("openai_output needs an OpenAI line format")
    if result.status is JobStatus.SUCCEEDED:
        created = int(result.timings.finished_at or 0)
        finish = result.finish_reason.value if result.finish_reason is not None else None
        if fmt is LineFormat.OPENAI_CHAT:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": finish,
                "logprobs": None,
            }
            obj, prefix = "chat.completion", "chatcmpl-"
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": finish, "logprobs": None}
            obj, prefix = "text_completion", "cmpl-"
        body: dict[str, Any] = {
            "id": prefix + result.id,
            "object": obj,
            "created": created,
            "model": result.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": result.usage.prompt_tokens,
                "completion_tokens": result.usage.completion_tokens,
                "total_tokens": result.usage.total_tokens,
                "prompt_tokens_details": {"cached_tokens": result.usage.cached_prompt_tokens},
            },
        }
        status_code = 200
    else:
        code = result.error_code or ErrorCode.CANCELLED
        status_code = _HTTP_STATUS[code]
        body = {
            "error": {"message": result.error_message or code.value, "type": code.value, "code": code.value}
        }
    return {
        "id": f"batch_req_{result.id}",
        "custom_id": result.id,
        "response": {"status_code": status_code, "request_id": result.id, "body": body},
        "error": None,
    }


def format_output_line(result: JobResult, fmt: LineFormat) -> str:
    """One output JSONL line (with its newline) for `result`, in the format its input line had."""
    obj = plain_output(result) if fmt is LineFormat.PLAIN else openai_output(result, fmt)
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"
