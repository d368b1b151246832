"""Helpers of the pipeline integration tests: jobs, in-process and subprocess workers, waiting."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from pipeline.settings import Settings
from pipeline.store import ResultStore
from schemas.job import JobRequest
from schemas.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def tag() -> str:
    return uuid.uuid4().hex[:8]


def make_jobs(
    n: int, prefix: str, *, batch_id: str | None = None, max_tokens: int = 4, keys: int | None = None
) -> list[JobRequest]:
    """n jobs that run exactly max_tokens tokens: greedy, and every third one seeded sampling."""
    out = []
    for i in range(n):
        if i % 3 == 2:
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
        else:
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out.append(
            JobRequest(
                id=f"{prefix}-{i}",
                batch_id=batch_id,
                prompt=f"job {i}: tell me about number {i * 7}",
                sampling=sp,
                prefix_key=None if keys is None else f"key-{i % keys}",
            )
        )
    return out


def settings_for(kafka_settings: Settings, postgres_url: str, **kw) -> Settings:
    return kafka_settings.model_copy(update={"database_url": postgres_url, **kw})


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def wait_while_progressing(done: Callable[[], bool], progress: Callable[[], object], what: str,
                           stall_s: float = 60.0, cap_s: float = 900.0, every_s: float = 0.5) -> None:
    """Wait for done(), failing when progress() has not changed for stall_s (a hang, a lost job) or after cap_s
    in all: a bound on progress, not on how fast the machine is (a loaded 2-core box runs a long job several
    times slower than an idle one, and neither is a defect)."""
    start = last_change = time.monotonic()
    last = progress()
    while not done():
        now = time.monotonic()
        mark = progress()
        if mark != last:
            last, last_change = mark, now
        if now - last_change > stall_s:
            raise AssertionError(f"no progress for {stall_s:.0f} s (at {last!r}) waiting for {what}")
        if now - start > cap_s:
            raise AssertionError(f"timed out after {cap_s:.0f} s waiting for {what} (still progressing: {last!r})")
        time.sleep(every_s)


def read_topic(settings: Settings, topic: str, n: int, timeout_s: float = 60.0) -> list:
    """At least the first n records of a topic, read from its beginning outside any group.

    Each attempt is a fresh consumer that assigns the topic's partitions itself and seeks to
    their beginning, driving kafka-python's event loop on this thread as the workers do, and
    re-sends an unanswered request after 5 s. An attempt that saw too few records in 15 s is
    replaced by a new one: CI runs of af40ffd and 2c4bb40.. saw a subscribed reader get nothing
    for a minute with the records on the broker (every row and commit was right), which a new
    client reading the same partitions does not repeat."""
    from kafka import KafkaConsumer, TopicPartition

    from pipeline.queue.kafka_internals import polling_thread_client

    deadline = time.monotonic() + timeout_s
    got: dict[tuple[int, int], object] = {}
    while True:
        c = KafkaConsumer(
            **settings.kafka_client_config,
            enable_auto_commit=False,
            request_timeout_ms=5_000,
            kafka_client=polling_thread_client,
        )
        try:
            attempt_end = min(deadline, time.monotonic() + 15.0)
            parts = None
            while parts is None and time.monotonic() < attempt_end:
                parts = c.partitions_for_topic(topic)
                if parts is None:
                    time.sleep(0.2)
            if parts:
                tps = [TopicPartition(topic, p) for p in sorted(parts)]
                c.assign(tps)
                c.seek_to_beginning(*tps)
                while len(got) < n and time.monotonic() < attempt_end:
                    for rs in c.poll(timeout_ms=500).values():
                        for r in rs:
                            got[(r.partition, r.offset)] = r
        finally:
            c.close()
        if len(got) >= n:
            return [got[k] for k in sorted(got)]
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {n} records on {topic} (got {len(got)})")


def terminal_count(store: ResultStore, batch_id: str) -> int:
    return store.batch_progress(batch_id).done


def in_process_worker(settings: Settings, engine, name: str):
    from workers.settings import WorkerSettings
    from workers.sink import SinkConfig
    from workers.wiring import build_worker

    w = build_worker(
        settings.model_copy(update={"worker_name": name}),
        WorkerSettings(model="tiny", drain_timeout_s=10, metrics_port=0),
        engine=engine,
    )
    w.sink.config = SinkConfig(batch_rows=w.sink.config.batch_rows, backoff_initial_s=0.1, backoff_max_s=1.0)
    return w


def worker_env(settings: Settings, name: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "FIRSTTOKEN_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "FIRSTTOKEN_JOBS_TOPIC": settings.jobs_topic,
            "FIRSTTOKEN_DLQ_TOPIC": settings.dlq_topic,
            "FIRSTTOKEN_CONSUMER_GROUP": settings.consumer_group,
            "FIRSTTOKEN_JOBS_PARTITIONS": str(settings.jobs_partitions),
            "FIRSTTOKEN_SESSION_TIMEOUT_MS": str(settings.session_timeout_ms),
            "FIRSTTOKEN_DATABASE_URL": settings.database_url,
            "FIRSTTOKEN_WORKER_NAME": name,
            "FIRSTTOKEN_DEVICE": "cpu",
            "FIRSTTOKEN_MODEL": "tiny",
            # jobs run in waves (the default, 512, admits a 300-job batch at once and finishes it
            # all in the same step: a kill after the first rows would find nothing left to do)
            "FIRSTTOKEN_MAX_NUM_SEQS": "64",
            # no metrics server unless a test asks for one (the default, 9400 and up, is shared by the host)
            "FIRSTTOKEN_METRICS_PORT": "0",
        }
    )
    return env


def start_worker_process(settings: Settings, name: str, log_dir: Path, **env: str) -> subprocess.Popen:
    """`firsttoken worker` in a subprocess (its own session, so the test can kill it alone);
    `env`: more FIRSTTOKEN_* variables."""
    log = (log_dir / f"{name}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "firsttoken.cli", "worker"],
        cwd=ROOT,
        env={**worker_env(settings, name), **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def services(*args: str) -> None:
    subprocess.run([str(ROOT / "scripts" / "services.sh"), *args], check=True, cwd=ROOT)
