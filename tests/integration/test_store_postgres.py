"""ResultStore on a real Postgres: the same behaviour as on SQLite, plus concurrency."""

from __future__ import annotations

import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text
from store_contract import StoreContract, ok

from pipeline.store import ResultStore, make_engine, migrate
from pipeline.store.tables import metadata
from schemas.job import JobStatus

pytestmark = pytest.mark.integration


@pytest.fixture
def store(postgres_url: str):
    s = ResultStore(make_engine(postgres_url))
    yield s
    with s.engine.begin() as conn:
        conn.execute(text("SET LOCAL lock_timeout = '10s'"))  # a connection a test left open fails loudly
        conn.execute(text("TRUNCATE jobs, batches"))
    s.close()


class TestPostgresStore(StoreContract):
    pass


def test_schema_matches_tables_and_uses_jsonb(postgres_url: str):
    engine = make_engine(postgres_url)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), metadata) == []
        types = dict(
            conn.execute(
                text(
                    "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'jobs'"
                )
            ).all()
        )
    assert types["sampling"] == "jsonb" and types["submitted_at"] == "double precision"
    assert "job_latency" in inspect(engine).get_view_names()
    engine.dispose()


def test_concurrent_migrations_serialise(postgres_url: str):
    errors: list[BaseException] = []

    def run() -> None:
        try:
            migrate(postgres_url)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_concurrent_duplicate_upserts_write_each_job_once(store: ResultStore):
    # Two sinks racing on the same re-delivered jobs: one row per job, the first terminal write wins.
    results_a = [ok(f"c{i:03d}", "from-a") for i in range(300)]
    results_b = [ok(f"c{i:03d}", "from-b") for i in range(300)]
    written: list[int] = []
    threads = [
        threading.Thread(target=lambda r=r: written.append(store.upsert_results(r)))
        for r in (results_a, results_b)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(written) == 300
    rows = store.list_jobs(limit=1000)
    assert len(rows) == 300 and all(r.status is JobStatus.SUCCEEDED for r in rows)
    assert all(r.text in ("from-a", "from-b") for r in rows)


def test_percentiles_computed_in_sql_match_python(store: ResultStore):
    import random

    rng = random.Random(7)
    store.upsert_results([ok(f"p{i}", ttft=rng.uniform(1, 500), finished=1000.0 + i) for i in range(500)])
    sql = store.latency_stats(by=(), metrics=("ttft_ms",))[0]
    from pipeline.store import percentile_cont

    values = sorted(r.timings.ttft_ms for r in store.list_jobs(limit=1000))  # type: ignore[misc]
    assert sql.count == 500
    assert sql.p50 == pytest.approx(percentile_cont(values, 0.5))
    assert sql.p90 == pytest.approx(percentile_cont(values, 0.9))
    assert sql.p99 == pytest.approx(percentile_cont(values, 0.99))
