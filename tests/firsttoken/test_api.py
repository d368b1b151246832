"""The HTTP API on SQLite and the in-process queue: API keys and owners, request limits, errors
that name the field without echoing the input, and no 500 from any malformed input."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from firsttoken.api import ConfigError, create_app
from pipeline.queue import LocalQueue
from pipeline.settings import Settings, parse_api_keys
from schemas.job import ErrorCode, JobStatus
from tests.fuzz_inputs import bad_lines

KEY_A = "alice-key-0123456789"
KEY_B = "bob-key-0123456789ab"
ALICE = {"authorization": f"Bearer {KEY_A}"}
BOB = {"authorization": f"Bearer {KEY_B}"}


@pytest.fixture
def queue():
    return LocalQueue(partitions=2)


@pytest.fixture
def client(store, queue):
    settings = Settings(
        api_keys=f"alice:{KEY_A},bob:{KEY_B}", api_max_body_bytes=64 * 1024, api_max_batch_bytes=4 * 1024 * 1024,
        api_max_unfinished_jobs=20_000,  # the big batch below is 12 000 jobs (the default limit is 10 000)
    )
    with TestClient(create_app(settings, store=store, queue=queue, canceller=None)) as c:
        yield c


def _published(queue: LocalQueue) -> int:
    return sum(queue.end_offsets().values())


def test_no_keys_refuses_to_start_unless_auth_is_switched_off(store, queue):
    with pytest.raises(ConfigError, match="FIRSTTOKEN_API_KEYS"):
        create_app(Settings(), store=store, queue=queue)
    app = create_app(Settings(api_no_auth=True), store=store, queue=queue, canceller=None)
    with TestClient(app) as c:
        r = c.post("/v1/jobs", json={"id": "a", "prompt": "hi"})
        assert r.status_code == 202 and c.get("/v1/jobs/a").json()["status"] == "queued"


def test_api_key_settings_are_checked():
    assert parse_api_keys(f"alice:{KEY_A}, {KEY_B}") == {KEY_A: "alice", KEY_B: parse_api_keys(KEY_B)[KEY_B]}
    with pytest.raises(ValueError, match="at least 16"):
        parse_api_keys("alice:short")
    with pytest.raises(ValueError, match="twice"):
        parse_api_keys(f"a:{KEY_A},b:{KEY_A}")
    with pytest.raises(ValueError) as e:
        Settings(api_keys="alice:tooshortkey")
    assert "tooshortkey" not in str(e.value)  # a key never appears in an error


def test_every_route_but_health_needs_a_valid_key(client):
    assert client.get("/healthz").status_code == 200
    for method, path in [
        ("get", "/v1/jobs/x"),
        ("post", "/v1/jobs"),
        ("delete", "/v1/jobs/x"),
        ("post", "/v1/batches"),
        ("get", "/v1/batches/x"),
        ("delete", "/v1/batches/x"),
        ("get", "/v1/batches/x/results"),
        ("get", "/v1/latency"),
    ]:
        for headers in ({}, {"authorization": "Bearer wrong-key-0123456789"}, {"authorization": KEY_A}):
            r = client.request(method, path, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer" and r.json()["error"]["code"] == "unauthorized"


def test_owners_see_only_their_own(client, queue):
    a = client.post("/v1/jobs", json={"id": "j1", "prompt": "alice's"}, headers=ALICE)
    assert a.status_code == 202
    a_id = a.json()["id"]
    # the same custom id is another job for another owner
    b = client.post("/v1/jobs", json={"id": "j1", "prompt": "bob's"}, headers=BOB)
    assert b.status_code == 202 and b.json()["id"] != a_id
    assert client.get(f"/v1/jobs/{a_id}", headers=BOB).status_code == 404
    assert client.get("/v1/jobs/j1", headers=BOB).json()["id"] == b.json()["id"]  # his own j1
    assert client.delete(f"/v1/jobs/{a_id}", headers=BOB).status_code == 404
    assert client.get(f"/v1/jobs/{a_id}", headers=ALICE).json()["status"] == "queued"

    r = client.post("/v1/batches", params={"batch_id": "shared-name"}, content='{"prompt": "x"}', headers=ALICE)
    assert r.status_code == 202
    alice_batch = r.json()["batch_id"]
    assert client.get("/v1/batches/shared-name", headers=BOB).status_code == 404
    assert client.get("/v1/batches/shared-name/results", headers=BOB).status_code == 404
    assert client.delete("/v1/batches/shared-name", headers=BOB).status_code == 404
    assert client.get(f"/v1/batches/{alice_batch}", headers=BOB).status_code == 404
    assert client.get("/v1/latency", params={"batch_id": "shared-name"}, headers=BOB).status_code == 404
    # another owner's batch name is as a name never used: bob's own batch, apart from alice's
    add = client.post("/v1/batches", params={"batch_id": "shared-name"}, content='{"prompt": "x"}', headers=BOB)
    assert add.status_code == 202 and add.json()["batch_id"] != alice_batch and not add.json()["resumed"]
    add = client.post("/v1/batches", params={"batch_id": alice_batch}, content='{"prompt": "x"}', headers=BOB)
    assert add.status_code == 202 and add.json()["batch_id"] != alice_batch  # alice's id too
    assert client.get(f"/v1/batches/{alice_batch}", headers=BOB).json()["id"] == add.json()["batch_id"]  # his
    assert client.get("/v1/batches/shared-name", headers=ALICE).json()["recorded"] == 1  # hers, untouched
    # alice re-sending the same body resumes it (nothing twice); another body under the id is refused
    n = _published(queue)
    again = client.post("/v1/batches", params={"batch_id": "shared-name"}, content='{"prompt": "x"}', headers=ALICE)
    assert again.status_code == 202 and again.json()["resumed"] and _published(queue) == n + 1  # still queued: sent again
    other = client.post("/v1/batches", params={"batch_id": "shared-name"}, content='{"prompt": "y"}', headers=ALICE)
    assert other.status_code == 409
    assert client.delete("/v1/batches/shared-name", headers=ALICE).json()["cancelled"] == 1


def test_a_job_id_used_twice_is_a_conflict(client, queue):
    r = client.post("/v1/jobs", json={"id": "dup", "prompt": "first"}, headers=ALICE)
    assert r.status_code == 202
    r2 = client.post("/v1/jobs", json={"id": "dup", "prompt": "second"}, headers=ALICE)
    assert r2.status_code == 409 and r2.json()["error"]["code"] == "duplicate_id"
    assert _published(queue) == 1
    assert client.get("/v1/jobs/dup", headers=ALICE).json()["id"] == r.json()["id"]


def test_the_server_stamps_submission_times(client, store):
    r = client.post("/v1/jobs", json={"prompt": "x", "submitted_at": 1.0}, headers=ALICE)
    assert r.status_code == 422 and "submitted_at: set by the server" in r.json()["error"]["message"]
    r = client.post("/v1/jobs", json={"prompt": "x", "batch_id": "elsewhere"}, headers=ALICE)
    assert r.status_code == 422 and "batch_id" in r.json()["error"]["message"]
    ok = client.post("/v1/jobs", json={"prompt": "x"}, headers=ALICE).json()
    rec = store.get_job(ok["id"])
    assert rec is not None and rec.timings.submitted_at == ok["submitted_at"] > 1.7e9


def test_limits_and_errors_that_do_not_echo_the_input(client):
    huge = "z" * 70_000
    r = client.post("/v1/jobs", content=json.dumps({"prompt": huge}), headers=ALICE)
    assert r.status_code == 413 and huge[:100] not in r.text
    r = client.post("/v1/batches", content=b"{\"prompt\": \"x\"}\n" * 300_000, headers=ALICE)
    assert r.status_code == 413
    secret = "do-not-echo-" + "s" * 50
    r = client.post("/v1/jobs", json={"prompt": "x", "colour": secret}, headers=ALICE)
    assert r.status_code == 422 and secret not in r.text and "colour: unknown field" in r.text
    r = client.post("/v1/jobs", json={"prompt": "x", "max_tokens": secret}, headers=ALICE)
    assert r.status_code == 422 and secret not in r.text
    r = client.get("/v1/latency", params={"metrics": secret}, headers=ALICE)
    assert r.status_code == 400 and secret not in r.text
    r = client.post("/v1/batches", params={"max_tokens": secret}, content='{"prompt": "x"}', headers=ALICE)
    assert r.status_code == 422 and secret not in r.text
    assert client.get("/v1/latency", params={"since": "nan"}, headers=ALICE).status_code == 400


def test_fuzz_no_malformed_input_gives_a_500(client, store, queue):
    bad = bad_lines(n_random=200, seed=3)
    for body in bad:
        r = client.post("/v1/jobs", content=body, headers={**ALICE, "content-type": "application/json"})
        assert 400 <= r.status_code < 500, (body[:80], r.status_code, r.text[:200])
        assert r.json()["error"]["code"]
    assert _published(queue) == 0
    # one batch of every bad line between good ones: each good line queued, each bad one its own row
    good = [json.dumps({"id": f"good-{i}", "prompt": f"fine {i}"}).encode() for i in range(len(bad) + 1)]
    lines = [x for pair in zip(good, [*bad, b""]) for x in pair if x]
    r = client.post("/v1/batches", params={"batch_id": "fuzz"}, content=b"\n".join(lines), headers=ALICE)
    assert r.status_code == 202, r.text
    assert r.json()["submitted"] == len(good) and r.json()["invalid"] == len(bad)
    b = store.get_batch(r.json()["batch_id"])
    assert b is not None and b.progress.counts == {JobStatus.QUEUED: len(good), JobStatus.FAILED: len(bad)}
    res = [json.loads(x) for x in client.get("/v1/batches/fuzz/results", headers=ALICE).text.splitlines()]
    assert len(res) == len(bad)
    for x in res:  # each in its line's format: OpenAI lines answer as OpenAI error lines
        if "response" in x:
            assert x["response"]["status_code"] >= 400 and x["response"]["body"]["error"]["code"]
        else:
            assert x["status"] == "failed" and x["error_code"]
    # odd query strings and paths
    for path in ["/v1/jobs/" + "x" * 5000, "/v1/batches/%2e%2e"]:
        assert client.get(path, headers=ALICE).status_code == 404
    for path in ["/v1/jobs/%00", "/v1/batches/%ff%fe", "/v1/jobs/%ED%A0%80"]:  # NUL, not UTF-8, a lone surrogate
        r = client.get(path, headers=ALICE)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, r.text)
    for params in [{"batch_id": ""}, {"batch_id": " x"}, {"batch_id": "x" * 300}, {"max_tokens": "0"},
                   {"max_tokens": "1e9"}]:
        r = client.post("/v1/batches", params=params, content='{"prompt": "x"}', headers=ALICE)
        assert r.status_code == 422, (params, r.text)
    r = client.post("/v1/batches", params={"batch_id": "a\u0000b"}, content='{"prompt": "x"}', headers=ALICE)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    for body in [b"", b"   ", b"[]", b"[1", b"[" * 5000, b"[NaN]"]:
        r = client.post("/v1/batches", content=body, headers=ALICE)
        assert 400 <= r.status_code < 500, (body[:40], r.text)
    assert client.get("/healthz").json() == {"ok": True}


def test_a_big_batch_does_not_block_the_event_loop(client):
    import threading
    import time

    body = b"\n".join(json.dumps({"id": f"l{i}", "prompt": f"line {i} " * 20}).encode() for i in range(12_000))
    done: dict[str, float] = {}

    def submit() -> None:
        t0 = time.monotonic()
        r = client.post("/v1/batches", params={"batch_id": "big"}, content=body, headers=ALICE)
        assert r.status_code == 202
        done["took"] = time.monotonic() - t0

    t = threading.Thread(target=submit)
    t.start()
    waits = []
    time.sleep(0.2)
    while t.is_alive():
        t0 = time.monotonic()
        assert client.get("/healthz").status_code == 200
        waits.append(time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    assert len(waits) >= 3, (done, waits)  # the health checks ran while the batch was being submitted
    assert max(waits) < done["took"] / 2, (done, waits)


def test_openai_routes_refuse_bad_input_without_a_500(store, queue):
    settings = Settings(api_keys=f"alice:{KEY_A},bob:{KEY_B}", api_max_body_bytes=64 * 1024)
    app = create_app(settings, store=store, queue=queue, canceller=None, replies=None)
    with TestClient(app) as c:
        bodies = [*bad_lines(n_random=60, seed=9), b'{"messages": "x"}', b'{"prompt": "x", "stream": "yes"}',
                  b'{"prompt": "x", "stream_options": {"include_usage": true, "x": 1}}', b'{"prompt": "x", "n": 2}',
                  b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}']
        for path in ("/v1/completions", "/v1/chat/completions"):
            for body in bodies:
                r = c.post(path, content=body, headers={**ALICE, "content-type": "application/json"})
                # refused (4xx), or valid and then 503: no reply channel in this test
                assert 400 <= r.status_code < 500 or r.status_code == 503, (path, body[:60], r.status_code, r.text[:200])
                assert r.json()["error"]["message"]
            # a valid body: no reply channel here, so 503 (after it was checked, before anything was queued)
            ok = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
            assert c.post(path, json=ok, headers=ALICE).status_code == 503
        assert _published(queue) == 0
        # files and OpenAI batches: owners, purposes, sizes
        f = c.post("/v1/files", files={"file": ("in.jsonl", b'{"custom_id": "a", "method": "POST", '
                                                          b'"url": "/v1/completions", "body": {"prompt": "x"}}\n')},
                   data={"purpose": "batch"}, headers=ALICE).json()
        assert f["object"] == "file" and f["purpose"] == "batch"
        assert c.get(f"/v1/files/{f['id']}", headers=BOB).status_code == 404
        assert c.get(f"/v1/files/{f['id']}/content", headers=BOB).status_code == 404
        assert c.post("/v1/files", files={"file": ("x", b"{}")}, data={"purpose": "fine-tune"}, headers=ALICE).status_code == 400
        assert c.post("/v1/files", content=b"not multipart", headers=ALICE).status_code == 400
        create = {"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        assert c.post("/v1/batches", json=create, headers=BOB).status_code == 404
        assert c.post("/v1/batches", json={**create, "endpoint": "/v1/embeddings"}, headers=ALICE).status_code == 400
        assert c.post("/v1/batches", json={**create, "completion_window": "1h"}, headers=ALICE).status_code == 400
        b = c.post("/v1/batches", json=create, headers=ALICE)
        assert b.status_code == 200 and b.json()["object"] == "batch" and b.json()["status"] == "in_progress"
        assert b.json()["request_counts"] == {"total": 1, "completed": 0, "failed": 0} and _published(queue) == 1
        listed = c.get("/v1/batches", headers=ALICE).json()
        assert listed["object"] == "list" and listed["data"][0]["id"] == b.json()["id"]
        assert c.get("/v1/batches", headers=BOB).json()["data"] == []
        # a line whose url is not the batch's endpoint fails alone
        f2 = c.post("/v1/files", files={"file": ("in.jsonl", b'{"custom_id": "a", "method": "POST", '
                                                            b'"url": "/v1/chat/completions", "body": {"messages": []}}\n')},
                    data={"purpose": "batch"}, headers=ALICE).json()
        b2 = c.post("/v1/batches", json={**create, "input_file_id": f2["id"]}, headers=ALICE).json()
        assert b2["status"] == "failed" and b2["request_counts"]["failed"] == 1 and b2["error_file_id"]  # no valid line
        err = c.get(f"/v1/files/{b2['error_file_id']}/content", headers=ALICE).text
        assert json.loads(err)["custom_id"] == "a" and b2["output_file_id"] is None


def test_openai_batch_statuses_follow_the_batch(store):
    from firsttoken.api.batches import openai_status
    from schemas.job import JobRequest, JobResult

    store.create_batch("S")
    assert openai_status(store.get_batch("S")) == "validating"  # its input is still being read
    store.insert_queued([JobRequest(id="S-1", prompt="x", batch_id="S")])
    store.set_batch_total("S", 1)
    assert openai_status(store.get_batch("S")) == "in_progress"
    store.upsert_results([JobResult.failure("S-1", ErrorCode.INVALID_REQUEST, "bad", batch_id="S")])
    assert openai_status(store.get_batch("S")) == "finalizing"  # every job ended; not marked yet
    store.finalize_batch("S")
    assert openai_status(store.get_batch("S")) == "completed"
    store.create_batch("C")
    store.set_batch_total("C", 1)
    store.cancel(batch_id="C")
    assert openai_status(store.get_batch("C")) == "cancelled"


def test_openai_batches_fail_when_no_line_is_valid_and_expire_after_their_window(store, queue):
    from firsttoken.api.batches import expire_if_due

    settings = Settings(api_keys=f"alice:{KEY_A}")
    app = create_app(settings, store=store, queue=queue, canceller=None, replies=None)
    with TestClient(app) as c:
        def upload(body: bytes) -> str:
            return c.post("/v1/files", files={"file": ("in.jsonl", body)}, data={"purpose": "batch"}, headers=ALICE).json()["id"]

        bad = upload(b'{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}\nnot json\n')
        b = c.post("/v1/batches", json={"input_file_id": bad, "endpoint": "/v1/completions"}, headers=ALICE).json()
        assert b["status"] == "failed" and b["failed_at"] is not None and b["request_counts"]["failed"] == 2
        assert [(e["code"], e["line"]) for e in b["errors"]["data"]] == [("invalid_request", 1), ("invalid_request", 2)]
        good = upload(b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
        b = c.post("/v1/batches", json={"input_file_id": good, "endpoint": "/v1/completions"}, headers=ALICE).json()
        assert b["status"] == "in_progress" and b["expires_at"] == b["created_at"] + 24 * 3600
        state = app.state.api
        rec = store.get_batch(b["id"])
        assert expire_if_due(state, rec, now=rec.created_at + 3600).status == "open"  # within its window
        expired = expire_if_due(state, rec, now=rec.created_at + 24 * 3600 + 1)
        assert expired.status == "expired" and expired.progress.counts == {JobStatus.CANCELLED: 1}
        view = c.get(f"/v1/batches/{b['id']}", headers=ALICE).json()
        assert view["status"] == "expired" and view["expired_at"] is not None and view["error_file_id"]


def test_the_sweep_expires_openai_batches_nobody_reads(store, queue, monkeypatch):
    from firsttoken.api import batches

    app = create_app(Settings(api_keys=f"alice:{KEY_A}"), store=store, queue=queue, canceller=None, replies=None)
    with TestClient(app) as c:
        def openai_batch(custom_id: str) -> str:
            line = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
            body = (json.dumps(line) + "\n").encode()
            fid = c.post("/v1/files", files={"file": ("in.jsonl", body)}, data={"purpose": "batch"}, headers=ALICE).json()["id"]
            return c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions"},
                          headers=ALICE).json()["id"]

        ids = [openai_batch(f"a{i}") for i in range(5)]
        plain = c.post("/v1/batches", content=b'{"id": "p", "prompt": "x"}\n', headers=ALICE)
        assert plain.status_code == 202, plain.text
        state = app.state.api
        created = max(store.get_batch(i).created_at for i in ids)
        assert batches.expire_due(state, now=created + 3600) == 0  # inside the window
        # past it: every OpenAI batch expires (pages of 2: the cursor walks past the plain batch too)
        assert batches.expire_due(state, now=created + 24 * 3600 + 1, page=2) == 5
        assert {store.get_batch(i).status for i in ids} == {"expired"}
        assert store.get_batch(plain.json()["batch_id"]).status == "open"  # not an OpenAI batch: no window
        assert batches.expire_due(state, now=created + 24 * 3600 + 2) == 0  # done once

    # the app runs the sweep on its own, every api_expire_every_s
    calls: list[float] = []
    monkeypatch.setattr(batches, "expire_due", lambda state: calls.append(1) or 0)
    app = create_app(Settings(api_keys=f"alice:{KEY_A}", api_expire_every_s=0.05), store=store, queue=queue,
                     canceller=None, replies=None)
    with TestClient(app):
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert len(calls) >= 2


def test_a_restarted_stream_sends_each_character_once():
    """A job redelivered to another worker streams again from its start: the deltas' offsets let
    the API drop what the client has; a run whose text differs ends the stream with an error."""
    import asyncio

    from firsttoken.api.completions import _events, _Run, stream_text
    from firsttoken.api.deps import ApiState
    from schemas.job import FinishReason, JobRequest, JobResult
    from schemas.openai import LineFormat

    assert stream_text("", {"text": "Hel", "offset": 0}) == "Hel"
    assert stream_text("Hel", {"text": "lo", "offset": 3}) == "lo"
    assert stream_text("Hello", {"text": "He", "offset": 0}) == ""  # the second run repeating
    assert stream_text("Hello", {"text": "llo wo", "offset": 2}) == " wo"  # overlapping
    assert stream_text("He", {"text": "o", "offset": 4}) == ""  # a gap: the final text fills it

    class Script:
        def __init__(self, msgs):
            self.msgs = list(msgs)

        async def next(self, timeout_s):
            return self.msgs.pop(0) if self.msgs else None

        async def close(self):
            pass

    def run(msgs):
        state = ApiState(settings=Settings(api_no_auth=True), authenticate=lambda r: None, model_name="m")
        job = JobRequest(id="j1", prompt="x")

        async def collect():
            run = _Run(state, job, Script(msgs))
            return [c async for c in _events(run, LineFormat.OPENAI_COMPLETIONS, False)]

        chunks = asyncio.run(collect())
        out = [json.loads(c[6:]) for c in chunks if c.startswith(b"data: {")]
        return "".join(x["choices"][0]["text"] for x in out if "choices" in x), out

    final = {"type": "final", "result": JobResult(id="j1", status="succeeded", text="Hello world",
                                                  finish_reason=FinishReason.LENGTH)}
    first_run = [{"type": "delta", "text": "Hel", "offset": 0}, {"type": "delta", "text": "lo", "offset": 3}]
    second_run = [{"type": "delta", "text": "Hel", "offset": 0}, {"type": "delta", "text": "lo w", "offset": 3}]
    text, _ = run([*first_run, *second_run, final])
    assert text == "Hello world"  # each character once
    changed = {"type": "final", "result": JobResult(id="j1", status="succeeded", text="Help me",
                                                    finish_reason=FinishReason.LENGTH)}
    text, out = run([*first_run, changed])
    assert text == "Hello" and out[-1]["error"]["code"] == "restarted"


def test_an_owner_past_its_unfinished_jobs_limit_gets_429_and_nothing_is_queued(store, queue):
    from schemas.job import JobResult, Usage

    settings = Settings(api_keys=f"alice:{KEY_A},bob:{KEY_B}", api_max_unfinished_jobs=3, api_retry_after_s=7)
    with TestClient(create_app(settings, store=store, queue=queue, canceller=None, replies=None)) as c:
        ids = [c.post("/v1/jobs", json={"id": f"j{i}", "prompt": "x"}, headers=ALICE).json()["id"] for i in range(3)]
        published = _published(queue)
        r = c.post("/v1/jobs", json={"id": "j3", "prompt": "x"}, headers=ALICE)
        assert r.status_code == 429 and r.headers["retry-after"] == "7"
        err = r.json()["error"]
        assert (err["code"], err["type"]) == ("rate_limit_exceeded", "rate_limit_error") and "limit is 3" in err["message"]
        # a batch is taken whole or not at all: two more lines would pass the limit
        r = c.post("/v1/batches", content=b'{"id": "b1", "prompt": "x"}\n{"id": "b2", "prompt": "x"}\n', headers=ALICE)
        assert r.status_code == 429
        fid = c.post("/v1/files", files={"file": ("in.jsonl", b'{"custom_id": "o", "method": "POST", "url": '
                                                  b'"/v1/completions", "body": {"prompt": "x"}}\n')},
                     data={"purpose": "batch"}, headers=ALICE).json()["id"]
        r = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions"}, headers=ALICE)
        assert r.status_code == 429
        assert _published(queue) == published and store.count_unfinished("alice") == 3  # nothing queued
        assert c.post("/v1/jobs", json={"id": "j0", "prompt": "x"}, headers=BOB).status_code == 202  # per owner
        # resuming a batch counts only its lines not recorded yet
        two = b'{"id": "r1", "prompt": "x"}\n{"id": "r2", "prompt": "x"}\n'
        assert c.post("/v1/batches?batch_id=rb", content=two, headers=BOB).status_code == 202
        r = c.post("/v1/batches?batch_id=rb", content=two, headers=BOB)  # 3 unfinished + 0 new
        assert r.status_code == 202 and r.json()["resumed"], r.text
        # one finishes: room for one more
        store.upsert_results([JobResult(id=ids[0], status=JobStatus.SUCCEEDED, text="y", usage=Usage())])
        assert c.post("/v1/jobs", json={"id": "j3", "prompt": "x"}, headers=ALICE).status_code == 202
        assert c.post("/v1/jobs", json={"id": "j4", "prompt": "x"}, headers=ALICE).status_code == 429
        # a batch bigger than the limit itself can never fit: 413, not a 429 to retry
        four = b"".join(b'{"id": "f%d", "prompt": "x"}\n' % i for i in range(4))
        r = c.post("/v1/batches", content=four, headers=BOB)
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_large" and "split" in r.json()["error"]["message"]


def _openai_line(custom_id: str, model: object = "smollm2-135m", **body: object) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}}).encode()


def test_the_api_serves_its_model_by_its_names_and_another_is_model_not_found(store, queue):
    settings = Settings(api_keys=f"alice:{KEY_A}", model="smollm2-135m")
    app = create_app(settings, store=store, queue=queue, canceller=None, replies=None)
    with TestClient(app) as c:
        assert [m["id"] for m in c.get("/v1/models", headers=ALICE).json()["data"]] == ["smollm2-135m"]
        for name in ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"):
            r = c.get(f"/v1/models/{name}", headers=ALICE)
            assert r.status_code == 200 and r.json()["id"] == "smollm2-135m", name
        r = c.get("/v1/models/gpt-4o", headers=ALICE)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

        # completions: another model is 404 before anything is queued; the served one passes the check
        # (then 503: no reply channel in this test); a model that is not a string is a 400
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            r = c.post(path, json={**body, "model": "gpt-4o"}, headers=ALICE)
            assert r.status_code == 404, r.text
            err = r.json()["error"]
            assert (err["code"], err["type"], err["param"]) == ("model_not_found", "not_found_error", "model")
            assert "gpt-4o" not in err["message"] and "'smollm2-135m'" in err["message"]  # the input never echoed
            assert c.post(path, json={**body, "model": "tiny"}, headers=ALICE).status_code == 404  # a preset too
            assert c.post(path, json={**body, "model": 5}, headers=ALICE).status_code == 400
            for name in ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"):
                assert c.post(path, json={**body, "model": name}, headers=ALICE).status_code == 503
            assert c.post(path, json=body, headers=ALICE).status_code == 503  # no model named: the served one
        assert _published(queue) == 0

        # a JSONL batch with one line naming another model is refused whole, as OpenAI's: nothing queued
        good = [_openai_line("a"), _openai_line("b", "HuggingFaceTB/SmolLM2-135M-Instruct"),
                _openai_line("c", metadata={"model": "gpt-4o"}),  # the client's metadata: not the model
                _openai_line("d", temperature=0).replace(b"hi", b'say \\"model\\": \\"gpt-4o\\"')]  # in a prompt
        for bad, where in ((_openai_line("x", "gpt-4o"), 3),
                           (_openai_line("x", "smollm2-135m").replace(b'"model"', b'"mod\\u0065l"', 1)
                            .replace(b'"smollm2-135m"', b'"gpt-4o"'), 3),
                           (_openai_line("x", "SMOLLM2-135M"), 3)):  # names are compared exactly
            lines = [*good[:2], b"", bad, *good[2:]]
            r = c.post("/v1/batches?batch_id=refused", content=b"\n".join(lines), headers=ALICE)
            assert r.status_code == 404, r.text
            err = r.json()["error"]
            assert err["code"] == "model_not_found" and err["message"].startswith(f"line {where + 1}: ")
        assert _published(queue) == 0 and store.get_batch("refused") is None
        r = c.post("/v1/batches?batch_id=served", content=b"\n".join(good), headers=ALICE)
        assert r.status_code == 202 and r.json()["submitted"] == 4 and _published(queue) == 4

        # an OpenAI batch (uploaded file) naming another model fails its validation, as OpenAI's does
        f = c.post("/v1/files", files={"file": ("in.jsonl", b"\n".join([good[0], _openai_line("x", "gpt-4o")]))},
                   data={"purpose": "batch"}, headers=ALICE).json()
        b = c.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions"},
                   headers=ALICE).json()
        assert b["status"] == "failed" and b["failed_at"] is not None
        assert [(e["code"], e["line"], e["param"]) for e in b["errors"]["data"]] == [("model_not_found", 2, "body.model")]
        assert b["request_counts"] == {"total": 0, "completed": 0, "failed": 0} and _published(queue) == 4


def test_a_checkpoint_directory_is_served_by_its_path_and_its_name(store, queue):
    settings = Settings(api_keys=f"alice:{KEY_A}", model="/models/Llama-3.1-8B-Instruct")
    with TestClient(create_app(settings, store=store, queue=queue, canceller=None, replies=None)) as c:
        assert [m["id"] for m in c.get("/v1/models", headers=ALICE).json()["data"]] == ["/models/Llama-3.1-8B-Instruct"]
        assert c.get("/v1/models/Llama-3.1-8B-Instruct", headers=ALICE).status_code == 200
        assert c.get("/v1/models//models/Llama-3.1-8B-Instruct", headers=ALICE).status_code == 200
        assert c.get("/v1/models/smollm2-135m", headers=ALICE).status_code == 404


def test_without_firsttoken_model_the_api_serves_the_real_default(store, queue, monkeypatch):
    monkeypatch.delenv("FIRSTTOKEN_MODEL", raising=False)
    with TestClient(create_app(Settings(api_keys=f"alice:{KEY_A}"), store=store, queue=queue, canceller=None,
                               replies=None)) as c:
        assert [m["id"] for m in c.get("/v1/models", headers=ALICE).json()["data"]] == ["smollm2-135m"]
    monkeypatch.setenv("FIRSTTOKEN_MODEL", "tiny")  # a random-weight preset, named
    with TestClient(create_app(Settings(api_keys=f"alice:{KEY_A}"), store=store, queue=queue, canceller=None,
                               replies=None)) as c:
        assert [m["id"] for m in c.get("/v1/models", headers=ALICE).json()["data"]] == ["tiny"]
        assert c.get("/v1/models/smollm2-135m", headers=ALICE).json()["error"]["code"] == "model_not_found"


def test_files_are_listed_and_deleted_by_their_owner_only(client):
    def upload(headers: dict, body: bytes) -> str:
        r = client.post("/v1/files", files={"file": ("in.jsonl", body)}, data={"purpose": "batch"}, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["id"]

    a1, a2 = upload(ALICE, b"{}\n"), upload(ALICE, b"{}\n{}\n")
    b1 = upload(BOB, b"{}\n")
    mine = {a1, a2}  # (the store is shared with other tests, which upload as alice too)

    def ids(query: str = "", headers: dict = ALICE) -> list[str]:
        page = client.get(f"/v1/files{query}", headers=headers).json()
        assert page["object"] == "list"
        return [f["id"] for f in page["data"]]

    listed = client.get("/v1/files", headers=ALICE).json()["data"]
    assert [(f["id"], f["bytes"]) for f in listed if f["id"] in mine] == [(a2, 6), (a1, 3)]  # newest first
    assert b1 not in ids() and [i for i in ids("?order=asc") if i in mine] == [a1, a2]
    assert ids("?limit=1") == [a2] and client.get("/v1/files?limit=1", headers=ALICE).json()["has_more"]
    assert ids(f"?limit=1&after={a2}") == [a1]
    assert ids(f"?after={b1}") == []  # bob's cursor: nothing
    for method in ("get", "delete"):  # another owner's file is as a missing one
        r = getattr(client, method)(f"/v1/files/{b1}", headers=ALICE)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    r = client.delete(f"/v1/files/{a1}", headers=ALICE)
    assert r.status_code == 200 and r.json() == {"id": a1, "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{a1}", headers=ALICE).status_code == 404
    assert a1 not in ids() and a2 in ids() and b1 in ids(headers=BOB) and a2 not in ids(headers=BOB)


def test_a_job_the_queue_refuses_is_503_and_leaves_no_row(store):
    """Producer.submit_one (what POST /v1/jobs and the completions use): the row is recorded, the
    queue refuses the message, the row goes again, so the same id may be sent again."""
    class DownQueue(LocalQueue):
        down = True

        def publish(self, jobs):
            if self.down:
                raise ConnectionError("broker unreachable")
            return super().publish(jobs)

    queue = DownQueue(partitions=1)
    app = create_app(Settings(api_keys=f"alice:{KEY_A}"), store=store, queue=queue, canceller=None)
    with TestClient(app) as c:
        r = c.post("/v1/jobs", json={"id": "q503", "prompt": "hi"}, headers=ALICE)
        assert r.status_code == 503 and "send the job again" in r.json()["error"]["message"], r.text
        assert c.get("/v1/jobs/q503", headers=ALICE).status_code == 404  # no row left behind
        queue.down = False
        assert c.post("/v1/jobs", json={"id": "q503", "prompt": "hi"}, headers=ALICE).status_code == 202
        assert c.post("/v1/jobs", json={"id": "q503", "prompt": "hi"}, headers=ALICE).status_code == 409
