"""Batches: `POST /v1/batches` takes either JSONL lines (or a JSON list) as its body, or, as the
OpenAI Batch API does, `{"input_file_id", "endpoint", "completion_window"}` naming an uploaded
file; both become the same batch. A batch answers as an OpenAI Batch object (statuses
in_progress, completed, cancelled; request_counts; output and error files once it ended) with
firsttoken's own fields beside (counts by status, done, complete)."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool

from firsttoken.api.deps import MODEL_NOT_FOUND, ApiError, ApiState, Principal, State, Who, read_body
from pipeline.batch_io import batch_format, bytes_digest, result_lines
from pipeline.producer import BatchConflict, JobCheck
from pipeline.store import BatchRecord, BatchStatus
from schemas.batchfile import loads_strict
from schemas.job import ErrorCode, JobRequest, JobStatus, new_job_id
from schemas.openai import OPENAI_URLS

router = APIRouter(tags=["batches"])

# our batch status -> the OpenAI Batch API's
_OPENAI_STATUS = {BatchStatus.OPEN: "in_progress", BatchStatus.COMPLETED: "completed",
                  BatchStatus.CANCELLED: "cancelled", BatchStatus.EXPIRED: "expired", BatchStatus.FAILED: "failed"}
WINDOW_S = 24 * 3600  # the only completion window: "24h"
OUTPUT_PREFIX = "file-output-"  # + batch id: the batch's succeeded lines, in input order
ERRORS_PREFIX = "file-errors-"  # + batch id: its failed and cancelled lines


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchView(BaseModel):
    """An OpenAI Batch object, and firsttoken's progress fields beside it."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: str = "batch"
    endpoint: str | None
    errors: Any = None
    input_file_id: str | None
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, Any] | None
    # firsttoken's
    input_format: str | None
    total: int | None
    recorded: int
    done: int
    complete: bool
    counts: dict[str, int]
    finished_at: float | None


class BatchList(BaseModel):
    object: str = "list"
    data: list[BatchView]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchSubmitted(BaseModel):
    """What a JSONL submission did."""

    batch_id: str
    lines: int
    submitted: int
    invalid: int
    resumed: bool
    errors: list[dict[str, Any]]


class OpenAIBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def openai_status(b: BatchRecord) -> str:
    """The OpenAI Batch status of a batch: `validating` while its input is still being read (no
    total yet), `finalizing` once every job ended but before the batch is marked completed, then
    `in_progress`, `completed` or `cancelled`."""
    if b.status is BatchStatus.OPEN:
        if b.total_jobs is None:
            return "validating"
        if b.progress.complete:
            return "finalizing"
    return _OPENAI_STATUS.get(b.status, b.status)


def batch_view(b: BatchRecord) -> BatchView:
    """The OpenAI Batch object of a batch, with firsttoken's fields."""
    p = b.progress
    total = p.total if p.total is not None else p.recorded
    ended = b.status.ended
    oa = b.metadata.get("openai", {}) if isinstance(b.metadata, dict) else {}
    succeeded = p.count(JobStatus.SUCCEEDED)
    failed = p.count(JobStatus.FAILED) + p.count(JobStatus.CANCELLED)
    finished = None if b.finished_at is None else int(b.finished_at)
    return BatchView(
        id=b.id,
        endpoint=oa.get("endpoint"),
        input_file_id=oa.get("input_file_id"),
        completion_window=oa.get("completion_window", "24h"),
        status=openai_status(b),
        output_file_id=OUTPUT_PREFIX + b.id if ended and succeeded else None,
        error_file_id=ERRORS_PREFIX + b.id if ended and failed else None,
        created_at=int(b.created_at),
        in_progress_at=int(b.created_at),
        completed_at=finished if b.status is BatchStatus.COMPLETED else None,
        cancelled_at=finished if b.status is BatchStatus.CANCELLED else None,
        expired_at=finished if b.status is BatchStatus.EXPIRED else None,
        failed_at=finished if b.status is BatchStatus.FAILED else None,
        expires_at=int(b.created_at + WINDOW_S) if oa else None,
        errors=oa.get("errors"),
        request_counts=RequestCounts(total=total, completed=succeeded, failed=failed),
        metadata=oa.get("metadata"),
        input_format=b.input_format,
        total=p.total,
        recorded=p.recorded,
        done=p.done,
        complete=p.complete,
        counts={k.value: v for k, v in p.counts.items()},
        finished_at=b.finished_at,
    )


