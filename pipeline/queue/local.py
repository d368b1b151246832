"""LocalQueue: an in-process stand-in for Kafka, for the embedded mode and unit tests.

Same semantics as KafkaQueue where they matter: keyed partitions, an append-only log per
partition, committed offsets per consumer group (a new consumer of a group resumes from them,
so what was not committed is delivered again), pause/resume, and a dead-letter log.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from pipeline.queue.base import (
    DLQ_ERROR,
    DLQ_ERROR_CODE,
    DLQ_ORIGIN_OFFSET,
    DLQ_ORIGIN_PARTITION,
    DLQ_ORIGIN_TOPIC,
    JobConsumer,
    JobQueue,
    PoisonReport,
    RawMessage,
    encode_job,
    routing_key,
)
from schemas.job import JobRequest


@dataclass(frozen=True)
class DeadLetter:
    """A message on the local dead-letter log."""

    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]


class LocalQueue(JobQueue):
    """A thread-safe in-process queue with `partitions` partitions. One consumer per group at a
    time holds every partition (the embedded mode runs one engine)."""

    def __init__(
        self,
        partitions: int = 4,
        *,
        topic: str = "firsttoken.jobs",
        prefix_chars: int = 256,
        group: str = "local",
    ) -> None:
        if partitions < 1:
            raise ValueError("partitions must be >= 1")
        self.topic = topic
        self.prefix_chars = prefix_chars
        self.default_group = group
        self._logs: list[list[tuple[bytes | None, bytes | None, int]]] = [[] for _ in range(partitions)]
        self._committed: dict[str, dict[int, int]] = {}
        self.dead_letters: list[DeadLetter] = []
        self._cond = threading.Condition()

    @property
    def partitions(self) -> int:
        """Number of partitions."""
        return len(self._logs)

    def partition_for(self, key: bytes | None) -> int:
        """The partition a key maps to (crc32 modulo partitions; keyless messages go to 0)."""
        return 0 if key is None else zlib.crc32(key) % len(self._logs)

    def publish(self, jobs: Iterable[JobRequest]) -> list[JobRequest]:
        """Append jobs to their key's partition."""
        stamped = list(self._stamp(jobs))
        records = [(routing_key(j, self.prefix_chars), encode_job(j)) for j in stamped]
        self.publish_raw(records)
        return stamped

    def publish_raw(self, records: Iterable[tuple[bytes | None, bytes | None]]) -> None:
        """Append raw (key, value) messages, e.g. to test how consumers treat bad ones."""
        now_ms = int(time.time() * 1000)
        with self._cond:
            for key, value in records:
                self._logs[self.partition_for(key)].append((key, value, now_ms))
            self._cond.notify_all()

    def end_offsets(self) -> dict[int, int]:
        """Per partition, the offset the next message will get."""
        with self._cond:
            return {p: len(log) for p, log in enumerate(self._logs)}

    def committed(self, group: str | None = None) -> dict[int, int]:
        """The group's committed offsets."""
        with self._cond:
            return dict(self._committed.get(group or self.default_group, {}))

    def consumer(self, group: str | None = None) -> LocalConsumer:
        """A consumer of `group` holding every partition, starting at the group's committed offsets."""
        return LocalConsumer(self, group or self.default_group)


class LocalConsumer(JobConsumer):
    """The consumer side of LocalQueue."""

    def __init__(self, queue: LocalQueue, group: str) -> None:
        super().__init__()
        self._queue = queue
        self.group = group
        committed = queue.committed(group)
        self._position = {p: committed.get(p, 0) for p in range(queue.partitions)}
        for p in range(queue.partitions):
            self._tracker.assign(p, committed.get(p))
        self._paused: set[int] = set()
        self._rr = 0  # round-robin start partition, so one busy partition cannot starve the others

    def _available(self) -> bool:
        return any(
            p not in self._paused and self._position[p] < len(log) for p, log in enumerate(self._queue._logs)
        )

    def _fetch(self, timeout_s: float, max_messages: int) -> list[RawMessage]:
        q = self._queue
        out: list[RawMessage] = []
        with q._cond:
            if not self._available():
                q._cond.wait_for(self._available, timeout=timeout_s)
            n = q.partitions
            for i in range(n):
                p = (self._rr + i) % n
                if p in self._paused:
                    continue
                log = q._logs[p]
                while self._position[p] < len(log) and len(out) < max_messages:
                    off = self._position[p]
                    key, value, ts = log[off]
                    out.append(RawMessage(q.topic, p, off, key, value, ts))
                    self._position[p] = off + 1
            self._rr = (self._rr + 1) % n
        return out

    def _commit_offsets(self, offsets: dict[int, int]) -> None:
        with self._queue._cond:
            group = self._queue._committed.setdefault(self.group, {})
            for p, off in offsets.items():
                group[p] = max(off, group.get(p, 0))

    def _dead_letter(self, raw: RawMessage, report: PoisonReport) -> None:
        headers = {
            DLQ_ERROR: report.error.encode("utf-8"),
            DLQ_ERROR_CODE: report.code.encode("utf-8"),
            DLQ_ORIGIN_TOPIC: raw.topic.encode("utf-8"),
            DLQ_ORIGIN_PARTITION: str(raw.partition).encode("ascii"),
            DLQ_ORIGIN_OFFSET: str(raw.offset).encode("ascii"),
        }
        with self._queue._cond:
            self._queue.dead_letters.append(DeadLetter(raw.key, raw.value, headers))

    def _flush_dead_letters(self) -> None:
        return None

    def pause(self, partitions: Iterable[int] | None = None) -> None:
        with self._queue._cond:
            self._paused |= set(range(self._queue.partitions) if partitions is None else partitions)

    def resume(self, partitions: Iterable[int] | None = None) -> None:
        with self._queue._cond:
            self._paused -= set(range(self._queue.partitions) if partitions is None else partitions)
            self._queue._cond.notify_all()

    def paused(self) -> set[int]:
        return set(self._paused)

    def assignment(self) -> set[int]:
        return set(range(self._queue.partitions))

    def _close_client(self) -> None:
        return None
