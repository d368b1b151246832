"""The result sink: batched idempotent upserts into the store, then the queue offsets of those jobs.

A result is handed to the sink with the queue messages that carried its job. The sink's thread
writes results in batches (`ResultStore.upsert_results`, one transaction per batch) and only
after a batch is durable hands its messages to `on_durable` (the intake commits their offsets).
When the store is unreachable the results stay in the buffer and the write is retried with
exponential backoff; nothing is dropped. The buffer has a soft bound: once it holds `max_buffer`
results the sink reports `full`, and the intake stops taking new work until it drains.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sqlalchemy.exc import DataError, IntegrityError

from pipeline.queue import Message
from pipeline.store import ResultStore
from schemas.job import ErrorCode, JobRequest, JobResult

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """A terminal result, the request it answers (when known) and the messages that carried it."""

    result: JobResult
    request: JobRequest | None = None
    messages: list[Message] = field(default_factory=list)


@dataclass(frozen=True)
class SinkConfig:
    """How the sink batches and retries."""

    batch_rows: int = 500  # most results per upsert transaction
    # How long a partial batch may wait for more results. Not on the path to the first token:
    # fewer, larger transactions leave more of the worker's CPU (and GIL) to the engine.
    flush_interval_s: float = 0.02
    max_buffer: int = 10_000  # results held (e.g. while the store is down) before `full` is reported
    backoff_initial_s: float = 0.1  # first retry delay after a failed write
    backoff_max_s: float = 5.0  # retry delays double up to this


class ResultSink:
    """A thread that writes outcomes to a ResultStore and then calls `on_durable(messages)`."""

    def __init__(
        self,
        store: ResultStore,
        on_durable: Callable[[list[Message]], None],
        config: SinkConfig | None = None,
        *,
        name: str = "result-sink",
    ) -> None:
        self.store = store
        self.config = config or SinkConfig()
        self._on_durable = on_durable
        self._buffer: deque[Outcome] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.rows_written = 0  # rows the store reported written (terminal rows are never rewritten)
        self.results_durable = 0  # results whose batch was committed to the store
        self.write_failures = 0
        self.last_error: str | None = None
        self.store_ok = True

    # --- producer side ---------------------------------------------------------------------------

    def put(self, outcomes: Outcome | Sequence[Outcome]) -> None:
        """Queue outcomes for writing. Never blocks and never drops: see `full`."""
        items = [outcomes] if isinstance(outcomes, Outcome) else list(outcomes)
        if not items:
            return
        with self._cond:
            self._buffer.extend(items)
            self._cond.notify_all()

    @property
    def buffered(self) -> int:
        """Results waiting to be written."""
        return len(self._buffer)

    @property
    def full(self) -> bool:
        """True when the buffer holds `max_buffer` results or more: take no new work."""
        return len(self._buffer) >= self.config.max_buffer

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> int:
        """Write what is buffered (retrying until `timeout_s`), then stop. Returns the results left
        unwritten: their messages are not committed, so the queue delivers them again."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._deadline = deadline
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        left = len(self._buffer)
        if left:
            log.warning("sink stopped with %d results unwritten (they will be delivered again)", left)
        return left

    def flush_once(self) -> bool:
        """Write one batch now, on the calling thread (tests). True if it was written or nothing waited."""
        return self._write_batch()

    # --- the writer ------------------------------------------------------------------------------

    _deadline: float = float("inf")

    def _run(self) -> None:
        backoff = self.config.backoff_initial_s
        while True:
            with self._cond:
                while not self._buffer and not self._stop:
                    self._cond.wait(0.5)
                if not self._buffer and self._stop:
                    return
                # Let a partial batch fill a little: fewer, larger transactions.
                if len(self._buffer) < self.config.batch_rows and not self._stop:
                    self._cond.wait(self.config.flush_interval_s)
            if self._write_batch():
                backoff = self.config.backoff_initial_s
                continue
            if self._stop and time.monotonic() >= self._deadline:
                return
            wait = min(backoff, max(0.0, self._deadline - time.monotonic()))
            with self._cond:
                self._cond.wait_for(lambda: False, timeout=wait)
            backoff = min(backoff * 2, self.config.backoff_max_s)

    def _write_one(self, o: Outcome) -> int:
        requests = {o.request.id: o.request} if o.request is not None else {}
        try:
            return self.store.upsert_results([o.result], requests)
        except (DataError, IntegrityError) as exc:
            log.warning(
                "job %s: result refused by the store (%s); writing it as failed",
                o.result.id,
                type(exc.orig).__name__ if exc.orig is not None else type(exc).__name__,
            )
            r = o.result
            failed = JobResult.failure(
                r.id,
                ErrorCode.INTERNAL_ERROR,
                f"the result could not be stored: {type(exc).__name__}",
                batch_id=r.batch_id,
                submitted_at=r.timings.submitted_at,
                finished_at=r.timings.finished_at,
                worker=r.worker,
                model=r.model,
            )
            return self.store.upsert_results([failed], {})

    def _write_batch(self) -> bool:
        with self._cond:
            batch = [self._buffer[i] for i in range(min(len(self._buffer), self.config.batch_rows))]
        if not batch:
            return True
        requests = {o.request.id: o.request for o in batch if o.request is not None}
        try:
            try:
                written = self.store.upsert_results([o.result for o in batch], requests)
            except (DataError, IntegrityError):
                # a row the database refuses: write the batch one by one, so it cannot block the rest
                written = sum(self._write_one(o) for o in batch)
        except Exception as exc:  # the store is down or refused the write: keep everything, retry
            self.write_failures += 1
            self.last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if self.store_ok:
                log.warning(
                    "result store write failed (%s); holding %d results and retrying",
                    self.last_error,
                    len(self._buffer),
                )
            self.store_ok = False
            return False
        if not self.store_ok:
            log.info("result store reachable again; %d results buffered", len(self._buffer))
        self.store_ok = True
        with self._cond:
            for _ in batch:
                self._buffer.popleft()
        self.rows_written += written
        self.results_durable += len(batch)
        messages = [m for o in batch for m in o.messages]
        if messages:
            self._on_durable(messages)
        self._finalize({o.result.batch_id for o in batch if o.result.batch_id is not None})
        return True

    def _finalize(self, batch_ids: set[str]) -> None:
        """Mark the batches these results may have ended completed (a cheap probe while a batch
        has jobs left). A failure here loses nothing: the next write, or finalize_batch, retries."""
        for batch_id in batch_ids:
            try:
                self.store.finalize_batch(batch_id)
            except Exception as exc:
                log.debug("batch %s not finalized now: %s", batch_id, exc)
