"""Control-plane tasks run eagerly (no broker): a batch ingest that meets an unreachable Kafka is
retried, and gives up after max_retries with the error; a missing file is not retried. Batch
finalization on the SQLite store: completed, already completed, cancelled, missing; re-checks
backing off from the settings' interval to their cap; giving up on a batch past the give-up age.
Finalize and cancel go on retrying while the database is unreachable (a real refused connection).
The `cancel_jobs` remote-control arguments as `celery control` parses them."""

from __future__ import annotations

import logging
import time

import pytest
from kafka.errors import KafkaTimeoutError
from pydantic import ValidationError

import workers.tasks as tasks
from pipeline.settings import Settings, get_settings
from pipeline.store import ResultStore
from schemas.job import ErrorCode, JobRequest, JobResult
from schemas.sampling import SamplingParams


class FlakyProducer:
    calls = 0

    def __init__(self, queue, store):
        pass

    def submit_file(self, path, batch_id=None, default_max_tokens=None, owner=None, check=None):
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
    monkeypatch.setattr(tasks.finalize_batch, "apply_async", lambda *a, **k: scheduled.append((a, k)))
    FlakyProducer.calls = 0
    return scheduled


def test_ingest_is_retried_while_kafka_is_unreachable(eager):
    FlakyProducer.failures = 2
    result = tasks.ingest_batch.apply(args=["batch.jsonl"], kwargs={"batch_id": "B"})
    assert result.successful(), result.traceback
    assert result.result == {"batch_id": "B", "submitted": 3, "invalid": 1}
    assert FlakyProducer.calls == 3
    assert eager == [((("B",),), {"countdown": get_settings().finalize_every_s})]


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


def test_ingest_schedules_finalize_after_the_settings_interval(eager, settings_env):
    settings_env(FIRSTTOKEN_FINALIZE_EVERY_S="2.5")
    FlakyProducer.failures = 0
    assert tasks.ingest_batch.apply(args=["batch.jsonl"], kwargs={"batch_id": "B"}).successful()
    assert eager == [((("B",),), {"countdown": 2.5})]
    kwargs = {"batch_id": "C", "finalize_after_s": 4}
    assert tasks.ingest_batch.apply(args=["batch.jsonl"], kwargs=kwargs).successful()
    assert eager[1] == ((("C",),), {"countdown": 4})


# --- finalize_batch ---------------------------------------------------------------------------------


@pytest.fixture
def settings_env(monkeypatch):
    """Set FIRSTTOKEN_* variables for the process's settings (rebuilt now and after the test)."""

    def set_env(**env: str) -> None:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        get_settings.cache_clear()

    get_settings.cache_clear()
    yield set_env
    get_settings.cache_clear()


