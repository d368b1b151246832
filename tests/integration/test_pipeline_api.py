"""The HTTP API against real Postgres and Kafka, with an in-process worker doing the jobs."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from pipeline_util import in_process_worker, settings_for, tag, wait_until

from firsttoken.api import create_app

pytestmark = pytest.mark.integration


KEY_A = "alice-key-0123456789"
KEY_B = "bob-key-0123456789ab"


def test_api_jobs_batches_results_cancel_latency(kafka_settings, postgres_url):
    from workers.engine import EngineConfig, LLMEngine

    s = settings_for(kafka_settings, postgres_url, api_keys=f"alice:{KEY_A},bob:{KEY_B}")
    cancels = []
    t = tag()
    app = create_app(s, canceller=lambda ids, batch: cancels.append((list(ids), batch)))
    alice = {"authorization": f"Bearer {KEY_A}"}
    bob = {"authorization": f"Bearer {KEY_B}"}
    with TestClient(app) as client:
        assert client.get("/healthz").json() == {"ok": True}  # the only route without a key
        assert client.get("/v1/jobs/x").status_code == 401
        # submitted before any worker runs: cancel it while it is queued
        r = client.post(
            "/v1/jobs", json={"id": f"cx-{t}", "prompt": "cancel me", "sampling": {"max_tokens": 3}}, headers=alice
        )
        assert r.status_code == 202 and r.json()["custom_id"] == f"cx-{t}"
        cx = r.json()["id"]
        # the same id again is a conflict, not a silently dropped prompt
        again = client.post("/v1/jobs", json={"id": f"cx-{t}", "prompt": "other"}, headers=alice)
        assert again.status_code == 409 and again.json()["error"]["job_id"] == cx
        # bob's own job may use the same custom id; he cannot see or cancel alice's
        assert client.post("/v1/jobs", json={"id": f"cx-{t}", "prompt": "bob's"}, headers=bob).status_code == 202
        assert client.delete(f"/v1/jobs/{cx}", headers=bob).status_code == 404
        d = client.delete(f"/v1/jobs/cx-{t}", headers=alice).json()  # by her custom id
        assert d == {"id": cx, "cancelled": True, "status": "cancelled"}
        assert cancels == [([cx], None)]

        r = client.post(
            "/v1/jobs", json={"prompt": "hello", "sampling": {"max_tokens": 3, "temperature": 0}}, headers=alice
        )
        job_id = r.json()["id"]
        bad = client.post("/v1/jobs", json={"prompt": "x", "sampling": {"top_p": 5}}, headers=alice)
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_sampling"

        lines = [
            json.dumps({"id": f"b{i}", "prompt": f"line {i}", "max_tokens": 2, "temperature": 0})
            for i in range(5)
        ] + ["{broken", json.dumps({"id": "bs", "prompt": "p", "max_tokens": 0}), json.dumps({"id": "b0", "prompt": "dup"})]
        r = client.post(
            "/v1/batches",
            params={"batch_id": f"B-{t}"},
            content="\n".join(lines),
            headers={"content-type": "application/x-ndjson", **alice},
        )
        assert r.status_code == 202, r.text
        assert r.json()["submitted"] == 5 and r.json()["invalid"] == 3
        # bob may neither read alice's batch nor add to it: the name is his own batch's
        assert client.get(f"/v1/batches/B-{t}", headers=bob).status_code == 404
        theirs = client.post("/v1/batches", params={"batch_id": f"B-{t}"}, content=lines[0], headers=bob)
        assert theirs.status_code == 202 and theirs.json()["batch_id"] != r.json()["batch_id"]
        assert client.get(f"/v1/jobs/{job_id}", headers=alice).json()["status"] == "queued"

        worker = in_process_worker(s, LLMEngine("tiny", EngineConfig(device="cpu")), "w-api").start()
        try:
            wait_until(
                lambda: client.get(f"/v1/batches/B-{t}", headers=alice).json()["status"] == "completed", 120, "the batch"
            )
            wait_until(
                lambda: client.get(f"/v1/jobs/{job_id}", headers=alice).json()["status"] == "succeeded", 60, "the job"
            )
            wait_until(lambda: client.get(f"/v1/batches/B-{t}", headers=bob).json()["complete"], 60, "bob's batch")
            wait_until(lambda: sum(worker.intake.consumer.in_flight().values()) == 0, 60, "commits")
        finally:
            worker.stop()
        job = client.get(f"/v1/jobs/{job_id}", headers=alice).json()
        assert job["usage"]["completion_tokens"] >= 1 and job["timings"]["ttft_ms"] is not None
        assert client.get(f"/v1/jobs/{cx}", headers=alice).json()["status"] == "cancelled"  # never overwritten
        b = client.get(f"/v1/batches/B-{t}", headers=alice).json()
        assert b["complete"] and b["counts"] == {"succeeded": 5, "failed": 3} and b["finished_at"] is not None
        assert b["request_counts"] == {"total": 8, "completed": 5, "failed": 3}
        res = [json.loads(x) for x in client.get(f"/v1/batches/B-{t}/results", headers=alice).text.splitlines()]
        # input order, each line its own result
        assert [(x["id"], x["status"], x.get("error_code")) for x in res] == [
            *[(f"b{i}", "succeeded", None) for i in range(5)],
            (None, "failed", "invalid_request"),
            ("bs", "failed", "invalid_sampling"),
            ("b0", "failed", "duplicate_id"),
        ]
        lat = client.get("/v1/latency", params={"since": time.time() - 600, "by": "worker"}, headers=alice).json()
        ttft = [x for x in lat["stats"] if x["metric"] == "ttft_ms" and x["worker"] == "w-api"]
        assert ttft and ttft[0]["count"] >= 6 and ttft[0]["p50"] <= ttft[0]["p99"]
        # bob's latency covers only his jobs: his one job and the line of his own batch named B-<t>
        lat_b = client.get("/v1/latency", params={"since": time.time() - 600, "metrics": "ttft_ms"}, headers=bob)
        assert lat_b.json()["stats"][0]["count"] == 2
        by_batch = client.get("/v1/latency", params={"batch_id": f"B-{t}", "metrics": "ttft_ms"}, headers=alice)
        assert by_batch.json()["stats"][0]["count"] == 5
        assert client.get("/v1/latency", params={"metrics": "nope"}, headers=alice).status_code == 400
        assert client.get("/v1/jobs/nope", headers=alice).status_code == 404
