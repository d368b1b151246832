"""Results to OpenAI response bodies (chat and text completions, usage, logprobs, firsttoken's
extension with the job's id and timings), and the output line of each result in its input line's
format (plain, or an OpenAI Batch output line)."""

from __future__ import annotations

import json
from typing import Any

from schemas.job import Choice, ErrorCode, JobResult, JobStatus, TokenLogprobs, TopLogprob
from schemas.openai.errors import HTTP_STATUS, error_body
from schemas.openai.formats import LineFormat
from schemas.openai.tool_calls import parse_tool_calls, tool_finish
from schemas.sampling import SamplingParams
from schemas.tools import ToolUse


def plain_output(result: JobResult, echo: str | None = None, tools: ToolUse | None = None) -> dict[str, Any]:
    """The plain output object of one result: `id` is the client's id (null for a line that had
    none), `job_id` firsttoken's, then the JobResult's fields, JSON-ready (`echo`: the prompt the
    text starts with; `tools`: the job's ToolUse, whose calls are added as `tool_calls`, the raw
    text kept)."""
    out: dict[str, Any] = {"id": result.custom_id, "job_id": result.id}
    # not asked: not shown
    absent = {k for k in ("logprobs", "prompt_logprobs", "choices") if getattr(result, k) is None}
    out.update(result.model_dump(mode="json", exclude={"id", "custom_id"} | absent))
    if echo is not None and result.status is JobStatus.SUCCEEDED:
        out["text"] = echo + (result.text or "")
    if result.choices is not None:
        out["choices"] = [_plain_choice(c) for c in result.choices]
        if result.status is JobStatus.SUCCEEDED:  # the first choice's, as the row's own columns
            out["text"] = out["choices"][0]["text"]
    if tools is not None and result.status is JobStatus.SUCCEEDED:
        for c, target in zip(result_choices(result), out.get("choices") or [out]):
            calls = parse_tool_calls(tools, c.text, result.id, c.index)[1]
            if calls:
                target["tool_calls"] = calls
    return out


def _plain_choice(c: Choice) -> dict[str, Any]:
    absent = {k for k in ("logprobs", "prompt_logprobs") if getattr(c, k) is None}
    out = c.model_dump(mode="json", exclude={"echo"} | absent)
    out["text"] = (c.echo or "") + c.text
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


def echo_prompt(prompt: str | None, sampling: SamplingParams | None, fmt: LineFormat) -> str | None:
    """The prompt a job's output text starts with (`echo`: text completions and plain lines with a
    text prompt), or None."""
    if fmt is LineFormat.OPENAI_CHAT or sampling is None or not sampling.echo:
        return None
    return prompt


def _echo_logprobs(out: JobResult | Choice, prompt: str) -> list[TokenLogprobs | str] | None:
    """A completion's log-probabilities with the prompt's before them (echo): the first prompt
    token, which nothing predicts, as its text alone (no log-probability, as OpenAI's)."""
    if out.logprobs is None:
        return None
    scored = [lp for lp in out.prompt_logprobs or [] if lp is not None]
    rest = "".join(lp.token for lp in scored)
    first = prompt[: len(prompt) - len(rest)] if prompt.endswith(rest) else ""
    return [first, *scored, *out.logprobs]


def openai_logprobs(logprobs: list[TokenLogprobs] | list[TokenLogprobs | str] | None,
                    fmt: LineFormat) -> dict[str, Any] | None:
    """A choice's `logprobs` object: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`,
    or completions' `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}` (an
    entry that is only a text, an echoed prompt's first token: null log-probabilities)."""
    if logprobs is None:
        return None
    if fmt is LineFormat.OPENAI_CHAT:
        def entry(t: TopLogprob) -> dict[str, Any]:
            return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8", "replace"))}

        return {"content": [{**entry(lp), "top_logprobs": [entry(t) for t in lp.top]} for lp in logprobs],
                "refusal": None}
    offsets, at = [], 0
    tokens = [lp if isinstance(lp, str) else lp.token for lp in logprobs]
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [None if isinstance(lp, str) else lp.logprob for lp in logprobs],
        # a dict per token, as OpenAI's: alternatives whose texts coincide keep the likelier
        "top_logprobs": [None if isinstance(lp, str) else {t.token: t.logprob for t in reversed(lp.top)}
                         for lp in logprobs],
        "text_offset": offsets,
    }


