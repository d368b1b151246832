"""Prometheus metrics of the API (its requests, the store's backlog, and every worker's jobs as
their rows say), read back as Prometheus scrapes them."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from firsttoken.api import create_app
from pipeline.settings import Settings
from tests.prometheus_text import samples as _samples
from tests.prometheus_text import value as _value


def test_api_metrics_show_requests_and_the_backlog(store, queue):
    app = create_app(Settings(api_no_auth=True), store=store, queue=queue, canceller=None, replies=None)
    with TestClient(app) as c:
        for i in range(3):
            assert c.post("/v1/jobs", json={"id": f"m{i}", "prompt": "hi"}).status_code == 202
        assert c.get("/v1/jobs/m1").status_code == 200
        assert c.get("/v1/jobs/nope").status_code == 404
        m = _samples(c.get("/metrics").text)
    assert _value(m, "firsttoken:jobs", status="queued") == 3 and _value(m, "firsttoken:jobs", status="running") == 0
    assert _value(m, "firsttoken:queue_lag_seconds") > 0
    assert _value(m, "firsttoken:api_requests_total", route="/v1/jobs", method="POST", status="202") == 3
    # routes by template: no job ids in the labels
    assert _value(m, "firsttoken:api_requests_total", route="/v1/jobs/{job_id}", status="404") == 1
    assert not [k for k in m if "m1" in str(k) or "nope" in str(k)]
    assert _value(m, "firsttoken:api_completions_in_flight") == 0  # no reply channel here: none


def test_api_metrics_count_completions_in_flight(store, queue):
    from types import SimpleNamespace

    replies = SimpleNamespace(live=3)  # the waiter's count of open reply subscriptions
    app = create_app(Settings(api_no_auth=True), store=store, queue=queue, canceller=None, replies=replies)
    with TestClient(app) as c:
        assert _value(_samples(c.get("/metrics").text), "firsttoken:api_completions_in_flight") == 3
        replies.live = 0
        assert _value(_samples(c.get("/metrics").text), "firsttoken:api_completions_in_flight") == 0


def test_api_metrics_count_each_succeeded_job_once_ttft_and_prefix_hits(store, queue):
    """The API's job figures come from the rows the workers write: every job that succeeded since
    the API started is observed once (TTFT histogram, prompt and cached tokens), whatever the
    scrapes; failed jobs and those before the start are left out."""
    import time

    from schemas.job import ErrorCode, FinishReason, JobResult, JobStatus, JobTimings, Usage

    def succeeded(i: int, ttft_ms: float, prompt: int, cached: int) -> JobResult:
        return JobResult(id=f"t{i}", status=JobStatus.SUCCEEDED, text="x", finish_reason=FinishReason.LENGTH,
                         usage=Usage(prompt_tokens=prompt, cached_prompt_tokens=cached, completion_tokens=1),
                         timings=JobTimings(submitted_at=time.time() - 1, finished_at=time.time(), ttft_ms=ttft_ms))

    store.upsert_results([succeeded(0, 5000.0, 100, 0)])  # before the API starts: not counted
    time.sleep(0.05)
    app = create_app(Settings(api_no_auth=True, api_metrics_max_age_s=1e-9), store=store, queue=queue, canceller=None,
                     replies=None)
    with TestClient(app) as c:
        def scrape() -> dict:
            return _samples(c.get("/metrics").text)

        m = scrape()
        assert _value(m, "firsttoken:api_time_to_first_token_seconds_count") == 0
        store.upsert_results([succeeded(1, 40.0, 1000, 512), succeeded(2, 300.0, 200, 0),
                              JobResult.failure("t3", ErrorCode.ENGINE_ERROR, "boom")])
        for _ in range(3):  # scraped again and again: each job counted once
            m = scrape()
        assert _value(m, "firsttoken:api_time_to_first_token_seconds_count") == 2
        assert _value(m, "firsttoken:api_time_to_first_token_seconds_sum") == pytest.approx(0.34)
        assert _value(m, "firsttoken:api_time_to_first_token_seconds_bucket", le="0.05") == 1
        assert _value(m, "firsttoken:api_prompt_tokens_total") == 1200
        assert _value(m, "firsttoken:api_prefix_cache_hit_tokens_total") == 512
        store.upsert_results([succeeded(4, 20.0, 64, 64)])
        m = scrape()
        assert _value(m, "firsttoken:api_time_to_first_token_seconds_count") == 3
        assert _value(m, "firsttoken:api_prefix_cache_hit_tokens_total") == 576


@pytest.fixture
def queue():
    from pipeline.queue import LocalQueue

    return LocalQueue(partitions=1)
