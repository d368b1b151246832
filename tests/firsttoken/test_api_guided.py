"""Structured output through the HTTP API (SQLite and the in-process queue, no worker): a
response_format or guided_* spec the grammar engine takes is accepted live (then 503 here: no
reply channel) and queued with its SamplingParams.guided from a JSONL batch and an OpenAI batch
file; one it refuses is a 400 invalid_request_error (code invalid_grammar) live, streamed or not,
and a failed line with code invalid_grammar in a batch, before anything is queued."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from firsttoken.api import create_app
from pipeline.queue import LocalQueue
from pipeline.settings import Settings
from schemas.sampling import GuidedDecoding

KEY = "alice-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "pop": {"type": "integer", "minimum": 0}},
          "required": ["city", "pop"], "additionalProperties": False}
REFUSED = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a city."}]})
TEXT = ("/v1/completions", {"prompt": "A city:"})


class RecordingQueue(LocalQueue):
    """The in-process queue, keeping each published job (what a worker would read)."""

    def __init__(self) -> None:
        super().__init__(partitions=1)
        self.jobs: list = []

    def publish(self, jobs):  # type: ignore[no-untyped-def]
        jobs = list(jobs)
        self.jobs.extend(jobs)
        return super().publish(jobs)


@pytest.fixture
def queue() -> RecordingQueue:
    return RecordingQueue()


@pytest.fixture
def client(store, queue):
    app = create_app(Settings(api_keys=f"alice:{KEY}"), store=store, queue=queue, canceller=None, replies=None)
    with TestClient(app) as c:
        yield c


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


@pytest.mark.parametrize("path,base", [CHAT, TEXT])
def test_live_specs_the_engine_takes_pass_the_checks(client, queue, path, base):
    for fields in ({"response_format": {"type": "json_object"}}, {"response_format": _json_schema(SCHEMA)},
                   {"guided_json": SCHEMA}, {"guided_regex": "[A-Z][a-z]+"}, {"guided_choice": ["Paris", "Rome"]},
                   {"response_format": {"type": "text"}}):
        for stream in (False, True):
            r = client.post(path, json={**base, **fields, "stream": stream}, headers=AUTH)
            assert r.status_code == 503, (fields, r.text)  # checked, then no reply channel in this test
    assert queue.jobs == []


@pytest.mark.parametrize("path,base", [CHAT, TEXT])
def test_live_specs_the_engine_refuses_are_400_invalid_grammar(client, queue, path, base):
    for fields, hint in (({"response_format": _json_schema(REFUSED)}, "uniqueItems"),
                         ({"guided_json": {"type": "string", "pattern": "(?=secret)x"}}, "look-around"),
                         ({"guided_regex": "secret(unclosed"}, "unclosed group")):
        for stream in (False, True):
            r = client.post(path, json={**base, **fields, "stream": stream}, headers=AUTH)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["code"], err["type"]) == ("invalid_grammar", "invalid_request_error")
            assert hint in err["message"] and "secret" not in err["message"]  # the spec is not echoed
    # malformed: invalid_request, not invalid_grammar
    r = client.post(path, json={**base, "response_format": {"type": "json_schema"}}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = client.post(path, json={**base, "guided_choice": ["a"], "guided_regex": "a"}, headers=AUTH)
    assert r.status_code == 400 and "give one" in r.json()["error"]["message"]
    assert queue.jobs == []


def _line(custom_id: str, path_base: tuple[str, dict], **fields: object) -> bytes:
    path, base = path_base
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": path,
                       "body": {**base, "max_tokens": 30, **fields}}).encode()


def test_a_jsonl_batch_queues_the_specs_and_fails_refused_lines_alone(client, queue):
    lines = [_line("a", CHAT, response_format=_json_schema(SCHEMA), temperature=0.5, n=2),
             _line("b", CHAT, response_format=_json_schema(REFUSED)),
             _line("c", TEXT, guided_choice=["Paris", "Rome"]),
             _line("d", TEXT, guided_regex="(unclosed"),
             _line("e", TEXT, response_format={"type": "json_object"}, logit_bias={"7": -100})]
    r = client.post("/v1/batches", content=b"\n".join(lines), headers=AUTH)
    assert r.status_code == 202, r.text
    out = r.json()
    assert (out["submitted"], out["invalid"]) == (3, 2)
    assert [(e["line"], e["error_code"]) for e in out["errors"]] == [(2, "invalid_grammar"), (4, "invalid_grammar")]
    got = {j.custom_id: j.sampling for j in queue.jobs}
    assert set(got) == {"a", "c", "e"}
    assert got["a"].guided == GuidedDecoding(kind="json_schema", json_schema=SCHEMA)
    assert (got["a"].temperature, got["a"].n, got["a"].max_tokens) == (0.5, 2, 30)
    assert got["c"].guided == GuidedDecoding(kind="choice", choices=["Paris", "Rome"])
    assert got["e"].guided == GuidedDecoding(kind="json_object") and got["e"].logit_bias == {7: -100.0}


def test_an_openai_batch_file_fails_refused_lines_with_invalid_grammar(client, queue):
    content = b"\n".join([_line("ok", CHAT, response_format=_json_schema(SCHEMA)),
                          _line("bad", CHAT, guided_json=REFUSED)])

    def batch(content: bytes) -> dict:
        f = client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"},
                        headers=AUTH).json()
        return client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                                "completion_window": "24h"}, headers=AUTH).json()

    b = batch(content)
    assert b["status"] == "in_progress" and b["request_counts"] == {"total": 2, "completed": 0, "failed": 1}, b
    assert [j.custom_id for j in queue.jobs] == ["ok"]
    assert queue.jobs[0].sampling.guided == GuidedDecoding(kind="json_schema", json_schema=SCHEMA)
    b = batch(_line("bad", CHAT, guided_json=REFUSED))  # no line runs: failed at once, with its error file
    assert b["status"] == "failed" and b["error_file_id"], b
    err = [json.loads(x) for x in client.get(f"/v1/files/{b['error_file_id']}/content", headers=AUTH).text.splitlines()]
    assert [(e["custom_id"], e["response"]["status_code"], e["response"]["body"]["error"]["code"]) for e in err] == [
        ("bad", 400, "invalid_grammar")]
    assert len(queue.jobs) == 1


def test_a_native_job_with_a_refused_spec_is_refused(client, queue):
    r = client.post("/v1/jobs", json={"id": "j", "prompt": "x", "sampling": {"guided": {"kind": "regex", "regex": "a(b"}}},
                    headers=AUTH)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_grammar"
    r = client.post("/v1/jobs", json={"id": "k", "prompt": "x", "sampling": {"guided": {"kind": "regex", "regex": "a+b"}}},
                    headers=AUTH)
    assert r.status_code == 202
    assert [j.sampling.guided for j in queue.jobs] == [GuidedDecoding(kind="regex", regex="a+b")]
