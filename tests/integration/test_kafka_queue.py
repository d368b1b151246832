"""KafkaQueue against a real broker: round trip, keys -> partitions, commit semantics with
redelivery after a restart, dead-letter topic with headers, pause/resume, rebalance."""

from __future__ import annotations

import threading
import time

import pytest
from kafka import KafkaConsumer, TopicPartition
from pipeline_util import read_topic

from pipeline.queue import (
    DLQ_ERROR,
    DLQ_ERROR_CODE,
    DLQ_ORIGIN_OFFSET,
    DLQ_ORIGIN_PARTITION,
    DLQ_ORIGIN_TOPIC,
    JobConsumer,
    Message,
)
from pipeline.queue.kafka import KafkaQueue
from pipeline.settings import Settings
from schemas.job import JobRequest

pytestmark = pytest.mark.integration


def drain(consumer: JobConsumer, n: int, timeout_s: float = 45.0) -> list[Message]:
    """Poll until n jobs arrived (fails after timeout_s)."""
    got: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, (
            f"got {len(got)} of {n} messages in {timeout_s} s; assigned {consumer.assignment()}, paused {consumer.paused()}"
        )
        got += consumer.poll(timeout_s=0.2, max_messages=500)
    return got


def quiet(consumer: JobConsumer, seconds: float = 1.0) -> list[Message]:
    """Whatever arrives within `seconds` (expected: nothing)."""
    got: list[Message] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got += consumer.poll(timeout_s=0.1)
    return got


def end_offsets(settings: Settings, topic: str) -> dict[int, int]:
    c = KafkaConsumer(**settings.kafka_client_config)
    try:
        parts = c.partitions_for_topic(topic) or set()
        ends = c.end_offsets([TopicPartition(topic, p) for p in parts])
        return {tp.partition: off for tp, off in ends.items()}
    finally:
        c.close()


@pytest.mark.parametrize("io_thread", [False, True], ids=["polling-thread", "io-thread"])
def test_round_trip(kafka_settings: Settings, io_thread: bool):
    q = KafkaQueue(kafka_settings.model_copy(update={"consumer_io_thread": io_thread}))
    try:
        sent = q.publish(
            JobRequest(id=f"rt{i}", prompt=f"prompt {i}", sampling={"max_tokens": i + 1, "seed": i})
            for i in range(200)
        )
        assert all(j.submitted_at is not None for j in sent)
        with q.consumer() as c:
            # kafka-python names its IO thread after the client id; by default there is none
            io_name = f"kafka-io-firsttoken-consumer-{kafka_settings.consumer_group}"
            assert any(t.name == io_name for t in threading.enumerate()) == io_thread
            got = drain(c, 200)
            assert sorted(m.job.id for m in got) == sorted(j.id for j in sent)
            by_id = {m.job.id: m.job for m in got}
            assert all(by_id[j.id] == j for j in sent)
            assert len({(m.partition, m.offset) for m in got}) == 200
            committed = c.commit(got)
            assert committed == {p: n for p, n in end_offsets(kafka_settings, q.topic).items() if n > 0}
            assert c.in_flight() == dict.fromkeys(c.assignment(), 0)
    finally:
        q.close()


def test_keys_route_a_prefix_to_one_partition(kafka_settings: Settings):
    q = KafkaQueue(kafka_settings.model_copy(update={"jobs_partitions": 8}))
    try:
        assert q.partitions == 8
        preamble = "You are a careful assistant. " * 20
        derived = [JobRequest(id=f"d{i}", prompt=preamble + f"question {i}") for i in range(30)]
        keyed = {
            k: [JobRequest(id=f"{k}-{i}", prompt=f"p{i}", prefix_key=k) for i in range(10)]
            for k in ("alpha", "beta", "gamma")
        }
        q.publish(derived + [j for js in keyed.values() for j in js])
        with q.consumer() as c:
            got = drain(c, 60)
            part = {m.job.id: m.partition for m in got}
            assert len({part[j.id] for j in derived}) == 1
            for js in keyed.values():
                assert len({part[j.id] for j in js}) == 1
            assert {m.key for m in got if m.job.id.startswith("alpha")} == {b"alpha"}
            c.commit(got)
    finally:
        q.close()


