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
