"""ResultStore: the jobs and batches tables behind one small interface, on Postgres or SQLite."""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Row,
    Text,
    and_,
    bindparam,
    case,
    cast,
    column,
    delete,
    func,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.types import JSON

from pipeline.store.engine import make_engine
from pipeline.store.records import Admission, BatchProgress, BatchRecord, FileRecord, JobRecord, LatencyStats
from pipeline.store.tables import LATENCY_METRICS, RESULT_COLUMNS, batches, files, jobs
from schemas.job import (
    TERMINAL_STATUSES,
    ChatMessage,
    ErrorCode,
    FinishReason,
    JobRequest,
    JobResult,
    JobStatus,
    JobTimings,
    TokenLogprobs,
    Usage,
)
from schemas.sampling import SamplingParams

_TERMINAL = sorted(s.value for s in TERMINAL_STATUSES)
_NOT_TERMINAL = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
# Bound parameters per statement stay under SQLite's 32766 and Postgres' 65535.
_MAX_PARAMS = 30_000
# Result columns that keep the stored value when the incoming one is null (e.g. submitted_at
# recorded at submission, admitted_at and worker recorded by admit).
_KEEP_IF_NULL = ("submitted_at", "admitted_at", "first_token_at", "worker", "model")
_REQUEST_COLUMNS = (
    "prompt", "messages", "sampling", "prefix_key", "metadata", "custom_id", "owner", "line_no", "line_format"
)
# What a row that holds a line's error (no JobRequest) may be given besides the result.
LINE_COLUMNS = frozenset({"owner", "line_no", "line_format"})
# JSON on SQLite, JSONB on Postgres.
_JSON_COLUMNS = frozenset(c.name for c in jobs.columns if isinstance(c.type, JSON))
_JSON_NULL = literal_column("'null'::jsonb")

BATCH_OPEN = "open"
BATCH_COMPLETED = "completed"
BATCH_CANCELLED = "cancelled"
BATCH_EXPIRED = "expired"  # its completion window passed: the jobs left were cancelled
BATCH_FAILED = "failed"  # no line of its input was a valid job


