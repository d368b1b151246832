"""Bulk submission: jobs (or a whole batch file) onto the jobs topic, optionally recorded as queued.

Messages are keyed by the queue's `routing_key` (jobs sharing a prefix share a partition) and
sent through one idempotent, acks=all, batched producer; the call returns once every message is
acknowledged, in chunks so that memory stays flat on a 10M-line file. Lines that are not valid
jobs become `failed` rows (when a store is given) instead of stopping the submission.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.batch_io import default_batch_id
from pipeline.queue.base import JobQueue
from pipeline.store import ResultStore
from schemas.batchfile import ParsedLine, parse_lines
from schemas.job import JobRequest, JobResult


@dataclass(frozen=True)
class SubmitSummary:
    """What a submission did."""

    batch_id: str | None
    submitted: int  # jobs acknowledged by the queue
    invalid: int  # lines that were not valid jobs
    seconds: float

    @property
    def jobs_per_s(self) -> float:
        return self.submitted / self.seconds if self.seconds > 0 else 0.0


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for x in items:
        chunk.append(x)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (restored after).

    A bulk submission allocates a few objects per job (the job, its message, kafka-python's
    record future) and frees none of them as cycles; with ~100k of them alive, each automatic
    collection walks them all: 30-40% of a 100k-line submission's time on the 2-core machine
    (bench/results/pipeline-2026-11-30-run2.md).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class Producer:
    """Submits jobs to `queue` (Kafka or local); records them as queued in `store` when given."""

    def __init__(self, queue: JobQueue, store: ResultStore | None = None, *, chunk: int = 20_000) -> None:
        self.queue = queue
        self.store = store
        self.chunk = chunk

    def submit(self, jobs: Iterable[JobRequest]) -> int:
        """Stamp `submitted_at`, record, and publish; returns the jobs acknowledged."""
        return self._submit(jobs, owned=False)

    def _submit(self, jobs: Iterable[JobRequest], *, owned: bool) -> int:
        # owned: the jobs were made here (parsed from a file), so they are stamped in place
        # instead of copied (a model_copy is ~10 us, a fifth of a bulk submission's own work).
        n = 0
        with _gc_paused():
            for chunk in _chunks(jobs, self.chunk):
                now = time.time()
                if owned:
                    for j in chunk:
                        if j.submitted_at is None:
                            j.submitted_at = now
                    stamped = chunk
                else:
                    stamped = [j.submitted(now) for j in chunk]
                if self.store is not None:
                    self.store.insert_queued(stamped)
                self.queue.publish(stamped)
                n += len(stamped)
        return n

    def submit_file(
        self, path: str | Path, *, batch_id: str | None = None, default_max_tokens: int | None = None
    ) -> SubmitSummary:
        """Submit every valid line of a JSONL batch file (plain or OpenAI lines) under one batch id."""
        t0 = time.perf_counter()
        batch_id = batch_id or default_batch_id(path)
        failures: list[JobResult] = []
        total = 0
        if self.store is not None:
            self.store.create_batch(batch_id, source=str(Path(path).resolve()))

        def jobs() -> Iterator[JobRequest]:
            with Path(path).open("rb") as f:
                for item in parse_lines(f, batch_id=batch_id, id_prefix=f"{batch_id}-L"):
                    if isinstance(item, ParsedLine):
                        job = item.job
                        if (
                            default_max_tokens is not None
                            and "max_tokens" not in job.sampling.model_fields_set
                        ):
                            job = job.model_copy(
                                update={
                                    "sampling": job.sampling.model_copy(
                                        update={"max_tokens": default_max_tokens}
                                    )
                                }
                            )
                        yield job
                    else:
                        result = item.result(batch_id=batch_id, fallback_id=f"{batch_id}-L{item.line_no}")
                        if result is not None:
                            failures.append(result)

        total = self._submit(jobs(), owned=True)
        if self.store is not None:
            if failures:
                self.store.upsert_results(failures)
            self.store.set_batch_total(batch_id, total + len(failures))
        return SubmitSummary(batch_id, total, len(failures), time.perf_counter() - t0)
