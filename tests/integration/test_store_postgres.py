"""ResultStore on a real Postgres: the same behaviour as on SQLite, plus concurrency."""

from __future__ import annotations

import json
import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text
from store_contract import StoreContract, check_upgrade_from_0001, ok

from pipeline.store import ResultStore, make_engine, migrate
from pipeline.store.tables import metadata
from schemas.job import ErrorCode, JobStatus

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


def test_a_row_postgres_refuses_raises_data_error_and_the_sink_writes_it_as_failed(store: ResultStore):
    # NUL cannot be stored in a Postgres text value: the batch is refused as a DataError, which the
    # sink answers by writing the batch row by row, the refused row as a failed result.
    from sqlalchemy.exc import DataError

    from workers.sink import Outcome, ResultSink, SinkConfig

    with pytest.raises(DataError):
        store.upsert_results([ok("n0"), ok("n1", "bad \x00 text")])
    assert store.list_jobs(limit=10) == []  # one transaction: nothing of the refused batch
    durable: list[object] = []
    sink = ResultSink(store, durable.extend, SinkConfig(flush_interval_s=0.0))
    sink.put([Outcome(ok("n0")), Outcome(ok("n1", "bad \x00 text")), Outcome(ok("n2"))])
    assert sink.flush_once()
    rows = {r.id: r for r in store.list_jobs(limit=10)}
    assert rows["n0"].status is JobStatus.SUCCEEDED and rows["n2"].status is JobStatus.SUCCEEDED
    assert rows["n1"].status is JobStatus.FAILED and rows["n1"].error_code is not None
    assert sink.results_durable == 3


def test_json_columns_keep_one_null_representation(store: ResultStore):
    # A None request field is stored as JSON null (what SQLAlchemy's JSON type writes), by the bulk
    # statements too.
    from schemas.job import JobRequest

    store.insert_queued([JobRequest(id="jn", prompt="x")])
    store.upsert_results([ok("jr")])
    with store.engine.connect() as conn:
        got = dict(
            conn.execute(
                text("SELECT id, jsonb_typeof(messages) || '/' || jsonb_typeof(sampling) FROM jobs")
            ).all()
        )
    assert got == {"jn": "null/object", "jr": "null/null"}


def test_upgrade_from_0001_on_postgres(postgres_server_url: str):
    import uuid

    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    server = make_url(postgres_server_url)
    name = f"firsttoken_upgrade_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        check_upgrade_from_0001(server.set(database=name).render_as_string(hide_password=False))
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_a_line_the_database_refuses_fails_alone_and_the_rest_of_its_chunk_is_queued(store: ResultStore):
    """Whatever the database refuses in one line of a bulk submission (here a constraint this test
    adds: a CHECK violation, as a refused value would be) costs that line only: the chunk is
    recorded again line by line, the refused line gets a failed row saying so (no value quoted),
    and every other line is queued and published."""
    from pipeline.producer import Producer
    from pipeline.queue import LocalQueue

    with store.engine.begin() as conn:
        conn.execute(text("ALTER TABLE jobs ADD CONSTRAINT test_refuse CHECK (prompt IS NULL OR prompt <> 'refused here')"))
    try:
        queue = LocalQueue(partitions=2)
        lines = [json.dumps({"id": f"ok{i}", "prompt": f"fine {i}"}) for i in range(5)]
        lines.insert(2, json.dumps({"id": "bad", "prompt": "refused here"}))
        summary = Producer(queue, store).submit_batch(lines, batch_id="refuse-batch")
        assert summary.submitted == 5 and summary.invalid == 1
        rows = {r.custom_id: r for r in store.list_jobs(batch_id="refuse-batch")}
        assert {cid: r.status for cid, r in rows.items() if cid != "bad"} == {f"ok{i}": JobStatus.QUEUED for i in range(5)}
        assert sum(queue.end_offsets().values()) == 5
        failed = [r for r in store.list_jobs(batch_id="refuse-batch") if r.status is JobStatus.FAILED]
        assert len(failed) == 1 and failed[0].line_no == 3 and failed[0].error_code is ErrorCode.INVALID_REQUEST
        assert "the store refused this line" in failed[0].error_message
        assert "refused here" not in failed[0].error_message
    finally:
        with store.engine.begin() as conn:
            conn.execute(text("ALTER TABLE jobs DROP CONSTRAINT test_refuse"))
