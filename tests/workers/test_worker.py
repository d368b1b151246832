"""The worker loop on LocalQueue + SQLite: timings, failures, duplicates, commit-after-durable,
drain on SIGTERM, cancellation, back-pressure."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pipeline.queue import DLQ_ERROR_CODE, encode_job, routing_key
from schemas.job import ChatMessage, ErrorCode, JobRequest, JobStatus
from schemas.sampling import SamplingParams
from tests.workers.conftest import all_committed, jobs, make_engine_tiny, wait_until
from workers.sink import SinkConfig
from workers.wiring import run_until_signalled
from workers.worker import Worker, WorkerConfig


@pytest.fixture(scope="module")
def engine():
    return make_engine_tiny()


def start_worker(engine, queue, store, **cfg) -> Worker:
    sink = cfg.pop("sink", SinkConfig(backoff_initial_s=0.02, backoff_max_s=0.1))
    return Worker(
        engine, queue.consumer(), store, WorkerConfig(name="w-test", sink=sink, **cfg), model_name="tiny"
    ).start()


def run_all(engine, queue, store, batch, **cfg) -> Worker:
    w = start_worker(engine, queue, store, **cfg)
    try:
        queue.publish(batch)
        wait_until(lambda: all_committed(queue), what="every offset committed")
    finally:
        w.stop()
    return w


def test_every_timing_filled_and_consistent(engine, queue, store):
    run_all(engine, queue, store, jobs(12))
    rows = store.get_jobs([f"j{i}" for i in range(12)])
    assert len(rows) == 12
    for r in rows.values():
        t = r.timings
        assert r.status is JobStatus.SUCCEEDED and r.usage.completion_tokens == 4
        assert r.worker == "w-test" and r.model == "tiny" and r.prompt is not None
        for name, value in t.model_dump().items():
            assert value is not None, name
        assert t.submitted_at <= t.admitted_at <= t.first_token_at <= t.finished_at
        assert t.ttft_ms == pytest.approx((t.first_token_at - t.submitted_at) * 1e3, abs=1e-3)
        assert t.admitted_at <= t.scheduled_at <= t.first_token_at
        # nothing held back here: the wait is the engine's queue, the rest of the way the pipeline's
        assert t.queue_ms == pytest.approx((t.scheduled_at - t.admitted_at) * 1e3, abs=1e-3)
        assert t.overhead_ms == pytest.approx((t.admitted_at - t.submitted_at) * 1e3, abs=1e-3)
        assert t.ttft_ms == pytest.approx(t.overhead_ms + t.queue_ms + (t.first_token_at - t.scheduled_at) * 1e3, abs=1e-2)
        assert t.e2e_ms == pytest.approx((t.finished_at - t.submitted_at) * 1e3, abs=1e-3)
        assert t.engine_ttft_ms == pytest.approx((t.first_token_at - t.admitted_at) * 1e3, abs=1e-2)
        assert t.prefill_ms <= t.engine_ttft_ms + 1e-6 and t.ttft_ms >= t.engine_ttft_ms - 1e-6
        assert t.tpot_ms == pytest.approx((t.finished_at - t.first_token_at) * 1e3 / 3, rel=1e-3)


def test_invalid_jobs_become_failed_rows_and_poison_goes_to_the_dlq(engine, queue, store):
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    bad = [
        JobRequest(id="long", prompt="x" * 5000, sampling=sp),
        JobRequest(id="ctx", prompt="short", sampling=SamplingParams(max_tokens=100_000)),
        JobRequest(id="ok", prompt="fine", sampling=sp),
    ]
    w = start_worker(engine, queue, store)
    try:
        queue.publish(bad)
        queue.publish_raw(
            [(b"k", b"{not json"), (b"k", b'{"id": "s", "prompt": "p", "sampling": {"top_p": 2}}')]
        )
        wait_until(lambda: all_committed(queue), what="every offset committed")
    finally:
        w.stop()
    rows = store.get_jobs(["long", "ctx", "ok", "s"])
    assert rows["long"].status is JobStatus.FAILED and rows["long"].error_code is ErrorCode.PROMPT_TOO_LONG
    assert rows["ctx"].error_code is ErrorCode.PROMPT_TOO_LONG and "max_tokens" in rows["ctx"].error_message
    assert rows["long"].timings.submitted_at is not None and rows["long"].worker == "w-test"
    assert rows["ok"].status is JobStatus.SUCCEEDED
    assert "s" not in rows  # not a valid job: dead-lettered with its error, no row
    codes = sorted(d.headers[DLQ_ERROR_CODE].decode() for d in queue.dead_letters)
    assert codes == ["invalid_sampling", "undecodable_json"]
    assert w.counters.failed == 2


def test_same_message_twice_gives_one_row(engine, queue, store):
    job = jobs(1, "dup")[0].submitted(1.0e9)
    raw = (routing_key(job), encode_job(job))
    w = start_worker(engine, queue, store)
    try:
        queue.publish_raw([raw, raw])
        wait_until(lambda: all_committed(queue), what="both committed")
        queue.publish_raw([raw])  # and once more after it is terminal
        wait_until(lambda: all_committed(queue), what="third committed")
    finally:
        w.stop()
    assert [r.id for r in store.list_jobs()] == ["dup0"]


class FlakyStore:
    """A ResultStore whose upsert fails while `down` is set."""

    def __init__(self, store):
        self._store = store
        self.down = threading.Event()
        self.failures = 0

    def upsert_results(self, results, requests=None):
        if self.down.is_set():
            self.failures += 1
            raise ConnectionError("database is down")
        return self._store.upsert_results(results, requests)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_offsets_are_committed_only_after_the_rows_are_durable(engine, queue, store):
    flaky = FlakyStore(store)
    flaky.down.set()
    w = start_worker(engine, queue, flaky)
    try:
        queue.publish(jobs(6, "f"))
        wait_until(
            lambda: w.counters.succeeded == 6 and flaky.failures >= 2, what="jobs done, writes failing"
        )
        # no result is durable (the jobs were admitted: running, one delivery each) and nothing committed
        assert queue.committed() == {} and [r.status for r in store.list_jobs()] == [JobStatus.RUNNING] * 6
        assert not w.sink.store_ok and w.sink.buffered == 6
        flaky.down.clear()
        wait_until(lambda: all_committed(queue), what="commit after recovery")
    finally:
        w.stop()
    assert len(store.list_jobs()) == 6 and w.sink.store_ok


def test_full_sink_buffer_pauses_intake(engine, queue, store):
    flaky = FlakyStore(store)
    flaky.down.set()
    w = start_worker(
        engine,
        queue,
        flaky,
        sink=SinkConfig(max_buffer=3, backoff_initial_s=0.02, backoff_max_s=0.05),
        max_poll_messages=2,
        max_waiting=2,
    )
    try:
        queue.publish(jobs(20, "b"))
        wait_until(lambda: w.sink.full and w.intake.paused, what="intake paused on a full sink")
        taken = w.intake.delivered
        threading.Event().wait(0.3)
        assert w.intake.delivered == taken < 20  # nothing more taken while the store is down
        flaky.down.clear()
        wait_until(lambda: all_committed(queue), what="everything after recovery")
    finally:
        w.stop()
    assert len(store.list_jobs()) == 20


def test_engine_backlog_pauses_intake(engine, queue, store):
    w = run_all(engine, queue, store, jobs(40, "p", max_tokens=16), max_waiting=4, max_poll_messages=8)
    rows = store.list_jobs(limit=100)
    assert w.intake.pauses >= 1 and len(rows) == 40
    # a job that sat in the queue while the worker held off: that wait is queue time, not overhead
    late = max(rows, key=lambda r: r.timings.admitted_at - r.timings.submitted_at)
    t = late.timings
    transit_ms = (t.admitted_at - t.submitted_at) * 1e3
    assert transit_ms > 50 and t.overhead_ms < 0.5 * transit_ms and t.queue_ms > 0.5 * transit_ms, t
    for r in rows:
        t = r.timings
        assert t.ttft_ms == pytest.approx(t.overhead_ms + t.queue_ms + (t.first_token_at - t.scheduled_at) * 1e3, abs=0.05)


def test_drain_hands_back_unfinished_jobs_uncommitted(engine, queue, store):
    long = jobs(4, "slow", max_tokens=400)
    w = start_worker(engine, queue, store)
    queue.publish(jobs(3, "quick"))
    wait_until(lambda: all_committed(queue), what="quick jobs")
    queue.publish(long)
    wait_until(lambda: len(w._inflight) == 4, what="slow jobs admitted")
    w.stop(drain=True, timeout_s=0.0)  # the deadline has passed at once: hand them back
    assert w.counters.handed_back == 4
    assert {r.id for r in store.list_jobs() if r.status.terminal} == {"quick0", "quick1", "quick2"}
    # the handed-back ones are queued again, that delivery not counted against them
    assert {(r.id, r.deliveries) for r in store.list_jobs(status=JobStatus.QUEUED)} == {(f"slow{i}", 0) for i in range(4)}
    assert not all_committed(queue)
    # a new member of the group gets them again and finishes them
    w2 = start_worker(engine, queue, store)
    try:
        wait_until(lambda: all_committed(queue), timeout_s=120, what="redelivered slow jobs")
    finally:
        w2.stop()
    rows = store.list_jobs()
    assert len(rows) == 7 and all(r.status is JobStatus.SUCCEEDED for r in rows)


def test_celery_cold_shutdown_hands_running_jobs_back_at_once(engine, queue, store, monkeypatch):
    """The bootstep's `terminate` (Celery's cold shutdown, SIGQUIT) stops the worker without the
    drain a warm stop would do (60 s here): running jobs get no result and stay uncommitted."""
    from workers import bootstep

    w = start_worker(engine, queue, store, drain_timeout_s=60)
    monkeypatch.setitem(bootstep._current, "worker", w)
    queue.publish(jobs(3, "quick"))
    wait_until(lambda: all_committed(queue), what="quick jobs")
    queue.publish(jobs(4, "slow", max_tokens=1500))
    wait_until(lambda: len(w._inflight) == 4, what="slow jobs admitted")
    t0 = time.monotonic()
    try:
        bootstep.GPUWorkerStep(None).terminate(None)
        took = time.monotonic() - t0
    finally:
        w.stop(drain=False, timeout_s=0.0)  # nothing to do once terminate stopped it
    assert bootstep.current_worker() is None and not w.intake._thread.is_alive()
    assert w.counters.handed_back == 4 and took < 10, (w.counters, took)
    assert {r.id for r in store.list_jobs() if r.status.terminal} == {"quick0", "quick1", "quick2"}
    assert {r.id for r in store.list_jobs(status=JobStatus.QUEUED)} == {f"slow{i}" for i in range(4)}
    assert not all_committed(queue)


def test_sigterm_drains_in_flight_jobs(engine, queue, store):
    queue.publish(jobs(5, "t", max_tokens=200))
    w = Worker(
        engine, queue.consumer(), store, WorkerConfig(name="w-sig", drain_timeout_s=60), model_name="tiny"
    )
    threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    old = signal.getsignal(signal.SIGTERM)
    try:
        assert run_until_signalled(w) == 0
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    rows = store.list_jobs()
    # whatever was admitted finished (drained) and was committed; the rest stays for redelivery
    assert all(r.status is JobStatus.SUCCEEDED and r.usage.completion_tokens == 200 for r in rows)
    assert sum(queue.committed().values()) == len(rows) == w.counters.succeeded
    assert w.counters.handed_back == 0


def test_cancel_running_job_and_later_batch_jobs(engine, queue, store):
    w = start_worker(engine, queue, store)
    try:
        queue.publish(jobs(1, "c", max_tokens=1500))
        wait_until(
            lambda: "c0" in w._inflight and w._inflight["c0"].first_token_mono is not None, what="job running"
        )
        w.cancel(["c0"])
        w.cancel(batch_id="B")
        queue.publish(jobs(3, "cb", batch_id="B") + jobs(2, "other"))
        wait_until(lambda: all_committed(queue), what="all committed")
    finally:
        w.stop()
    rows = {r.id: r for r in store.list_jobs()}
    c0 = rows["c0"]
    assert c0.status is JobStatus.CANCELLED and c0.error_code is ErrorCode.CANCELLED
    assert 0 < c0.usage.completion_tokens < 1500 and c0.timings.first_token_at is not None
    assert all(rows[f"cb{i}"].status is JobStatus.CANCELLED for i in range(3))
    assert all(rows[f"other{i}"].status is JobStatus.SUCCEEDED for i in range(2))


def test_chat_messages_are_rendered(engine, queue, store):
    job = JobRequest(
        id="chat",
        messages=[ChatMessage(role="user", content="hi")],
        sampling=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    )
    run_all(engine, queue, store, [job])
    row = store.get_job("chat")
    assert row.status is JobStatus.SUCCEEDED and row.usage.prompt_tokens > 2


def test_paused_between_counts_the_overlap_with_each_pause():
    from workers.intake import Intake

    intake = Intake(consumer=None, deliver=lambda m: None)  # type: ignore[arg-type]
    intake._pause_log.extend([[10.0, 12.0], [15.0, 16.0], [20.0, None]])  # the last pause still open
    assert intake.paused_between(0.0, 9.0) == 0.0
    assert intake.paused_between(11.0, 15.5) == pytest.approx(1.0 + 0.5)
    assert intake.paused_between(0.0, 30.0) == pytest.approx(2.0 + 1.0 + 10.0)
    assert intake.paused_between(16.0, 21.0) == pytest.approx(1.0)


class AcceleratorError(RuntimeError):
    """What torch raises once a kernel has broken the device context: the engine cannot go on."""


def engine_killed_by(poison: str):
    """A tiny engine whose steps lose the device context whenever they compute `poison`."""
    eng = make_engine_tiny()
    real = eng.runner.execute

    def execute(out, prev=None, guide=None):
        if any(e.request.request_id == poison for e in out.scheduled):
            raise AcceleratorError("CUDA error: an illegal memory access was encountered")
        return real(out, prev, guide)

    eng.runner.execute = execute
    return eng


def test_a_job_that_keeps_killing_workers_is_failed_and_dead_lettered_after_max_deliveries(queue, store):
    """Each worker that runs the poison job stops (its engine is lost); its messages are delivered
    again to the next. The jobs beside it die with it twice; delivered twice without a result,
    each runs alone (one such job at a time), so the third death counts against the poison job
    only. Its fourth delivery fails it with engine_error and copies its message to the
    dead-letter topic; every other job succeeds."""
    good = jobs(6, "good")
    bad = jobs(1, "poison", max_tokens=8)[0]
    queue.publish([*good[:3], bad, *good[3:]])
    stopped = 0
    for _ in range(6):
        w = start_worker(engine_killed_by("poison0"), queue, store, max_deliveries=3)
        try:
            wait_until(lambda w=w: w.failed_with is not None or all_committed(queue), timeout_s=60,
                       what="the worker to die or finish")
        finally:
            w.stop(drain=False)
        if w.failed_with is None:
            break
        stopped += 1
        assert "AcceleratorError" in str(w.failed_with) or "illegal memory" in str(w.failed_with)
    assert stopped == 3 and all_committed(queue)
    row = store.get_job("poison0")
    assert row.status is JobStatus.FAILED and row.error_code is ErrorCode.ENGINE_ERROR
    assert "3 times without a result" in row.error_message and row.deliveries == 3
    assert w.counters.poisoned == 1
    (letter,) = queue.dead_letters
    assert JobRequest.model_validate_json(letter.value).id == bad.id  # the message as it was delivered
    assert letter.headers[DLQ_ERROR_CODE] == b"engine_error"
    for j in good:
        assert store.get_job(j.id).status is JobStatus.SUCCEEDED, j.id


def test_a_redelivered_job_already_written_is_skipped_not_run(engine, queue, store):
    """A message delivered again after its result was written (a worker died between the row and
    the commit) costs one lookup, not a second run."""
    batch = jobs(4, "once")
    run_all(engine, queue, store, batch)
    before = {r.id: r.updated_at for r in store.list_jobs()}
    queue.publish(batch)  # the same jobs again, as a redelivery would bring them
    w = run_all(engine, queue, store, [])
    assert w.counters.skipped == 4 and w.counters.admitted == 0 and w.counters.succeeded == 0
    assert {r.id: r.updated_at for r in store.list_jobs()} == before


def test_partitions_are_served_in_turn_whatever_order_they_arrive(queue, store):
    """A partition's backlog handed to the engine first does not make the others wait behind it
    all: jobs of equal priority take fair ranks (a partition's k-th job beside the other
    partitions' k-th), so a partition that arrives later is served beside the first one."""
    from tests.pipeline.queue.test_queue_local import _on

    eng = make_engine_tiny(max_num_seqs=2)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = [j.model_copy(update={"sampling": sp}) for j in _on(queue, 0, 40, "a")]
    later = [j.model_copy(update={"sampling": sp}) for j in _on(queue, 1, 10, "b")]
    w = start_worker(eng, queue, store, max_waiting=64)
    try:
        queue.publish(first)
        wait_until(lambda: len(w._inflight) == 40, what="the first partition's backlog in the engine")
        queue.publish(later)
        wait_until(lambda: all_committed(queue), timeout_s=120, what="every job")
    finally:
        w.stop()
    rows = {r.id: r for r in store.list_jobs(limit=100)}
    order = sorted(rows.values(), key=lambda r: r.timings.first_token_at)
    pos = {r.id: i for i, r in enumerate(order)}
    # without fair ranks the later partition's jobs would all come after the first's 40 (positions 40-49)
    assert max(pos[j.id] for j in later) < 40, sorted(pos[j.id] for j in later)
    assert all(r.status is JobStatus.SUCCEEDED for r in rows.values())