def _batch_lines(raw: bytes) -> list[bytes | str]:
    """A JSONL body as lines, or a JSON list body as one line per item."""
    if raw.lstrip()[:1] != b"[":
        return raw.splitlines()  # type: ignore[return-value]
    try:
        items = loads_strict(raw)
    except (ValueError, RecursionError) as exc:
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        raise ApiError(400, ErrorCode.INVALID_REQUEST, f"body: not a valid JSON list ({msg})") from None
    if not isinstance(items, list):
        raise ApiError(400, ErrorCode.INVALID_REQUEST, "body: send JSONL lines or one JSON list")
    return [json.dumps(x, ensure_ascii=False) for x in items]


def _openai_request(raw: bytes) -> OpenAIBatchRequest | None:
    """The body as an OpenAI batch creation, if it is one (a JSON object naming input_file_id)."""
    head = raw.lstrip()[:1]
    if head != b"{" or len(raw) > 64 * 1024 or b"input_file_id" not in raw:
        return None
    try:
        obj = loads_strict(raw, check_text=False)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or "input_file_id" not in obj:
        return None
    try:  # a batch creation: a NUL or a lone surrogate in any of its strings is a 400
        loads_strict(raw)
    except ValueError:
        raise ApiError(400, ErrorCode.INVALID_REQUEST,
                       "batch: a string holds a NUL or an unpaired surrogate") from None
    try:
        return OpenAIBatchRequest.model_validate(obj)
    except ValidationError as exc:  # the fields and rules, never the values
        parts = [f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]]
        raise ApiError(400, ErrorCode.INVALID_REQUEST, "batch: " + "; ".join(parts)) from None


@router.post("/v1/batches", status_code=202, response_model=BatchSubmitted | BatchView)
async def submit_batch(
    request: Request,
    who: Who,
    state: State,
    batch_id: str | None = Query(default=None, min_length=1, max_length=200, pattern=r"^\S(.*\S)?$"),
    max_tokens: int | None = Query(default=None, ge=1, le=1 << 20),
) -> Any:
    """A batch from JSONL lines in the body, or (OpenAI) from an uploaded file."""
    raw = await read_body(request, state.settings.api_max_batch_bytes)
    oa = _openai_request(raw)
    if oa is not None:
        view = await run_in_threadpool(_create_openai_batch, state, oa, who)
        return JSONResponse(view.model_dump(mode="json"), status_code=200)
    return await run_in_threadpool(_submit_lines, state, raw, batch_id, max_tokens, who)


def _submit(
    state: ApiState,
    lines: list[bytes | str],
    *,
    bid: str,
    digest: str,
    max_tokens: int | None,
    who: Principal,
    check: JobCheck | None,
) -> Any:
    try:
        return state.producer().submit_batch(
            lines,
            batch_id=bid,
            input_digest=digest,
            source="api",
            default_max_tokens=max_tokens,
            owner=who.owner,
            check=check,
        )
    except BatchConflict as exc:  # (messages without the id: the caller has it)
        if exc.reason == "owner":
            raise ApiError(403, "forbidden", "this batch id cannot be used; choose another") from None
        raise ApiError(409, "conflict", "this batch id already holds another input; submit this one under "
                       "another batch id") from None


