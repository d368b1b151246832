"""Pipeline benchmarks on loopback services, tiny model on CPU (the engine is not what is measured).

1. overhead: jobs submitted to Kafka at a steady rate (default 100 jobs/s) and served by one
   in-process worker; per job, TTFT from submission minus the engine's own TTFT (= the time from
   `submitted_at` to admission: produce + ack + fetch + intake + hand-off). Targets: p50 <= 5 ms,
   p99 <= 20 ms. Beside it ("kafka_floor"): the Kafka round trip alone, publish -> ack -> polled.
2. submit: a 100k-line JSONL file parsed, validated and produced to Kafka (acks=all, idempotent;
   chunks of 20k jobs go as prebuilt record batches, pipeline/queue/kafka_batches.py).
   Target >= 20k jobs/s.
3. sink: results written into Postgres by the ResultSink (batched upserts). Target >= 5k rows/s.

    scripts/services.sh start && eval "$(scripts/services.sh env)"
    .venv/bin/python bench/bench_pipeline.py [--rate 100 --seconds 20 --lines 100000 --rows 50000]

Prints a JSON summary; --markdown FILE appends a result section.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.producer import Producer
from pipeline.queue.kafka import KafkaQueue
from pipeline.settings import Settings
from pipeline.store import ResultStore, migrate
from schemas.job import FinishReason, JobRequest, JobResult, JobStatus, JobTimings, Usage
from schemas.sampling import SamplingParams


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


_TOPICS: list[str] = []  # made by this run, deleted at its end


def fresh_settings(base: Settings, db_url: str) -> Settings:
    t = uuid.uuid4().hex[:8]
    _TOPICS.extend([f"bench.jobs.{t}", f"bench.jobs.{t}.dlq"])
    return base.model_copy(
        update={
            "jobs_topic": f"bench.jobs.{t}",
            "dlq_topic": f"bench.jobs.{t}.dlq",
            "consumer_group": f"bench-{t}",
            "database_url": db_url,
        }
    )


def fresh_database(server_url: str) -> str:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"firsttoken_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(make_url(server_url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    migrate(url)
    return url


def bench_kafka_floor(s: Settings, n: int = 300) -> dict:
    """The Kafka round trip alone, one job at a time: publish (acks=all, returns on the ack) and
    publish -> the job polled by a consumer of the group. No worker, engine or store: the part
    of the overhead that no worker code can remove."""
    queue = KafkaQueue(s)
    producer = Producer(queue)
    consumer = queue.consumer(f"{s.consumer_group}-floor")
    sp = SamplingParams(max_tokens=1)
    ack, seen = [], []
    try:
        for i in range(-20, n):  # the first 20 warm up the connections and the group join
            t0 = time.perf_counter()
            producer.submit([JobRequest(id=f"floor{i}", prompt="floor probe", sampling=sp)])
            t1 = time.perf_counter()
            got: list = []
            deadline = time.monotonic() + 60
            while not got and time.monotonic() < deadline:
                got = consumer.poll(0.05)
            t2 = time.perf_counter()
            consumer.commit(got)
            if i >= 0:
                ack.append((t1 - t0) * 1e3)
                seen.append((t2 - t0) * 1e3)
            time.sleep(0.01)
    finally:
        consumer.close()
        queue.close()
    return {
        "jobs": n,
        "publish_ack_ms": {"p50": pct(ack, 0.5), "p99": pct(ack, 0.99)},
        "publish_to_polled_ms": {"p50": pct(seen, 0.5), "p99": pct(seen, 0.99)},
    }


def _submit_paced(producer: Producer, jobs: list[JobRequest], rate: float) -> None:
    t0 = time.monotonic()
    for i, job in enumerate(jobs):
        wait = t0 + i / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        producer.submit([job])


def _paced_producer(settings: dict, jobs: list[dict], rate: float) -> None:
    """Child process: submit `jobs` one at a time at `rate` jobs/s."""
    queue = KafkaQueue(Settings(**settings), create_topics=False)
    try:
        _submit_paced(Producer(queue), [JobRequest.model_validate(j) for j in jobs], rate)
    finally:
        queue.close()


def _run_paced(s: Settings, jobs: list[JobRequest], rate: float, seconds: float, producer_process: bool) -> None:
    if producer_process:
        # Producers are other processes in a deployment (API, CLI): this one must not hold the
        # worker's GIL. (It still shares the 2 cores.)
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=_paced_producer, args=(s.model_dump(), [j.model_dump() for j in jobs], rate))
        proc.start()
        proc.join(seconds + 120)
    else:
        queue = KafkaQueue(s, create_topics=False)
        try:
            _submit_paced(Producer(queue), jobs, rate)
        finally:
            queue.close()


def bench_overhead(
    s: Settings,
    rate: float,
    seconds: float,
    torch_threads: int | None,
    producer_process: bool = True,
    engine_process: bool = True,
    warmup_s: float = 0.0,
) -> dict:
    import torch

    from workers.settings import WorkerSettings
    from workers.wiring import build_worker

    if torch_threads:
        # The tiny model stands in for a GPU engine: intra-op threads only make its steps slower
        # on 2 cores shared with Kafka, Postgres and the worker's own threads (OpenMP workers
        # spin against them), and a longer step is a longer wait for the next admission.
        torch.set_num_threads(torch_threads)
    # The worker as deployed: the engine core in a child process (or on a thread of this one)
    ws = WorkerSettings(model="tiny", device="cpu", torch_threads=torch_threads, engine_process=engine_process,
                        metrics_port=0)
    worker = build_worker(s.model_copy(update={"worker_name": "bench"}), ws)
    queue = KafkaQueue(s)
    store = ResultStore.from_url(s.database_url)
    n = int(rate * seconds)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    jobs = [
        JobRequest(id=f"o{i}", prompt=f"overhead probe {i}", sampling=sp, batch_id="ovh") for i in range(n)
    ]
    worker.start()
    # warm up: the consumer joins the group and gets its partitions
    Producer(queue).submit([JobRequest(id="warm", prompt="warm", sampling=sp, batch_id="warm")])
    deadline = time.monotonic() + 60
    while store.batch_progress("warm").done < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    if warmup_s > 0:
        # the same load, unrecorded: a broker's JIT takes minutes of traffic to settle (a fresh
        # broker's p50 fell from ~11 to ~5.5 ms over its first six 15 s runs)
        m = int(rate * warmup_s)
        warm = [JobRequest(id=f"w{i}", prompt=f"warm up {i}", sampling=sp, batch_id="warmup") for i in range(m)]
        _run_paced(s, warm, rate, warmup_s, producer_process)
        while store.batch_progress("warmup").done < m and time.monotonic() < deadline + warmup_s + 120:
            time.sleep(0.1)
    t0 = time.monotonic()
    _run_paced(s, jobs, rate, seconds, producer_process)
    while store.batch_progress("ovh").done < n and time.monotonic() < t0 + seconds + 120:
        time.sleep(0.1)
    worker.stop()
    queue.close()
    rows = store.list_jobs(batch_id="ovh", limit=n + 10)
    store.close()
    # overhead = TTFT from submission - engine TTFT = admitted_at - submitted_at: produce, ack,
    # fetch, intake, hand-off, and the wait for the engine loop to reach its next admission
    over = [r.timings.ttft_ms - r.timings.engine_ttft_ms for r in rows if r.timings.ttft_ms is not None]
    queue_ms = [r.timings.queue_ms for r in rows if r.timings.queue_ms is not None]
    stored = [r.timings.overhead_ms for r in rows if r.timings.overhead_ms is not None]
    ttft = [r.timings.ttft_ms for r in rows if r.timings.ttft_ms is not None]
    eng = [r.timings.engine_ttft_ms for r in rows if r.timings.engine_ttft_ms is not None]
    return {
        "rate_jobs_per_s": rate,
        "jobs": n,
        "rows": len(rows),
        "overhead_ms": {
            "p50": pct(over, 0.5),
            "p90": pct(over, 0.9),
            "p99": pct(over, 0.99),
            "mean": statistics.fmean(over),
        },
        # since revision 0004: the waiting for capacity (back-pressure, engine queue), stored apart
        "queue_ms": {"p50": pct(queue_ms, 0.5), "p99": pct(queue_ms, 0.99)},
        "stored_overhead_ms": {"p50": pct(stored, 0.5), "p99": pct(stored, 0.99)} if stored else None,
        "torch_threads": torch.get_num_threads(),
        "producer": "process" if producer_process else "thread",
        "engine": "process" if engine_process else "thread",
        "warmup_s": warmup_s,
        "ttft_ms": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99)},
        "engine_ttft_ms": {"p50": pct(eng, 0.5), "p99": pct(eng, 0.99)},
    }


def bench_submit(s: Settings, lines: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bulk.jsonl"
        with path.open("w") as f:
            for i in range(lines):
                f.write(
                    json.dumps(
                        {
                            "id": f"bulk-{i}",
                            "prompt": f"document {i}: summarise the following text about topic {i % 97}",
                            "max_tokens": 16,
                        }
                    )
                    + "\n"
                )
        queue = KafkaQueue(s)
        try:
            summary = Producer(queue).submit_file(path, batch_id="bulk")
        finally:
            queue.close()
    return {
        "lines": lines,
        "submitted": summary.submitted,
        "seconds": summary.seconds,
        "jobs_per_s": summary.jobs_per_s,
    }


def bench_sink(db_url: str, rows: int) -> dict:
    from workers.sink import Outcome, ResultSink, SinkConfig

    store = ResultStore.from_url(db_url)
    now = time.time()
    results = [
        JobResult(
            id=f"sink-{i}",
            batch_id="sink",
            status=JobStatus.SUCCEEDED,
            text="out " * 8,
            finish_reason=FinishReason.LENGTH,
            usage=Usage(prompt_tokens=20, cached_prompt_tokens=0, completion_tokens=16),
            timings=JobTimings.from_instants(
                submitted_at=now,
                admitted_at=now + 0.001,
                first_token_at=now + 0.01,
                finished_at=now + 0.1,
                completion_tokens=16,
            ),
            worker="bench",
            model="tiny",
        )
        for i in range(rows)
    ]
    sink = ResultSink(store, lambda _msgs: None, SinkConfig(batch_rows=500, max_buffer=rows + 1))
    t0 = time.perf_counter()
    sink.start()
    sink.put([Outcome(r) for r in results])
    while sink.results_durable < rows:
        time.sleep(0.005)
    dt = time.perf_counter() - t0
    sink.stop()
    store.close()
    return {"rows": rows, "rows_written": sink.rows_written, "seconds": dt, "rows_per_s": rows / dt}


def _crc32c_in_c() -> bool:
    from kafka.record import util

    return getattr(util, "crc32c_c", None) is not None


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.system()}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--only", choices=["overhead", "floor", "submit", "sink"], default=None)
    ap.add_argument(
        "--producer-thread",
        action="store_true",
        help="overhead: submit from the worker's process (as run 1 did) instead of a child process",
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads of the tiny engine (0: torch's default)",
    )
    ap.add_argument(
        "--engine-thread",
        action="store_true",
        help="overhead: the engine on a thread of the worker's process (before run 5) instead of its own process",
    )
    ap.add_argument(
        "--warmup-s",
        type=float,
        default=30.0,
        help="overhead: this many seconds of the same load first, not recorded (broker JIT, consumer)",
    )
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()

    base = Settings()
    db = fresh_database(base.database_url)
    out: dict = {
        "machine": machine(),
        "load_average": os.getloadavg(),
        # kafka-python checksums record batches with CRC32C: in C with the `crc32c` package,
        # in pure Python (~3.5 MB/s here) without it
        "kafka_crc32c_in_c": _crc32c_in_c(),
        "kafka_settings": {
            "fetch_max_wait_ms": base.fetch_max_wait_ms,
            "producer_linger_ms": base.producer_linger_ms,
            "producer_batch_bytes": base.producer_batch_bytes,
            "bulk_min_records": KafkaQueue.bulk_min_records,  # publishes this large go as prebuilt batches
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
    }
    # the latency-bound sections first: the bulk ones leave the broker and Postgres busy for a
    # while after (segment rolls, autovacuum, checkpoints)
    if args.only in (None, "overhead"):
        out["overhead"] = bench_overhead(
            fresh_settings(base, db),
            args.rate,
            args.seconds,
            args.torch_threads,
            not args.producer_thread,
            not args.engine_thread,
            args.warmup_s,
        )
        print(json.dumps({"overhead": out["overhead"]}), flush=True)
    if args.only in (None, "floor"):
        out["kafka_floor"] = bench_kafka_floor(fresh_settings(base, db))
        print(json.dumps({"kafka_floor": out["kafka_floor"]}), flush=True)
    if args.only in (None, "submit"):
        out["submit"] = bench_submit(fresh_settings(base, db), args.lines)
        print(json.dumps({"submit": out["submit"]}), flush=True)
    if args.only in (None, "sink"):
        out["sink"] = bench_sink(db, args.rows)
        print(json.dumps({"sink": out["sink"]}), flush=True)
    from pipeline.queue.kafka import delete_topics

    delete_topics(base, _TOPICS)
    print(json.dumps(out, indent=2))
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(f"\n```json\n{json.dumps(out, indent=2)}\n```\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
