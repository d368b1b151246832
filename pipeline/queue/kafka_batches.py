"""Whole record batches for a bulk publish through kafka-python's own producer.

`KafkaProducer.send` costs ~80 us a record on the 2-core machine (a record future, the partitioner's
pure-Python murmur2, the accumulator append, a sender wake-up per new batch): a 100k-line
submission spent 8-10 s there. Here the same records are partitioned with a vectorised murmur2
(bit for bit the partitioner's, so a key lands where `send` would put it), encoded per partition
into record-batch v2 bodies in one pass, and handed to the producer's accumulator as complete
`ProducerBatch`es (pipeline/queue/kafka_internals.py: what reaches into kafka-python's
internals). Everything after that is kafka-python's: the sender drains them, stamps the
idempotent producer id, epoch and sequence numbers, retries, and completes each batch on the
broker's acknowledgement (acks=all).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from kafka.producer.producer_batch import ProducerBatch
from kafka.record.default_records import DefaultRecordBatchBuilder
from kafka.record.util import encode_varint
from kafka.structs import TopicPartition

from pipeline.queue.kafka_internals import prebuilt_batch

_SEED = 0x9747B28C
_M = np.uint32(0x5BD1E995)


def murmur2(keys: Sequence[bytes]) -> np.ndarray:
    """Kafka's murmur2 of each key (the Java client's and kafka-python's), as uint32: keys of one
    length are hashed together, four bytes a column."""
    out = np.empty(len(keys), dtype=np.uint32)
    by_len: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        by_len.setdefault(len(k), []).append(i)
    with np.errstate(over="ignore"):
        for length, idx in by_len.items():
            data = np.frombuffer(b"".join(keys[i] for i in idx), dtype=np.uint8).reshape(len(idx), length)
            h = np.full(len(idx), (_SEED ^ length) & 0xFFFFFFFF, dtype=np.uint32)
            n4 = length // 4
            if n4:
                words = data[:, : n4 * 4].copy().view("<u4")  # [n, n4] little-endian words
                for j in range(n4):
                    k = words[:, j] * _M
                    k ^= k >> np.uint32(24)
                    k *= _M
                    h *= _M
                    h ^= k
            tail = length % 4
            base = n4 * 4
            if tail >= 3:
                h ^= data[:, base + 2].astype(np.uint32) << np.uint32(16)
            if tail >= 2:
                h ^= data[:, base + 1].astype(np.uint32) << np.uint32(8)
            if tail >= 1:
                h ^= data[:, base].astype(np.uint32)
                h *= _M
            h ^= h >> np.uint32(13)
            h *= _M
            h ^= h >> np.uint32(15)
            out[idx] = h
    return out


def partitions_for(keys: Sequence[bytes], num_partitions: int) -> np.ndarray:
    """The partition of each key, as kafka-python's DefaultPartitioner picks it:
    (murmur2(key) & 0x7fffffff) % num_partitions."""
    return (murmur2(keys) & np.uint32(0x7FFFFFFF)) % np.uint32(num_partitions)


class _Varints:
    """Zig-zag varints (the record format's) of small non-negative ints, cached as bytes."""

    def __init__(self) -> None:
        self._cache: list[bytes] = []

    def table(self, upto: int) -> list[bytes]:
        cache = self._cache
        for v in range(len(cache), upto + 1):
            buf = bytearray()
            encode_varint(v, buf.append)
            cache.append(bytes(buf))
        return cache


_VARINTS = _Varints()


def encode_records(keys: Sequence[bytes], values: Sequence[bytes]) -> bytes:
    """The records of one v2 record batch, in order, every one with timestamp delta 0, offset
    delta = its index, no headers: the bytes DefaultRecordBatchBuilder.append writes."""
    longest = max(max(map(len, keys), default=0), max(map(len, values), default=0), len(keys))
    # a record's body is at most 1 + 1 + 3 varints + key + value + 1 bytes
    v = _VARINTS.table(max(longest * 2 + 32, 128))
    parts: list[bytes] = []
    add = parts.append
    for i, (k, val) in enumerate(zip(keys, values, strict=True)):
        off = v[i]
        klen = v[len(k)]
        vlen = v[len(val)]
        body_len = 2 + len(off) + len(klen) + len(k) + len(vlen) + len(val) + 1
        add(v[body_len])
        add(b"\x00\x00")  # attributes, timestamp delta 0
        add(off)
        add(klen)
        add(k)
        add(vlen)
        add(val)
        add(b"\x00")  # no headers
    return b"".join(parts)


BATCH_HEADER_BYTES = DefaultRecordBatchBuilder.HEADER_STRUCT.size


def record_size(key: bytes, value: bytes) -> int:
    """An upper bound of one record's encoded size (for splitting a partition into batches)."""
    return len(key) + len(value) + DefaultRecordBatchBuilder.MAX_RECORD_OVERHEAD + 1


def make_batch(
    tp: TopicPartition,
    keys: Sequence[bytes],
    values: Sequence[bytes],
    *,
    magic: int,
    compression_attrs: int,
    batch_size: int,
    timestamp_ms: int | None = None,
    now: float | None = None,
) -> ProducerBatch:
    """One closed-to-appends ProducerBatch holding these records (in order), ready for the
    accumulator: the sender stamps its producer id, epoch and base sequence when it drains it."""
    if not keys:
        raise ValueError("a batch needs at least one record")
    if magic < 2:
        raise ValueError("prebuilt batches need the v2 record format (Kafka >= 0.11)")
    ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    return prebuilt_batch(tp, encode_records(keys, values), len(keys), magic=magic,
                          compression_attrs=compression_attrs, batch_size=batch_size, timestamp_ms=ts, now=now)