def _submit_lines(
    state: ApiState, raw: bytes, batch_id: str | None, max_tokens: int | None, who: Principal
) -> BatchSubmitted:
    if batch_id is not None and not batch_id.isprintable():
        raise ApiError(422, ErrorCode.INVALID_REQUEST, "batch_id: must be printable characters")
    lines = _batch_lines(raw)
    if not any(line.strip() for line in lines):
        raise ApiError(400, ErrorCode.INVALID_REQUEST, "body: no jobs (send JSONL lines or a JSON list)")
    unserved = state.unserved_models(lines, limit=1)
    if unserved:  # as OpenAI's batches: refused whole, nothing queued
        line_no, name = unserved[0]
        raise ApiError(404, MODEL_NOT_FOUND, f"line {line_no}: {state.model_not_found_message(name)}",
                       param="body.model")
    new = sum(1 for line in lines if line.strip())
    bid = f"batch_{new_job_id()}" if batch_id is None else state.batch_id_for(who, batch_id)
    if batch_id is not None:  # resuming a batch: its lines already recorded are not new jobs
        new -= state.st.batch_progress(bid).recorded
    state.admit(who, new)  # a batch is taken whole or not at all
    summary = _submit(state, lines, bid=bid, digest=bytes_digest(raw), max_tokens=max_tokens, who=who, check=state.check)
    return BatchSubmitted(
        batch_id=bid,
        lines=summary.lines,
        submitted=summary.submitted,
        invalid=summary.invalid,
        resumed=summary.resumed,
        errors=[
            {"custom_id": f.custom_id, "error_code": f.error_code, "error": f.error_message, "line": f.line_no or None}
            for f in summary.errors
        ],
    )


def _create_openai_batch(state: ApiState, req: OpenAIBatchRequest, who: Principal) -> BatchView:
    if req.endpoint not in OPENAI_URLS:
        raise ApiError(400, ErrorCode.INVALID_REQUEST, f"endpoint: one of {sorted(OPENAI_URLS)}")
    if req.completion_window != "24h":
        raise ApiError(400, ErrorCode.INVALID_REQUEST, "completion_window: only '24h'")
    f = state.st.get_file(req.input_file_id)
    if f is None or not who.may_see(f.owner):
        raise ApiError(404, "not_found", "no such file")
    if f.purpose != "batch":
        raise ApiError(400, ErrorCode.INVALID_REQUEST, f"file {f.id!r} has purpose {f.purpose!r}, not 'batch'")
    content = state.st.file_content(f.id) or b""
    lines = content.splitlines()
    if not any(line.strip() for line in lines):
        raise ApiError(400, ErrorCode.INVALID_REQUEST, f"file {f.id!r} holds no requests")
    unserved = state.unserved_models(lines)
    if not unserved:
        state.admit(who, sum(1 for line in lines if line.strip()))
    fmt = OPENAI_URLS[req.endpoint].value
    inner = state.check

    def check(job: JobRequest) -> tuple[ErrorCode, str] | None:
        if job.line_format != fmt:
            return ErrorCode.INVALID_REQUEST, f"url: this batch's endpoint is {req.endpoint}"
        return None if inner is None else inner(job)

    bid = f"batch_{new_job_id()}"
    meta = {"openai": {"endpoint": req.endpoint, "input_file_id": f.id, "completion_window": "24h",
                       "metadata": req.metadata}}
    state.st.create_batch(bid, owner=who.owner, input_digest=f.sha256, source=f"file {f.id}", metadata=meta)
    errors: list[dict[str, Any]] = []
    if unserved:  # as OpenAI's: a line naming another model fails the batch's validation, nothing runs
        errors = [{"code": MODEL_NOT_FOUND, "message": state.model_not_found_message(name), "line": line_no,
                   "param": "body.model"} for line_no, name in unserved]
    else:
        summary = _submit(state, lines, bid=bid, digest=f.sha256, max_tokens=None, who=who, check=check)  # type: ignore[arg-type]
        if summary.submitted == 0 and summary.already_done == 0:  # not one valid request: the batch failed
            errors = [{"code": str(e.error_code), "message": e.error_message, "line": e.line_no or None}
                      for e in summary.errors[:20]]
    if errors:
        meta["openai"]["errors"] = {"object": "list", "data": errors}
        state.st.set_batch_metadata(bid, meta)
        # (its rows are all failed, so the batch may have been marked completed already)
        state.st.end_batch(bid, BatchStatus.FAILED, reason="the batch failed validation",
                           from_statuses=(BatchStatus.OPEN, BatchStatus.COMPLETED))
    b = state.st.get_batch(bid)
    assert b is not None
    return batch_view(b)