def choice_logprobs(result: JobResult | Choice, fmt: LineFormat, echo: str | None = None) -> dict[str, Any] | None:
    """A result's (or one choice's) `logprobs` object, the echoed prompt's tokens first when
    `echo` is given."""
    return openai_logprobs(result.logprobs if echo is None else _echo_logprobs(result, echo), fmt)


def result_choices(result: JobResult, echo: str | None = None) -> list[Choice]:
    """A succeeded result's choices: its `choices`, or its one output as choice 0 (`echo`: the
    prompt a single-prompt text completion starts with)."""
    if result.choices is not None:
        return result.choices
    return [Choice(index=0, text=result.text, finish_reason=result.finish_reason, logprobs=result.logprobs,
                   prompt_logprobs=result.prompt_logprobs, echo=echo)]


def _prompt_logprobs_field(lps: list[TokenLogprobs | None]) -> list[dict[str, Any] | None]:
    return [None if lp is None else {
        "token": lp.token, "logprob": lp.logprob,
        "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in lp.top]} for lp in lps]


def openai_choice(c: Choice, fmt: LineFormat, tools: ToolUse | None = None, job_id: str = "") -> dict[str, Any]:
    """One choice of a (chat) completion response; `tools`: how to read the tool calls of job
    `job_id` out of its text (the message's tool_calls, finish_reason tool_calls)."""
    finish = None if c.finish_reason is None else c.finish_reason.value
    if fmt is LineFormat.OPENAI_CHAT:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if tools is not None:
            content, calls = parse_tool_calls(tools, c.text, job_id, c.index)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = tool_finish(c.finish_reason, True)
        out: dict[str, Any] = {"index": c.index, "message": message,
                               "finish_reason": finish, "logprobs": openai_logprobs(c.logprobs, fmt)}
    else:
        out = {"index": c.index, "text": (c.echo or "") + c.text, "finish_reason": finish,
               "logprobs": choice_logprobs(c, fmt, c.echo)}
    if c.prompt_logprobs is not None and c.echo is None:  # asked with prompt_logprobs (vLLM's extension)
        out["prompt_logprobs"] = _prompt_logprobs_field(c.prompt_logprobs)
    return out


def openai_response(result: JobResult, fmt: LineFormat, model: str | None = None,
                    echo: str | None = None, tools: ToolUse | None = None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of one result as an OpenAI (chat) completions response; a failed or
    cancelled job gives its error status and an OpenAI error body. The body carries the job's
    timings under `firsttoken`. `echo`: the prompt a text completion starts with (echo_prompt; a
    result with choices has each choice's own). `tools`: the job's ToolUse (its tool calls are
    read out of each choice's text)."""
    if result.status is JobStatus.SUCCEEDED:
        created = int(result.timings.finished_at or 0)
        if fmt is LineFormat.OPENAI_CHAT:
            obj, prefix = "chat.completion", "chatcmpl-"
        else:
            obj, prefix = "text_completion", "cmpl-"
        return 200, {
            "id": prefix + result.id,
            "object": obj,
            "created": created,
            "model": model or result.model,
            "choices": [openai_choice(c, fmt, tools, result.id) for c in result_choices(result, echo)],
            "usage": openai_usage(result),
            "firsttoken": firsttoken_extension(result),
        }
    code = result.error_code or ErrorCode.CANCELLED
    status = HTTP_STATUS[code]
    return status, error_body(code, result.error_message or code.value, status=status)


def openai_output(result: JobResult, fmt: LineFormat, echo: str | None = None,
                  tools: ToolUse | None = None) -> dict[str, Any]:
    """The OpenAI Batch API output object of one result (`custom_id` = the line's custom id)."""
    if fmt is LineFormat.PLAIN:
        raise ValueError("openai_output needs an OpenAI line format")
    status_code, body = openai_response(result, fmt, echo=echo, tools=tools)
    return {
        "id": f"batch_req_{result.id}",
        "custom_id": result.custom_id,
        "response": {"status_code": status_code, "request_id": result.id, "body": body},
        "error": None,
    }


def format_output_line(result: JobResult, fmt: LineFormat, echo: str | None = None,
                       tools: ToolUse | None = None) -> str:
    """One output JSONL line (with its newline) for `result`, in the format its input line had
    (`echo`: the prompt its text completion starts with; `tools`: the job's ToolUse, whose calls
    are read out of the text)."""
    obj = plain_output(result, echo, tools) if fmt is LineFormat.PLAIN else openai_output(result, fmt, echo, tools)
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"