def _chunks(rows: list[dict[str, Any]], ncols: int, limit: int) -> Iterable[list[dict[str, Any]]]:
    size = max(1, min(limit, _MAX_PARAMS // max(1, ncols)))
    for i in range(0, len(rows), size):
        yield rows[i : i + size]


def _request_row(job: JobRequest, status: JobStatus, now: float) -> dict[str, Any]:
    return {
        "id": job.id,
        "batch_id": job.batch_id,
        "status": status.value,
        "prompt": job.prompt,
        "messages": None if job.messages is None else [m.model_dump() for m in job.messages],
        "sampling": job.sampling.model_dump(mode="json"),
        "priority": job.priority,
        "prefix_key": job.prefix_key,
        "metadata": dict(job.metadata),
        "custom_id": job.custom_id,
        "owner": job.owner,
        "line_no": job.line_no,
        "line_format": job.line_format,
        "submitted_at": job.submitted_at,
        "created_at": now,
        "updated_at": now,
    }


def _result_row(
    result: JobResult, request: JobRequest | None, now: float, line: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    t, u = result.timings, result.usage
    row: dict[str, Any] = {
        "id": result.id,
        "batch_id": result.batch_id,
        "priority": 0,
        "prompt": None,
        "messages": None,
        "sampling": None,
        "prefix_key": None,
        "metadata": None,
        "custom_id": result.custom_id,
        "owner": None,
        "line_no": None,
        "line_format": None,
        "status": result.status.value,
        "text": result.text,
        "finish_reason": None if result.finish_reason is None else result.finish_reason.value,
        "prompt_tokens": u.prompt_tokens,
        "cached_prompt_tokens": u.cached_prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "submitted_at": t.submitted_at,
        "admitted_at": t.admitted_at,
        "scheduled_at": t.scheduled_at,
        "first_token_at": t.first_token_at,
        "finished_at": t.finished_at,
        "queue_ms": t.queue_ms,
        "overhead_ms": t.overhead_ms,
        "ttft_ms": t.ttft_ms,
        "engine_ttft_ms": t.engine_ttft_ms,
        "prefill_ms": t.prefill_ms,
        "tpot_ms": t.tpot_ms,
        "e2e_ms": t.e2e_ms,
        "worker": result.worker,
        "model": result.model,
        "error_code": None if result.error_code is None else result.error_code.value,
        "error_message": result.error_message,
        "logprobs": None if result.logprobs is None else [lp.model_dump() for lp in result.logprobs],
        "prompt_logprobs": None if result.prompt_logprobs is None else [
            None if lp is None else lp.model_dump() for lp in result.prompt_logprobs],
        "created_at": now,
        "updated_at": now,
    }
    if line:
        bad = set(line) - LINE_COLUMNS
        if bad:
            raise ValueError(f"not a line column: {sorted(bad)}")
        row.update(line)
    if request is not None:
        req = _request_row(request, result.status, now)
        for col in (*_REQUEST_COLUMNS, "priority"):
            row[col] = req[col]
        row["batch_id"] = row["batch_id"] or req["batch_id"]
        if row["submitted_at"] is None:
            row["submitted_at"] = req["submitted_at"]
    return row


def _status_in(statuses: Iterable[str]) -> Any:
    """`jobs.status IN (...)` with the statuses as SQL literals: an expanding IN parameter cannot
    be used with executemany."""
    return or_(*(jobs.c.status == literal_column(f"'{JobStatus(s).value}'") for s in statuses))


def _on_conflict(kind: str, stmt: Any) -> Any:
    """The upsert of `kind` on top of an INSERT of jobs rows. Every kind is idempotent by id and
    leaves a terminal row (succeeded, failed, cancelled) as it is."""
    if kind == "queued":  # a row that exists (in any state) is left alone
        return stmt.on_conflict_do_nothing(index_elements=["id"])
    ex = stmt.excluded
    if kind == "running":
        set_: dict[str, Any] = {
            "status": literal_column(f"'{JobStatus.RUNNING.value}'"),
            "worker": ex.worker,
            "admitted_at": ex.admitted_at,
            "updated_at": ex.updated_at,
        }
        return stmt.on_conflict_do_update(index_elements=["id"], set_=set_, where=_status_in(_NOT_TERMINAL))
    assert kind == "result", kind
    set_ = {c: ex[c] for c in RESULT_COLUMNS}
    for c in _KEEP_IF_NULL:
        set_[c] = func.coalesce(ex[c], jobs.c[c])
    for c in (*_REQUEST_COLUMNS, "batch_id"):
        set_[c] = func.coalesce(jobs.c[c], ex[c])
    set_["updated_at"] = ex.updated_at
    return stmt.on_conflict_do_update(index_elements=["id"], set_=set_, where=~_status_in(_TERMINAL))


def _count(conn: Connection, stmt: Any) -> int:
    # Rows written, counted from RETURNING: DBAPI rowcount is -1 for some drivers' multi-row upserts.
    return len(conn.execute(stmt).all())


def _first_by_id(items: Iterable[Any], key: Callable[[Any], str]) -> list[Any]:
    seen: set[str] = set()
    out = []
    for item in items:
        k = key(item)
        if k not in seen:
            seen.add(k)
            out.append(item)
    return out


def percentile_cont(sorted_values: Sequence[float], q: float) -> float | None:
    """Postgres' percentile_cont: linear interpolation between the two nearest ranks."""
    if not sorted_values:
        return None
    pos = q * (len(sorted_values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _job_record(row: Row[Any]) -> JobRecord:
    m = row._mapping
    messages = m["messages"]
    sampling = m["sampling"]
    return JobRecord(
        id=m["id"],
        batch_id=m["batch_id"],
        status=JobStatus(m["status"]),
        custom_id=m["custom_id"],
        owner=m["owner"],
        line_no=m["line_no"],
        line_format=m["line_format"],
        prompt=m["prompt"],
        messages=None if messages is None else [ChatMessage.model_validate(x) for x in messages],
        sampling=None if sampling is None else SamplingParams.model_validate(sampling),
        priority=m["priority"],
        prefix_key=m["prefix_key"],
        metadata=m["metadata"] or {},
        text=m["text"],
        finish_reason=None if m["finish_reason"] is None else FinishReason(m["finish_reason"]),
        usage=Usage(
            prompt_tokens=m["prompt_tokens"] or 0,
            cached_prompt_tokens=m["cached_prompt_tokens"] or 0,
            completion_tokens=m["completion_tokens"] or 0,
        ),
        timings=JobTimings(**{k: m[k] for k in JobTimings.model_fields}),
        worker=m["worker"],
        model=m["model"],
        error_code=None if m["error_code"] is None else ErrorCode(m["error_code"]),
        error_message=m["error_message"],
        created_at=m["created_at"],
        updated_at=m["updated_at"],
        logprobs=None if m["logprobs"] is None else [TokenLogprobs.model_validate(x) for x in m["logprobs"]],
        prompt_logprobs=None if m["prompt_logprobs"] is None else [
            None if x is None else TokenLogprobs.model_validate(x) for x in m["prompt_logprobs"]],
        deliveries=m["deliveries"],
    )


class ResultStore:
    """Jobs and batches in one SQL database (Postgres in production, SQLite embedded).

    Every write is idempotent by id, and a row in a terminal state (succeeded, failed, cancelled)
    is never changed again: a re-delivered job, or a late duplicate result, writes nothing.
    The schema comes from the Alembic migrations (`pipeline.store.migrate`); this class never
    creates tables.
    """

    def __init__(
        self, engine: Engine, *, batch_rows: int = 500, clock: Callable[[], float] = time.time
    ) -> None:
        self.engine = engine
        self.batch_rows = batch_rows
        self._clock = clock
        dialect = engine.dialect.name
        if dialect == "postgresql":
            self._insert = postgresql.insert
        elif dialect == "sqlite":
            self._insert = sqlite.insert
        else:
            raise ValueError(f"unsupported database dialect {dialect!r}")
        self.dialect = dialect
        self._stmts: dict[tuple[str, tuple[str, ...], bool], Any] = {}

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> ResultStore:
        """A store on a new engine for `url` (normalised like settings' database_url)."""
        return cls(make_engine(url), **kwargs)

    def close(self) -> None:
        """Close the engine's pooled connections."""
        self.engine.dispose()

    # --- writes ----------------------------------------------------------------------------------

    def insert_queued(self, requests: Iterable[JobRequest]) -> int:
        """Record jobs as queued; jobs that already have a row are left alone. Returns rows inserted."""
        return len(self.record_queued(requests))

    def record_queued(self, requests: Iterable[JobRequest]) -> set[str]:
        """Record jobs as queued; jobs that already have a row are left alone. Returns the ids inserted."""
        now = self._clock()
        rows = [_request_row(j, JobStatus.QUEUED, now) for j in _first_by_id(requests, lambda j: j.id)]
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
                cond = [jobs.c.id.in_(ids[i : i + 1000]), jobs.c.status.in_(_NOT_TERMINAL)]
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
                if status in _NOT_TERMINAL:
                    out.held[jid] = deliveries
                else:
                    out.terminal.add(jid)
            absent = set(missing) - set(found)
            rows = []
            for j in _first_by_id((j for j in requests if j.id in absent), lambda j: j.id):
                row = _request_row(j, JobStatus.RUNNING, now)
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
                n += _count(conn, stmt.returning(jobs.c.id))
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
            _result_row(r, requests.get(r.id), now, lines.get(r.id))
            for r in _first_by_id(results, lambda r: r.id)
        ]
        if not rows:
            return 0
        with self.engine.begin() as conn:
            return self._execute_many(conn, "result", rows)

    # --- bulk statements -------------------------------------------------------------------------

    def _execute_many(self, conn: Connection, kind: str, rows: list[dict[str, Any]]) -> int:
        """Run the `kind` statement ("queued", "running", "result") over many rows, in chunks of
        `batch_rows`; returns the rows it wrote.

        Postgres: one `INSERT ... SELECT ... FROM jsonb_to_recordset(<the chunk as one JSON
        array>) ON CONFLICT ...` per chunk: the statement text does not depend on the row count
        (compiled and prepared once) and the rows travel as one JSON document, encoded in C. A
        multi-row VALUES clause cost ~1 ms a row in psycopg's placeholder handling, and one array
        per column (unnest) ~0.2 ms a row in its pure-Python array dumper. SQLite: the same
        upsert with VALUES, run as executemany. The statements are built once per store and
        column set, so SQLAlchemy's compiled cache holds them.
        """
        names = tuple(rows[0])
        stmt = self._bulk_stmt(kind, names)
        written = 0
        if self.dialect == "postgresql":
            for chunk in _chunks(rows, 1, self.batch_rows):
                written += conn.execute(stmt, {"rows": json.dumps(chunk)}).rowcount
        else:
            for chunk in _chunks(rows, len(names), self.batch_rows):
                written += len(conn.execute(stmt, chunk).all())
        return written

    def _returning_many(self, conn: Connection, kind: str, rows: list[dict[str, Any]]) -> set[str]:
        """`_execute_many`, returning the ids of the rows written instead of their count."""
        names = tuple(rows[0])
        stmt = self._bulk_stmt(kind, names, returning=True)
        ids: set[str] = set()
        if self.dialect == "postgresql":
            for chunk in _chunks(rows, 1, self.batch_rows):
                ids.update(r[0] for r in conn.execute(stmt, {"rows": json.dumps(chunk)}))
        else:
            for chunk in _chunks(rows, len(names), self.batch_rows):
                ids.update(r[0] for r in conn.execute(stmt, chunk).all())
        return ids

    def _bulk_stmt(self, kind: str, names: tuple[str, ...], *, returning: bool = False) -> Any:
        key = (kind, names, returning)
        stmt = self._stmts.get(key)
        if stmt is None:
            stmt = _on_conflict(kind, self._bulk_insert(names))
            # executemany's rowcount is not reliable on SQLite: count RETURNING
            if returning or self.dialect != "postgresql":
                stmt = stmt.returning(jobs.c.id)
            self._stmts[key] = stmt
        return stmt

    def _bulk_insert(self, names: tuple[str, ...]) -> Any:
        if self.dialect != "postgresql":
            return self._insert(jobs)
        # the record's columns as Postgres reads them from each JSON object
        fields = [column(n, postgresql.JSONB() if n in _JSON_COLUMNS else jobs.c[n].type) for n in names]
        doc = cast(bindparam("rows", type_=Text()), postgresql.JSONB)
        src = func.jsonb_to_recordset(doc).table_valued(*fields).render_derived(name="src", with_types=True)
        # jsonb_to_recordset reads a JSON null as SQL NULL; SQLAlchemy's JSON type (the SQLite
        # path, and every write before) stores None as JSON null: keep one representation.
        cols = [func.coalesce(src.c[n], _JSON_NULL) if n in _JSON_COLUMNS else src.c[n] for n in names]
        stmt = postgresql.insert(jobs).from_select(list(names), select(*cols))
        # rows written = the INSERT's rowcount (conflicting rows the WHERE skips are not counted)
        return stmt.execution_options(preserve_rowcount=True)

    def forget_queued(self, job_ids: Sequence[str]) -> int:
        """Delete rows still queued (a job recorded whose publish failed, so that it can be sent
        again under the same id). Returns rows deleted."""
        if not job_ids:
            return 0
        stmt = delete(jobs).where(jobs.c.id.in_(list(job_ids)), jobs.c.status == JobStatus.QUEUED.value)
        with self.engine.begin() as conn:
            return _count(conn, stmt.returning(jobs.c.id))

    def cancel(
        self, *, job_ids: Sequence[str] = (), batch_id: str | None = None, reason: str = "cancelled"
    ) -> int:
        """Mark queued or running jobs (by id, or every job of a batch) cancelled. Returns rows changed."""
        if not job_ids and batch_id is None:
            return 0
        now = self._clock()
        cond = jobs.c.status.in_(_NOT_TERMINAL)
        cond = (
            and_(cond, jobs.c.id.in_(list(job_ids))) if job_ids else and_(cond, jobs.c.batch_id == batch_id)
        )
        stmt = (
            update(jobs)
            .where(cond)
            .values(
                status=JobStatus.CANCELLED.value,
                finish_reason=FinishReason.ABORT.value,
                error_code=ErrorCode.CANCELLED.value,
                error_message=reason,
                finished_at=now,
                updated_at=now,
            )
        )
        with self.engine.begin() as conn:
            n = _count(conn, stmt.returning(jobs.c.id))
            if batch_id is not None and not job_ids:
                conn.execute(
                    update(batches)
                    .where(batches.c.id == batch_id, batches.c.status == BATCH_OPEN)
                    .values(status=BATCH_CANCELLED, updated_at=now, finished_at=now)
                )
        return n

    # --- batches ---------------------------------------------------------------------------------

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
                status=BATCH_OPEN,
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
            return _count(conn, stmt.returning(batches.c.id)) == 1

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
            if row[0] != BATCH_OPEN:
                return row[0] == BATCH_COMPLETED
            if row[1] is None:  # its input is still being read
                return False
            pending = conn.execute(
                select(jobs.c.id).where(jobs.c.batch_id == batch_id, jobs.c.status.in_(_NOT_TERMINAL)).limit(1)
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
                .where(batches.c.id == batch_id, batches.c.status == BATCH_OPEN)
                .values(status=BATCH_COMPLETED, updated_at=now, finished_at=now)
            )
            status = conn.execute(select(batches.c.status).where(batches.c.id == batch_id)).scalar()
        return status == BATCH_COMPLETED

    # --- reads -----------------------------------------------------------------------------------

    def get_job(self, job_id: str) -> JobRecord | None:
        """The job's row, or None."""
        with self.engine.connect() as conn:
            row = conn.execute(select(jobs).where(jobs.c.id == job_id)).first()
        return None if row is None else _job_record(row)

    def get_jobs(self, job_ids: Sequence[str]) -> dict[str, JobRecord]:
        """The rows of those ids that exist, by id."""
        out: dict[str, JobRecord] = {}
        ids = list(dict.fromkeys(job_ids))
        with self.engine.connect() as conn:
            for i in range(0, len(ids), 1000):
                for row in conn.execute(select(jobs).where(jobs.c.id.in_(ids[i : i + 1000]))):
                    rec = _job_record(row)
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
            return [_job_record(r) for r in conn.execute(q)]

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
                rows = [_job_record(r) for r in conn.execute(q)]
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
                rows = [_job_record(r) for r in conn.execute(q.order_by(jobs.c.id).limit(page))]
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
                    select(jobs.c.status, func.count()).where(jobs.c.status.in_(_NOT_TERMINAL)).group_by(jobs.c.status)
                )
            }
            oldest = conn.execute(
                select(func.min(jobs.c.submitted_at)).where(jobs.c.status == JobStatus.QUEUED.value)
            ).scalar()
        return counts, oldest

    def count_unfinished(self, owner: str | None) -> int:
        """Jobs of `owner` queued or running (an index range: ix_jobs_owner_status)."""
        with self.engine.connect() as conn:
            return conn.execute(
                select(func.count()).where(jobs.c.owner == owner, jobs.c.status.in_(_NOT_TERMINAL))
            ).scalar() or 0

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
        q = (select(batches).where(batches.c.status == BATCH_OPEN, batches.c.created_at < created_before)
             .order_by(batches.c.created_at, batches.c.id).limit(limit))
        if after is not None:
            q = q.where(or_(batches.c.created_at > after[0],
                            and_(batches.c.created_at == after[0], batches.c.id > after[1])))
        with self.engine.connect() as conn:
            return [self._batch_record(conn, row) for row in conn.execute(q).all()]

    def end_batch(
        self, batch_id: str, status: str, *, reason: str, from_statuses: Sequence[str] = (BATCH_OPEN,)
    ) -> int:
        """End a batch that is in one of `from_statuses` (open) as `status` (expired, failed,
        cancelled): its queued and running jobs are cancelled with `reason`. Returns the jobs
        cancelled; 0 also when the batch was in another status (it is left as it is)."""
        if status not in (BATCH_EXPIRED, BATCH_FAILED, BATCH_CANCELLED):
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
                .where(jobs.c.batch_id == batch_id, jobs.c.status.in_(_NOT_TERMINAL))
                .values(
                    status=JobStatus.CANCELLED.value,
                    finish_reason=FinishReason.ABORT.value,
                    error_code=ErrorCode.CANCELLED.value,
                    error_message=reason,
                    finished_at=now,
                    updated_at=now,
                )
            )
            return _count(conn, stmt.returning(jobs.c.id))

    def set_batch_metadata(self, batch_id: str, metadata: Mapping[str, Any]) -> None:
        """Replace a batch's metadata (the OpenAI Batch API's fields live there)."""
        with self.engine.begin() as conn:
            conn.execute(
                update(batches).where(batches.c.id == batch_id).values(metadata=dict(metadata), updated_at=self._clock())
            )

    # --- files -----------------------------------------------------------------------------------

    def put_file(self, file_id: str, *, owner: str | None, purpose: str, filename: str, content: bytes) -> FileRecord:
        """Store an uploaded file."""
        import hashlib

        rec = FileRecord(
            id=file_id,
            owner=owner,
            purpose=purpose,
            filename=filename,
            bytes=len(content),
            sha256=hashlib.sha256(content).hexdigest(),
            created_at=self._clock(),
        )
        with self.engine.begin() as conn:
            conn.execute(files.insert().values(**rec.__dict__, content=content))
        return rec

    def get_file(self, file_id: str) -> FileRecord | None:
        """A file's record (not its content), or None."""
        cols = [c for c in files.c if c.name != "content"]
        with self.engine.connect() as conn:
            row = conn.execute(select(*cols).where(files.c.id == file_id)).first()
        return None if row is None else FileRecord(**row._mapping)

    def file_content(self, file_id: str) -> bytes | None:
        """A file's bytes, or None."""
        with self.engine.connect() as conn:
            return conn.execute(select(files.c.content).where(files.c.id == file_id)).scalar()

    def _batch_record(self, conn: Connection, row: Row[Any]) -> BatchRecord:
        progress = self._progress(conn, row._mapping["id"])
        m = row._mapping
        return BatchRecord(
            id=m["id"],
            status=m["status"],
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

    # --- latency ---------------------------------------------------------------------------------

    def latency_stats(
        self,
        *,
        since: float | None = None,
        until: float | None = None,
        metrics: Sequence[str] = ("ttft_ms", "queue_ms", "tpot_ms"),
        by: Sequence[str] = ("worker", "model"),
        time_column: str = "finished_at",
        status: JobStatus | None = JobStatus.SUCCEEDED,
        owner: str | None = None,
        batch_id: str | None = None,
    ) -> list[LatencyStats]:
        """p50/p90/p99, mean and count of each metric over jobs whose `time_column` lies in
        [since, until), grouped by `by` (a subset of worker, model; empty: one group), of one
        owner's and/or one batch's jobs when given.

        Postgres computes percentile_cont in SQL; SQLite has no percentile aggregate, so the
        values are fetched and interpolated the same way in Python.
        """
        bad = [m for m in metrics if m not in LATENCY_METRICS]
        if bad:
            raise ValueError(f"unknown latency metric {bad[0]!r}; one of {LATENCY_METRICS}")
        if any(g not in ("worker", "model") for g in by):
            raise ValueError("by: only 'worker' and 'model' can group latency stats")
        if time_column not in ("finished_at", "submitted_at"):
            raise ValueError("time_column: finished_at or submitted_at")
        tcol = jobs.c[time_column]
        conds = [tcol.is_not(None)]
        if since is not None:
            conds.append(tcol >= since)
        if until is not None:
            conds.append(tcol < until)
        if status is not None:
            conds.append(jobs.c.status == JobStatus(status).value)
        if owner is not None:
            conds.append(jobs.c.owner == owner)
        if batch_id is not None:
            conds.append(jobs.c.batch_id == batch_id)
        groups = [jobs.c[g] for g in by]
        if self.dialect == "postgresql":
            return self._latency_sql(metrics, by, groups, conds)
        return self._latency_python(metrics, by, groups, conds)

    def _latency_sql(
        self, metrics: Sequence[str], by: Sequence[str], groups: list[Any], conds: list[Any]
    ) -> list[LatencyStats]:
        cols: list[Any] = list(groups)
        for m in metrics:
            c = jobs.c[m]
            cols += [
                func.count(c),
                func.avg(c),
                func.percentile_cont(0.5).within_group(c),
                func.percentile_cont(0.9).within_group(c),
                func.percentile_cont(0.99).within_group(c),
            ]
        q = select(*cols).where(*conds)
        if groups:
            q = q.group_by(*groups).order_by(*groups)
        out = []
        with self.engine.connect() as conn:
            for row in conn.execute(q):
                key = dict(zip(by, row[: len(by)]))
                vals = row[len(by) :]
                for i, m in enumerate(metrics):
                    n, mean, p50, p90, p99 = vals[5 * i : 5 * i + 5]
                    out.append(
                        LatencyStats(
                            metric=m,
                            worker=key.get("worker"),
                            model=key.get("model"),
                            count=int(n),
                            mean=None if mean is None else float(mean),
                            p50=p50,
                            p90=p90,
                            p99=p99,
                        )
                    )
        return out

    def _latency_python(
        self, metrics: Sequence[str], by: Sequence[str], groups: list[Any], conds: list[Any]
    ) -> list[LatencyStats]:
        values: dict[tuple[Any, ...], dict[str, list[float]]] = defaultdict(lambda: {m: [] for m in metrics})
        q = select(*groups, *(jobs.c[m] for m in metrics)).where(*conds)
        with self.engine.connect() as conn:
            for row in conn.execute(q):
                key = tuple(row[: len(by)])
                bucket = values[key]
                for m, v in zip(metrics, row[len(by) :]):
                    if v is not None:
                        bucket[m].append(float(v))
        if not values and not by:
            values[()] = {m: [] for m in metrics}
        out = []
        for key in sorted(values, key=lambda k: tuple("" if x is None else str(x) for x in k)):
            named = dict(zip(by, key))
            for m in metrics:
                vs = sorted(values[key][m])
                out.append(
                    LatencyStats(
                        metric=m,
                        worker=named.get("worker"),
                        model=named.get("model"),
                        count=len(vs),
                        mean=(sum(vs) / len(vs)) if vs else None,
                        p50=percentile_cont(vs, 0.5),
                        p90=percentile_cont(vs, 0.9),
                        p99=percentile_cont(vs, 0.99),
                    )
                )
        return out
