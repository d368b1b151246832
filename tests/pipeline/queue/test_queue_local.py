"""LocalQueue and the offset tracker: keyed partitions, lowest-in-flight commits, redelivery, DLQ."""

from __future__ import annotations

import threading

from pipeline.queue import (
    DLQ_ERROR,
    DLQ_ERROR_CODE,
    DLQ_ORIGIN_OFFSET,
    DLQ_ORIGIN_PARTITION,
    LocalQueue,
    OffsetTracker,
    routing_key,
)
from schemas.job import JobRequest


def jobs(n: int, prefix: str = "j", **kw) -> list[JobRequest]:
    return [JobRequest(id=f"{prefix}{i}", prompt=f"prompt {prefix} {i}", **kw) for i in range(n)]


def test_tracker_commits_up_to_lowest_in_flight():
    t = OffsetTracker()
    for off in range(5):
        t.delivered(0, off)
    assert t.committable() == {}  # nothing done: offset 0, where reading started, is the lowest in flight
    t.done(0, 1)
    t.done(0, 2)
    assert t.committable() == {}  # 0 still in flight holds everything
    t.done(0, 0)
    assert t.committable() == {0: 3}
    t.committed({0: 3})
    assert t.committable() == {}
    t.done(0, 4)
    assert t.committable() == {}  # 3 still in flight
    t.done(0, 3)
    assert t.committable() == {0: 5}  # nothing in flight: one past the highest delivered
    assert not t.done(0, 3)  # twice: ignored
    assert not t.done(9, 0)  # unknown partition
    t.revoke(0)
    assert t.committable() == {} and t.partitions() == set()


def test_tracker_gaps_and_partitions():
    t = OffsetTracker()
    t.delivered(1, 10)
    t.delivered(1, 14)  # gap (compaction, transaction markers)
    t.delivered(2, 0)
    t.done(1, 10)
    assert t.committable() == {1: 14}
    t.done(2, 0)
    assert t.committable({2}) == {2: 1}
    assert t.in_flight() == {1: 1, 2: 0}


def test_same_prefix_key_same_partition():
    q = LocalQueue(partitions=8)
    shared = [JobRequest(id=f"s{i}", prompt=f"p{i}", prefix_key="system-A") for i in range(20)]
    derived = [JobRequest(id=f"d{i}", prompt="same long preamble " * 20 + f"question {i}") for i in range(20)]
    q.publish(shared + derived)
    c = q.consumer()
    got = c.poll(timeout_s=0.5, max_messages=100)
    assert len(got) == 40
    assert len({m.partition for m in got if m.job.id.startswith("s")}) == 1
    assert len({m.partition for m in got if m.job.id.startswith("d")}) == 1
    assert len({routing_key(j) for j in derived}) == 1
    assert routing_key(shared[0]) == b"system-A"
    assert all(m.job.submitted_at is not None for m in got)


def test_commit_lowest_in_flight_and_redelivery_after_restart():
    q = LocalQueue(partitions=1)
    q.publish(jobs(6))
    c = q.consumer("g")
    batch = c.poll(max_messages=10)
    assert [m.offset for m in batch] == list(range(6))
    # finish 0, 1, 3, 4: commit stops at 2 (lowest in flight)
    assert c.commit([batch[i] for i in (0, 1, 3, 4)]) == {0: 2}
    assert q.committed("g") == {0: 2}
    assert c.in_flight() == {0: 2}
    c.close()
    # a new member of the group (the worker restarted) gets 2.. again; 0 and 1 never come back
    c2 = q.consumer("g")
    again = c2.poll(max_messages=10)
    assert [m.offset for m in again] == [2, 3, 4, 5]
    assert c2.commit(again) == {0: 6}
    c2.close()
    assert q.consumer("g").poll(timeout_s=0.05) == []
    # another group reads everything from the start
    assert len(q.consumer("other").poll(max_messages=10)) == 6


def test_poison_messages_go_to_dlq_and_count_as_done():
    q = LocalQueue(partitions=1)
    q.publish(jobs(1, "a"))
    q.publish_raw(
        [
            (b"k", b"{not json"),
            (b"k", b'{"id": "x", "prompt": "p", "sampling": {"max_tokens": -1}}'),
            (b"k", None),
        ]
    )
    q.publish(jobs(1, "b"))
    c = q.consumer()
    got = c.poll(max_messages=10)
    assert [m.job.id for m in got] == ["a0", "b0"]
    assert c.dead_lettered == 3
    assert [d.headers[DLQ_ERROR_CODE] for d in q.dead_letters] == [
        b"undecodable_json",
        b"invalid_sampling",
        b"invalid_request",
    ]
    assert b"sampling.max_tokens" in q.dead_letters[1].headers[DLQ_ERROR]
    assert [d.headers[DLQ_ORIGIN_OFFSET] for d in q.dead_letters] == [b"1", b"2", b"3"]
    assert q.dead_letters[0].headers[DLQ_ORIGIN_PARTITION] == b"0" and q.dead_letters[0].value == b"{not json"
    # with a0 still in flight nothing can be committed; once it is done, all 5 are
    assert c.commit([]) == {}
    assert c.commit([got[0]]) == {0: 4}
    assert c.commit([got[1]]) == {0: 5}


