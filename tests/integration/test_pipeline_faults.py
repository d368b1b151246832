"""Faults: a worker killed with SIGKILL mid-run, Kafka stopped and restarted, Postgres stopped for
10 s. Every job ends up with exactly one row; the worker recovers by itself.

These stop and start the suite's shared Kafka and Postgres (scripts/services.sh stop/start NAME).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from pipeline_util import (
    in_process_worker,
    make_jobs,
    services,
    settings_for,
    start_worker_process,
    tag,
    terminal_count,
    wait_until,
)
from sqlalchemy import func, select

from pipeline.producer import Producer
from pipeline.queue.kafka import KafkaQueue
from pipeline.store import ResultStore, make_engine
from pipeline.store.tables import jobs as jobs_table
from schemas.job import JobStatus

pytestmark = pytest.mark.integration


@pytest.fixture
def store(postgres_url):
    s = ResultStore(make_engine(postgres_url))
    yield s
    s.close()


def rows_of(store: ResultStore, batch: str) -> list:
    return store.list_jobs(batch_id=batch, limit=10_000)


def assert_exactly_once(store: ResultStore, batch: str, n: int) -> None:
    with store.engine.connect() as conn:
        count = conn.execute(select(func.count()).where(jobs_table.c.batch_id == batch)).scalar()
    rows = rows_of(store, batch)
    assert count == n == len({r.id for r in rows})
    assert all(r.status is JobStatus.SUCCEEDED for r in rows)


def test_kill_9_a_worker_and_start_another(kafka_settings, postgres_url, store, tmp_path):
    s = settings_for(kafka_settings, postgres_url)
    batch = f"kill-{tag()}"
    queue = KafkaQueue(s)
    store.create_batch(batch)
    Producer(queue, store).submit(make_jobs(300, batch, batch_id=batch, max_tokens=24))
    queue.close()
    # an in-flight window of max_num_seqs 16 + backlog 16: what may run again after the kill
    first = start_worker_process(s, "victim", tmp_path, FIRSTTOKEN_MAX_NUM_SEQS="16", FIRSTTOKEN_MAX_WAITING="16")
    second = None
    try:
        wait_until(lambda: terminal_count(store, batch) >= 30, 120, "the first worker to make progress")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        done_at_kill = terminal_count(store, batch)
        assert done_at_kill < 300, "the first worker finished everything before the kill"
        second = start_worker_process(s, "rescuer", tmp_path)
        wait_until(lambda: terminal_count(store, batch) == 300, 240, "all 300 jobs after the restart")
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(60)
    assert_exactly_once(store, batch, 300)
    assert {r.worker for r in rows_of(store, batch)} == {"victim", "rescuer"}
    # run again: only what the killed worker had in flight (jobs whose rows were written are
    # skipped by the admission lookup, however far the committed offset trailed): at most its
    # window (16 running + 16 waiting) and the results its sink had not written yet (a wave of
    # 16 finishes per 24 steps; up to three waves allowed for a slow Postgres on a busy box), and
    # only jobs with no result when it died. Before the lookup, every job after the lowest
    # uncommitted offset ran again.
    rows = rows_of(store, batch)
    again = sum(r.deliveries for r in rows) - len(rows)
    assert 0 <= again <= min(16 + 16 + 3 * 16, 300 - done_at_kill), (again, done_at_kill)
    assert all(r.deliveries == 1 for r in rows if r.worker == "victim")  # finished by the victim: run once


def test_kafka_restart_and_postgres_outage(kafka_settings, postgres_url, store, engines_one):
    s = settings_for(kafka_settings, postgres_url)
    batch = f"chaos-{tag()}"
    store.create_batch(batch)
    jobs = make_jobs(300, batch, batch_id=batch, max_tokens=8)
    queue = KafkaQueue(s)
    Producer(queue, store).submit(jobs[:100])
    queue.close()
    worker = in_process_worker(s, engines_one, "w-chaos").start()
    try:
        wait_until(lambda: terminal_count(store, batch) >= 20, 60, "progress before the faults")
        # --- Kafka down and up again, then more jobs
        services("stop", "kafka")
        time.sleep(3)
        services("start", "kafka")
        queue = KafkaQueue(s)
        Producer(queue).submit(jobs[100:200])
        wait_until(lambda: terminal_count(store, batch) == 200, 180, "200 rows after the Kafka restart")
        # --- Postgres down for 10 s while jobs keep coming
        services("stop", "postgres")
        t0 = time.monotonic()
        feeder = threading.Thread(target=lambda: Producer(queue).submit(jobs[200:]))
        feeder.start()
        feeder.join(60)
        wait_until(lambda: not worker.sink.store_ok, 30, "the sink to notice the outage")
        time.sleep(max(0.0, 10 - (time.monotonic() - t0)))
        held = worker.sink.buffered
        services("start", "postgres")
        wait_until(lambda: terminal_count(store, batch) == 300, 180, "all 300 rows after Postgres is back")
        wait_until(
            lambda: sum(worker.intake.consumer.in_flight().values()) == 0, 60, "every offset committed"
        )
        assert held > 0 and worker.sink.store_ok and worker.sink.write_failures > 0
        queue.close()
    finally:
        services("start", "kafka", "postgres")
        worker.stop()
    assert_exactly_once(store, batch, 300)


@pytest.fixture(scope="module")
def engines_one():
    from workers.engine import EngineConfig, LLMEngine

    return LLMEngine("tiny", EngineConfig(device="cpu"))


def _kafka_pid() -> int:
    import os as _os
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    services_dir = Path(_os.environ.get("FIRSTTOKEN_SERVICES_DIR", root / ".services"))
    return int((services_dir / "kafka" / "kafka.pid").read_text().split()[0])


def test_a_broker_killed_for_10_s_costs_seconds_of_results_once_it_is_back(
        kafka_settings, postgres_url, store):
    """kill -9 of the broker with a backlog on the topic, back after 10 s: the worker's client
    reconnects within a second and keeps its place in the group (no new client, no rejoin wait),
    so jobs fetched after the restart have results soon after the broker is ready (its
    partitions writable again)."""
    s = settings_for(kafka_settings, postgres_url)
    batch = f"broker-{tag()}"
    store.create_batch(batch)
    # short jobs (16 tokens): what is measured is the broker's cost, not the engine's speed (with
    # 64 tokens and four CPU hogs on the 2-core box the engine had not drained its window when
    # the broker was back, and a job took 5 s to run: 14.9 s, of which Kafka's part was 0.1 s)
    jobs = make_jobs(3000, batch, batch_id=batch, max_tokens=16)
    probe_settings = s.model_copy(update={"jobs_topic": s.jobs_topic + ".probe", "dlq_topic": s.dlq_topic + ".probe",
                                          "jobs_partitions": 1})
    KafkaQueue(probe_settings).close()
    queue = KafkaQueue(s)
    Producer(queue, store).submit(jobs)
    queue.close()
    from dataclasses import replace

    from workers.engine import EngineConfig, LLMEngine

    # a worker with a small in-flight window, so that it has drained what it holds when the
    # broker comes back and waits on the broker alone (what the consumer holds fetched is served
    # through an outage: kept small too)
    worker = in_process_worker(s, LLMEngine("tiny", EngineConfig(device="cpu", max_num_seqs=16)), "w-broker")
    worker.config = replace(worker.config, max_waiting=16)
    worker.intake.consumer.buffer_messages = 32
    worker.start()
    try:
        wait_until(lambda: terminal_count(store, batch) >= 50, 120, "progress before the kill")
        # (a client stuck after a quick rejoin at its first join, kafka-python's bug that the
        # consumer's watchdog works around, may have been rebuilt before this: not the outage's)
        rebuilt_before = worker.intake.consumer.recreated
        os.kill(_kafka_pid(), signal.SIGKILL)
        time.sleep(10)
        services("start", "kafka")  # returns once the broker answers requests
        # ready: its partitions are online again (a killed broker recovers its logs and has its
        # leaders elected after it answers): a write to the probe topic is acknowledged
        probe = KafkaQueue(probe_settings, create_topics=False)
        deadline = time.monotonic() + 120
        while True:
            try:
                probe.publish_raw([(None, b"probe")])
                break
            except Exception:
                assert time.monotonic() < deadline, "the broker's partitions never came back"
                time.sleep(0.2)
        probe.close()
        ready = time.time()
        assert terminal_count(store, batch) < 2900, "the backlog ran out during the outage: nothing to measure"

        def fetched_after_restart() -> list:
            return [r for r in rows_of(store, batch) if r.timings.admitted_at and r.timings.admitted_at > ready
                    and r.status is JobStatus.SUCCEEDED]

        wait_until(lambda: fetched_after_restart(), 60, "a result of a job fetched after the restart")
        first = min(r.timings.finished_at for r in fetched_after_restart())
        rows = rows_of(store, batch)
        busy = sum(1 for r in rows if r.timings.admitted_at and r.timings.admitted_at <= ready
                   and r.timings.finished_at and r.timings.finished_at > ready)
        admitted = min(r.timings.admitted_at for r in fetched_after_restart())
        scheduled = min(r.timings.scheduled_at or 1e18 for r in fetched_after_restart())
        print(f"results resumed {first - ready:.1f} s after the broker was ready (first job fetched after "
              f"it admitted at +{admitted - ready:.1f} s, run at +{scheduled - ready:.1f} s; {busy} jobs "
              f"fetched before it finished after it)")
        # issue 21: at most 10 s. The consumer keeps its client and its member id through the
        # outage: its watchdog probes the broker from two heartbeat intervals of silence on, once
        # a second until it is back, and the outage does not count against the client. Measured
        # on the 2-core box (its restart after the kill takes 15-24 s): 0.5-1.3 s quiet, 1.0 s
        # beside two CPU hogs, 1.6 s beside four, 1.9 s beside two and the kernel and worker unit
        # tests, 2.0 s after a 53 s outage; the first job fetched after the restart was admitted
        # 0.0-0.4 s after the broker was ready, the rest is the engine. Before, the watchdog
        # probed only after 25 s of silence, about when the broker was back: found up, the client
        # was rebuilt, joined as a new member and waited out the old one's session (23.5 s quiet,
        # 47.4 s in a fresh-clone suite run).
        assert first - ready <= 10.0, f"results resumed {first - ready:.1f} s after the broker was ready"
        assert worker.intake.consumer.recreated == rebuilt_before, "the outage rebuilt the consumer's client"
    finally:
        services("start", "kafka")
        worker.stop(drain=False)
