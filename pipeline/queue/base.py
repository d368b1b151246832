"""The JobQueue interface: publish jobs; consume them in batches; commit what is done."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from pipeline.queue.offsets import OffsetTracker
from schemas.job import JobRequest, describe_validation_error, error_code_for

log = logging.getLogger(__name__)

# Headers of a dead-letter message (its value and key are the original message's).
DLQ_ERROR = "firsttoken-error"  # what was wrong, naming the field and rule
DLQ_ERROR_CODE = "firsttoken-error-code"  # an ErrorCode value, or "undecodable_json"
DLQ_ORIGIN_TOPIC = "firsttoken-origin-topic"
DLQ_ORIGIN_PARTITION = "firsttoken-origin-partition"
DLQ_ORIGIN_OFFSET = "firsttoken-origin-offset"


def routing_key(job: JobRequest, prefix_chars: int = 256) -> bytes:
    """The message key of a job: its prefix_key, or a hash of the first `prefix_chars` characters
    of its prompt (or chat turns), so jobs sharing a prefix land on one partition."""
    if job.prefix_key is not None:
        return job.prefix_key.encode("utf-8")
    head = job.prefix_text()[:prefix_chars].encode("utf-8")
    return b"p:" + hashlib.blake2b(head, digest_size=12).hexdigest().encode("ascii")


def encode_job(job: JobRequest) -> bytes:
    """A job as a message value (JSON)."""
    return job.model_dump_json(exclude_none=True).encode("utf-8")


@dataclass(frozen=True)
class Message:
    """One consumed job message: where it came from and the job it holds."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    job: JobRequest
    timestamp_ms: int | None = None


