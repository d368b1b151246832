"""Batches: created open, completed when every line has its result, or ended (cancelled,
expired, failed); their progress counted from their jobs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Row,
    and_,
    func,
    or_,
    select,
    update,
)

from pipeline.store.records import (
    BatchProgress,
    BatchRecord,
    BatchStatus,
)
from pipeline.store.rows import (
    NOT_TERMINAL,
    StoreBase,
    cancelled_row,
    count_rows,
)
from pipeline.store.tables import batches, jobs
from schemas.job import (
    JobStatus,
)


class Batches(StoreBase):
    """The `batches` table and its progress."""

    def create_batch(
        self,
        batch_id: str,
        *,
        input_format: str | None = None,
        source: str | None = None,
        output: str | None = None,
        total_jobs: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        owner: str | None = None,
        input_digest: str | None = None,
    ) -> bool:
        """Record a batch (open). Idempotent: returns False when it already exists."""
        now = self._clock()
        stmt = (
            self._insert(batches)
            .values(
                id=batch_id,
                status=BatchStatus.OPEN.value,
                owner=owner,
                input_digest=input_digest,
                input_format=input_format,
                source=source,
                output=output,
                total_jobs=total_jobs,
                metadata=dict(metadata or {}),
                created_at=now,
                updated_at=now,
            )
            .on_conflict_do_nothing(index_elements=["id"])
        )
        with self.engine.begin() as conn:
            return count_rows(conn, stmt.returning(batches.c.id)) == 1

    def set_batch_total(self, batch_id: str, total_jobs: int, *, input_format: str | None = None) -> None:
        """Announce how many rows a batch has (once its input is fully read), and its input's format."""
        values: dict[str, Any] = {"total_jobs": total_jobs, "updated_at": self._clock()}
        if input_format is not None:
            values["input_format"] = input_format
        with self.engine.begin() as conn:
            conn.execute(update(batches).where(batches.c.id == batch_id).values(**values))

    def finalize_batch(self, batch_id: str) -> bool:
        """Mark an open batch completed if every one of its jobs is terminal. Returns True if it is now completed.

        Cheap while the batch has work left (one indexed probe for a queued or running job), so
        the sink can call it after every write: the jobs are counted only once none is pending.
        """
        with self.engine.connect() as conn:
            row = conn.execute(
                select(batches.c.status, batches.c.total_jobs).where(batches.c.id == batch_id)
            ).first()
            if row is None:
                return False
            if row[0] != BatchStatus.OPEN.value:
                return row[0] == BatchStatus.COMPLETED.value
            if row[1] is None:  # its input is still being read
                return False
            pending = conn.execute(
                select(jobs.c.id).where(jobs.c.batch_id == batch_id, jobs.c.status.in_(NOT_TERMINAL)).limit(1)
            ).first()
            if pending is not None:
                return False
            progress = self._progress(conn, batch_id)
        if not progress.complete:
            return False
        now = self._clock()
        with self.engine.begin() as conn:
            conn.execute(
                update(batches)
                .where(batches.c.id == batch_id, batches.c.status == BatchStatus.OPEN.value)
                .values(status=BatchStatus.COMPLETED.value, updated_at=now, finished_at=now)
            )
            status = conn.execute(select(batches.c.status).where(batches.c.id == batch_id)).scalar()
        return status == BatchStatus.COMPLETED.value

    def batch_progress(self, batch_id: str) -> BatchProgress:
        """Job counts by status for one batch (from the jobs table)."""
        with self.engine.connect() as conn:
            return self._progress(conn, batch_id)

    def _progress(self, conn: Connection, batch_id: str) -> BatchProgress:
        counts = {
            JobStatus(s): n
            for s, n in conn.execute(
                select(jobs.c.status, func.count()).where(jobs.c.batch_id == batch_id).group_by(jobs.c.status)
            )
        }
        total = conn.execute(select(batches.c.total_jobs).where(batches.c.id == batch_id)).scalar()
        return BatchProgress(batch_id=batch_id, total=total, counts=counts)

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        """The batch's row with its progress, or None."""
        with self.engine.connect() as conn:
            row = conn.execute(select(batches).where(batches.c.id == batch_id)).first()
            if row is None:
                return None
            return self._batch_record(conn, row)

    def list_batches(
        self, *, owner: str | None = None, limit: int = 20, after: str | None = None
    ) -> list[BatchRecord]:
        """Batches newest first (of one owner when given); `after` is the last id of the previous page."""
        q = select(batches).order_by(batches.c.created_at.desc(), batches.c.id.desc()).limit(limit)
        if owner is not None:
            q = q.where(batches.c.owner == owner)
        with self.engine.connect() as conn:
            if after is not None:  # a cursor of the same owner's only: another's id is as a missing one
                cursor = select(batches.c.created_at).where(batches.c.id == after)
                if owner is not None:
                    cursor = cursor.where(batches.c.owner == owner)
                last = conn.execute(cursor).scalar()
                if last is None:
                    return []
                q = q.where(
                    or_(batches.c.created_at < last, and_(batches.c.created_at == last, batches.c.id < after))
                )
            return [self._batch_record(conn, row) for row in conn.execute(q).all()]

    def open_batches(
        self, *, created_before: float, limit: int = 100, after: tuple[float, str] | None = None
    ) -> list[BatchRecord]:
        """Open batches created before `created_before` (epoch s), oldest first: the candidates of
        an expiry sweep. `after`: the (created_at, id) of the previous page's last batch."""
        q = (select(batches).where(batches.c.status == BatchStatus.OPEN.value, batches.c.created_at < created_before)
             .order_by(batches.c.created_at, batches.c.id).limit(limit))
        if after is not None:
            q = q.where(or_(batches.c.created_at > after[0],
                            and_(batches.c.created_at == after[0], batches.c.id > after[1])))
        with self.engine.connect() as conn:
            return [self._batch_record(conn, row) for row in conn.execute(q).all()]

    def end_batch(
        self, batch_id: str, status: str, *, reason: str, from_statuses: Sequence[str] = (BatchStatus.OPEN.value,)
    ) -> int:
        """End a batch that is in one of `from_statuses` (open) as `status` (expired, failed,
        cancelled): its queued and running jobs are cancelled with `reason`. Returns the jobs
        cancelled; 0 also when the batch was in another status (it is left as it is)."""
        if status not in (BatchStatus.EXPIRED.value, BatchStatus.FAILED.value, BatchStatus.CANCELLED.value):
            raise ValueError(f"not an end status: {status!r}")
        now = self._clock()
        with self.engine.begin() as conn:
            ended = conn.execute(
                update(batches)
                .where(batches.c.id == batch_id, batches.c.status.in_(list(from_statuses)))
                .values(status=status, updated_at=now, finished_at=now)
                .returning(batches.c.id)
            ).first()
            if ended is None:
                return 0
            stmt = (
                update(jobs)
                .where(jobs.c.batch_id == batch_id, jobs.c.status.in_(NOT_TERMINAL))
                .values(**cancelled_row(reason, now))
            )
            return count_rows(conn, stmt.returning(jobs.c.id))

    def set_batch_metadata(self, batch_id: str, metadata: Mapping[str, Any]) -> None:
        """Replace a batch's metadata (the OpenAI Batch API's fields live there)."""
        with self.engine.begin() as conn:
            conn.execute(
                update(batches).where(batches.c.id == batch_id).values(metadata=dict(metadata), updated_at=self._clock())
            )

    def _batch_record(self, conn: Connection, row: Row[Any]) -> BatchRecord:
        progress = self._progress(conn, row._mapping["id"])
        m = row._mapping
        return BatchRecord(
            id=m["id"],
            status=BatchStatus(m["status"]),
            owner=m["owner"],
            input_digest=m["input_digest"],
            input_format=m["input_format"],
            source=m["source"],
            output=m["output"],
            total_jobs=m["total_jobs"],
            metadata=m["metadata"] or {},
            created_at=m["created_at"],
            updated_at=m["updated_at"],
            finished_at=m["finished_at"],
            progress=progress,
        )
