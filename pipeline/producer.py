"""Bulk submission: jobs (or a whole batch file) onto the jobs topic, optionally recorded as queued.

Messages are keyed by the queue's `routing_key` (jobs sharing a prefix share a partition) and
sent through one idempotent, acks=all, batched producer; the call returns once every message is
acknowledged, in chunks so that memory stays flat on a 10M-line file. Lines that are not valid
jobs become `failed` rows (when a store is given) instead of stopping the submission.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.batch_io import default_batch_id, file_digest
from pipeline.queue.base import JobQueue, encode_job
from pipeline.store import ResultStore, refused_data
from schemas.batchfile import BatchLineError, ParsedLine, parse_lines
from schemas.job import ErrorCode, JobRequest, JobResult, job_id_of_line
from schemas.limits import MAX_MESSAGE_BYTES


class BatchConflict(Exception):
    """A batch id that cannot take this input: another owner's batch (`reason` "owner"), or a
    batch made from a different input ("input")."""

    def __init__(self, batch_id: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.batch_id = batch_id
        self.reason = reason


@dataclass(frozen=True)
class LineFailure:
    """A line of a submission that failed at once, with its place in the input."""

    line_no: int  # 1-based; 0 when the line's place is not known
    result: JobResult

    @property
    def custom_id(self) -> str | None:
        return self.result.custom_id

    @property
    def error_code(self) -> ErrorCode | None:
        return self.result.error_code

    @property
    def error_message(self) -> str | None:
        return self.result.error_message


@dataclass(frozen=True)
class SubmitSummary:
    """What a submission did."""

    batch_id: str | None
    submitted: int  # jobs published to the queue now
    invalid: int  # lines that got a `failed` row (unparseable, invalid, too large, duplicate id)
    seconds: float
    lines: int = 0  # non-blank input lines
    duplicates: int = 0  # of `invalid`: lines whose id an earlier line of the batch has
    already_done: int = 0  # jobs of a resumed batch that were already terminal (not sent again)
    resumed: bool = False  # the batch existed (same owner, same input): this submission resumed it
    errors: tuple[LineFailure, ...] = ()  # the first line errors (at most 100)

    @property
    def jobs_per_s(self) -> float:
        return self.submitted / self.seconds if self.seconds > 0 else 0.0


# A job at submission: None if it may go, else (ErrorCode, message) (e.g. the model's context).
JobCheck = Callable[[JobRequest], "tuple[ErrorCode, str] | None"]
MAX_REPORTED_ERRORS = 100


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


def message_too_large(job: JobRequest) -> tuple[ErrorCode, str] | None:
    """`too_large` when the job would not fit one queue message (schemas.limits.MAX_MESSAGE_BYTES,
    which the producer and the broker are configured to carry). Encoded only when a bound on its
    size (6 bytes a character: a JSON escape) says it might not fit: never within the line limits."""
    chars = len(job.prompt or "") + sum(m.chars + 32 for m in job.messages or ())
    chars += 0 if job.tools is None else sum(len(t.model_dump_json()) for t in job.tools)
    # a prompt list: a text's characters, or 2 a token id (6 * 2 bytes hold "2147483647,")
    chars += sum(len(p) if isinstance(p, str) else 2 * len(p) for p in job.prompts or ())
    chars += sum(len(x) for x in job.sampling.stop) + len(json.dumps(job.metadata, ensure_ascii=False))
    if 6 * chars + 64 * 1024 <= MAX_MESSAGE_BYTES:
        return None
    size = len(encode_job(job))
    if size <= MAX_MESSAGE_BYTES:
        return None
    return ErrorCode.TOO_LARGE, f"the job is {size} bytes as a queue message; the limit is {MAX_MESSAGE_BYTES}"


class QueueRefused(RuntimeError):
    """The queue did not take a job (unreachable, or it refused the message)."""


class Producer:
    """Submits jobs to `queue` (Kafka or local); records them as queued in `store` when given."""

    def __init__(self, queue: JobQueue, store: ResultStore | None = None, *, chunk: int = 20_000) -> None:
        self.queue = queue
        self.store = store
        self.chunk = chunk

    def submit(self, jobs: Iterable[JobRequest]) -> int:
        """Stamp `submitted_at` (now, whatever the job held), record, and publish; returns the
        jobs acknowledged."""
        n = 0
        with _gc_paused():
            for chunk in _chunks(jobs, self.chunk):
                now = time.time()
                stamped = [j.model_copy(update={"submitted_at": now}) for j in chunk]
                if self.store is not None:
                    self.store.insert_queued(stamped)
                self.queue.publish(stamped)
                n += len(stamped)
        return n

    def submit_one(self, job: JobRequest) -> bool:
        """Record one job queued and publish it, stamped now (`job.submitted_at`, the server's
        clock, set on the job itself). False when its id has a row already: nothing is sent. When
        the queue refuses it, its row is removed again (the same id may be sent again) and
        QueueRefused raised (from the queue's error)."""
        job.submitted_at = time.time()
        if self.store is not None and not self.store.record_queued([job]):
            return False
        try:
            self.queue.publish([job])
        except Exception as exc:
            if self.store is not None:
                self.store.forget_queued([job.id])
            raise QueueRefused(type(exc).__name__) from exc
        return True

    def submit_file(
        self,
        path: str | Path,
        *,
        batch_id: str | None = None,
        default_max_tokens: int | None = None,
        owner: str | None = None,
        check: JobCheck | None = None,
    ) -> SubmitSummary:
        """Submit every line of a JSONL batch file (plain or OpenAI lines) as batch `batch_id`
        (default: from the file's name and content, so the same file again resumes its batch)."""
        digest = file_digest(path)
        batch_id = batch_id or default_batch_id(path, digest)
        with Path(path).open("rb") as f:
            return self.submit_batch(
                f,
                batch_id=batch_id,
                input_digest=digest,
                source=str(Path(path).resolve()),
                default_max_tokens=default_max_tokens,
                owner=owner,
                check=check,
            )

    def submit_batch(
        self,
        lines: Iterable[bytes | str],
        *,
        batch_id: str,
        input_digest: str | None = None,
        source: str | None = None,
        default_max_tokens: int | None = None,
        owner: str | None = None,
        check: JobCheck | None = None,
    ) -> SubmitSummary:
        """Submit batch-file lines as one batch: each valid line a job, each other line a `failed`
        row of its own with its error code, every row numbered by its line.

        Job ids are scoped to the batch (schemas.job.job_id_in_batch). A second line with an id
        an earlier line has gets `duplicate_id` (the first one runs). Submitting the same input
        under the same batch id again resumes the batch: its terminal jobs are not sent again,
        the others are (a crash between recording and publishing loses nothing). Raises
        BatchConflict when `batch_id` is another owner's or was made from another input.
        """
        t0 = time.perf_counter()
        resumed = False
        if self.store is not None:
            resumed = not self.store.create_batch(
                batch_id, owner=owner, input_digest=input_digest, source=source
            )
            if resumed:
                self._check_resumable(batch_id, owner, input_digest)
        run = _BatchRun(self, batch_id, owner, default_max_tokens, check)
        with _gc_paused():
            for chunk in _chunks(parse_lines(lines), self.chunk):
                run.submit_chunk(chunk)
        if self.store is not None:
            self.store.set_batch_total(batch_id, run.lines, input_format=run.input_format)
            self.store.finalize_batch(batch_id)
        return SubmitSummary(
            batch_id,
            submitted=run.published,
            invalid=run.invalid,
            seconds=time.perf_counter() - t0,
            lines=run.lines,
            duplicates=run.duplicates,
            already_done=run.already_done,
            resumed=resumed,
            errors=tuple(run.errors),
        )

    def _check_resumable(self, batch_id: str, owner: str | None, input_digest: str | None) -> None:
        assert self.store is not None
        b = self.store.get_batch(batch_id)
        if b is None:  # deleted meanwhile: nothing to resume against
            return
        if b.owner != owner:
            raise BatchConflict(batch_id, "owner", f"batch {batch_id!r} belongs to another owner")
        if input_digest is not None and b.input_digest is not None and b.input_digest != input_digest:
            raise BatchConflict(
                batch_id,
                "input",
                f"batch {batch_id!r} already exists with a different input; submit this one under another batch id",
            )


class _BatchRun:
    """One submission of a batch's lines, a chunk at a time."""

    def __init__(
        self,
        producer: Producer,
        batch_id: str,
        owner: str | None,
        default_max_tokens: int | None,
        check: JobCheck | None,
    ) -> None:
        self.p = producer
        self.batch_id = batch_id
        self.owner = owner
        self.default_max_tokens = default_max_tokens
        self.check = check
        self.lines = 0
        self.published = 0
        self.invalid = 0
        self.duplicates = 0
        self.already_done = 0
        self.input_format: str | None = None
        self.errors: list[LineFailure] = []
        self._seen: set[str] | None = set() if producer.store is None else None  # no store: ids kept here

    def submit_chunk(self, items: list[ParsedLine | BatchLineError]) -> None:
        failures: list[tuple[JobResult, int, str | None]] = []  # (result, line_no, line format)
        first: dict[str, JobRequest] = {}
        for item in items:
            self.lines += 1
            if self.input_format is None and item.format is not None:
                self.input_format = item.format.value
            if isinstance(item, BatchLineError):
                fmt = None if item.format is None else item.format.value
                failures.append((item.result(self.batch_id), item.line_no, fmt))
                continue
            job = item.request(self.batch_id, owner=self.owner, default_max_tokens=self.default_max_tokens)
            problem = None if self.check is None else self.check(job)
            if problem is None:
                problem = message_too_large(job)
            if problem is not None:
                failures.append((self._line_failure(job, *problem), item.line_no, job.line_format))
            elif job.id in first:
                failures.append((self._duplicate(job, first[job.id].line_no), item.line_no, job.line_format))
            else:
                first[job.id] = job
        now = time.time()
        for j in first.values():  # stamped here, by the server (a client never sets submitted_at): row and message
            j.submitted_at = now
        publish = self._new_or_unfinished(list(first.values()), failures)
        if publish:
            self.p.queue.publish(publish)
            self.published += len(publish)
        if failures:
            self.invalid += len(failures)
            room = MAX_REPORTED_ERRORS - len(self.errors)
            self.errors.extend(LineFailure(line_no or 0, f) for f, line_no, _ in failures[: max(0, room)])
            if self.p.store is not None:
                self._record_failures(failures)

    def _new_or_unfinished(
        self, jobs: list[JobRequest], failures: list[tuple[JobResult, int, str | None]]
    ) -> list[JobRequest]:
        """The jobs to publish: new ones (recorded as queued now), and those of a resumed batch
        that are not terminal yet. An id another line of the batch holds is that line's duplicate."""
        store = self.p.store
        if store is None:
            assert self._seen is not None
            out = []
            for j in jobs:
                if j.id in self._seen:
                    failures.append((self._duplicate(j, None), j.line_no or 0, j.line_format))
                else:
                    self._seen.add(j.id)
                    out.append(j)
            return out
        inserted = self._record_queued(jobs, failures)
        if len(inserted) == len(jobs):
            return jobs
        others = [j for j in jobs if j.id not in inserted]
        rows = store.get_jobs([j.id for j in others])
        out = [j for j in jobs if j.id in inserted]
        for j in others:
            rec = rows.get(j.id)
            if rec is not None and rec.line_no not in (None, j.line_no):
                failures.append((self._duplicate(j, rec.line_no), j.line_no or 0, j.line_format))
            elif rec is not None and rec.status.terminal:
                self.already_done += 1
            else:  # this very line, recorded by an earlier submission that may not have published it
                out.append(j)
        return out

    def _record_queued(self, jobs: list[JobRequest], failures: list[tuple[JobResult, int, str | None]]) -> set[str]:
        """Record the chunk's jobs as queued, in one statement; when the database refuses the
        chunk's values, record them one by one, and each job it refuses is that line's error
        (the others go on). `jobs` loses the refused ones."""
        store = self.p.store
        assert store is not None
        try:
            return store.record_queued(jobs)
        except Exception as exc:
            if refused_data(exc) is None:
                raise
        inserted: set[str] = set()
        refused: set[str] = set()
        for j in jobs:
            try:
                inserted |= store.record_queued([j])
            except Exception as exc:
                reason = refused_data(exc)
                if reason is None:
                    raise
                refused.add(j.id)
                failures.append((self._line_failure(j, ErrorCode.INVALID_REQUEST, f"the store refused this line ({reason})"),
                                 j.line_no or 0, j.line_format))
        if refused:
            jobs[:] = [j for j in jobs if j.id not in refused]
        return inserted

    def _record_failures(self, failures: list[tuple[JobResult, int, str | None]]) -> None:
        """Write the lines' `failed` rows; one the database refuses (it holds what no column can)
        is written again by itself with a plain message, so one row never costs the others."""
        store = self.p.store
        assert store is not None

        def write(part: list[tuple[JobResult, int, str | None]]) -> None:
            store.upsert_results(
                [f for f, _, _ in part],
                lines={f.id: {"owner": self.owner, "line_no": line_no, "line_format": fmt} for f, line_no, fmt in part},
            )

        try:
            write(failures)
            return
        except Exception as exc:
            if refused_data(exc) is None:
                raise
        for f, line_no, fmt in failures:
            try:
                write([(f, line_no, fmt)])
            except Exception as exc:
                reason = refused_data(exc)
                if reason is None:
                    raise
                plain = f.model_copy(update={"custom_id": None, "error_message": f"line {line_no}: the store refused "
                                             f"this line's error ({reason})"})
                write([(plain, line_no, fmt)])

    def _line_failure(self, job: JobRequest, code: ErrorCode, message: str) -> JobResult:
        return JobResult.failure(
            job_id_of_line(self.batch_id, job.line_no or 0),
            code,
            f"line {job.line_no}: {message}",
            batch_id=self.batch_id,
            custom_id=job.custom_id,
        )

    def _duplicate(self, job: JobRequest, first_line: int | None) -> JobResult:
        self.duplicates += 1
        where = "an earlier line" if first_line is None else f"line {first_line}"
        return self._line_failure(
            job, ErrorCode.DUPLICATE_ID, f"id {job.custom_id!r} is already used by {where} of this batch (that one runs)"
        )
