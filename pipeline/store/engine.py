"""SQLAlchemy engines for the results store: Postgres (psycopg 3) or SQLite (embedded)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.pool import StaticPool

from pipeline.settings import normalize_database_url


def refused_data(exc: BaseException) -> str | None:
    """When `exc` is the database refusing the values of a statement (a text it cannot store, a
    number out of range, a constraint), a short reason that names no value; None for any other
    error (the connection, the server): those are not the data's fault."""
    if not isinstance(exc, (DataError, IntegrityError)):
        return None
    orig = getattr(exc, "orig", None)
    diag = getattr(orig, "diag", None)
    primary = getattr(diag, "message_primary", None)  # psycopg: the message without DETAIL/CONTEXT (which quote data)
    reason = primary if isinstance(primary, str) and primary else type(orig or exc).__name__
    return reason[:120]


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """An engine for `url`, with per-dialect settings.

    SQLite: WAL journal (readers do not block the writer), a 30 s busy timeout, usable from any
    thread; an in-memory database is one shared connection. Postgres: pre-ping, so a connection
    that died with a server restart is replaced instead of failing the next write. Either way an
    error's text never holds the statement's parameters.
    """
    url = normalize_database_url(url)
    parsed = make_url(url)
    # errors never carry a statement's parameters: they hold prompts, and tracebacks get logged
    hide = {"hide_parameters": True}
    if parsed.get_backend_name() == "sqlite":
        kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False, "timeout": 30}}
        in_memory = parsed.database in (None, "", ":memory:")
        if in_memory:
            kwargs["poolclass"] = StaticPool
        engine = create_engine(url, echo=echo, **hide, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            if not in_memory:
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_engine(url, echo=echo, pool_pre_ping=True, pool_size=5, max_overflow=10, **hide)