def test_bulk_publish_routes_and_orders_like_send(kafka_settings: Settings):
    """A publish of many jobs goes as prebuilt record batches: every job lands on the partition
    kafka-python's partitioner gives its key (where a small publish sends it), in input order
    within a partition, and is acknowledged before publish returns."""
    from kafka.partitioner.default import murmur2

    from pipeline.queue.base import routing_key

    q = KafkaQueue(kafka_settings.model_copy(update={"jobs_partitions": 5, "producer_batch_bytes": 4096}))
    try:
        # varied sizes: many batches per partition (4 KB batches), a few one-record batches
        jobs = [JobRequest(id=f"b{i}", prompt=f"p{i % 40} " + "x" * (i * 37 % 5000)) for i in range(1500)]
        small = [JobRequest(id=f"s{i}", prompt=f"p{i} small") for i in range(3)]
        assert len(jobs) >= q.bulk_min_records > len(small)
        q.publish(jobs)
        q.publish(small)
        assert sum(end_offsets(kafka_settings, q.topic).values()) == len(jobs) + len(small)
        with q.consumer() as c:
            got = drain(c, len(jobs) + len(small))
            # delivery is at least once: a client rebuilt after a rejoin that never completed
            # (kafka-python, at a join's quick second rebalance) reads again from the committed
            # offsets; each message once is what is checked here
            got = list({(m.partition, m.offset): m for m in reversed(got)}.values())[::-1]
            while len(got) < len(jobs) + len(small):
                more = drain(c, 1)
                got = list({(m.partition, m.offset): m for m in reversed(got + more)}.values())[::-1]
            assert sorted(m.job.id for m in got) == sorted(j.id for j in jobs + small)
            for m in got:
                key = routing_key(m.job, kafka_settings.prefix_key_chars)
                assert m.key == key
                assert m.partition == (murmur2(key) & 0x7FFFFFFF) % 5
            for p in range(5):
                ids = [int(m.job.id[1:]) for m in sorted(got, key=lambda m: m.offset)
                       if m.partition == p and m.job.id.startswith("b")]
                assert ids == sorted(ids)
            c.commit(got)
    finally:
        q.close()


def test_uncommitted_messages_come_back_after_a_restart(kafka_settings: Settings):
    q = KafkaQueue(kafka_settings.model_copy(update={"jobs_partitions": 1}))
    try:
        q.publish(JobRequest(id=f"r{i}", prompt="x") for i in range(10))
        c1 = q.consumer()
        got = drain(c1, 10)
        assert [m.offset for m in got] == list(range(10))
        # 0-3 and 5-6 are done; 4 is still in flight, so the commit stops at 4
        assert c1.commit([got[i] for i in (0, 1, 2, 3, 5, 6)]) == {0: 4}
        assert c1.committed() == {0: 4}
        c1.close()  # a worker that dies: 4 and 7-9 were never finished

        c2 = q.consumer()
        again = drain(c2, 6)
        assert [m.offset for m in again] == [4, 5, 6, 7, 8, 9]  # 5 and 6 again too: the store dedupes them
        assert [m.job.id for m in again] == ["r4", "r5", "r6", "r7", "r8", "r9"]
        assert c2.commit(again) == {0: 10}
        c2.close()

        c3 = q.consumer()
        assert quiet(c3, 2.0) == []  # everything committed: nothing comes back
        c3.close()
    finally:
        q.close()


def test_poison_messages_go_to_the_dead_letter_topic(kafka_settings: Settings):
    q = KafkaQueue(kafka_settings.model_copy(update={"jobs_partitions": 1}))
    try:
        q.publish([JobRequest(id="good1", prompt="x")])
        q.publish_raw(
            [
                (b"k1", b"\x00\x01 not json"),
                (b"k2", b'{"id": "bad", "prompt": "x", "sampling": {"top_p": 0}}'),
            ]
        )
        q.publish([JobRequest(id="good2", prompt="y")])
        with q.consumer() as c:
            got = drain(c, 2)
            assert [m.job.id for m in got] == ["good1", "good2"]
            assert c.dead_lettered == 2
            assert c.commit(got) == {0: 4}  # the poison messages count as done

        letters = read_topic(kafka_settings, q.dlq_topic, 2)
        assert len(letters) == 2  # committed after the letters were durable: each written once
        h0, h1 = dict(letters[0].headers), dict(letters[1].headers)
        assert letters[0].key == b"k1" and letters[0].value == b"\x00\x01 not json"
        assert h0[DLQ_ERROR_CODE] == b"undecodable_json" and h0[DLQ_ERROR].startswith(b"value is not JSON")
        assert (
            h0[DLQ_ORIGIN_TOPIC] == q.topic.encode()
            and h0[DLQ_ORIGIN_PARTITION] == b"0"
            and h0[DLQ_ORIGIN_OFFSET] == b"1"
        )
        assert h1[DLQ_ERROR_CODE] == b"invalid_sampling" and b"sampling.top_p" in h1[DLQ_ERROR]
        assert h1[DLQ_ORIGIN_OFFSET] == b"2"
    finally:
        q.close()


