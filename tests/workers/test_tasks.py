"""Control-plane tasks run eagerly (no broker): a batch ingest that meets an unreachable Kafka is
retried, and gives up after max_retries with the error; a missing file is not retried."""

from __future__ import annotations

import pytest
from kafka.errors import KafkaTimeoutError

import workers.tasks as tasks


class FlakyProducer:
    calls = 0

    def __init__(self, queue, store):
        pass

    def submit_file(self, path, batch_id=None, default_max_tokens=None):
        FlakyProducer.calls += 1
        if FlakyProducer.calls <= FlakyProducer.failures:
            raise KafkaTimeoutError("Kafka is down")
        if not str(path).endswith(".jsonl"):
            raise FileNotFoundError(path)
        from pipeline.producer import SubmitSummary

        return SubmitSummary(batch_id or "b", 3, 1, 0.1)


@pytest.fixture
def eager(monkeypatch):
    import pipeline.producer

    monkeypatch.setattr(pipeline.producer, "Producer", FlakyProducer)
    monkeypatch.setattr(tasks, "_queue", lambda: None)
    monkeypatch.setattr(tasks, "_store", lambda: None)
    scheduled = []
    monkeypatch.setattr(tasks.finalize_batch, "apply_async", lambda *a, **k: scheduled.append(a))
    FlakyProducer.calls = 0
    return scheduled


def test_ingest_is_retried_while_kafka_is_unreachable(eager):
    FlakyProducer.failures = 2
    result = tasks.ingest_batch.apply(args=["batch.jsonl"], kwargs={"batch_id": "B"})
    assert result.successful(), result.traceback
    assert result.result == {"batch_id": "B", "submitted": 3, "invalid": 1}
    assert FlakyProducer.calls == 3 and eager == [(("B",),)]


def test_ingest_gives_up_after_max_retries(eager):
    FlakyProducer.failures = 100
    result = tasks.ingest_batch.apply(args=["batch.jsonl"])
    assert result.failed() and isinstance(result.result, KafkaTimeoutError)
    assert FlakyProducer.calls == tasks.ingest_batch.max_retries + 1 and eager == []


def test_a_missing_file_is_not_retried(eager):
    FlakyProducer.failures = 0
    result = tasks.ingest_batch.apply(args=["missing.txt"])
    assert result.failed() and isinstance(result.result, FileNotFoundError)
    assert FlakyProducer.calls == 1
