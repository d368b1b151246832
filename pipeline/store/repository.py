"""ResultStore: the jobs, batches and files tables behind one small interface, on Postgres or
SQLite. Each role is a part of its own (rows.py, bulk.py, jobs.py, batches.py, files.py,
latency.py); ResultStore puts them together on one engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.dialects import postgresql, sqlite

from pipeline.store.batches import Batches
from pipeline.store.engine import make_engine
from pipeline.store.files import Files
from pipeline.store.jobs import JobRows
from pipeline.store.latency import Latency, percentile_cont

__all__ = ["ResultStore", "percentile_cont"]


class ResultStore(JobRows, Batches, Files, Latency):
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