def test_pause_and_resume(kafka_settings: Settings):
    q = KafkaQueue(kafka_settings.model_copy(update={"jobs_partitions": 2}))
    try:
        q.publish([JobRequest(id="warm", prompt="x", prefix_key="warm")])
        with q.consumer() as c:
            drain(c, 1)  # joined the group, both partitions assigned
            assert c.assignment() == {0, 1}
            c.pause()
            assert c.paused() == {0, 1}
            q.publish(JobRequest(id=f"p{i}", prompt="x", prefix_key=f"key{i}") for i in range(20))
            assert quiet(c, 1.5) == []
            c.resume()
            got = drain(c, 20, timeout_s=10)
            assert sorted(m.job.id for m in got) == sorted(f"p{i}" for i in range(20))
            one = got[0].partition
            c.pause([one])
            assert c.paused() == {one}
            q.publish(JobRequest(id=f"q{i}", prompt="x", prefix_key=f"key{i}") for i in range(20))
            more = drain(c, sum(1 for m in got if m.partition != one), timeout_s=10)
            assert {m.partition for m in more} == {1 - one}
            c.resume([one])
            rest = drain(c, 20 - len(more), timeout_s=10)
            assert {m.partition for m in rest} == {one}
    finally:
        q.close()


def test_rebalance_commits_finished_work_of_revoked_partitions(kafka_settings: Settings):
    q = KafkaQueue(kafka_settings.model_copy(update={"jobs_partitions": 2}))
    try:
        q.publish(JobRequest(id=f"b{i}", prompt="x", prefix_key=f"k{i}") for i in range(40))
        a = q.consumer()
        got = drain(a, 40)
        assert a.assignment() == {0, 1}
        a.commit(got)  # all done and committed
        q.publish(JobRequest(id=f"c{i}", prompt="x", prefix_key=f"k{i}") for i in range(40))
        second = drain(a, 40)
        # done: every other message of each partition, starting with its first, so that whichever
        # partition is revoked has finished work to commit
        first = {p: min(m.offset for m in second if m.partition == p) for p in (0, 1)}
        done = [m for m in second if (m.offset - first[m.partition]) % 2 == 0]
        for m in done:
            a._tracker.done(m.partition, m.offset)  # finished, but not yet committed when the rebalance comes

        b = q.consumer()
        deadline = time.monotonic() + 30
        while not (
            len(a.assignment()) == 1
            and len(b.assignment()) == 1
            and a.assignment() | b.assignment() == {0, 1}
        ):
            assert time.monotonic() < deadline, "the group did not rebalance"
            a.poll(timeout_s=0.1)
            b.poll(timeout_s=0.1)
        # a gave up a partition: on revocation it committed up to that partition's lowest in-flight offset
        lost = ({0, 1} - a.assignment()).pop()
        lowest = min(m.offset for m in second if m.partition == lost and m not in done)
        tp = TopicPartition(q.topic, lost)
        check = KafkaConsumer(**kafka_settings.kafka_client_config, group_id=kafka_settings.consumer_group)
        assert check.committed(tp) == lowest
        check.close()
        assert lost not in a.in_flight()  # in-flight tracking of the revoked partition is gone
        b.close()
        a.close()
    finally:
        q.close()


def test_messages_fetched_and_not_handed_out_survive_a_rebalance(kafka_settings: Settings):
    """The consumer holds fetched messages to hand them out round-robin. A rebalance drops them
    (a partition may go to another member); a partition that comes back to this member is read
    again from the first dropped message (kafka-python's kept position is past them). Every job
    of the topic reaches one of the two members: none is skipped."""
    q = KafkaQueue(kafka_settings.model_copy(update={"jobs_partitions": 4}))
    try:
        q.publish(JobRequest(id=f"r{i}", prompt="x", prefix_key=f"k{i}") for i in range(400))
        a = q.consumer()
        got: set[str] = set()
        # poll a few at a time until a holds more than it handed out
        deadline = time.monotonic() + 30
        while a._buffered == 0:
            assert time.monotonic() < deadline, "the consumer never held fetched messages"
            got |= {m.job.id for m in a.poll(timeout_s=0.2, max_messages=4)}
        assert a._buffered > 0 and len(got) < 400
        b = q.consumer()
        deadline = time.monotonic() + 60
        while not (len(a.assignment()) == 2 and len(b.assignment()) == 2):  # one job a poll meanwhile
            assert time.monotonic() < deadline, "the group did not rebalance"
            for c in (a, b):
                batch = c.poll(timeout_s=0.1, max_messages=1)
                got |= {m.job.id for m in batch}
                c.commit(batch)
        assert len(got) < 400, "everything was handed out before the rebalance: nothing tested"
        deadline = time.monotonic() + 60
        while len(got) < 400:
            assert time.monotonic() < deadline, f"{400 - len(got)} jobs never came"
            for c in (a, b):
                batch = c.poll(timeout_s=0.1, max_messages=64)
                got |= {m.job.id for m in batch}
                c.commit(batch)
        b.close()
        a.close()
    finally:
        q.close()
