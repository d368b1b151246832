"""Every use of kafka-python's private internals, in one module, for the one version they were
written against (KAFKA_PYTHON_VERSION, pinned exactly in pyproject.toml; importing this module
with another version installed fails with a clear error instead of misbehaving later).

- Eager writes: kafka-python 3's `KafkaTCPTransport.write` only queues the bytes and schedules a
  task; the task waits for the socket to be writable, one event-loop turn, and sends on the next:
  ~0.5 ms from a request being built to its bytes leaving (measured on the 2-core machine,
  produce requests of one job, bench/results/pipeline-2026-11-30-run4.md). Here `write` first
  tries a non-blocking `send` when nothing is queued before it, as asyncio's selector transports
  do; what the socket does not take goes the original way. `write` runs on the thread that drives
  the client's event loop (the producer's sender thread, the consumer's IO thread), so no other
  send can be under way. TLS transports are left as they are.
- Prebuilt record batches (pipeline/queue/kafka_batches.py encodes them): a DefaultRecordBatchBuilder
  given its records' bytes, wrapped as a ProducerBatch and appended to the producer's accumulator.
- The consumer's event loop on the polling thread (no IO thread), its heartbeat's clock, and the
  commit coroutine a rebalance listener awaits inside that loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import kafka
from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import IllegalStateError
from kafka.net.compat import KafkaNetClient
from kafka.net.selector import NetworkSelector
from kafka.net.transport import KafkaTCPTransport
from kafka.producer.producer_batch import FinalState, ProducerBatch
from kafka.record.default_records import DefaultRecordBatchBuilder
from kafka.record.memory_records import MemoryRecordsBuilder
from kafka.structs import OffsetAndMetadata, TopicPartition

KAFKA_PYTHON_VERSION = "3.0.12"


def check_version(installed: str | None = None) -> None:
    """Raise unless the installed kafka-python is the version this module was written for."""
    installed = kafka.__version__ if installed is None else installed
    if installed != KAFKA_PYTHON_VERSION:
        raise RuntimeError(
            f"kafka-python {installed} is installed, but firsttoken's Kafka client reaches into "
            f"kafka-python {KAFKA_PYTHON_VERSION}'s internals (pipeline/queue/kafka_internals.py): "
            f"install kafka-python=={KAFKA_PYTHON_VERSION} (pyproject.toml pins it)"
        )


check_version()

_lock = threading.Lock()
_original_write: Any = None


def _eager_write(self: KafkaTCPTransport, data: Any) -> None:
    if (
        type(self) is KafkaTCPTransport
        and data
        and not self._writing
        and not self._write_buffer
        and self._write
        and not self._closed
        and self._sock is not None
    ):
        try:
            sent = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            sent = 0  # the queued path reports the error as it always did
        if sent:
            self.last_write = time.monotonic()
        if sent == len(data):
            return
        data = memoryview(data)[sent:]
    _original_write(self, data)


def install_eager_writes() -> None:
    """Make every plain-TCP kafka-python transport in this process write eagerly (idempotent)."""
    global _original_write
    with _lock:
        if _original_write is None:
            _original_write = KafkaTCPTransport.write
            KafkaTCPTransport.write = _eager_write  # type: ignore[method-assign]


def eager_writes_installed() -> bool:
    """True once install_eager_writes ran."""
    return _original_write is not None


# --- prebuilt record batches -----------------------------------------------------------------------


class _PrebuiltBatchBuilder(DefaultRecordBatchBuilder):
    """A DefaultRecordBatchBuilder whose records were encoded beforehand (kafka_batches.encode_records)."""

    def set_records(self, body: bytes, count: int, timestamp_ms: int) -> None:
        self._first_timestamp = timestamp_ms
        self._max_timestamp = timestamp_ms
        self._num_records = count
        self._last_offset = count - 1
        self._buffer.extend(body)


def prebuilt_batch(
    tp: TopicPartition, body: bytes, count: int, *, magic: int, compression_attrs: int, batch_size: int,
    timestamp_ms: int, now: float | None = None,
) -> ProducerBatch:
    """A closed-to-appends ProducerBatch of `count` records already encoded in `body`: the sender
    stamps its producer id, epoch and base sequence when it drains it."""
    records = MemoryRecordsBuilder(magic, compression_attrs, batch_size)
    builder = _PrebuiltBatchBuilder(
        magic=magic,
        compression_type=compression_attrs,
        is_transactional=False,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=batch_size,
    )
    builder.set_records(body, count, timestamp_ms)
    records._builder = builder
    records._next_offset = count
    return ProducerBatch(tp, records, now=now)


def record_format(producer: KafkaProducer) -> int:
    """The record format version (magic) the producer writes."""
    return producer._accumulator.config["message_version"]


def append_batches(producer: KafkaProducer, batches: Sequence[ProducerBatch]) -> None:
    """Queue complete batches in the producer's accumulator, behind what each partition already
    holds, and wake its sender. (A later `send` to one of these partitions may append to the last
    batch: its builder is a DefaultRecordBatchBuilder in a consistent state.)"""
    if producer._transaction_manager is not None and producer._transaction_manager.is_transactional():
        raise ValueError("prebuilt batches are for idempotent, non-transactional producers")
    acc = producer._accumulator
    if acc._closed:
        raise IllegalStateError("RecordAccumulator is closed")
    acc._appends_in_progress.increment()
    try:
        for batch in batches:
            tp = batch.topic_partition
            with acc._tp_lock(tp):
                acc._batches[tp].append(batch)
                acc._incomplete.add(batch)
    finally:
        acc._appends_in_progress.decrement()
    producer._sender.wakeup()


def batch_succeeded(batch: ProducerBatch) -> bool:
    """True when the broker acknowledged the batch."""
    return batch.final_state is FinalState.SUCCEEDED


def batch_error(batch: ProducerBatch) -> Exception:
    """Why a completed batch failed (the exception its records would carry)."""
    if not batch.produce_future.is_done:
        return TimeoutError(f"batch for {batch.topic_partition} was not acknowledged")
    _offset, _ts, record_exceptions_fn = batch.produce_future.value
    if record_exceptions_fn is not None:
        return record_exceptions_fn(0)
    return RuntimeError(f"batch for {batch.topic_partition} ended {batch.final_state}")


# --- the consumer ------------------------------------------------------------------------------------


class _PollingThreadSelector(NetworkSelector):
    """kafka-python's event loop, driven by the thread that calls poll() instead of an IO thread.

    kafka-python 3 runs every consumer's loop on an IO thread of its own: each poll() hands its
    wait to that thread and sleeps on an Event (three such round trips a poll), and a fetch
    response is decoded there, then handed to the polling thread, which must win the GIL back
    from it. Without the IO thread (`start` does nothing) `NetworkSelector.run` drives the loop
    on the calling thread, as kafka-python did before 3.0 and as the Java consumer does. The
    consumer is then single-threaded, which KafkaJobConsumer already is (every call under its
    lock). Heartbeats, commits' answers and rebalance callbacks run inside poll() or a blocking
    call; the intake polls at least every 20 ms.
    """

    def start(self) -> None:
        pass


def polling_thread_client(**configs: Any) -> KafkaNetClient:
    """A `kafka_client` for KafkaConsumer: its usual client over the loop above (no IO thread)."""
    return KafkaNetClient(net=_PollingThreadSelector(**configs), **configs)


def membership(consumer: KafkaConsumer) -> str:
    """The client's place in its group as it holds it, for a log line: its generation and whether it still has
    a member id (a client that lost it rejoins as a new member: a rebalance then waits for the old member's
    session to expire, unless static membership names it)."""
    gen = getattr(getattr(consumer, "_coordinator", None), "_generation", None)
    if gen is None:
        return "no coordinator"
    kept = bool(getattr(gen, "member_id", ""))
    return f"generation {getattr(gen, 'generation_id', '?')}, member id {'kept' if kept else 'lost'}"


def heartbeat_clock(consumer: KafkaConsumer) -> float | None:
    """When the consumer's group coordinator last answered a heartbeat (or its heartbeat was
    reset: a join), on the monotonic clock; None before it has a coordinator."""
    hb = getattr(getattr(consumer, "_coordinator", None), "heartbeat", None)
    return None if hb is None else max(hb.last_receive, hb.last_reset)


async def commit_in_loop(consumer: KafkaConsumer, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
    """The coroutine behind KafkaConsumer.commit(), for a rebalance listener to await inside the
    event loop (where the blocking commit() is refused)."""
    await consumer._coordinator._commit_offsets_sync_async(offsets)
