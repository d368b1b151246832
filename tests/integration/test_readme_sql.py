"""The SQL over job_latency in docs/observability.md runs on Postgres and answers sensibly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sqlalchemy import text

from pipeline.store import ResultStore, make_engine
from schemas.job import FinishReason, JobRequest, JobResult, JobStatus, JobTimings, Usage

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


def readme_queries() -> list[str]:
    section = README.read_text().split("## SQL over latency history", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sql\n(.*?)```", section, flags=re.S)


@pytest.fixture
def empty_db(postgres_server_url):
    """A database of its own (the session's holds other tests' jobs, which the queries would mix in)."""
    import uuid

    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from pipeline.store import migrate

    server = make_url(postgres_server_url)
    name = f"firsttoken_sql_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = server.set(database=name).render_as_string(hide_password=False)
    try:
        migrate(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_the_five_queries_run(empty_db):
    import time

    queries = readme_queries()
    assert len(queries) == 5
    store = ResultStore(make_engine(empty_db))
    now = time.time()
    results, requests = [], {}
    for i in range(40):
        jid = f"sql-{i}"
        prompt = 100 + 300 * i
        results.append(JobResult(
            id=jid, batch_id="sql-batch", custom_id=f"c{i}", status=JobStatus.SUCCEEDED, text="x",
            finish_reason=FinishReason.LENGTH,
            usage=Usage(prompt_tokens=prompt, cached_prompt_tokens=(prompt // 2) * (i % 3 == 0), completion_tokens=8),
            timings=JobTimings(submitted_at=now - 100 + i, admitted_at=now - 99 + i, finished_at=now - 90 + i,
                               ttft_ms=10.0 + i, queue_ms=1.0, overhead_ms=2.0, engine_ttft_ms=7.0 + i,
                               prefill_ms=5.0 + i, tpot_ms=3.0, e2e_ms=100.0),
            worker="w1", model="m",
        ))
        requests[jid] = JobRequest(id=jid, prompt="x", batch_id="sql-batch", custom_id=f"c{i}")
    store.upsert_results(results, requests)
    try:
        with store.engine.connect() as conn:
            out = [conn.execute(text(q)).mappings().all() for q in queries]
    finally:
        store.close()
    per_batch = {r["batch_id"]: r for r in out[0]}
    assert per_batch["sql-batch"]["jobs"] == 40 and per_batch["sql-batch"]["ttft_p50"] == pytest.approx(29.5)
    assert sum(r["jobs"] for r in out[1]) == 40  # all within the last day
    assert sum(r["jobs"] for r in out[2]) == 40 and len(out[2]) == 9  # 8 buckets and the one past 8192
    cached = {r["cached"]: r for r in out[3]}
    assert cached["3 half or more"]["jobs"] >= 1 and cached["1 none"]["jobs"] >= 1
    assert [r["custom_id"] for r in out[4]][:3] == ["c39", "c38", "c37"]
    assert out[4][0]["pipeline_overhead_ms"] == pytest.approx(2.0)  # the stored overhead, no queue in it
