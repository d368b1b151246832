"""The HTTP API against real Postgres and Kafka, with an in-process worker doing the jobs."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from pipeline_util import in_process_worker, settings_for, tag, wait_until

from pipeline.api import create_app

pytestmark = pytest.mark.integration


def test_api_jobs_batches_results_cancel_latency(kafka_settings, postgres_url):
    from workers.engine import EngineConfig, LLMEngine

    s = settings_for(kafka_settings, postgres_url)
    cancels = []
    t = tag()
    app = create_app(s, canceller=lambda ids, batch: cancels.append((list(ids), batch)))
    with TestClient(app) as client:
        assert client.get("/healthz").json() == {"ok": True}
        # submitted before any worker runs: cancel it while it is queued
        r = client.post(
            "/v1/jobs", json={"id": f"cx-{t}", "prompt": "cancel me", "sampling": {"max_tokens": 3}}
        )
        assert r.status_code == 202 and r.json()["id"] == f"cx-{t}"
        d = client.delete(f"/v1/jobs/cx-{t}").json()
        assert d == {"id": f"cx-{t}", "cancelled": True, "status": "cancelled"}
        assert cancels == [([f"cx-{t}"], None)]

        r = client.post("/v1/jobs", json={"prompt": "hello", "sampling": {"max_tokens": 3, "temperature": 0}})
        job_id = r.json()["id"]
        assert client.post("/v1/jobs", json={"prompt": "x", "sampling": {"top_p": 5}}).status_code == 422

        lines = [
            json.dumps({"id": f"b{i}-{t}", "prompt": f"line {i}", "max_tokens": 2, "temperature": 0})
            for i in range(5)
        ] + ["{broken", json.dumps({"id": f"bs-{t}", "prompt": "p", "max_tokens": 0})]
        r = client.post(
            "/v1/batches",
            params={"batch_id": f"B-{t}"},
            content="\n".join(lines),
            headers={"content-type": "application/x-ndjson"},
        )
        assert r.status_code == 202, r.text
        assert r.json()["submitted"] == 5 and r.json()["invalid"] == 2
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"

        worker = in_process_worker(s, LLMEngine("tiny", EngineConfig(device="cpu")), "w-api").start()
        try:
            wait_until(lambda: client.get(f"/v1/batches/B-{t}").json()["done"] == 7, 120, "the batch")
            wait_until(
                lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded", 60, "the job"
            )
            wait_until(lambda: sum(worker.intake.consumer.in_flight().values()) == 0, 60, "commits")
        finally:
            worker.stop()
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["usage"]["completion_tokens"] >= 1 and job["timings"]["ttft_ms"] is not None
        assert client.get(f"/v1/jobs/cx-{t}").json()["status"] == "cancelled"  # never overwritten
        b = client.get(f"/v1/batches/B-{t}").json()
        assert b["complete"] and b["counts"] == {"succeeded": 5, "failed": 2}
        res = [json.loads(x) for x in client.get(f"/v1/batches/B-{t}/results").text.splitlines()]
        assert len(res) == 7 and {x["error_code"] for x in res if x["status"] == "failed"} == {
            "invalid_request",
            "invalid_sampling",
        }
        lat = client.get("/v1/latency", params={"since": time.time() - 600, "by": "worker"}).json()
        ttft = [x for x in lat["stats"] if x["metric"] == "ttft_ms" and x["worker"] == "w-api"]
        assert ttft and ttft[0]["count"] >= 6 and ttft[0]["p50"] <= ttft[0]["p99"]
        assert client.get("/v1/latency", params={"metrics": "nope"}).status_code == 400
        assert client.get("/v1/jobs/nope").status_code == 404
