"""Control-plane tasks (CPU workers): ingest a batch file, finalize a batch, cancel jobs."""

from __future__ import annotations

import logging
import time
from enum import StrEnum
from typing import Any

from pipeline.settings import get_settings
from pipeline.store import BatchStatus
from workers.celery_app import app, broadcast_cancel

log = logging.getLogger(__name__)

_state: dict[str, Any] = {}


def _store() -> Any:
    """The process's ResultStore, created on first use (never at import)."""
    if "store" not in _state:
        from pipeline.store import ResultStore

        s = get_settings()
        _state["store"] = ResultStore.from_url(s.database_url, batch_rows=s.store_batch_rows)
    return _state["store"]


def _store_unreachable() -> tuple[type[BaseException], ...]:
    """The errors of a database that cannot be reached (retried), imported on first use."""
    from sqlalchemy.exc import DBAPIError

    return (DBAPIError, ConnectionError, TimeoutError)


def _queue() -> Any:
    if "queue" not in _state:
        from pipeline.queue.kafka import KafkaQueue

        _state["queue"] = KafkaQueue()
    return _state["queue"]


def _check() -> Any:
    """The settings' check_model's context check, built once per process (None when unset)."""
    if "check" not in _state:
        s = get_settings()
        if s.check_model:
            from workers.engine.prompts import SubmitCheck

            _state["check"] = SubmitCheck.for_model(s.check_model, s.check_max_model_len)
        else:
            _state["check"] = None
    return _state["check"]


@app.task(name="firsttoken.ingest_batch", bind=True, max_retries=5, default_retry_delay=10)
def ingest_batch(
    self: Any,
    path: str,
    batch_id: str | None = None,
    max_tokens: int | None = None,
    finalize_after_s: float | None = None,
    owner: str | None = None,
) -> dict[str, Any]:
    """Validate every line of a batch file, record queued (or failed) rows, produce the jobs to
    Kafka, and schedule the batch's finalization `finalize_after_s` later (None: the settings'
    finalize_every_s). Safe to retry: the same file under the same batch id resumes the batch.
    Prompts are checked against the settings' check_model's context when it is set."""
    from kafka.errors import KafkaError

    from pipeline.producer import Producer

    try:
        summary = Producer(_queue(), _store()).submit_file(
            path, batch_id=batch_id, default_max_tokens=max_tokens, owner=owner, check=_check()
        )
    except (KafkaError, *_store_unreachable()) as exc:
        # Kafka or Postgres unreachable: try again later (max_retries, default_retry_delay). What
        # the failed attempt did is redone idempotently: rows by job id, and the worker writes a
        # job delivered twice once.
        log.warning("batch file ingest failed (%s: %s); retrying", type(exc).__name__, exc)
        raise self.retry(exc=exc) from exc
    if finalize_after_s is None:
        finalize_after_s = get_settings().finalize_every_s
    finalize_batch.apply_async((summary.batch_id,), countdown=finalize_after_s)
    log.info("batch %s: %d jobs submitted, %d invalid", summary.batch_id, summary.submitted, summary.invalid)
    return {"batch_id": summary.batch_id, "submitted": summary.submitted, "invalid": summary.invalid}


class Finalized(StrEnum):
    """What a finalize_batch run found: the `outcome` of its result."""

    COMPLETED = "completed"  # every job terminal: this run marked the batch completed
    ALREADY_COMPLETED = "already_completed"  # completed before this run
    ENDED = "ended"  # ended otherwise (cancelled): left as it is; the result's `status` says how
    MISSING = "missing"  # no batch with this id
    GAVE_UP = "gave_up"  # still open `give_up_s` after it was created: checked no more


def recheck_delay(checks: int, every_s: float, max_every_s: float) -> float:
    """The wait before the next check after `checks` earlier ones: `every_s`, doubled after each
    check, at most `max_every_s`."""
    return min(max_every_s, every_s * 2.0 ** min(checks, 32))


@app.task(name="firsttoken.finalize_batch", bind=True, max_retries=None)
def finalize_batch(
    self: Any,
    batch_id: str,
    every_s: float | None = None,
    max_every_s: float | None = None,
    give_up_s: float | None = None,
) -> dict[str, Any]:
    """Mark the batch completed once all its jobs are terminal. While some are not, check again
    after `every_s`, doubling up to `max_every_s`, until the batch is `give_up_s` old (then log a
    warning and stop; the batch stays open). None: the settings' finalize_every_s,
    finalize_max_every_s, finalize_give_up_s.

    Returns {"batch_id", "outcome": a Finalized value, "status": the batch's status (None if missing)}.
    """
    s = get_settings()
    every = s.finalize_every_s if every_s is None else every_s
    most = s.finalize_max_every_s if max_every_s is None else max_every_s
    give_up = s.finalize_give_up_s if give_up_s is None else give_up_s

    def result(outcome: Finalized, status: str | None) -> dict[str, Any]:
        return {"batch_id": batch_id, "outcome": outcome.value, "status": status}

    store = _store()
    try:
        b = store.get_batch(batch_id)
        completed = b is not None and b.status is BatchStatus.OPEN and store.finalize_batch(batch_id)
    except _store_unreachable() as exc:
        # the database is unreachable: an outage must not end the batch's checks
        log.warning("finalize: batch %s not checked (%s: %s); retrying", batch_id, type(exc).__name__, exc)
        raise self.retry(countdown=recheck_delay(self.request.retries, every, most)) from exc
    if b is None:
        log.warning("finalize: there is no batch %s", batch_id)
        return result(Finalized.MISSING, None)
    if b.status is BatchStatus.COMPLETED:
        return result(Finalized.ALREADY_COMPLETED, b.status)
    if b.status is not BatchStatus.OPEN:
        log.info("finalize: batch %s is %s, not open: left as it is", batch_id, b.status)
        return result(Finalized.ENDED, b.status)
    if completed:
        log.info("batch %s completed", batch_id)
        return result(Finalized.COMPLETED, "completed")
    age = time.time() - b.created_at
    if age >= give_up:
        p = b.progress
        log.warning(
            "batch %s is still open %.0f s after it was created (%d of %s jobs done): no more "
            "finalize checks (give-up age %.0f s); run finalize_batch again once its jobs are done",
            batch_id,
            age,
            p.done,
            p.total if p.total is not None else p.recorded,
            give_up,
        )
        return result(Finalized.GAVE_UP, b.status)
    raise self.retry(countdown=recheck_delay(self.request.retries, every, most))


@app.task(name="firsttoken.cancel", bind=True, max_retries=10, default_retry_delay=5)
def cancel(self: Any, job_ids: list[str] | None = None, batch_id: str | None = None) -> int:
    """Cancel jobs (or a batch): mark queued/running rows cancelled and tell the GPU workers to
    abort them. Returns the rows cancelled. Retried while the database is unreachable (both
    steps are idempotent)."""
    try:
        n = _store().cancel(job_ids=job_ids or (), batch_id=batch_id)
    except _store_unreachable() as exc:
        log.warning("cancel: the store is unreachable (%s: %s); retrying", type(exc).__name__, exc)
        raise self.retry(exc=exc) from exc
    broadcast_cancel(job_ids or (), batch_id)
    return n
