"""Prometheus metrics of a GPU worker (its results and its engine's gauges), read back as
Prometheus scrapes them (the API's: tests/firsttoken/test_api_metrics.py)."""

from __future__ import annotations

import socket

import httpx
import pytest

from schemas.job import JobRequest
from tests.prometheus_text import samples as _samples
from tests.prometheus_text import value as _value
from tests.workers.conftest import all_committed, jobs, make_engine_tiny, wait_until
from workers.worker import Worker, WorkerConfig


def test_worker_metrics_count_its_results_and_show_its_engine(queue, store):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = Worker(make_engine_tiny(), queue.consumer(), store, WorkerConfig(name="w-metrics"), model_name="tiny").start()
    try:
        w.serve_metrics(port, addr="127.0.0.1")
        batch = jobs(6, max_tokens=4)
        batch.append(JobRequest(id="bad", prompt="x" * 5000))  # longer than the tiny model's context
        queue.publish(batch)
        wait_until(lambda: all_committed(queue), what="every offset committed")
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        w.stop()
    m = _samples(text)
    labels = {"worker": "w-metrics", "model_name": "tiny"}
    assert _value(m, "firsttoken:time_to_first_token_seconds_count", **labels) == 6
    assert _value(m, "firsttoken:e2e_request_latency_seconds_count", **labels) == 6
    assert _value(m, "firsttoken:inter_token_latency_seconds_count", **labels) == 6
    assert _value(m, "firsttoken:generation_tokens_total", **labels) == 24
    rows = store.get_jobs([j.id for j in batch[:6]]).values()
    assert _value(m, "firsttoken:prompt_tokens_total", **labels) == sum(r.usage.prompt_tokens for r in rows)
    assert _value(m, "firsttoken:prefix_cache_queries_total", **labels) == sum(r.usage.prompt_tokens for r in rows)
    assert _value(m, "firsttoken:request_results_total", status="failed", error_code="prompt_too_long") == 1
    assert _value(m, "firsttoken:request_results_total", status="succeeded") == 6
    assert _value(m, "firsttoken:num_requests_running", **labels) == 0
    assert 0.0 <= _value(m, "firsttoken:kv_cache_usage_perc", **labels) <= 1.0
    # kv_reserve auto: every job ran to its max_tokens, so the reserve stays at 0.85 of the remaining output
    assert _value(m, "firsttoken:kv_reserve_ratio", **labels) == pytest.approx(0.85)
    assert _value(m, "firsttoken:jobs_in_flight", **labels) == 0


def test_a_worker_whose_metrics_port_is_taken_serves_them_on_the_next_free_one(queue, store):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    w = Worker(make_engine_tiny(), queue.consumer(), store, WorkerConfig(name="w-port"), model_name="tiny")
    try:
        got = w.serve_metrics(port, addr="127.0.0.1")
        assert got is not None and got > port and w.metrics_port == got
        assert "firsttoken:jobs_in_flight" in httpx.get(f"http://127.0.0.1:{got}/metrics", timeout=5).text
    finally:
        holder.close()


@pytest.fixture
def queue():
    from pipeline.queue import LocalQueue

    return LocalQueue(partitions=1)
