"""Jobs through their lifecycle: queued at submission, admitted (running) by a worker, their
results, cancels and hand-backs; reads of jobs and the backlog."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import (
    and_,
    case,
    delete,
    func,
    or_,
    select,
    update,
)

from pipeline.store.bulk import BulkWrites
from pipeline.store.records import (
    Admission,
    BatchStatus,
    JobRecord,
)
from pipeline.store.rows import (
    NOT_TERMINAL,
    cancelled_row,
    count_rows,
    first_by_id,
    job_record,
    request_row,
    result_row,
)
from pipeline.store.tables import batches, jobs
from schemas.job import (
    JobRequest,
    JobResult,
    JobStatus,
)


class JobRows(BulkWrites):
    """The `jobs` table: writes idempotent by id; a terminal row never changes again."""

    def insert_queued(self, requests: Iterable[JobRequest]) -> int:
        """Record jobs as queued; jobs that already have a row are left alone. Returns rows inserted."""
        return len(self.record_queued(requests))

    def record_queued(self, requests: Iterable[JobRequest]) -> set[str]:
        """Record jobs as queued; jobs that already have a row are left alone. Returns the ids inserted."""
        now = self._clock()
        rows = [request_row(j, JobStatus.QUEUED, now) for j in first_by_id(requests, lambda j: j.id)]
        if not rows:
            return set()
        with self.engine.begin() as conn:
            return self._returning_many(conn, "queued", rows)

    def admit(
        self,
        requests: Sequence[JobRequest],
        *,
        worker: str | None = None,
        admitted_at: float | None = None,
        hold_from: int | None = None,
    ) -> Admission:
        """Jobs a worker is about to run. Each one not terminal with fewer than `hold_from` earlier
        deliveries (all of them when None) is marked running and counts one more delivery; one
        with more is held (unchanged: the caller decides when it runs, and admits it then); a
        terminal one (a redelivered message whose result is written) is neither, and must not
        run again. A job without a row gets a running one (a job that came straight through Kafka). One UPDATE when every
        job is fresh (the usual case); a SELECT more for the others."""
        now = self._clock()
        admitted = now if admitted_at is None else admitted_at
        ids = list(dict.fromkeys(j.id for j in requests))
        out = Admission()
        if not ids:
            return out
        with self.engine.begin() as conn:
            for i in range(0, len(ids), 1000):
                cond = [jobs.c.id.in_(ids[i : i + 1000]), jobs.c.status.in_(NOT_TERMINAL)]
                if hold_from is not None:
                    cond.append(jobs.c.deliveries < hold_from)
                stmt = (
                    update(jobs)
                    .where(*cond)
                    .values(status=JobStatus.RUNNING.value, worker=worker, admitted_at=admitted, updated_at=now,
                            deliveries=jobs.c.deliveries + 1)
                    .returning(jobs.c.id, jobs.c.deliveries)
                )
                out.running.update((r[0], r[1]) for r in conn.execute(stmt))
            missing = [i for i in ids if i not in out.running]
            if not missing:
                return out
            found: dict[str, tuple[str, int]] = {}
            for i in range(0, len(missing), 1000):
                q = select(jobs.c.id, jobs.c.status, jobs.c.deliveries).where(jobs.c.id.in_(missing[i : i + 1000]))
                found.update((r[0], (r[1], r[2])) for r in conn.execute(q))
            for jid, (status, deliveries) in found.items():
                if status in NOT_TERMINAL:
                    out.held[jid] = deliveries
                else:
                    out.terminal.add(jid)
            absent = set(missing) - set(found)
            rows = []
            for j in first_by_id((j for j in requests if j.id in absent), lambda j: j.id):
                row = request_row(j, JobStatus.RUNNING, now)
                row.update(worker=worker, admitted_at=admitted, deliveries=1)
                rows.append(row)
            if rows:  # inserted now, or by a writer in between (then left alone, not counted: it runs)
                self._execute_many(conn, "queued", rows)
                out.running.update((r["id"], 1) for r in rows)
        return out

    def cancelled_among(self, job_ids: Sequence[str]) -> set[str]:
        """Which of these jobs are cancelled in the store (a user cancelled them, or their batch,
        or the client that waited went away): what a worker running them should drop."""
        ids = list(dict.fromkeys(job_ids))
        out: set[str] = set()
        with self.engine.connect() as conn:
            for i in range(0, len(ids), 1000):
                q = select(jobs.c.id).where(jobs.c.id.in_(ids[i : i + 1000]), jobs.c.status == JobStatus.CANCELLED.value)
                out.update(r[0] for r in conn.execute(q))
        return out

    def hand_back(self, job_ids: Sequence[str]) -> int:
        """Jobs a worker gave back unfinished (it stopped before they ended; their messages are
        delivered again): queued again, and that delivery not counted. Returns rows changed."""
        ids = list(dict.fromkeys(job_ids))
        n = 0
        now = self._clock()
        with self.engine.begin() as conn:
            for i in range(0, len(ids), 1000):
                stmt = (
                    update(jobs)
                    .where(jobs.c.id.in_(ids[i : i + 1000]), jobs.c.status == JobStatus.RUNNING.value)
                    .values(status=JobStatus.QUEUED.value, worker=None, updated_at=now,
                            deliveries=case((jobs.c.deliveries > 0, jobs.c.deliveries - 1), else_=0))
                )
                n += count_rows(conn, stmt.returning(jobs.c.id))
        return n

    def upsert_results(
        self,
        results: Iterable[JobResult],
        requests: Mapping[str, JobRequest] | None = None,
        lines: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> int:
        """Write terminal results, all in one transaction (many rows per statement).

        Idempotent by job id: a row already terminal is never overwritten, so a result delivered
        twice writes once. A result without a row inserts one, with its request's fields when
        `requests` has them, or with the `lines` columns (owner, line_no, line_format) of a row that
        holds a batch line's error. Returns the rows written (inserted or updated).
        """
        now = self._clock()
        requests = requests or {}
        lines = lines or {}
        rows = [
            result_row(r, requests.get(r.id), now, lines.get(r.id))
            for r in first_by_id(results, lambda r: r.id)
        ]
        if not rows:
            return 0
        with self.engine.begin() as conn:
            return self._execute_many(conn, "result", rows)

    def forget_queued(self, job_ids: Sequence[str]) -> int:
        """Delete rows still queued (a job recorded whose publish failed, so that it can be sent
        again under the same id). Returns rows deleted."""
        if not job_ids:
            return 0
        stmt = delete(jobs).where(jobs.c.id.in_(list(job_ids)), jobs.c.status == JobStatus.QUEUED.value)
        with self.engine.begin() as conn:
            return count_rows(conn, stmt.returning(jobs.c.id))

    def cancel(
        self, *, job_ids: Sequence[str] = (), batch_id: str | None = None, reason: str = "cancelled"
    ) -> int:
        """Mark queued or running jobs (by id, or every job of a batch) cancelled. Returns rows changed."""
        if not job_ids and batch_id is None:
            return 0
        now = self._clock()
        cond = jobs.c.status.in_(NOT_TERMINAL)
        cond = (
            and_(cond, jobs.c.id.in_(list(job_ids))) if job_ids else and_(cond, jobs.c.batch_id == batch_id)
        )
        stmt = (
            update(jobs)
            .where(cond)
            .values(**cancelled_row(reason, now))
        )
        with self.engine.begin() as conn:
            n = count_rows(conn, stmt.returning(jobs.c.id))
            if batch_id is not None and not job_ids:
                conn.execute(
                    update(batches)
                    .where(batches.c.id == batch_id, batches.c.status == BatchStatus.OPEN.value)
                    .values(status=BatchStatus.CANCELLED.value, updated_at=now, finished_at=now)
                )
        return n

    def get_job(self, job_id: str) -> JobRecord | None:
        """The job's row, or None."""
        with self.engine.connect() as conn:
            row = conn.execute(select(jobs).where(jobs.c.id == job_id)).first()
        return None if row is None else job_record(row)

    def get_jobs(self, job_ids: Sequence[str]) -> dict[str, JobRecord]:
        """The rows of those ids that exist, by id."""
        out: dict[str, JobRecord] = {}
        ids = list(dict.fromkeys(job_ids))
        with self.engine.connect() as conn:
            for i in range(0, len(ids), 1000):
                for row in conn.execute(select(jobs).where(jobs.c.id.in_(ids[i : i + 1000]))):
                    rec = job_record(row)
                    out[rec.id] = rec
        return out

    def list_jobs(
        self,
        *,
        batch_id: str | None = None,
        status: JobStatus | str | None = None,
        limit: int = 100,
        after: str | None = None,
        owner: str | None = None,
    ) -> list[JobRecord]:
        """Jobs in id order, filtered by batch, status and/or owner; `after` is the last id of the previous page."""
        q = select(jobs).order_by(jobs.c.id).limit(limit)
        if batch_id is not None:
            q = q.where(jobs.c.batch_id == batch_id)
        if owner is not None:
            q = q.where(jobs.c.owner == owner)
        if status is not None:
            q = q.where(jobs.c.status == JobStatus(status).value)
        if after is not None:
            q = q.where(jobs.c.id > after)
        with self.engine.connect() as conn:
            return [job_record(r) for r in conn.execute(q)]

    def iter_batch(self, batch_id: str, *, page: int = 1000) -> Iterator[JobRecord]:
        """Every row of a batch in its input's order (line number; rows without one, written
        before line numbers were kept, after them by id), a page per query."""
        after: tuple[int, str] | None = None
        while True:
            q = (
                select(jobs)
                .where(jobs.c.batch_id == batch_id, jobs.c.line_no.is_not(None))
                .order_by(jobs.c.line_no, jobs.c.id)
                .limit(page)
            )
            if after is not None:
                q = q.where(
                    or_(jobs.c.line_no > after[0], and_(jobs.c.line_no == after[0], jobs.c.id > after[1]))
                )
            with self.engine.connect() as conn:
                rows = [job_record(r) for r in conn.execute(q)]
            yield from rows
            if len(rows) < page:
                break
            after = (rows[-1].line_no or 0, rows[-1].id)
        last: str | None = None
        while True:
            q = select(jobs).where(jobs.c.batch_id == batch_id, jobs.c.line_no.is_(None))
            if last is not None:
                q = q.where(jobs.c.id > last)
            with self.engine.connect() as conn:
                rows = [job_record(r) for r in conn.execute(q.order_by(jobs.c.id).limit(page))]
            yield from rows
            if len(rows) < page:
                return
            last = rows[-1].id

    def backlog(self) -> tuple[dict[JobStatus, int], float | None]:
        """Jobs not finished yet: queued and running counts, and the oldest queued job's
        submission time (epoch seconds; None when nothing is queued). Index scans only."""
        with self.engine.connect() as conn:
            counts = {
                JobStatus(st): n
                for st, n in conn.execute(
                    select(jobs.c.status, func.count()).where(jobs.c.status.in_(NOT_TERMINAL)).group_by(jobs.c.status)
                )
            }
            oldest = conn.execute(
                select(func.min(jobs.c.submitted_at)).where(jobs.c.status == JobStatus.QUEUED.value)
            ).scalar()
        return counts, oldest

    def succeeded_since(self, since: float, *, limit: int = 5000) -> list[tuple[str, float, float | None, int, int]]:
        """Jobs that succeeded with their rows written at or after `since` (updated_at, the writer's
        clock), oldest write first, at most `limit`: (id, updated_at, ttft_ms, prompt tokens,
        cached prompt tokens). An index range (ix_jobs_updated_at): what the API's metrics read."""
        q = (
            select(jobs.c.id, jobs.c.updated_at, jobs.c.ttft_ms, jobs.c.prompt_tokens, jobs.c.cached_prompt_tokens)
            .where(jobs.c.updated_at >= since, jobs.c.status == JobStatus.SUCCEEDED.value)
            .order_by(jobs.c.updated_at)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [(r[0], r[1], r[2], r[3] or 0, r[4] or 0) for r in conn.execute(q)]

    def count_unfinished(self, owner: str | None) -> int:
        """Jobs of `owner` queued or running (an index range: ix_jobs_owner_status)."""
        with self.engine.connect() as conn:
            return conn.execute(
                select(func.count()).where(jobs.c.owner == owner, jobs.c.status.in_(NOT_TERMINAL))
            ).scalar() or 0
