"""The HTTP API (FastAPI): submit jobs and batches, read results and progress, cancel, latency.

`create_app()` builds the app; the store and the queue are created on startup (never at import)
from the settings, unless passed in (tests, the embedded mode). Cancellation marks the rows and
tells the GPU workers through `canceller` (a Celery broadcast by default).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import StreamingResponse

from pipeline.batch_io import read_batch
from pipeline.producer import Producer
from pipeline.queue.base import JobQueue
from pipeline.settings import Settings, get_settings
from pipeline.store import JobRecord, ResultStore
from pipeline.store.tables import LATENCY_METRICS
from schemas.batchfile import LineFormat, format_output_line
from schemas.job import JobRequest, new_job_id

log = logging.getLogger(__name__)

Canceller = Callable[[Sequence[str], "str | None"], None]


def celery_canceller(job_ids: Sequence[str], batch_id: str | None) -> None:
    """Tell every GPU worker to abort these jobs (Celery remote-control broadcast, no reply awaited)."""
    from workers.celery_app import broadcast_cancel

    broadcast_cancel(list(job_ids), batch_id)


def _job_view(rec: JobRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": rec.id,
        "batch_id": rec.batch_id,
        "status": rec.status.value,
        "created_at": rec.created_at,
        "updated_at": rec.updated_at,
    }
    result = rec.result()
    if result is not None:
        out.update(result.model_dump(mode="json", exclude={"id", "batch_id", "status"}))
    else:
        out["timings"] = rec.timings.model_dump(mode="json")
        out["worker"] = rec.worker
    return out


def create_app(
    settings: Settings | None = None,
    *,
    store: ResultStore | None = None,
    queue: JobQueue | None = None,
    canceller: Canceller | None = celery_canceller,
) -> FastAPI:
    """The API app. Without `store`/`queue`, they are built from `settings` at startup."""
    state: dict[str, Any] = {"store": store, "queue": queue}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):  # type: ignore[no-untyped-def]
        s = settings or get_settings()
        own = []
        if state["store"] is None:
            state["store"] = ResultStore.from_url(s.database_url, batch_rows=s.store_batch_rows)
            own.append(state["store"])
        if state["queue"] is None:
            from pipeline.queue.kafka import KafkaQueue

            state["queue"] = KafkaQueue(s)
            own.append(state["queue"])
        try:
            yield
        finally:
            for x in own:
                x.close()

    app = FastAPI(title="firsttoken", version="0.1", lifespan=lifespan)

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

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        from sqlalchemy import text

        try:
            with st().engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:
            raise HTTPException(503, f"database: {type(exc).__name__}") from None
        return {"ok": True}

    @app.post("/v1/jobs", status_code=202)
    def submit_job(job: JobRequest) -> dict[str, Any]:
        stamped = job.submitted(time.time())
        producer().submit([stamped])
        return {"id": stamped.id, "status": "queued", "submitted_at": stamped.submitted_at}

    @app.post("/v1/batches", status_code=202)
    async def submit_batch(
        request: Request,
        batch_id: str | None = Query(default=None),
        max_tokens: int | None = Query(default=None, ge=1),
    ) -> dict[str, Any]:
        raw = await request.body()
        if raw.lstrip()[:1] == b"[":
            try:
                items = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise HTTPException(400, f"body: not valid JSON: {exc.msg}") from None
            lines: list[str | bytes] = [json.dumps(x) for x in items]
        else:
            lines = raw.splitlines()
        bid = batch_id or f"batch-{new_job_id()}"
        batch = read_batch(lines, bid, default_max_tokens=max_tokens)
        if not batch.refs:
            raise HTTPException(400, "body: no jobs (send JSONL lines or a JSON list)")

        def work() -> None:
            s = st()
            s.create_batch(bid, input_format=batch.input_format, source="api")
            if batch.failures:
                s.upsert_results(batch.failures)
            producer().submit(batch.jobs)
            s.set_batch_total(bid, len({r.job_id for r in batch.refs}))

        from starlette.concurrency import run_in_threadpool

        await run_in_threadpool(work)
        return {
            "batch_id": bid,
            "submitted": len(batch.jobs),
            "invalid": len(batch.failures),
            "errors": [
                {"id": f.id, "error_code": f.error_code, "error": f.error_message}
                for f in batch.failures[:100]
            ],
        }

    @app.get("/v1/jobs/{job_id}")
    def get_job(job_id: str) -> dict[str, Any]:
        rec = st().get_job(job_id)
        if rec is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return _job_view(rec)

    @app.delete("/v1/jobs/{job_id}")
    def cancel_job(job_id: str) -> dict[str, Any]:
        s = st()
        rec = s.get_job(job_id)
        if rec is None:
            raise HTTPException(404, f"no job {job_id!r}")
        n = s.cancel(job_ids=[job_id])
        cancel([job_id], None)
        rec = s.get_job(job_id)
        return {"id": job_id, "cancelled": n > 0, "status": rec.status.value if rec else None}

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str) -> dict[str, Any]:
        b = st().get_batch(batch_id)
        if b is None:
            raise HTTPException(404, f"no batch {batch_id!r}")
        p = b.progress
        return {
            "id": b.id,
            "status": b.status,
            "input_format": b.input_format,
            "total": p.total,
            "recorded": p.recorded,
            "done": p.done,
            "complete": p.complete,
            "counts": {k.value: v for k, v in p.counts.items()},
            "created_at": b.created_at,
            "finished_at": b.finished_at,
        }

    @app.delete("/v1/batches/{batch_id}")
    def cancel_batch(batch_id: str) -> dict[str, Any]:
        s = st()
        if s.get_batch(batch_id) is None:
            raise HTTPException(404, f"no batch {batch_id!r}")
        n = s.cancel(batch_id=batch_id)
        cancel([], batch_id)
        return {"id": batch_id, "cancelled": n}

    @app.get("/v1/batches/{batch_id}/results")
    def batch_results(batch_id: str) -> StreamingResponse:
        s = st()
        b = s.get_batch(batch_id)
        if b is None:
            raise HTTPException(404, f"no batch {batch_id!r}")
        fmt = LineFormat(b.input_format) if b.input_format in set(LineFormat) else LineFormat.PLAIN

        def lines() -> Iterator[str]:
            after = None
            while True:
                page = s.list_jobs(batch_id=batch_id, limit=1000, after=after)
                if not page:
                    return
                for rec in page:
                    result = rec.result()
                    if result is not None:
                        yield format_output_line(result, fmt)
                after = page[-1].id

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/v1/latency")
    def latency(
        since: float | None = Query(default=None, description="epoch seconds (finished_at >= since)"),
        until: float | None = Query(default=None, description="epoch seconds (finished_at < until)"),
        metrics: str = Query(default="ttft_ms,queue_ms,engine_ttft_ms,tpot_ms"),
        by: str = Query(default="", description="comma-separated: worker, model"),
    ) -> dict[str, Any]:
        ms = [m for m in metrics.split(",") if m]
        groups = [g for g in by.split(",") if g]
        bad = [m for m in ms if m not in LATENCY_METRICS] + [
            g for g in groups if g not in ("worker", "model")
        ]
        if bad:
            raise HTTPException(400, f"unknown metric or grouping {bad[0]!r}")
        stats = st().latency_stats(since=since, until=until, metrics=ms, by=groups)
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

    return app
