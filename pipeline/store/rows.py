"""Rows of `jobs`: JobRequests and JobResults to column values, rows to JobRecords, and the
constants and small SQL helpers every part of the store shares."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Row,
    literal_column,
    or_,
)
from sqlalchemy.types import JSON

from pipeline.store.records import (
    JobRecord,
)
from pipeline.store.tables import jobs
from schemas.job import (
    TERMINAL_STATUSES,
    ChatMessage,
    Choice,
    ErrorCode,
    FinishReason,
    JobRequest,
    JobResult,
    JobStatus,
    JobTimings,
    TokenLogprobs,
    Usage,
)
from schemas.sampling import SamplingParams

TERMINAL = sorted(s.value for s in TERMINAL_STATUSES)
NOT_TERMINAL = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
# Bound parameters per statement stay under SQLite's 32766 and Postgres' 65535.
MAX_PARAMS = 30_000
# Result columns that keep the stored value when the incoming one is null (e.g. submitted_at
# recorded at submission, admitted_at and worker recorded by admit).
KEEP_IF_NULL = ("submitted_at", "admitted_at", "first_token_at", "worker", "model")
REQUEST_COLUMNS = (
    "prompt", "prompts", "messages", "sampling", "prefix_key", "metadata", "custom_id", "owner", "line_no", "line_format",
    "tools",
)
# What a row that holds a line's error (no JobRequest) may be given besides the result.
LINE_COLUMNS = frozenset({"owner", "line_no", "line_format"})
# JSON on SQLite, JSONB on Postgres.
JSON_COLUMNS = frozenset(c.name for c in jobs.columns if isinstance(c.type, JSON))
JSON_NULL = literal_column("'null'::jsonb")


def chunks(rows: list[dict[str, Any]], ncols: int, limit: int) -> Iterable[list[dict[str, Any]]]:
    size = max(1, min(limit, MAX_PARAMS // max(1, ncols)))
    for i in range(0, len(rows), size):
        yield rows[i : i + size]


def request_row(job: JobRequest, status: JobStatus, now: float) -> dict[str, Any]:
    return {
        "id": job.id,
        "batch_id": job.batch_id,
        "status": status.value,
        "prompt": job.prompt,
        "prompts": job.prompts,
        "messages": None if job.messages is None else [m.model_dump(exclude_none=True) for m in job.messages],
        "sampling": job.sampling.model_dump(mode="json"),
        "tools": tools_doc(job),
        "priority": job.priority,
        "prefix_key": job.prefix_key,
        "metadata": dict(job.metadata),
        "custom_id": job.custom_id,
        "owner": job.owner,
        "line_no": job.line_no,
        "line_format": job.line_format,
        "submitted_at": job.submitted_at,
        "created_at": now,
        "updated_at": now,
    }


def result_row(
    result: JobResult, request: JobRequest | None, now: float, line: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    t, u = result.timings, result.usage
    row: dict[str, Any] = {
        "id": result.id,
        "batch_id": result.batch_id,
        "priority": 0,
        "prompt": None,
        "prompts": None,
        "messages": None,
        "sampling": None,
        "tools": None,
        "prefix_key": None,
        "metadata": None,
        "custom_id": result.custom_id,
        "owner": None,
        "line_no": None,
        "line_format": None,
        "status": result.status.value,
        "text": result.text,
        "finish_reason": None if result.finish_reason is None else result.finish_reason.value,
        "prompt_tokens": u.prompt_tokens,
        "cached_prompt_tokens": u.cached_prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "submitted_at": t.submitted_at,
        "admitted_at": t.admitted_at,
        "scheduled_at": t.scheduled_at,
        "first_token_at": t.first_token_at,
        "finished_at": t.finished_at,
        "queue_ms": t.queue_ms,
        "overhead_ms": t.overhead_ms,
        "ttft_ms": t.ttft_ms,
        "engine_ttft_ms": t.engine_ttft_ms,
        "prefill_ms": t.prefill_ms,
        "tpot_ms": t.tpot_ms,
        "e2e_ms": t.e2e_ms,
        "worker": result.worker,
        "model": result.model,
        "error_code": None if result.error_code is None else result.error_code.value,
        "error_message": result.error_message,
        "logprobs": None if result.logprobs is None else [lp.model_dump() for lp in result.logprobs],
        "prompt_logprobs": None if result.prompt_logprobs is None else [
            None if lp is None else lp.model_dump() for lp in result.prompt_logprobs],
        "choices": None if result.choices is None else [c.model_dump(mode="json") for c in result.choices],
        "created_at": now,
        "updated_at": now,
    }
    if line:
        bad = set(line) - LINE_COLUMNS
        if bad:
            raise ValueError(f"not a line column: {sorted(bad)}")
        row.update(line)
    if request is not None:
        req = request_row(request, result.status, now)
        for col in (*REQUEST_COLUMNS, "priority"):
            row[col] = req[col]
        row["batch_id"] = row["batch_id"] or req["batch_id"]
        if row["submitted_at"] is None:
            row["submitted_at"] = req["submitted_at"]
    return row


def status_in(statuses: Iterable[str]) -> Any:
    """`jobs.status IN (...)` with the statuses as SQL literals: an expanding IN parameter cannot
    be used with executemany."""
    return or_(*(jobs.c.status == literal_column(f"'{JobStatus(s).value}'") for s in statuses))


def count_rows(conn: Connection, stmt: Any) -> int:
    # Rows written, counted from RETURNING: DBAPI rowcount is -1 for some drivers' multi-row upserts.
    return len(conn.execute(stmt).all())


def first_by_id(items: Iterable[Any], key: Callable[[Any], str]) -> list[Any]:
    seen: set[str] = set()
    out = []
    for item in items:
        k = key(item)
        if k not in seen:
            seen.add(k)
            out.append(item)
    return out


def tools_doc(job: JobRequest) -> dict[str, Any] | None:
    """The `tools` column of a job: its tools, tool_choice and parallel_tool_calls, or null."""
    if job.tools is None:
        return None
    choice = job.tool_choice
    return {"tools": [t.model_dump(exclude_none=True) for t in job.tools],
            "tool_choice": choice if choice is None or isinstance(choice, str) else choice.model_dump(),
            "parallel_tool_calls": job.parallel_tool_calls}


def job_record(row: Row[Any]) -> JobRecord:
    m = row._mapping
    messages = m["messages"]
    sampling = m["sampling"]
    return JobRecord(
        id=m["id"],
        batch_id=m["batch_id"],
        status=JobStatus(m["status"]),
        custom_id=m["custom_id"],
        owner=m["owner"],
        line_no=m["line_no"],
        line_format=m["line_format"],
        prompt=m["prompt"],
        prompts=m["prompts"],
        messages=None if messages is None else [ChatMessage.model_validate(x) for x in messages],
        sampling=None if sampling is None else SamplingParams.model_validate(sampling),
        priority=m["priority"],
        prefix_key=m["prefix_key"],
        metadata=m["metadata"] or {},
        text=m["text"],
        finish_reason=None if m["finish_reason"] is None else FinishReason(m["finish_reason"]),
        usage=Usage(
            prompt_tokens=m["prompt_tokens"] or 0,
            cached_prompt_tokens=m["cached_prompt_tokens"] or 0,
            completion_tokens=m["completion_tokens"] or 0,
        ),
        timings=JobTimings(**{k: m[k] for k in JobTimings.model_fields}),
        worker=m["worker"],
        model=m["model"],
        error_code=None if m["error_code"] is None else ErrorCode(m["error_code"]),
        error_message=m["error_message"],
        created_at=m["created_at"],
        updated_at=m["updated_at"],
        logprobs=None if m["logprobs"] is None else [TokenLogprobs.model_validate(x) for x in m["logprobs"]],
        prompt_logprobs=None if m["prompt_logprobs"] is None else [
            None if x is None else TokenLogprobs.model_validate(x) for x in m["prompt_logprobs"]],
        deliveries=m["deliveries"],
        choices=None if m["choices"] is None else [Choice.model_validate(x) for x in m["choices"]],
        tools=m["tools"],
    )


def cancelled_row(reason: str, now: float) -> dict[str, Any]:
    """The column values of a job cancelled now (by its owner, or with its batch)."""
    return {
        "status": JobStatus.CANCELLED.value,
        "finish_reason": FinishReason.ABORT.value,
        "error_code": ErrorCode.CANCELLED.value,
        "error_message": reason,
        "finished_at": now,
        "updated_at": now,
    }


class StoreBase:
    """What every part of ResultStore works with (set by ResultStore.__init__)."""

    engine: Engine
    batch_rows: int
    dialect: str
    _clock: Callable[[], float]
    _insert: Any
    _stmts: dict[tuple[str, tuple[str, ...], bool], Any]
