"""The distributed pipeline on real Kafka and Postgres, tiny model on CPU: 500 jobs, outputs equal
to the embedded mode's, poison messages to the DLQ, failed rows, duplicates, two workers sharing
the partitions by prefix key."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest
from pipeline_util import (
    ROOT,
    in_process_worker,
    make_jobs,
    read_topic,
    settings_for,
    start_worker_process,
    tag,
    terminal_count,
    wait_until,
    worker_env,
)

from firsttoken.embedded import run_file
from pipeline.producer import Producer
from pipeline.queue import (
    DLQ_ERROR,
    DLQ_ERROR_CODE,
    DLQ_ORIGIN_OFFSET,
    DLQ_ORIGIN_PARTITION,
    encode_job,
    routing_key,
)
from pipeline.queue.kafka import KafkaQueue
from pipeline.store import ResultStore, make_engine
from schemas.job import ErrorCode, JobInput, JobRequest, JobStatus
from schemas.sampling import SamplingParams
from tests.fuzz_inputs import bad_lines

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engines():
    from workers.engine import EngineConfig, LLMEngine

    return [LLMEngine("tiny", EngineConfig(device="cpu")) for _ in range(2)]


@pytest.fixture
def store(postgres_url):
    s = ResultStore(make_engine(postgres_url))
    yield s
    s.close()


def test_500_jobs_one_worker_equal_to_embedded(kafka_settings, postgres_url, store, engines, tmp_path):
    s = settings_for(kafka_settings, postgres_url)
    batch = f"b500-{tag()}"
    jobs = make_jobs(500, batch, batch_id=batch)
    bad = [
        JobRequest(
            id=f"{batch}-long", batch_id=batch, prompt="z" * 3000, sampling=SamplingParams(max_tokens=4)
        ),
        JobRequest(id=f"{batch}-ctx", batch_id=batch, prompt="p", sampling=SamplingParams(max_tokens=10**6)),
    ]
    queue = KafkaQueue(s)
    worker = in_process_worker(s, engines[0], "w-one").start()
    try:
        store.create_batch(batch)
        Producer(queue, store).submit(jobs + bad)
        dup = jobs[0].submitted(1.0e9)
        queue.publish_raw(
            [
                (routing_key(dup), encode_job(dup)),  # the same job once more
                (b"poison", b"\xff\xfe not json"),
                (b"poison", b'{"id": "x", "prompt": "p", "sampling": {"temperature": -1}}'),
            ]
        )
        wait_until(lambda: terminal_count(store, batch) == 502, 240, "502 terminal rows")
        # read while the worker still runs: the poison messages sit at their partition's end, and
        # 502 rows can be written before the worker has fetched them (a slow CI run stopped it
        # first, then found the dead-letter topic empty)
        dead = read_topic(s, s.dlq_topic, 2, timeout_s=120)
        wait_until(lambda: sum(worker.intake.consumer.in_flight().values()) == 0, 30, "nothing in flight")
    finally:
        worker.stop()
        queue.close()
    rows = {r.id: r for r in store.list_jobs(batch_id=batch, limit=1000)}
    assert len(rows) == 502
    assert rows[f"{batch}-long"].error_code is ErrorCode.PROMPT_TOO_LONG
    assert (
        rows[f"{batch}-ctx"].status is JobStatus.FAILED
        and rows[f"{batch}-ctx"].error_code is ErrorCode.PROMPT_TOO_LONG
    )
    for j in jobs:
        r = rows[j.id]
        assert r.status is JobStatus.SUCCEEDED and r.usage.completion_tokens == 4 and r.worker == "w-one"
        t = r.timings
        assert all(v is not None for v in t.model_dump().values()), (j.id, t)
        assert t.submitted_at <= t.admitted_at <= t.first_token_at <= t.finished_at
        assert t.ttft_ms >= t.engine_ttft_ms >= t.prefill_ms
    headers = [dict(m.headers) for m in dead]
    assert all(DLQ_ERROR in h and DLQ_ORIGIN_OFFSET in h for h in headers)
    # At least once: a consumer that lost its group before committing a poison's offset
    # dead-letters it again (the CI run of 835a930 met the client's start-up stall twice in this
    # test); the origin headers identify each poison message.
    codes = defaultdict(set)
    for h in headers:
        codes[(h[DLQ_ORIGIN_PARTITION], h[DLQ_ORIGIN_OFFSET])].add(h[DLQ_ERROR_CODE].decode())
    assert sorted(c for cs in codes.values() for c in cs) == ["invalid_sampling", "undecodable_json"]

    # the embedded mode, same jobs and seeds: the same outputs
    path = tmp_path / "same.jsonl"
    client_fields = set(JobInput.model_fields)  # what a batch line may hold
    path.write_text("".join(j.model_dump_json(include=client_fields) + "\n" for j in jobs))
    out = io.StringIO()
    run_file(path, model="tiny", db_url=f"sqlite:///{tmp_path / 'e.db'}", output=out, batch_id="emb")
    embedded = {o["id"]: o["text"] for o in map(json.loads, out.getvalue().splitlines())}
    assert embedded == {j.id: rows[j.id].text for j in jobs}


def test_two_workers_share_partitions_by_prefix_key(kafka_settings, postgres_url, store, tmp_path):
    s = settings_for(kafka_settings, postgres_url)
    batch = f"b2w-{tag()}"
    queue = KafkaQueue(s)
    procs = [start_worker_process(s, f"w{i}", tmp_path) for i in range(2)]
    try:
        # a steady group: each member's latest assignment is non-empty and together they cover
        # the topic (an early "assigned" line can be followed by a revocation)
        def split_between_both() -> bool:
            latest = []
            for i in range(2):
                found = re.findall(r"assigned \[([0-9, ]*)\]", (tmp_path / f"w{i}.log").read_text())
                if not found or not found[-1].strip():
                    return False
                latest.append({int(x) for x in found[-1].split(",")})
            return latest[0].isdisjoint(latest[1]) and len(latest[0] | latest[1]) == s.jobs_partitions

        wait_until(split_between_both, 120, "the partitions split between both workers")
        time.sleep(2)
        Producer(queue, store).submit(make_jobs(200, batch, batch_id=batch, keys=16))
        wait_until(lambda: terminal_count(store, batch) == 200, 180, "200 terminal rows")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(60)
        queue.close()
    by_key: dict[str, set[str]] = defaultdict(set)
    for r in store.list_jobs(batch_id=batch, limit=1000):
        assert r.status is JobStatus.SUCCEEDED
        by_key[r.prefix_key].add(r.worker)
    assert len(by_key) == 16
    assert all(len(ws) == 1 for ws in by_key.values()), by_key
    assert {w for ws in by_key.values() for w in ws} == {"w0", "w1"}


def test_submit_cli_fuzz_every_good_line_succeeds_every_bad_one_fails_alone(
    kafka_settings, postgres_url, store, engines, tmp_path
):
    """`firsttoken submit` of a file with hundreds of bad lines between good ones, on real Kafka
    and Postgres: each bad line its own failed row and error, each good one run by a worker, the
    batch completed, `firsttoken results` in input order; the same file again resumes (nothing
    twice) and another file under the batch id is refused."""
    s = settings_for(kafka_settings, postgres_url)
    batch = f"fuzz-{tag()}"
    bad = bad_lines(n_random=150, seed=5)
    lines: list[bytes] = []
    good_lines: list[int] = []
    for i, b in enumerate(bad):
        if i % 5 == 0:
            lines.append(json.dumps({"id": f"g{i}", "prompt": f"good {i}", "max_tokens": 2}).encode())
            good_lines.append(len(lines))
        lines.append(b)
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    env = worker_env(s, "submitter")
    cmd = [sys.executable, "-m", "firsttoken.cli", "submit", str(path), "--batch-id", batch, "--model", "tiny"]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stderr  # some lines failed
    summary = json.loads(r.stdout)
    assert summary["submitted"] == len(good_lines) and summary["invalid"] == len(bad)
    worker = in_process_worker(s, engines[0], "w-fuzz").start()
    try:
        wait_until(lambda: store.get_batch(batch).status == "completed", 120, "the batch to complete")
    finally:
        worker.stop()
    rows = list(store.iter_batch(batch))
    assert [r.line_no for r in rows] == list(range(1, len(lines) + 1))
    for row in rows:
        if row.line_no in good_lines:
            assert row.status is JobStatus.SUCCEEDED and row.usage.completion_tokens >= 1, row
        else:
            assert row.status is JobStatus.FAILED and row.error_code is not None and row.error_message, row
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, "-m", "firsttoken.cli", "results", batch, "-o", str(out)],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and len(out.read_text().splitlines()) == len(lines), r.stderr
    # the same file again: a resume that sends nothing; another input under the id: refused
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    again = json.loads(r.stdout)
    assert again["resumed"] and again["submitted"] == 0 and again["already_done"] == len(good_lines)
    path.write_bytes(lines[good_lines[0] - 1] + b"\n")
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "different input" in r.stderr and "Traceback" not in r.stderr


def test_submit_wait_follows_the_batch_to_its_end(kafka_settings, postgres_url, store, engines, tmp_path):
    s = settings_for(kafka_settings, postgres_url)
    batch = f"wait-{tag()}"
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps({"id": f"w{i}", "prompt": f"wait {i}", "max_tokens": 3}) + "\n" for i in range(6)))
    env = worker_env(s, "submitter")
    worker = in_process_worker(s, engines[0], "w-wait").start()
    try:
        cmd = [sys.executable, "-m", "firsttoken.cli", "submit", str(path), "--batch-id", batch, "--wait"]
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr  # every line succeeded
        assert f"batch {batch} completed: 6/6 done (6 succeeded)" in r.stderr
        r = subprocess.run([sys.executable, "-m", "firsttoken.cli", "status", batch], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == f"batch {batch} completed: 6/6 done (6 succeeded)"
    finally:
        worker.stop()


def test_submit_of_an_empty_input_exits_0(kafka_settings, postgres_url, store, tmp_path):
    s = settings_for(kafka_settings, postgres_url)
    batch = f"empty-{tag()}"
    path = tmp_path / "empty.jsonl"
    path.write_text("\n   \n")
    env = worker_env(s, "submitter")
    cmd = [sys.executable, "-m", "firsttoken.cli", "submit", str(path), "--batch-id", batch, "--wait", "--no-progress"]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)  # no worker: none needed
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert (summary["lines"], summary["submitted"], summary["invalid"]) == (0, 0, 0)
    b = store.get_batch(batch)
    assert b is not None and b.progress.total == 0 and b.progress.recorded == 0


def test_submit_without_a_model_still_refuses_a_grammar_at_once(kafka_settings, postgres_url, store, tmp_path):
    """`firsttoken submit` with no --model cannot check prompts against a context, but a guided
    spec the grammar engine refuses (checked with no tokenizer) is that line's invalid_grammar row
    at once, not a job sent to a worker to fail there; the good line is queued."""
    s = settings_for(kafka_settings, postgres_url)
    batch = f"grammar-{tag()}"
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"id": "ok", "prompt": "hi", "max_tokens": 2}) + "\n"
                    + json.dumps({"id": "bad", "prompt": "hi", "max_tokens": 2,
                                  "sampling": {"guided": {"kind": "regex", "regex": "(a)\\1"}}}) + "\n")
    r = subprocess.run([sys.executable, "-m", "firsttoken.cli", "submit", str(path), "--batch-id", batch],
                       env=worker_env(s, "submitter"), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stderr
    summary = json.loads(r.stdout)
    assert summary["submitted"] == 1 and summary["invalid"] == 1
    rows = {row.custom_id: row for row in store.iter_batch(batch)}
    assert rows["bad"].status is JobStatus.FAILED and rows["bad"].error_code == "invalid_grammar", rows["bad"]
    assert "(a)" not in (rows["bad"].error_message or "")
