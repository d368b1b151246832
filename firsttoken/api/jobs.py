"""Single jobs (`/v1/jobs`) and latency percentiles (`/v1/latency`)."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from firsttoken.api.deps import ApiError, ApiState, Principal, State, Who, read_body
from pipeline.producer import Producer, QueueRefused
from pipeline.store import JobRecord
from pipeline.store.tables import LATENCY_METRICS
from schemas.batchfile import BatchLineError, parse_json_object, parse_line
from schemas.job import (
    Choice,
    ErrorCode,
    JobRequest,
    JobTimings,
    LineError,
    Usage,
    job_id_of_owner,
    new_job_id,
)
from schemas.openai import LineFormat
from schemas.openai.tool_calls import parse_tool_calls

log = logging.getLogger(__name__)
router = APIRouter(tags=["jobs"])

_CODE_STATUS = {ErrorCode.TOO_LARGE: 413}


class JobAccepted(BaseModel):
    """A job taken: its id (firsttoken's), the client's id, and when it was stamped submitted."""

    id: str
    custom_id: str | None
    status: str
    submitted_at: float


class JobView(BaseModel):
    """One job: where it is and, once terminal, its result, usage and timings."""

    id: str
    custom_id: str | None
    batch_id: str | None
    line: int | None
    status: str
    created_at: float
    updated_at: float
    text: str | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: JobTimings
    worker: str | None = None
    model: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    choices: list[Choice] | None = None  # a job of several choices: all of them (text is the first's)
    tool_calls: list[dict[str, Any]] | None = None  # a job with tools: the calls read out of its text (the first choice's)


class Cancelled(BaseModel):
    """What a cancel did."""

    id: str
    cancelled: bool
    status: str | None


class LatencyRow(BaseModel):
    """Percentiles of one metric over one group of jobs (ms)."""

    metric: str
    worker: str | None
    model: str | None
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


class Latency(BaseModel):
    """Latency percentiles of finished jobs."""

    since: float | None
    until: float | None
    stats: list[LatencyRow]


def job_view(rec: JobRecord) -> JobView:
    """The API's view of a job row."""
    base: dict[str, Any] = {
        "id": rec.id,
        "custom_id": rec.custom_id,
        "batch_id": rec.batch_id,
        "line": rec.line_no,
        "status": rec.status.value,
        "created_at": rec.created_at,
        "updated_at": rec.updated_at,
        "timings": rec.timings,
        "worker": rec.worker,
    }
    result = rec.result()
    if result is not None:
        base.update(
            text=result.text,
            finish_reason=None if result.finish_reason is None else result.finish_reason.value,
            usage=result.usage,
            model=result.model,
            error_code=None if result.error_code is None else result.error_code.value,
            error_message=result.error_message,
            choices=result.choices,
        )
        use = rec.tool_use
        if use is not None and result.error_code is None:
            base["tool_calls"] = parse_tool_calls(use, result.text, rec.id)[1] or None
    return JobView(**base)


def queue_one(state: ApiState, job: JobRequest, custom_id: str | None) -> None:
    """Record and publish one job stamped now; 409 when the caller already has its id, 503 when
    the queue is unreachable (the row is removed: the same id may be sent again)."""
    try:
        queued = Producer(state.queue, state.st).submit_one(job)  # type: ignore[arg-type]
    except QueueRefused as exc:
        log.warning("job %s not queued: %s", job.id, exc)
        raise ApiError(503, "unavailable", "the job queue is unreachable; send the job again") from None
    if not queued:
        raise ApiError(409, ErrorCode.DUPLICATE_ID, "you already have a job with this id", job_id=job.id)


def job_id_for(who: Principal, custom_id: str | None) -> str:
    """The id of a single job: scoped to the caller when it gave one, else a fresh one."""
    return new_job_id() if custom_id is None else job_id_of_owner(who.owner, custom_id)


@router.post("/v1/jobs", status_code=202, response_model=JobAccepted)
async def submit_job(request: Request, who: Who, state: State) -> JobAccepted:
    """Queue one job (a plain batch line as the body)."""
    raw = await read_body(request, state.settings.api_max_body_bytes)
    return await run_in_threadpool(_submit_job, state, raw, who)


def _submit_job(state: ApiState, raw: bytes, who: Principal) -> JobAccepted:
    if raw.strip():  # not JSON text any store can keep (bad bytes, a NUL, a lone surrogate, 1e400): 400
        try:
            parse_json_object(raw, max_bytes=state.settings.api_max_body_bytes)
        except LineError as exc:
            raise ApiError(_CODE_STATUS.get(exc.code, 400), exc.code, exc.message) from None
    item = parse_line(raw, 1)
    if item is None:
        raise ApiError(422, ErrorCode.INVALID_REQUEST, "the body is empty: send one job as a JSON object")
    if isinstance(item, BatchLineError):
        raise ApiError(_CODE_STATUS.get(item.code, 422), item.code, item.message)
    if item.format is not LineFormat.PLAIN:
        raise ApiError(422, ErrorCode.INVALID_REQUEST, "an OpenAI batch line goes to POST /v1/batches")
    custom = item.job.id
    job = item.job.to_request(job_id_for(who, custom), owner=who.owner)
    problem = None if state.check is None else state.check(job)
    if problem is not None:
        raise ApiError(422, problem[0], problem[1])
    state.admit(who, 1)
    queue_one(state, job, custom)
    assert job.submitted_at is not None
    return JobAccepted(id=job.id, custom_id=custom, status="queued", submitted_at=job.submitted_at)


@router.get("/v1/jobs/{job_id}", response_model=JobView)
def get_job(job_id: str, who: Who, state: State) -> JobView:
    """A job by its id, or by the id the caller gave it."""
    return job_view(state.find_job(who, job_id))


@router.delete("/v1/jobs/{job_id}", response_model=Cancelled)
def cancel_job(job_id: str, who: Who, state: State) -> Cancelled:
    """Cancel a queued or running job."""
    rec = state.find_job(who, job_id)
    n = state.st.cancel(job_ids=[rec.id])
    state.cancel([rec.id], None)
    after = state.st.get_job(rec.id)
    return Cancelled(id=rec.id, cancelled=n > 0, status=after.status.value if after else None)


@router.get("/v1/latency", response_model=Latency)
def latency(
    who: Who,
    state: State,
    since: float | None = Query(default=None, description="epoch seconds (finished_at >= since)"),
    until: float | None = Query(default=None, description="epoch seconds (finished_at < until)"),
    metrics: str = Query(default="ttft_ms,queue_ms,engine_ttft_ms,tpot_ms", max_length=500),
    by: str = Query(default="", max_length=100, description="comma-separated: worker, model"),
    batch_id: str | None = Query(default=None, max_length=200),
) -> Latency:
    """p50/p90/p99 and mean of the caller's finished jobs (of one batch when given)."""
    if any(t is not None and not math.isfinite(t) for t in (since, until)):
        raise ApiError(400, ErrorCode.INVALID_REQUEST, "since/until: must be finite epoch seconds")
    ms = [m for m in metrics.split(",") if m]
    groups = [g for g in by.split(",") if g]
    bad = [m for m in ms if m not in LATENCY_METRICS] + [g for g in groups if g not in ("worker", "model")]
    if bad:
        raise ApiError(400, ErrorCode.INVALID_REQUEST, "metrics or by: an unknown name (metrics: "
                       f"{', '.join(sorted(LATENCY_METRICS))}; by: worker, model)")
    if batch_id is not None:
        batch_id = state.find_batch(who, batch_id).id
    stats = state.st.latency_stats(since=since, until=until, metrics=ms, by=groups, owner=who.owner, batch_id=batch_id)
    return Latency(since=since, until=until, stats=[LatencyRow(**x.__dict__) for x in stats])