class Rechecks:
    """The waits of the re-checks finalize_batch schedules; `then(n, f)` calls f when it schedules
    the n-th."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self._hooks: dict[int, object] = {}

    def then(self, n: int, f) -> None:
        self._hooks[n] = f

    def scheduled(self, countdown: float) -> None:
        self.waits.append(countdown)
        hook = self._hooks.pop(len(self.waits), None)
        if hook is not None:
            hook()


@pytest.fixture
def rechecks(monkeypatch, store) -> Rechecks:
    """finalize_batch on the SQLite store, its re-checks recorded (run at once: eager)."""
    monkeypatch.setattr(tasks, "_store", lambda: store)
    rec = Rechecks()
    retry = tasks.finalize_batch.retry

    def recorded_retry(**kw):
        rec.scheduled(kw["countdown"])
        return retry(**kw)

    monkeypatch.setattr(tasks.finalize_batch, "retry", recorded_retry)
    return rec


def add_batch(store: ResultStore, batch_id: str, n: int) -> list[str]:
    """An open batch of n queued jobs; their ids."""
    store.create_batch(batch_id, total_jobs=n)
    sp = SamplingParams(max_tokens=4)
    ids = [f"{batch_id}-{i}" for i in range(n)]
    store.insert_queued([JobRequest(id=jid, prompt="p", batch_id=batch_id, sampling=sp) for jid in ids])
    return ids


def finish(store: ResultStore, batch_id: str, ids: list[str]) -> None:
    """Terminal rows for these jobs."""
    store.upsert_results(
        [JobResult.failure(jid, ErrorCode.INVALID_SAMPLING, "bad", batch_id=batch_id) for jid in ids]
    )


def finalize(batch_id: str, **kw) -> dict:
    r = tasks.finalize_batch.apply(args=[batch_id], kwargs=kw)
    assert r.successful(), r.traceback
    return r.result


def test_finalize_completes_a_done_batch_once(store, rechecks):
    finish(store, "B", add_batch(store, "B", 3))
    assert finalize("B") == {"batch_id": "B", "outcome": "completed", "status": "completed"}
    assert store.get_batch("B").status == "completed"
    assert finalize("B") == {"batch_id": "B", "outcome": "already_completed", "status": "completed"}
    assert rechecks.waits == []


def test_finalize_leaves_a_cancelled_batch_and_says_so(store, rechecks):
    add_batch(store, "B", 2)
    assert store.cancel(batch_id="B") == 2
    assert finalize("B") == {"batch_id": "B", "outcome": "ended", "status": "cancelled"}
    assert store.get_batch("B").status == "cancelled" and rechecks.waits == []


def test_finalize_of_a_missing_batch(rechecks):
    assert finalize("nope") == {"batch_id": "nope", "outcome": "missing", "status": None}
    assert rechecks.waits == []


def test_finalize_rechecks_backing_off_to_the_cap(store, rechecks, settings_env):
    settings_env(FIRSTTOKEN_FINALIZE_EVERY_S="3", FIRSTTOKEN_FINALIZE_MAX_EVERY_S="20")
    ids = add_batch(store, "B", 2)
    finish(store, "B", ids[:1])
    rechecks.then(6, lambda: finish(store, "B", ids[1:]))  # the last job ends during the 6th wait
    assert finalize("B") == {"batch_id": "B", "outcome": "completed", "status": "completed"}
    assert rechecks.waits == [3, 6, 12, 20, 20, 20]

    # values given to the task win over the settings
    ids = add_batch(store, "C", 1)
    rechecks.waits.clear()
    rechecks.then(3, lambda: finish(store, "C", ids))
    assert finalize("C", every_s=1, max_every_s=1.5)["outcome"] == "completed"
    assert rechecks.waits == [1, 1.5, 1.5]


def test_recheck_delay_stays_at_the_cap_however_many_checks():
    assert [tasks.recheck_delay(n, 10, 60) for n in range(5)] == [10, 20, 40, 60, 60]
    assert tasks.recheck_delay(100_000, 10, 60) == 60


def test_finalize_gives_up_on_a_batch_open_past_the_give_up_age(store, rechecks, settings_env, caplog):
    settings_env(FIRSTTOKEN_FINALIZE_GIVE_UP_S="3600")
    two_hours_ago = ResultStore(store.engine, clock=lambda: time.time() - 7200)
    old = add_batch(two_hours_ago, "OLD", 3)
    finish(store, "OLD", old[:1])
    with caplog.at_level(logging.WARNING, logger="workers.tasks"):
        assert finalize("OLD") == {"batch_id": "OLD", "outcome": "gave_up", "status": "open"}
    assert rechecks.waits == [] and store.get_batch("OLD").status == "open"
    assert any("OLD" in r.getMessage() and "1 of 3 jobs done" in r.getMessage() for r in caplog.records)

    # a younger batch is checked again
    young = add_batch(store, "YOUNG", 1)
    rechecks.then(1, lambda: finish(store, "YOUNG", young))
    assert finalize("YOUNG")["outcome"] == "completed" and rechecks.waits == [10]
    # one given up on completes when finalized again after its jobs ended
    finish(store, "OLD", old[1:])
    assert finalize("OLD")["outcome"] == "completed"


def test_the_finalize_settings_are_validated():
    with pytest.raises(ValidationError, match="finalize_max_every_s"):
        Settings(finalize_every_s=30, finalize_max_every_s=10)
    with pytest.raises(ValidationError):
        Settings(finalize_give_up_s=0)


# --- the database unreachable ----------------------------------------------------------------------


@pytest.fixture
def store_down_then_up(monkeypatch, store):
    """`tasks._store()` gives a store on a Postgres port nobody listens on (a real connection error)
    for its first `down_for` calls, then the SQLite store."""
    down = ResultStore.from_url("postgresql+psycopg://firsttoken@127.0.0.1:9/firsttoken")
    calls = {"n": 0, "down_for": 2}

    def current() -> ResultStore:
        calls["n"] += 1
        return down if calls["n"] <= calls["down_for"] else store

    monkeypatch.setattr(tasks, "_store", current)
    yield calls
    down.close()


def test_finalize_keeps_checking_while_the_database_is_unreachable(store, rechecks, store_down_then_up):
    finish(store, "B", add_batch(store, "B", 2))
    assert finalize("B", every_s=1, max_every_s=4) == {"batch_id": "B", "outcome": "completed", "status": "completed"}
    assert store_down_then_up["n"] == 3 and rechecks.waits == [1, 2]


def test_cancel_is_retried_while_the_database_is_unreachable(store, store_down_then_up, monkeypatch):
    told = []
    monkeypatch.setattr(tasks, "broadcast_cancel", lambda ids, batch: told.append((list(ids), batch)))
    add_batch(store, "B", 3)
    r = tasks.cancel.apply(kwargs={"batch_id": "B"})
    assert r.successful(), r.traceback
    assert r.result == 3 and store_down_then_up["n"] == 3
    assert told == [([], "B")]  # the workers are told once, after the rows are cancelled
    assert store.get_batch("B").status == "cancelled"

    store_down_then_up["n"], store_down_then_up["down_for"] = 0, 100
    r = tasks.cancel.apply(kwargs={"job_ids": ["x"]})
    assert r.failed() and store_down_then_up["n"] == tasks.cancel.max_retries + 1


# --- remote control from the command line -----------------------------------------------------------


def test_cancel_jobs_arguments_as_celery_control_parses_them():
    # `celery control cancel_jobs ARGS...` applies each declared argument type to the text given
    from celery.bin.control import _compile_arguments

    assert _compile_arguments("cancel_jobs", ["job-1,job-2"]) == {"job_ids": ["job-1", "job-2"]}
    assert _compile_arguments("cancel_jobs", ['["job-1", "b,c"]']) == {"job_ids": ["job-1", "b,c"]}
    assert _compile_arguments("cancel_jobs", ["", "B7"]) == {"job_ids": [], "batch_id": "B7"}
    with pytest.raises(ValueError, match="job_ids"):
        _compile_arguments("cancel_jobs", ['["a", 3]'])
