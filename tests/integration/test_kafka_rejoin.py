"""A consumer whose rejoin never completes (revoked, never assigned) rebuilds its client and goes on."""

from __future__ import annotations

import time

import pytest

from pipeline.queue.kafka import KafkaQueue
from pipeline.settings import Settings
from schemas.job import JobRequest

pytestmark = pytest.mark.integration


def test_stuck_rejoin_rebuilds_the_client(kafka_settings: Settings):
    q = KafkaQueue(kafka_settings)
    try:
        q.publish(JobRequest(id=f"a{i}", prompt=f"p {i}") for i in range(20))
        with q.consumer() as c:
            got = []
            deadline = time.monotonic() + 45
            while len(got) < 20 and time.monotonic() < deadline:
                got += c.poll(0.5)
            assert len(got) == 20
            c.commit(got[:10])  # half done; the other half stays in flight
            old_client = c._consumer
            # the state the watchdog looks for: a revocation long ago and no assignment since
            c._revoked_at = time.monotonic() - c.stuck_after_s - 1
            q.publish(JobRequest(id=f"b{i}", prompt=f"q {i}") for i in range(5))
            # the jobs not committed come back (the store's upsert keeps one row each); new ones arrive
            want = {m.job.id for m in got[10:]} | {f"b{i}" for i in range(5)}
            ids: set[str] = set()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not want <= ids:
                ids |= {m.job.id for m in c.poll(0.5)}
            assert c.recreated == 1 and c._consumer is not old_client
            assert want <= ids
    finally:
        q.close()


_MEMBER = """
import sys, time
from pipeline.queue.kafka import KafkaQueue
from pipeline.settings import Settings
c = KafkaQueue(Settings()).consumer()
while not c.assignment():
    c.poll(0.2)
print("assigned", flush=True)
while True:
    for m in c.poll(0.2):
        print("job", m.job.id, flush=True)
"""


def _line(p, timeout_s: float) -> str:
    """The child's next stdout line, or fail after timeout_s (never a test hung on a dead child)."""
    import select

    ready, _, _ = select.select([p.stdout], [], [], timeout_s)
    assert ready, f"no line from the member in {timeout_s} s"
    return p.stdout.readline().strip()


def test_a_killed_static_member_restarted_takes_its_partitions_back_at_once(kafka_settings: Settings):
    """With a consumer instance id (static membership), a worker killed -9 and restarted under the
    same id holds its partitions again long before its session could have timed out, and gets the
    jobs sent since; a new dynamic member waits for the killed one's session to end (19.2-19.9 s
    at a 20 s timeout, against 0.35 s static: measured with the same script). The session here is
    60 s, so only a restart that skipped the wait passes the 30 s bound, however loaded the box."""
    import os
    import subprocess
    import sys

    from pipeline.queue.kafka import ensure_topics

    s = kafka_settings
    ensure_topics(s, {s.jobs_topic: s.jobs_partitions, s.dlq_topic: 1})
    env = {**os.environ, "FIRSTTOKEN_KAFKA_BOOTSTRAP": s.kafka_bootstrap, "FIRSTTOKEN_JOBS_TOPIC": s.jobs_topic,
           "FIRSTTOKEN_DLQ_TOPIC": s.dlq_topic, "FIRSTTOKEN_CONSUMER_GROUP": s.consumer_group,
           "FIRSTTOKEN_JOBS_PARTITIONS": str(s.jobs_partitions), "FIRSTTOKEN_SESSION_TIMEOUT_MS": "60000",
           "FIRSTTOKEN_CONSUMER_INSTANCE_ID": "worker-under-test"}

    def start() -> tuple[subprocess.Popen, float]:
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-c", _MEMBER], env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert _line(p, 90) == "assigned"
        except BaseException:
            p.kill()
            raise
        return p, time.monotonic() - t0

    first, _ = start()
    q = KafkaQueue(s)
    try:
        first.kill()
        first.wait(10)
        second, took = start()
        try:
            # a fresh interpreter joins in ~1-2 s here; a new member's wait for the old session
            # would be ~60 s
            assert took < 30, took
            q.publish([JobRequest(id="after-restart", prompt="p")])
            assert _line(second, 60) == "job after-restart"
        finally:
            second.kill()
            second.wait(10)
    finally:
        q.close()
