"""Prebuilt record batches (pipeline.queue.kafka_batches) against kafka-python's own partitioner
and record builder: same partitions, byte-identical batches, readable records."""

from __future__ import annotations

import random
import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka.partitioner.default import murmur2 as kafka_murmur2
    from kafka.record.default_records import DefaultRecordBatchBuilder
    from kafka.record.memory_records import MemoryRecords
    from kafka.structs import TopicPartition

from pipeline.queue.kafka_batches import encode_records, make_batch, murmur2, partitions_for, record_size


def _keys(n: int, seed: int = 0) -> list[bytes]:
    rnd = random.Random(seed)
    # every tail length (0-3 bytes past a word), empty keys, long keys, derived-key shapes
    return [rnd.randbytes(rnd.randint(0, 70)) for _ in range(n)] + [
        b"p:" + rnd.randbytes(12).hex().encode() for _ in range(50)
    ]


def test_murmur2_is_kafka_pythons():
    keys = _keys(2000)
    assert [int(h) for h in murmur2(keys)] == [kafka_murmur2(k) & 0xFFFFFFFF for k in keys]


@pytest.mark.parametrize("n", [1, 3, 8, 13])
def test_partitions_are_the_default_partitioners(n: int):
    keys = _keys(500, seed=n)
    expected = [(kafka_murmur2(k) & 0x7FFFFFFF) % n for k in keys]
    assert partitions_for(keys, n).tolist() == expected


def _reference_batch(keys: list[bytes], values: list[bytes], ts: int) -> bytes:
    b = DefaultRecordBatchBuilder(
        magic=2, compression_type=0, is_transactional=False, producer_id=7, producer_epoch=1,
        base_sequence=42, batch_size=1 << 24,
    )
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        assert b.append(i, ts, k, v, []) is not None
    return bytes(b.build())


@pytest.mark.parametrize("n", [1, 2, 70, 300])
def test_prebuilt_batch_is_byte_identical(n: int):
    rnd = random.Random(n)
    keys = [rnd.randbytes(rnd.choice([0, 5, 26, 200])) for _ in range(n)]
    # values across the 1/2/3-byte varint lengths, offsets past 63 (two-byte zig-zag varints)
    values = [rnd.randbytes(rnd.choice([0, 1, 60, 64, 100, 8200, 20000])) for _ in range(n)]
    ts = 1_764_000_000_123
    batch = make_batch(TopicPartition("t", 0), keys, values, magic=2, compression_attrs=0,
                       batch_size=1 << 20, timestamp_ms=ts)
    assert batch.record_count == n
    batch.records.set_producer_state(7, 1, 42, False)  # what the sender does when it drains it
    batch.records.close()
    assert bytes(batch.records.buffer()) == _reference_batch(keys, values, ts)
    (read,) = list(MemoryRecords(bytes(batch.records.buffer())))
    records = list(read)
    assert [(r.offset, r.key or b"", r.value or b"") for r in records] == [
        (i, k, v) for i, (k, v) in enumerate(zip(keys, values, strict=True))
    ]
    assert read.producer_id == 7 and read.base_sequence == 42


def test_record_size_bounds_the_encoding():
    rnd = random.Random(1)
    keys = [rnd.randbytes(rnd.randint(0, 300)) for _ in range(200)]
    values = [rnd.randbytes(rnd.randint(0, 30000)) for _ in range(200)]
    assert len(encode_records(keys, values)) <= sum(record_size(k, v) for k, v in zip(keys, values))
