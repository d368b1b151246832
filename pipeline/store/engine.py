"""SQLAlchemy engines for the results store: Postgres (psycopg 3) or SQLite (embedded)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.pool import StaticPool

from pipeline.settings import normalize_database_url


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """An engine for `url`, with per-dialect settings.

    SQLite: WAL journal (readers do not block the writer), a 30 s busy timeout, usable from any
    thread; an in-memory database is one shared connection. Postgres: pre-ping, so a connection
    that died with a server restart is replaced instead of failing the next write.
    """
    url = normalize_database_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False, "timeout": 30}}
        in_memory = parsed.database in (None, "", ":memory:")
        if in_memory:
            kwargs["poolclass"] = StaticPool
        engine = create_engine(url, echo=echo, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            if not in_memory:
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_engine(url, echo=echo, pool_pre_ping=True, pool_size=5, max_overflow=10)