def test_pause_resume():
    q = LocalQueue(partitions=2)
    a = JobRequest(id="a", prompt="x", prefix_key="ka")
    pa = q.partition_for(b"ka")
    other = next(k for k in (f"k{i}" for i in range(100)) if q.partition_for(k.encode()) != pa)
    b = JobRequest(id="b", prompt="x", prefix_key=other)
    c = q.consumer()
    c.pause([pa])
    assert c.paused() == {pa}
    q.publish([a, b])
    assert [m.job.id for m in c.poll(max_messages=10)] == ["b"]
    assert c.poll(timeout_s=0.05) == []
    c.resume()
    assert [m.job.id for m in c.poll(max_messages=10)] == ["a"]
    c.pause()
    q.publish([JobRequest(id="c", prompt="x", prefix_key="ka")])
    assert c.poll(timeout_s=0.05) == []
    c.resume([pa])
    assert [m.job.id for m in c.poll()] == ["c"]


def test_poll_wakes_when_a_producer_publishes():
    q = LocalQueue(partitions=1)
    c = q.consumer()
    timer = threading.Timer(0.05, lambda: q.publish(jobs(1)))
    timer.start()
    got = c.poll(timeout_s=5.0)
    timer.join()
    assert [m.job.id for m in got] == ["j0"]


def test_commit_from_another_thread():
    q = LocalQueue(partitions=2)
    q.publish(jobs(50))
    c = q.consumer()
    seen = []
    while len(seen) < 50:
        seen += c.poll(max_messages=7)
    t = threading.Thread(target=c.commit, args=(seen,))
    t.start()
    t.join()
    assert sum(q.committed().values()) == 50
    assert c.in_flight() == {0: 0, 1: 0}


def test_commit_async_retries_a_failed_commit_and_sends_one_at_a_time():
    from pipeline.queue.local import LocalConsumer

    class Deferred(LocalConsumer):
        """Commits complete when the test says so (as kafka-python's callbacks come later)."""

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.sent: list[tuple[dict[int, int], object]] = []

        def _commit_offsets_async(self, offsets, on_done) -> None:
            self.sent.append((dict(offsets), on_done))

    q = LocalQueue(partitions=1)
    q.publish(jobs(4))
    c = Deferred(q, "g")
    got = c.poll(0.5)
    assert c.commit_async(got[:2]) == {0: 2}
    assert c.commit_async() == {}  # one in flight: nothing more is sent
    offsets, on_done = c.sent[-1]
    on_done(offsets, ConnectionError("coordinator moved"))
    assert c.commit_error is not None and "coordinator moved" in c.commit_error
    assert c.commit_async() == {0: 2}  # the failed commit again
    offsets, on_done = c.sent[-1]
    on_done(offsets, None)
    assert c.commit_error is None
    assert c.commit_async() == {}  # committed: nothing to send
    assert c.commit_async(got[2:]) == {0: 4}
    assert len(c.sent) == 3


def test_commit_async_is_commit_for_the_local_queue():
    q = LocalQueue(partitions=2)
    q.publish(jobs(6))
    c = q.consumer("g")
    got = c.poll(0.5)
    assert c.commit_async(got) == q.end_offsets()
    assert q.committed("g") == q.end_offsets()


def _on(q: LocalQueue, p: int, n: int, prefix: str) -> list[JobRequest]:
    """n jobs whose routing key lands on partition p."""
    out, i = [], 0
    while len(out) < n:
        key = f"{prefix}-{i}"
        if q.partition_for(key.encode()) == p:
            out.append(JobRequest(id=f"{prefix}{len(out)}", prompt="x", prefix_key=key))
        i += 1
    return out


def test_poll_hands_out_the_partitions_round_robin():
    """One partition's backlog never keeps the others waiting behind it: a poll takes one
    partition's message after another's (in offset order within each)."""
    q = LocalQueue(partitions=3)
    for p, prefix in ((0, "a"), (1, "b"), (2, "c")):
        q.publish(_on(q, p, 300, prefix))
    c = q.consumer()
    got = c.poll(0.1, max_messages=30)
    assert len(got) == 30
    per = {p: [m.offset for m in got if m.partition == p] for p in range(3)}
    assert {p: len(v) for p, v in per.items()} == {0: 10, 1: 10, 2: 10}
    assert all(v == sorted(v) for v in per.values())
    assert len({m.partition for m in got[:3]}) == 3  # interleaved, not 10 then 10 then 10
    # the rest keeps coming in turn, and nothing is lost or repeated
    seen = [(m.partition, m.offset) for m in got]
    while len(seen) < 900:
        batch = c.poll(0.1, max_messages=256)
        assert batch
        seen.extend((m.partition, m.offset) for m in batch)
    assert sorted(seen) == sorted((p, o) for p in range(3) for o in range(300))


def test_a_partition_pinned_by_one_job_is_held_at_its_span_bound():
    """The committed offset never trails the done jobs by more than max_span per partition: a
    partition whose lowest job is still running gets no more jobs handed out past the bound."""
    q = LocalQueue(partitions=2)
    q.publish(_on(q, 0, 50, "a") + _on(q, 1, 50, "b"))
    c = q.consumer()
    c.max_span = 8
    first = c.poll(0.1, max_messages=16)
    pinned = next(m for m in first if m.partition == 0)
    c.commit([m for m in first if m is not pinned])
    later = []
    for _ in range(10):
        later += c.poll(0.1, max_messages=16)
        c.commit([m for m in later])
    p0 = [m.offset for m in first + later if m.partition == 0]
    assert max(p0) - pinned.offset + 1 == 8  # handed out up to the bound, then held
    assert sorted(m.offset for m in first + later if m.partition == 1) == list(range(50))
    assert q.committed().get(0, 0) == pinned.offset
    c.commit([pinned])  # the pinning job is done: the partition flows again
    rest = c.poll(0.1, max_messages=64)
    assert [m.partition for m in rest] and {m.partition for m in rest} == {0}