@dataclass(frozen=True)
class RawMessage:
    """A message as fetched, before parsing."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int | None = None


@dataclass(frozen=True)
class PoisonReport:
    """Why a message went to the dead-letter topic."""

    code: str
    error: str


def parse_message(raw: RawMessage) -> JobRequest | PoisonReport:
    """The JobRequest a message holds, or why it holds none."""
    if raw.value is None:
        return PoisonReport("invalid_request", "message has no value")
    try:
        return JobRequest.model_validate_json(raw.value)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if len(errors) == 1 and errors[0]["type"] == "json_invalid" and "surrogate" not in errors[0]["msg"]:
            return PoisonReport("undecodable_json", f"value is not JSON: {errors[0]['msg']}")
        return PoisonReport(error_code_for(exc).value, describe_validation_error(exc))


class JobConsumer(ABC):
    """A member of a consumer group: fetches job messages in batches and commits the done ones.

    `poll` hands out parsed jobs; messages that are not valid jobs go to the dead-letter topic
    and count as done at once. `commit(done)` commits, per partition, up to the lowest offset
    still in flight (see OffsetTracker); `commit_async(done)` does the same without waiting for
    the broker. poll and commit may be called from different threads.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._tracker = OffsetTracker()
        self._closed = False
        # when the asynchronous commit in flight was sent (None: none is); one whose answer never
        # comes (a client rebuilt under it) stops blocking the next after async_commit_timeout_s
        self._async_commit_sent_at: float | None = None
        self.async_commit_timeout_s = 30.0
        self.commit_error: str | None = None  # why the last asynchronous commit failed
        self.dead_lettered = 0
        # Fetched messages not handed out yet, per partition: `poll` hands them out round-robin,
        # one partition's message after another's, so that one partition's backlog (a client's
        # fetch can hold all of it, drained partition by partition) never keeps the others
        # waiting behind it. At most `buffer_messages` are held; paused partitions are skipped.
        self._buffers: dict[int, deque[RawMessage]] = {}
        self._handed_next: dict[int, int] = {}  # per partition, one past the last offset handed out
        self._buffered = 0
        self._rr = 0
        self.buffer_messages = 8192
        # A partition whose delivered span (highest offset handed out - lowest still in flight)
        # reaches this is skipped until its lowest job is done: the committed offset never
        # trails the written results by more than this (None: no bound).
        self.max_span: int | None = None

    # --- what implementations provide ---

    @abstractmethod
    def _fetch(self, timeout_s: float, max_messages: int) -> list[RawMessage]:
        """Fetch up to max_messages raw messages from the assigned, unpaused partitions."""

    @abstractmethod
    def _commit_offsets(self, offsets: dict[int, int]) -> None:
        """Commit offsets (next offset to read, per partition) for the group, synchronously."""

    @abstractmethod
    def _dead_letter(self, raw: RawMessage, report: PoisonReport) -> None:
        """Send a poison message to the dead-letter topic (durable before the next commit)."""

    @abstractmethod
    def _flush_dead_letters(self) -> None:
        """Wait until every dead letter sent so far is durable."""

    @abstractmethod
    def pause(self, partitions: Iterable[int] | None = None) -> None:
        """Stop fetching from these partitions (all assigned ones when None); polling goes on."""

    @abstractmethod
    def resume(self, partitions: Iterable[int] | None = None) -> None:
        """Fetch again from these partitions (all when None)."""

    @abstractmethod
    def paused(self) -> set[int]:
        """Partitions currently paused."""

    @abstractmethod
    def assignment(self) -> set[int]:
        """Partitions currently assigned to this consumer."""

    @abstractmethod
    def _close_client(self) -> None:
        """Release the underlying client."""

    # --- the shared behaviour ---

    def _fill(self, timeout_s: float, *, wait: bool = False) -> None:
        """Fetch into the buffers, up to their bound (with `wait`, block for the timeout even
        when they are full)."""
        room = self.buffer_messages - self._buffered
        if room <= 0 and not wait:
            return
        for raw in self._fetch(timeout_s, max(1, room)):
            self._buffers.setdefault(raw.partition, deque()).append(raw)
            self._buffered += 1

    def _drop_buffered(self, partitions: Iterable[int] | None = None) -> None:
        """Forget fetched messages not handed out (partitions revoked, or a new client): their
        next owner (or the new client) reads them again from the committed offset."""
        for p in list(self._buffers) if partitions is None else partitions:
            self._buffered -= len(self._buffers.pop(p, ()))

    def _take_round_robin(self, max_messages: int) -> list[RawMessage]:
        """Up to max_messages buffered messages, one partition's after another's, in offset order
        within each; paused partitions and those at their span bound are left."""
        skip = self.paused()
        if self.max_span is not None:
            skip |= self._tracker.spans_at_least(self.max_span)
        parts = [p for p, b in self._buffers.items() if b and p not in skip]
        out: list[RawMessage] = []
        if not parts:
            return out
        parts.sort()
        start = self._rr % len(parts)
        parts = parts[start:] + parts[:start]
        self._rr += 1
        while len(out) < max_messages and parts:
            for p in list(parts):
                b = self._buffers[p]
                out.append(b.popleft())
                if not b or len(out) >= max_messages:
                    parts.remove(p)
                    if len(out) >= max_messages:
                        break
        self._buffered -= len(out)
        return out

    def poll(self, timeout_s: float = 0.1, max_messages: int = 256) -> list[Message]:
        """The next batch of jobs (possibly empty after `timeout_s`), taken round-robin from the
        partitions' fetched messages."""
        with self._lock:
            if self._closed:
                raise RuntimeError("consumer is closed")
            ready = self._buffered > 0
            self._fill(0.0 if ready else timeout_s)
            raws = self._take_round_robin(max_messages)
            if not raws and ready:
                # what is held cannot go now (paused, or at its span bound): wait in the client
                # for the timeout as an empty poll would, instead of spinning on the held messages
                self._fill(timeout_s, wait=True)
                raws = self._take_round_robin(max_messages)
            out: list[Message] = []
            for raw in raws:
                self._tracker.delivered(raw.partition, raw.offset)
                if raw.offset >= self._handed_next.get(raw.partition, 0):
                    self._handed_next[raw.partition] = raw.offset + 1
                parsed = parse_message(raw)
                if isinstance(parsed, PoisonReport):
                    log.warning(
                        "dead-lettering %s[%d]@%d: %s (%s)",
                        raw.topic,
                        raw.partition,
                        raw.offset,
                        parsed.code,
                        parsed.error,
                    )
                    self._dead_letter(raw, parsed)
                    self.dead_lettered += 1
                    self._tracker.done(raw.partition, raw.offset)
                    continue
                out.append(
                    Message(
                        raw.topic,
                        raw.partition,
                        raw.offset,
                        raw.key,
                        raw.value or b"",
                        parsed,
                        raw.timestamp_ms,
                    )
                )
            return out

    def dead_letter(self, messages: Iterable[Message], code: str, error: str) -> None:
        """Copy messages to the dead-letter topic with why (durable when this returns). They stay
        in flight: the caller marks them done (commit) once it has recorded their outcome."""
        with self._lock:
            for m in messages:
                raw = RawMessage(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp_ms)
                self._dead_letter(raw, PoisonReport(code, error))
                self.dead_lettered += 1
            self._flush_dead_letters()

    def batches(self, timeout_s: float = 0.1, max_messages: int = 256) -> Iterator[list[Message]]:
        """Poll forever (until closed), yielding each batch, empty ones included, so that the
        caller can do its other work between polls."""
        while not self._closed:
            yield self.poll(timeout_s, max_messages)

    def commit(self, done: Iterable[Message] = ()) -> dict[int, int]:
        """Mark messages done and commit, per partition, up to the lowest offset still in flight.

        Returns the offsets committed now (partition -> next offset to read). Messages of
        partitions no longer assigned are ignored: their new owner will re-deliver them.
        """
        with self._lock:
            for m in done:
                self._tracker.done(m.partition, m.offset)
            return self._commit_tracked(None)

    def commit_async(self, done: Iterable[Message] = ()) -> dict[int, int]:
        """`commit` without waiting for the broker: marks messages done and sends the commit of
        what is committable now; returns those offsets. A failed commit is retried by the next
        call (see `commit_error`); while one is in flight a call only marks messages done."""
        with self._lock:
            for m in done:
                self._tracker.done(m.partition, m.offset)
            sent = self._async_commit_sent_at
            if sent is not None and time.monotonic() - sent < self.async_commit_timeout_s:
                return {}
            offsets = self._tracker.committable(None)
            if not offsets:
                return {}
            self._flush_dead_letters()
            self._async_commit_sent_at = time.monotonic()
            try:
                self._commit_offsets_async(offsets, self._async_commit_done)
            except BaseException:
                self._async_commit_sent_at = None
                raise
            return offsets

    def _async_commit_done(self, offsets: dict[int, int], error: BaseException | None) -> None:
        with self._lock:
            self._async_commit_sent_at = None
            if error is None:
                self._tracker.committed(offsets)
                if self.commit_error is not None:
                    log.info("offset commits work again")
                self.commit_error = None
                return
            if self.commit_error is None:
                log.warning("offset commit failed (%s); the next commit retries", error)
            self.commit_error = f"{type(error).__name__}: {error}"

    def _commit_offsets_async(
        self, offsets: dict[int, int], on_done: Callable[[dict[int, int], BaseException | None], None]
    ) -> None:
        """Send a commit of `offsets` and call on_done(offsets, error or None) when it completes
        (on a thread that calls poll). Default: a synchronous commit."""
        try:
            self._commit_offsets(offsets)
        except Exception as exc:
            on_done(offsets, exc)
        else:
            on_done(offsets, None)

    def _commit_tracked(self, partitions: set[int] | None) -> dict[int, int]:
        offsets = self._tracker.committable(partitions)
        if not offsets:
            return {}
        self._flush_dead_letters()
        self._commit_offsets(offsets)
        self._tracker.committed(offsets)
        return offsets

    def in_flight(self) -> dict[int, int]:
        """Number of jobs handed out and not yet done, per partition."""
        with self._lock:
            return self._tracker.in_flight()

    def close(self, *, commit: bool = True) -> None:
        """Commit what is done (unless commit=False) and leave the group."""
        with self._lock:
            if self._closed:
                return
            try:
                if commit:
                    self._commit_tracked(None)
            finally:
                self._closed = True
                self._close_client()

    def __enter__(self) -> JobConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JobQueue(ABC):
    """Where producers put jobs and workers take them from: Kafka, or in-process for the embedded mode."""

    @abstractmethod
    def publish(self, jobs: Iterable[JobRequest]) -> list[JobRequest]:
        """Put jobs on the queue, durably (returns when every one is acknowledged).

        Jobs without `submitted_at` get the current time. Returns the jobs as published.
        """

    @abstractmethod
    def consumer(self, group: str | None = None) -> JobConsumer:
        """A new member of the consumer group `group` (the settings' group when None)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release producer resources."""

    @staticmethod
    def _stamp(jobs: Iterable[JobRequest]) -> Sequence[JobRequest]:
        now = time.time()
        return [j.submitted(now) for j in jobs]
