"""Run the Alembic migrations from Python: the same as `alembic upgrade head`."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, text

from pipeline.settings import get_settings, normalize_database_url
from pipeline.store.engine import make_engine

ROOT = Path(__file__).resolve().parents[2]
_MIGRATION_LOCK_ID = 0x66697273  # pg_advisory_xact_lock key: one migrating process at a time


def alembic_config(url: str | None = None) -> Config:
    """An Alembic Config for this repository's migrations/, targeting `url` (settings' when None)."""
    ini = ROOT / "alembic.ini"
    cfg = Config(str(ini)) if ini.exists() else Config()
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.attributes["url"] = normalize_database_url(url) if url else get_settings().database_url
    cfg.attributes["configure_logging"] = False
    return cfg


def migrate(url: str | None = None, revision: str = "head", *, engine: Engine | None = None) -> None:
    """Upgrade the database at `url` (or behind `engine`) to `revision`.

    On Postgres an advisory lock makes concurrent callers (several workers starting at once) run
    the migrations one after the other; the later ones find nothing to do.
    """
    cfg = alembic_config(url if engine is None else engine.url.render_as_string(hide_password=False))
    own = engine is None
    eng = make_engine(cfg.attributes["url"]) if engine is None else engine
    try:
        with eng.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK_ID})
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    finally:
        if own:
            eng.dispose()
