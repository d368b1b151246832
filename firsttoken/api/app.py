"""The HTTP API (FastAPI): submit jobs and batches, read results and progress, cancel, latency.

`create_app()` builds the app; the store and the queue are created on startup (never at import)
from the settings, unless passed in (tests, the embedded mode). Cancellation marks the rows and
tells the GPU workers through `canceller` (a Celery broadcast by default).

Every route but /healthz needs `Authorization: Bearer <key>` with a key of FIRSTTOKEN_API_KEYS;
each key has an owner, and an owner sees, cancels and adds to only its own jobs and batches
(another owner's are 404, as if they did not exist). Without keys the app refuses to start unless
authentication is switched off explicitly (FIRSTTOKEN_API_NO_AUTH, for local use).

Bodies are read up to a limit (413 past it) and parsed on a worker thread, never on the event
loop. Errors are `{"error": {"code", "message"}}`; a 422 names the field and the rule, never
echoes the input.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.batch_io import batch_format, bytes_digest, result_lines
from pipeline.producer import BatchConflict, JobCheck, Producer
from pipeline.queue.base import JobQueue
from pipeline.settings import Settings, get_settings
from pipeline.store import BatchRecord, JobRecord, ResultStore
from pipeline.store.tables import LATENCY_METRICS
from schemas.batchfile import BatchLineError, LineFormat, loads_strict, parse_line
from schemas.job import ErrorCode, JobStatus, job_id_of_owner, new_job_id

log = logging.getLogger(__name__)

Canceller = Callable[[Sequence[str], "str | None"], None]

_CODE_STATUS = {ErrorCode.TOO_LARGE: 413}


class ApiError(Exception):
    """An error answered as `{"error": {"code", "message"}}` with `status`."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.extra = extra


class ConfigError(RuntimeError):
    """The API cannot start with these settings (e.g. no API keys and auth not switched off)."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: the owner of the API key (None when authentication is off: sees everything)."""

    owner: str | None

    def may_see(self, owner: str | None) -> bool:
        """True if this caller may read or change a job or batch of `owner`."""
        return self.owner is None or self.owner == owner


def celery_canceller(job_ids: Sequence[str], batch_id: str | None) -> None:
    """Tell every GPU worker to abort these jobs (Celery remote-control broadcast, no reply awaited)."""
    from workers.celery_app import broadcast_cancel

    broadcast_cancel(list(job_ids), batch_id)


def _error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, **extra}}


def _job_view(rec: JobRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": rec.id,
        "custom_id": rec.custom_id,
        "batch_id": rec.batch_id,
        "line": rec.line_no,
        "status": rec.status.value,
        "created_at": rec.created_at,
        "updated_at": rec.updated_at,
    }
    result = rec.result()
    if result is not None:
        out.update(result.model_dump(mode="json", exclude={"id", "batch_id", "status", "custom_id"}))
    else:
        out["timings"] = rec.timings.model_dump(mode="json")
        out["worker"] = rec.worker
    return out


def _batch_view(b: BatchRecord) -> dict[str, Any]:
    p = b.progress
    total = p.total if p.total is not None else p.recorded
    return {
        "id": b.id,
        "status": b.status,
        "input_format": b.input_format,
        "total": p.total,
        "recorded": p.recorded,
        "done": p.done,
        "complete": p.complete,
        "counts": {k.value: v for k, v in p.counts.items()},
        "request_counts": {
            "total": total,
            "completed": p.count(JobStatus.SUCCEEDED),
            "failed": p.count(JobStatus.FAILED) + p.count(JobStatus.CANCELLED),
        },
        "created_at": b.created_at,
        "finished_at": b.finished_at,
    }


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, ErrorCode.TOO_LARGE, f"the body is {length} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, ErrorCode.TOO_LARGE, f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _authenticator(settings: Settings) -> Callable[[Request], Principal]:
    keys = settings.api_key_owners
    if not keys and not settings.api_no_auth:
        raise ConfigError(
            "no API keys: set FIRSTTOKEN_API_KEYS=owner:key,... (keys of 16+ characters), or switch "
            "authentication off for local use with FIRSTTOKEN_API_NO_AUTH=true (`firsttoken api --no-auth`)"
        )
    if settings.api_no_auth:

        def anyone(request: Request) -> Principal:
            return Principal(None)

        return anyone
    pairs = [(k.encode(), owner) for k, owner in keys.items()]

    def authenticate(request: Request) -> Principal:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "unauthorized", "send an API key: Authorization: Bearer <key>")
        given = token.strip().encode("utf-8", "replace")
        found = None
        for key, owner in pairs:  # every key compared, in constant time each
            if hmac.compare_digest(key, given):
                found = owner
        if found is None:
            raise ApiError(401, "unauthorized", "the API key is not valid")
        return Principal(found)

    return authenticate


def _principal(request: Request) -> Principal:
    """The caller, by the app's authenticator (settings-dependent, so kept on app.state)."""
    return request.app.state.authenticate(request)


Who = Annotated[Principal, Depends(_principal)]


