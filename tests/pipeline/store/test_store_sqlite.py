"""ResultStore on SQLite (the embedded mode), schema made by the Alembic migrations."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from store_contract import StoreContract, check_upgrade_from_0001

from pipeline.store import ResultStore, make_engine, migrate
from pipeline.store.tables import metadata


class TestSQLiteStore(StoreContract):
    pass


def test_migrations_match_the_tables(sqlite_url: str):
    engine = make_engine(sqlite_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    engine.dispose()
    assert diff == []


def test_migrate_is_idempotent_and_creates_the_view(sqlite_url: str):
    migrate(sqlite_url)
    engine = make_engine(sqlite_url)
    insp = inspect(engine)
    assert {"jobs", "batches", "alembic_version"} <= set(insp.get_table_names())
    assert "job_latency" in insp.get_view_names()
    assert {ix["name"] for ix in insp.get_indexes("jobs")} >= {
        "ix_jobs_submitted_at",
        "ix_jobs_finished_at",
        "ix_jobs_batch_status",
    }
    engine.dispose()


def test_in_memory_database(tmp_path):
    engine = make_engine("sqlite://")
    migrate(engine=engine)
    store = ResultStore(engine)
    from store_contract import ok

    assert store.upsert_results([ok("mem")]) == 1
    assert store.get_job("mem") is not None


def test_upgrade_from_0001_keeps_rows_and_their_ids(tmp_path):
    check_upgrade_from_0001(f"sqlite:///{tmp_path / 'old.db'}")