@router.get("/v1/batches", response_model=BatchList)
def list_batches(
    who: Who,
    state: State,
    limit: int = Query(default=20, ge=1, le=100),
    after: str | None = Query(default=None, max_length=200),
) -> BatchList:
    """The caller's batches, newest first."""
    page = state.st.list_batches(owner=who.owner, limit=limit + 1, after=after)
    data = [batch_view(expire_if_due(state, b)) for b in page[:limit]]
    return BatchList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=len(page) > limit,
    )


def expire_if_due(state: ApiState, b: BatchRecord, now: float | None = None) -> BatchRecord:
    """An OpenAI batch still open past its completion window expires: its jobs left are cancelled."""
    oa = b.metadata.get("openai") if isinstance(b.metadata, dict) else None
    if b.status != "open" or not oa or (now or time.time()) < b.created_at + WINDOW_S:
        return b
    n = state.st.end_batch(b.id, BatchStatus.EXPIRED, reason="the batch's completion window (24h) passed")
    if n:
        state.cancel([], b.id)
    return state.st.get_batch(b.id) or b


def expire_due(state: ApiState, now: float | None = None, page: int = 100) -> int:
    """Expire every OpenAI batch whose window has passed, read or not (the API's periodic sweep;
    `expire_if_due` also runs on each read). Returns the batches expired."""
    now = time.time() if now is None else now
    n, after = 0, None
    while True:
        due = state.st.open_batches(created_before=now - WINDOW_S, limit=page, after=after)
        n += sum(1 for b in due if expire_if_due(state, b, now).status != "open")
        if len(due) < page:
            return n
        after = (due[-1].created_at, due[-1].id)


@router.get("/v1/batches/{batch_id}", response_model=BatchView)
def get_batch(batch_id: str, who: Who, state: State) -> BatchView:
    """A batch's status and progress."""
    return batch_view(expire_if_due(state, state.find_batch(who, batch_id)))


def _cancel(state: ApiState, who: Principal, batch_id: str) -> tuple[BatchRecord, int]:
    b = state.find_batch(who, batch_id)
    n = state.st.cancel(batch_id=b.id)
    state.cancel([], b.id)
    after = state.st.get_batch(b.id)
    assert after is not None
    return after, n


@router.delete("/v1/batches/{batch_id}")
def cancel_batch(batch_id: str, who: Who, state: State) -> dict[str, Any]:
    """Cancel every queued or running job of a batch."""
    b, n = _cancel(state, who, batch_id)
    return {"id": b.id, "cancelled": n}


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchView)
def cancel_batch_openai(batch_id: str, who: Who, state: State) -> BatchView:
    """Cancel a batch (the OpenAI Batch API's route); answers the batch."""
    b, _ = _cancel(state, who, batch_id)
    return batch_view(b)


@router.get("/v1/batches/{batch_id}/results")
def batch_results(batch_id: str, who: Who, state: State) -> StreamingResponse:
    """Every line's result so far, in input order, each in its input line's format."""
    b = state.find_batch(who, batch_id)
    return StreamingResponse(result_lines(state.st, b.id, batch_format(b.input_format)), media_type="application/x-ndjson")
