"""Results to OpenAI response bodies (chat and text completions, usage, logprobs, firsttoken's
extension with the job's id and timings), and the output line of each result in its input line's
format (plain, or an OpenAI Batch output line)."""

from __future__ import annotations

import json
from typing import Any

from schemas.job import ErrorCode, JobResult, JobStatus, TokenLogprobs, TopLogprob
from schemas.openai.errors import HTTP_STATUS, error_body
from schemas.openai.formats import LineFormat


def plain_output(result: JobResult) -> dict[str, Any]:
    """The plain output object of one result: `id` is the client's id (null for a line that had
    none), `job_id` firsttoken's, then the JobResult's fields, JSON-ready."""
    out: dict[str, Any] = {"id": result.custom_id, "job_id": result.id}
    absent = {k for k in ("logprobs", "prompt_logprobs") if getattr(result, k) is None}  # not asked: not shown
    out.update(result.model_dump(mode="json", exclude={"id", "custom_id"} | absent))
    return out


def openai_usage(result: JobResult) -> dict[str, Any]:
    """The OpenAI `usage` object of a result (cached prompt tokens included)."""
    return {
        "prompt_tokens": result.usage.prompt_tokens,
        "completion_tokens": result.usage.completion_tokens,
        "total_tokens": result.usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": result.usage.cached_prompt_tokens},
    }


def firsttoken_extension(result: JobResult) -> dict[str, Any]:
    """firsttoken's own fields beside an OpenAI response: the job's id and its timings (TTFT first)."""
    return {"job_id": result.id, "timings": result.timings.model_dump(mode="json")}


def openai_logprobs(logprobs: list[TokenLogprobs] | None, fmt: LineFormat) -> dict[str, Any] | None:
    """A choice's `logprobs` object: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`,
    or completions' `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`."""
    if logprobs is None:
        return None
    if fmt is LineFormat.OPENAI_CHAT:
        def entry(t: TopLogprob) -> dict[str, Any]:
            return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8", "replace"))}

        return {"content": [{**entry(lp), "top_logprobs": [entry(t) for t in lp.top]} for lp in logprobs],
                "refusal": None}
    offsets, at = [], 0
    for lp in logprobs:
        offsets.append(at)
        at += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        # a dict per token, as OpenAI's: alternatives whose texts coincide keep the likelier
        "top_logprobs": [{t.token: t.logprob for t in reversed(lp.top)} for lp in logprobs],
        "text_offset": offsets,
    }


def openai_response(result: JobResult, fmt: LineFormat, model: str | None = None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of one result as an OpenAI (chat) completions response; a failed or
    cancelled job gives its error status and an OpenAI error body. The body carries the job's
    timings under `firsttoken`."""
    if result.status is JobStatus.SUCCEEDED:
        created = int(result.timings.finished_at or 0)
        finish = result.finish_reason.value if result.finish_reason is not None else None
        if fmt is LineFormat.OPENAI_CHAT:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": finish,
                "logprobs": openai_logprobs(result.logprobs, fmt),
            }
            obj, prefix = "chat.completion", "chatcmpl-"
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": finish,
                      "logprobs": openai_logprobs(result.logprobs, fmt)}
            obj, prefix = "text_completion", "cmpl-"
        if result.prompt_logprobs is not None:  # asked with prompt_logprobs (vLLM's extension)
            choice["prompt_logprobs"] = [None if lp is None else {
                "token": lp.token, "logprob": lp.logprob,
                "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in lp.top]}
                for lp in result.prompt_logprobs]
        return 200, {
            "id": prefix + result.id,
            "object": obj,
            "created": created,
            "model": model or result.model,
            "choices": [choice],
            "usage": openai_usage(result),
            "firsttoken": firsttoken_extension(result),
        }
    code = result.error_code or ErrorCode.CANCELLED
    status = HTTP_STATUS[code]
    return status, error_body(code, result.error_message or code.value, status=status)


def openai_output(result: JobResult, fmt: LineFormat) -> dict[str, Any]:
    """The OpenAI Batch API output object of one result (`custom_id` = the line's custom id)."""
    if fmt is LineFormat.PLAIN:
        raise ValueError("openai_output needs an OpenAI line format")
    status_code, body = openai_response(result, fmt)
    return {
        "id": f"batch_req_{result.id}",
        "custom_id": result.custom_id,
        "response": {"status_code": status_code, "request_id": result.id, "body": body},
        "error": None,
    }


def format_output_line(result: JobResult, fmt: LineFormat) -> str:
    """One output JSONL line (with its newline) for `result`, in the format its input line had."""
    obj = plain_output(result) if fmt is LineFormat.PLAIN else openai_output(result, fmt)
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"
