"""Bulk writes of `jobs` rows, one statement per chunk, with each dialect's upsert."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import (
    Connection,
    Text,
    bindparam,
    cast,
    column,
    func,
    literal_column,
    select,
)
from sqlalchemy.dialects import postgresql

from pipeline.store.rows import (
    JSON_COLUMNS,
    JSON_NULL,
    KEEP_IF_NULL,
    NOT_TERMINAL,
    REQUEST_COLUMNS,
    TERMINAL,
    StoreBase,
    chunks,
    status_in,
)
from pipeline.store.tables import RESULT_COLUMNS, jobs
from schemas.job import (
    JobStatus,
)


def on_conflict(kind: str, stmt: Any) -> Any:
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
        return stmt.on_conflict_do_update(index_elements=["id"], set_=set_, where=status_in(NOT_TERMINAL))
    assert kind == "result", kind
    set_ = {c: ex[c] for c in RESULT_COLUMNS}
    for c in KEEP_IF_NULL:
        set_[c] = func.coalesce(ex[c], jobs.c[c])
    for c in (*REQUEST_COLUMNS, "batch_id"):
        set_[c] = func.coalesce(jobs.c[c], ex[c])
    set_["updated_at"] = ex.updated_at
    return stmt.on_conflict_do_update(index_elements=["id"], set_=set_, where=~status_in(TERMINAL))


class BulkWrites(StoreBase):
    """Bulk inserts and upserts of `jobs` rows (prepared once per shape)."""

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
            for chunk in chunks(rows, 1, self.batch_rows):
                written += conn.execute(stmt, {"rows": json.dumps(chunk)}).rowcount
        else:
            for chunk in chunks(rows, len(names), self.batch_rows):
                written += len(conn.execute(stmt, chunk).all())
        return written

    def _returning_many(self, conn: Connection, kind: str, rows: list[dict[str, Any]]) -> set[str]:
        """`_execute_many`, returning the ids of the rows written instead of their count."""
        names = tuple(rows[0])
        stmt = self._bulk_stmt(kind, names, returning=True)
        ids: set[str] = set()
        if self.dialect == "postgresql":
            for chunk in chunks(rows, 1, self.batch_rows):
                ids.update(r[0] for r in conn.execute(stmt, {"rows": json.dumps(chunk)}))
        else:
            for chunk in chunks(rows, len(names), self.batch_rows):
                ids.update(r[0] for r in conn.execute(stmt, chunk).all())
        return ids

    def _bulk_stmt(self, kind: str, names: tuple[str, ...], *, returning: bool = False) -> Any:
        key = (kind, names, returning)
        stmt = self._stmts.get(key)
        if stmt is None:
            stmt = on_conflict(kind, self._bulk_insert(names))
            # executemany's rowcount is not reliable on SQLite: count RETURNING
            if returning or self.dialect != "postgresql":
                stmt = stmt.returning(jobs.c.id)
            self._stmts[key] = stmt
        return stmt

    def _bulk_insert(self, names: tuple[str, ...]) -> Any:
        if self.dialect != "postgresql":
            return self._insert(jobs)
        # the record's columns as Postgres reads them from each JSON object
        fields = [column(n, postgresql.JSONB() if n in JSON_COLUMNS else jobs.c[n].type) for n in names]
        doc = cast(bindparam("rows", type_=Text()), postgresql.JSONB)
        src = func.jsonb_to_recordset(doc).table_valued(*fields).render_derived(name="src", with_types=True)
        # jsonb_to_recordset reads a JSON null as SQL NULL; SQLAlchemy's JSON type (the SQLite
        # path, and every write before) stores None as JSON null: keep one representation.
        cols = [func.coalesce(src.c[n], JSON_NULL) if n in JSON_COLUMNS else src.c[n] for n in names]
        stmt = postgresql.insert(jobs).from_select(list(names), select(*cols))
        # rows written = the INSERT's rowcount (conflicting rows the WHERE skips are not counted)
        return stmt.execution_options(preserve_rowcount=True)
