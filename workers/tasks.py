"""Control-plane tasks (CPU workers): ingest a batch file, finalize a batch, cancel jobs."""

from __future__ import annotations

import logging
from typing import Any

from workers.celery_app import app, broadcast_cancel

log = logging.getLogger(__name__)

_state: dict[str, Any] = {}


def _store() -> Any:
    """The process's ResultStore, created on first use (never at import)."""
    if "store" not in _state:
        from pipeline.settings import get_settings
        from pipeline.store import ResultStore

        s = get_settings()
        _state["store"] = ResultStore.from_url(s.database_url, batch_rows=s.store_batch_rows)
    return _state["store"]


def _queue() -> Any:
    if "queue" not in _state:
        from pipeline.queue.kafka import KafkaQueue

        _state["queue"] = KafkaQueue()
    return _state["queue"]


@app.task(name="firsttoken.ingest_batch", bind=True, max_retries=5, default_retry_delay=10)
def ingest_batch(
    self: Any,
    path: str,
    batch_id: str | None = None,
    max_tokens: int | None = None,
    finalize_after_s: float = 10.0,
) -> dict[str, Any]:
    """Validate every line of a batch file, record queued (or failed) rows, produce the jobs to
    Kafka, and schedule the batch's finalization. Safe to retry: rows and results are idempotent."""
    from kafka.errors import KafkaError
    from sqlalchemy.exc import DBAPIError

    from pipeline.producer import Producer

    try:
        summary = Producer(_queue(), _store()).submit_file(path, batch_id=batch_id, default_max_tokens=max_tokens)
    except (KafkaError, DBAPIError, ConnectionError, TimeoutError) as exc:
        # Kafka or Postgres unreachable: try again later (max_retries, default_retry_delay). What
        # the failed attempt did is redone idempotently: rows by job id, and the worker writes a
        # job delivered twice once.
        log.warning("batch file ingest failed (%s: %s); retrying", type(exc).__name__, exc)
        raise self.retry(exc=exc) from exc
    finalize_batch.apply_async((summary.batch_id,), countdown=finalize_after_s)
    log.info("batch %s: %d jobs submitted, %d invalid", summary.batch_id, summary.submitted, summary.invalid)
    return {"batch_id": summary.batch_id, "submitted": summary.submitted, "invalid": summary.invalid}


@app.task(name="firsttoken.finalize_batch", bind=True, max_retries=None)
def finalize_batch(self: Any, batch_id: str, every_s: float = 10.0) -> bool:
    """Mark the batch completed once all its jobs are terminal; checks again every `every_s` until then."""
    b = _store().get_batch(batch_id)
    if b is None or b.status != "open":
        return b is not None
    if _store().finalize_batch(batch_id):
        log.info("batch %s completed", batch_id)
        return True
    raise self.retry(countdown=every_s)


@app.task(name="firsttoken.cancel")
def cancel(job_ids: list[str] | None = None, batch_id: str | None = None) -> int:
    """Cancel jobs (or a batch): mark queued/running rows cancelled and tell the GPU workers to
    abort them. Returns the rows cancelled."""
    n = _store().cancel(job_ids=job_ids or (), batch_id=batch_id)
    broadcast_cancel(job_ids or (), batch_id)
    return n