def _batch_lines(raw: bytes) -> list[bytes | str]:
    """A POST /v1/batches body as batch-file lines: JSONL, or one JSON list of objects."""
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


def create_app(
    settings: Settings | None = None,
    *,
    store: ResultStore | None = None,
    queue: JobQueue | None = None,
    canceller: Canceller | None = celery_canceller,
    check: JobCheck | None = None,
) -> FastAPI:
    """The API app. Without `store`/`queue`, they are built from `settings` at startup. `check`
    (default: the settings' check_model's context check, when set) runs on each job at submission.

    Raises ConfigError when there are no API keys and authentication is not switched off.
    """
    s = settings or get_settings()
    authenticate = _authenticator(s)
    state: dict[str, Any] = {"store": store, "queue": queue, "check": check}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):  # type: ignore[no-untyped-def]
        own = []
        if state["store"] is None:
            state["store"] = ResultStore.from_url(s.database_url, batch_rows=s.store_batch_rows)
            own.append(state["store"])
        if state["queue"] is None:
            from pipeline.queue.kafka import KafkaQueue

            state["queue"] = KafkaQueue(s)
            own.append(state["queue"])
        if state["check"] is None and s.check_model:
            from workers.engine.prompts import SubmitCheck

            state["check"] = SubmitCheck.for_model(s.check_model, s.check_max_model_len)
        try:
            yield
        finally:
            for x in own:
                x.close()

    app = FastAPI(title="firsttoken", version="0.2", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(_error_body(exc.code, exc.message, **exc.extra), exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors()[:10]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body", "query", "path"))
            parts.append(f"{loc or 'request'}: {str(e.get('msg', 'invalid'))[:200]}")
        return JSONResponse(_error_body(ErrorCode.INVALID_REQUEST, "; ".join(parts)), 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(_error_body("http_error", str(exc.detail)[:500]), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled %s in the API", type(exc).__name__, exc_info=exc)
        return JSONResponse(_error_body(ErrorCode.INTERNAL_ERROR, "internal error"), 500)

    def st() -> ResultStore:
        return state["store"]

    def producer() -> Producer:
        return Producer(state["queue"], state["store"])

    def cancel(job_ids: Sequence[str], batch_id: str | None) -> None:
        if canceller is None:
            return
        try:
            canceller(job_ids, batch_id)
        except Exception as exc:  # the rows are cancelled anyway; a worker finishing one writes nothing
            log.warning("could not reach the GPU workers to cancel: %s", exc)

    def find_job(who: Principal, job_id: str) -> JobRecord:
        """The caller's job by firsttoken's id, or by the custom id it gave a single job."""
        s_ = st()
        rec = s_.get_job(job_id)
        if rec is None or not who.may_see(rec.owner):
            rec = s_.get_job(job_id_of_owner(who.owner, job_id))
        if rec is None or not who.may_see(rec.owner):
            raise ApiError(404, "not_found", f"no job {job_id[:200]!r}")
        return rec

    def find_batch(who: Principal, batch_id: str) -> BatchRecord:
        b = st().get_batch(batch_id)
        if b is None or not who.may_see(b.owner):
            raise ApiError(404, "not_found", f"no batch {batch_id[:200]!r}")
        return b

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        from sqlalchemy import text

        try:
            with st().engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:
            raise ApiError(503, "unavailable", f"database: {type(exc).__name__}") from None
        return {"ok": True}

    app.state.authenticate = authenticate
    router = APIRouter()

    @router.post("/v1/jobs", status_code=202)
    async def submit_job(request: Request, who: Who) -> dict[str, Any]:
        raw = await _read_body(request, s.api_max_body_bytes)
        return await run_in_threadpool(_submit_job, raw, who)

    def _submit_job(raw: bytes, who: Principal) -> dict[str, Any]:
        item = parse_line(raw, 1)
        if item is None:
            raise ApiError(422, ErrorCode.INVALID_REQUEST, "the body is empty: send one job as a JSON object")
        if isinstance(item, BatchLineError):
            message = item.message.removeprefix("line 1: ")
            raise ApiError(_CODE_STATUS.get(item.code, 422), item.code, message)
        if item.format is not LineFormat.PLAIN:
            raise ApiError(422, ErrorCode.INVALID_REQUEST, "an OpenAI batch line goes to POST /v1/batches")
        custom = item.job.id
        job_id = new_job_id() if custom is None else job_id_of_owner(who.owner, custom)
        job = item.job.to_request(job_id, owner=who.owner)
        problem = None if state["check"] is None else state["check"](job)
        if problem is not None:
            raise ApiError(422, problem[0], problem[1])
        job.submitted_at = time.time()  # the server's clock, never the client's
        if not st().record_queued([job]):
            raise ApiError(
                409, ErrorCode.DUPLICATE_ID, f"you already have a job with id {custom!r}", job_id=job_id
            )
        try:
            state["queue"].publish([job])
        except Exception as exc:
            st().forget_queued([job_id])  # nothing was queued: the same id may be sent again
            log.warning("job %s not queued: %s", job_id, type(exc).__name__)
            raise ApiError(503, "unavailable", "the job queue is unreachable; send the job again") from None
        return {"id": job_id, "custom_id": custom, "status": "queued", "submitted_at": job.submitted_at}

    @router.post("/v1/batches", status_code=202)
    async def submit_batch(
        request: Request,
        who: Who,
        batch_id: str | None = Query(default=None, min_length=1, max_length=200, pattern=r"^\S(.*\S)?$"),
        max_tokens: int | None = Query(default=None, ge=1, le=1 << 20),
    ) -> dict[str, Any]:
        raw = await _read_body(request, s.api_max_batch_bytes)
        return await run_in_threadpool(_submit_batch, raw, batch_id, max_tokens, who)

    def _submit_batch(raw: bytes, batch_id: str | None, max_tokens: int | None, who: Principal) -> dict[str, Any]:
        if batch_id is not None and not batch_id.isprintable():
            raise ApiError(422, ErrorCode.INVALID_REQUEST, "batch_id: must be printable characters")
        lines = _batch_lines(raw)
        if not any(line.strip() for line in lines):
            raise ApiError(400, ErrorCode.INVALID_REQUEST, "body: no jobs (send JSONL lines or a JSON list)")
        bid = batch_id or f"batch_{new_job_id()}"
        try:
            summary = producer().submit_batch(
                lines,
                batch_id=bid,
                input_digest=bytes_digest(raw),
                source="api",
                default_max_tokens=max_tokens,
                owner=who.owner,
                check=state["check"],
            )
        except BatchConflict as exc:
            if exc.reason == "owner":
                raise ApiError(403, "forbidden", f"batch id {bid!r} is taken; choose another") from None
            raise ApiError(409, "conflict", str(exc)) from None
        return {
            "batch_id": bid,
            "lines": summary.lines,
            "submitted": summary.submitted,
            "invalid": summary.invalid,
            "resumed": summary.resumed,
            "errors": [
                {"custom_id": f.custom_id, "error_code": f.error_code, "error": f.error_message}
                for f in summary.errors
            ],
        }

    @router.get("/v1/jobs/{job_id}")
    def get_job(job_id: str, who: Who) -> dict[str, Any]:
        return _job_view(find_job(who, job_id))

    @router.delete("/v1/jobs/{job_id}")
    def cancel_job(job_id: str, who: Who) -> dict[str, Any]:
        rec = find_job(who, job_id)
        n = st().cancel(job_ids=[rec.id])
        cancel([rec.id], None)
        after = st().get_job(rec.id)
        return {"id": rec.id, "cancelled": n > 0, "status": after.status.value if after else None}

    @router.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str, who: Who) -> dict[str, Any]:
        return _batch_view(find_batch(who, batch_id))

    @router.delete("/v1/batches/{batch_id}")
    def cancel_batch(batch_id: str, who: Who) -> dict[str, Any]:
        b = find_batch(who, batch_id)
        n = st().cancel(batch_id=b.id)
        cancel([], b.id)
        return {"id": b.id, "cancelled": n}

    @router.get("/v1/batches/{batch_id}/results")
    def batch_results(batch_id: str, who: Who) -> StreamingResponse:
        b = find_batch(who, batch_id)
        lines: Iterator[str] = result_lines(st(), b.id, batch_format(b.input_format))
        return StreamingResponse(lines, media_type="application/x-ndjson")

    @router.get("/v1/latency")
    def latency(
        who: Who,
        since: float | None = Query(default=None, description="epoch seconds (finished_at >= since)"),
        until: float | None = Query(default=None, description="epoch seconds (finished_at < until)"),
        metrics: str = Query(default="ttft_ms,queue_ms,engine_ttft_ms,tpot_ms", max_length=500),
        by: str = Query(default="", max_length=100, description="comma-separated: worker, model"),
        batch_id: str | None = Query(default=None, max_length=200),
    ) -> dict[str, Any]:
        if any(t is not None and not math.isfinite(t) for t in (since, until)):
            raise ApiError(400, ErrorCode.INVALID_REQUEST, "since/until: must be finite epoch seconds")
        ms = [m for m in metrics.split(",") if m]
        groups = [g for g in by.split(",") if g]
        bad = [m for m in ms if m not in LATENCY_METRICS] + [g for g in groups if g not in ("worker", "model")]
        if bad:
            raise ApiError(400, ErrorCode.INVALID_REQUEST, f"unknown metric or grouping {bad[0][:50]!r}")
        if batch_id is not None:
            find_batch(who, batch_id)
        stats = st().latency_stats(
            since=since, until=until, metrics=ms, by=groups, owner=who.owner, batch_id=batch_id
        )
        return {
            "since": since,
            "until": until,
            "stats": [
                {
                    "metric": x.metric,
                    "worker": x.worker,
                    "model": x.model,
                    "count": x.count,
                    "mean": x.mean,
                    "p50": x.p50,
                    "p90": x.p90,
                    "p99": x.p99,
                }
                for x in stats
            ],
        }

    app.include_router(router)
    return app
