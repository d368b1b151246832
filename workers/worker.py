"""The GPU worker loop: one process, one engine, three threads.

    intake thread:  consumer.poll -> inbox            (pause/resume on engine or sink pressure)
    engine thread:  inbox -> add_request; step(); events -> results -> sink
    sink thread:    upsert_results (batched, idempotent) -> intake commits those offsets

Only the engine thread touches the engine. Timings: `submitted_at` comes with the job (epoch);
`admitted_at` is the wall time the job entered this worker's engine queue (the intake handed it
over; the engine takes it at its next step boundary, as vLLM counts a request's arrival when it
is queued to the engine core); later instants are that wall time plus durations on the monotonic
clock, so `engine_ttft_ms`, `prefill_ms`, `tpot_ms` are monotonic measurements and `ttft_ms` =
first_token_at - submitted_at is what the user waited.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.queue import JobConsumer, Message
from pipeline.settings import Settings
from pipeline.store import ResultStore
from schemas.job import (
    ErrorCode,
    FinishReason,
    JobRequest,
    JobResult,
    JobStatus,
    JobTimings,
    Usage,
)
from workers.engine import FinishedRequest, InvalidRequestError, LLMEngine
from workers.intake import Intake, error_code_of, render_prompt
from workers.sink import Outcome, ResultSink, SinkConfig

log = logging.getLogger(__name__)


def default_worker_name() -> str:
    """host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class WorkerConfig:
    """Bounds and timeouts of one worker."""

    name: str | None = None  # written with each result; host:pid when None
    max_waiting: int = 512  # pause intake when more jobs than this wait (inbox + engine queue)
    kv_high_watermark: float = 0.95  # pause intake when this share of KV blocks is in use
    poll_timeout_s: float = 0.02
    max_poll_messages: int = 256
    # Offsets are committed on the intake thread, synchronously: while it commits it does not
    # poll, so frequent commits delay deliveries. A later commit only means more re-deliveries
    # after a crash (written once each, by job id).
    commit_interval_s: float = 0.25
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight jobs may run before being handed back
    sink: SinkConfig = field(default_factory=SinkConfig)
    # Python's GIL switch interval for this process (default 5 ms): the intake thread waits up to
    # that long for the GIL while the engine thread runs Python between kernels; None: unchanged
    gil_switch_interval_s: float | None = 0.0005


@dataclass
class _InFlight:
    request: JobRequest
    messages: list[Message]
    submitted_at: float  # epoch
    admitted_at: float  # epoch, when the intake handed it to the engine queue
    admitted_mono: float
    first_token_mono: float | None = None


@dataclass
class WorkerCounters:
    """What the worker has done since it started."""

    admitted: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    duplicates: int = 0  # messages for a job already in the engine
    handed_back: int = 0  # aborted at shutdown, left uncommitted


class Worker:
    """Runs `engine` over the jobs of `consumer` and writes results to `store`.

    `start()` starts the threads; `stop(drain=True)` lets in-flight jobs finish (up to
    `drain_timeout_s`), hands back the rest uncommitted, writes what finished and commits it.
    `cancel(job_ids, batch_id)` may be called from any thread.
    """

    def __init__(
        self,
        engine: LLMEngine,
        consumer: JobConsumer,
        store: ResultStore,
        config: WorkerConfig | None = None,
        *,
        model_name: str | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.config = config or WorkerConfig()
        self.name = self.config.name or default_worker_name()
        self.model_name = model_name or str(getattr(engine, "model_name", "unknown"))
        self._wall = wall_clock
        self.counters = WorkerCounters()
        # messages handed over by the intake, with the wall and monotonic instants they arrived
        self._inbox: deque[tuple[Message, float, float]] = deque()
        self._controls: deque[tuple[str, tuple[str, ...], str | None]] = deque()
        self._wake = threading.Event()
        self._inflight: dict[str, _InFlight] = {}
        self._cancelled_ids: set[str] = set()
        self._cancelled_batches: set[str] = set()
        self._handing_back: set[str] = set()
        self._draining = threading.Event()
        self._stopped = threading.Event()
        self._engine_error: BaseException | None = None
        self._stats: Any = None  # the engine's latest EngineStats (a dataclass)
        self._stats_at = 0.0
        self._waiting = 0
        self._kv_used = 0.0
        self.sink = ResultSink(store, self._on_durable, self.config.sink)
        self.intake = Intake(
            consumer,
            self._deliver,
            self._overloaded,
            poll_timeout_s=self.config.poll_timeout_s,
            max_messages=self.config.max_poll_messages,
            commit_interval_s=self.config.commit_interval_s,
        )
        self._thread = threading.Thread(target=self._engine_loop, name="engine-loop", daemon=True)

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Worker:
        """Start the sink, the engine loop and the intake."""
        if self.config.gil_switch_interval_s is not None:
            sys.setswitchinterval(self.config.gil_switch_interval_s)
        self.sink.start()
        self._thread.start()
        self.intake.start()
        log.info("worker %s started (model %s)", self.name, self.model_name)
        return self

    def stop(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop taking jobs; let in-flight ones finish (drain) or hand them back at once; write
        and commit what finished; leave the group. Safe to call twice."""
        if self._stopped.is_set():
            return
        timeout = self.config.drain_timeout_s if timeout_s is None else timeout_s
        self.intake.stop_taking()
        self._drain_deadline = time.monotonic() + (timeout if drain else 0.0)
        self._draining.set()
        self._wake.set()
        self._thread.join(timeout + 30.0)
        self.sink.stop(timeout_s=max(5.0, timeout))
        self.intake.stop()
        self._stopped.set()
        c = self.counters
        log.info(
            "worker %s stopped: %d succeeded, %d failed, %d cancelled, %d handed back",
            self.name,
            c.succeeded,
            c.failed,
            c.cancelled,
            c.handed_back,
        )

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the engine loop ends (after stop(), or on an engine failure). True if it ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def failed_with(self) -> BaseException | None:
        """The exception that ended the engine loop, if one did."""
        return self._engine_error

    # --- control (any thread) --------------------------------------------------------------------

    def cancel(self, job_ids: Iterable[str] = (), batch_id: str | None = None) -> None:
        """Abort these jobs (or every job of the batch) if they are in the engine, and cancel them
        when they arrive later; each gets a `cancelled` row."""
        self._controls.append(("cancel", tuple(job_ids), batch_id))
        self._wake.set()

    def stats(self) -> dict[str, Any]:
        """The engine's latest stats and this worker's counters, JSON-ready."""
        return {
            "worker": self.name,
            "model": self.model_name,
            "engine": {} if self._stats is None else asdict(self._stats),
            "in_flight": len(self._inflight),
            "inbox": len(self._inbox),
            "sink_buffered": self.sink.buffered,
            "store_ok": self.sink.store_ok,
            "intake_paused": self.intake.paused,
            "counters": asdict(self.counters),
        }

    # --- intake / sink callbacks -----------------------------------------------------------------

    def _deliver(self, messages: list[Message]) -> None:
        wall, mono = self._wall(), time.monotonic()
        self._inbox.extend((m, wall, mono) for m in messages)
        self._wake.set()

    def _overloaded(self) -> bool:
        backlog = len(self._inbox) + self._waiting
        if self.sink.full:
            return True
        if self.intake.paused:  # hysteresis: resume once half drained
            return (
                backlog > self.config.max_waiting // 2 or self._kv_used > self.config.kv_high_watermark - 0.1
            )
        return backlog >= self.config.max_waiting or self._kv_used >= self.config.kv_high_watermark

    def _on_durable(self, messages: list[Message]) -> None:
        self.intake.commit_later(messages)

    # --- the engine loop -------------------------------------------------------------------------

    def _engine_loop(self) -> None:
        try:
            while True:
                self._apply_controls()
                if not self._draining.is_set():
                    self._admit()
                elif time.monotonic() >= self._drain_deadline:
                    self._hand_back()
                if self.engine.has_unfinished():
                    self._step()
                elif self._draining.is_set():
                    break
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
                self._refresh_load()
        except BaseException as exc:  # the engine itself failed: stop; uncommitted jobs are redelivered
            self._engine_error = exc
            log.exception("engine loop failed; stopping this worker")
            self.intake.stop_taking()
        finally:
            # Anything still in the inbox was never admitted: left uncommitted, delivered again.
            self._inbox.clear()

    def _refresh_load(self, every_s: float = 0.02) -> None:
        now = time.monotonic()
        if now - self._stats_at < every_s:
            return
        self._stats_at = now
        st = self.engine.stats()
        self._stats = st  # converted for stats() only: asdict on every refresh cost GIL time
        self._waiting = st.waiting
        self._kv_used = st.kv_blocks_used / st.kv_blocks_total if st.kv_blocks_total else 0.0

    def _admit(self) -> None:
        outcomes: list[Outcome] = []
        while self._inbox:
            msg, wall_now, mono_now = self._inbox.popleft()
            job = msg.job
            running = self._inflight.get(job.id)
            if running is not None:  # the same job delivered again while it runs: one result
                running.messages.append(msg)
                self.counters.duplicates += 1
                continue
            submitted = job.submitted_at
            if submitted is None:
                submitted = msg.timestamp_ms / 1000.0 if msg.timestamp_ms else wall_now
            if job.id in self._cancelled_ids or (
                job.batch_id is not None and job.batch_id in self._cancelled_batches
            ):
                outcomes.append(
                    self._failure(job, msg, ErrorCode.CANCELLED, "cancelled before it ran", submitted)
                )
                continue
            try:
                try:
                    prompt = render_prompt(self.engine.tokenizer, job)
                except Exception as exc:  # a template that refuses these turns
                    raise InvalidRequestError("chat_template", f"chat template: {exc}") from None
                self.engine.add_request(
                    job.id,
                    prompt=prompt,
                    sampling=job.sampling,
                    priority=job.priority,
                    # the engine's clock: submission time moved onto the monotonic clock
                    arrival_time=mono_now - max(0.0, wall_now - submitted),
                )
            except InvalidRequestError as exc:
                outcomes.append(self._failure(job, msg, error_code_of(exc.code), exc.message, submitted))
                continue
            self._inflight[job.id] = _InFlight(job, [msg], submitted, wall_now, mono_now)
            self.counters.admitted += 1
        if outcomes:
            self.sink.put(outcomes)

    def _failure(
        self, job: JobRequest, msg: Message, code: ErrorCode, message: str, submitted: float
    ) -> Outcome:
        result = JobResult.failure(
            job.id,
            code,
            message,
            batch_id=job.batch_id,
            submitted_at=submitted,
            finished_at=self._wall(),
            worker=self.name,
            model=self.model_name,
        )
        if code is ErrorCode.CANCELLED:
            self.counters.cancelled += 1
        else:
            self.counters.failed += 1
        log.info("job %s %s: %s", job.id, result.status.value, code.value)
        return Outcome(result, job, [msg])

    def _step(self) -> None:
        out = self.engine.step()
        for ev in out.first_tokens:
            entry = self._inflight.get(ev.request_id)
            if entry is not None:
                entry.first_token_mono = ev.time
        outcomes = []
        for f in out.finished:
            entry = self._inflight.pop(f.request_id, None)
            if entry is None:
                continue
            if f.request_id in self._handing_back:
                self._handing_back.discard(f.request_id)
                continue  # aborted at shutdown: no row, no commit; the queue delivers it again
            outcomes.append(self._outcome(entry, f))
        if outcomes:
            self.sink.put(outcomes)

    def _outcome(self, entry: _InFlight, f: FinishedRequest) -> Outcome:
        t = f.timings

        def wall(mono: float | None) -> float | None:
            return None if mono is None else entry.admitted_at + (mono - entry.admitted_mono)

        first_mono = entry.first_token_mono if entry.first_token_mono is not None else t.first_token
        timings = JobTimings.from_instants(
            submitted_at=entry.submitted_at,
            admitted_at=entry.admitted_at,
            first_token_at=wall(first_mono),
            finished_at=wall(t.finished),
            completion_tokens=f.usage.completion_tokens,
            engine_ttft_ms=None if first_mono is None else max(0.0, (first_mono - entry.admitted_mono) * 1e3),
            prefill_ms=t.prefill_ms,
            tpot_ms=f.tpot_ms,
        )
        job = entry.request
        cancelled = f.finish_reason == "abort"
        if cancelled:
            self.counters.cancelled += 1
        else:
            self.counters.succeeded += 1
        result = JobResult(
            id=job.id,
            batch_id=job.batch_id,
            status=JobStatus.CANCELLED if cancelled else JobStatus.SUCCEEDED,
            # NUL is valid output but no Postgres text value may hold it
            text=f.text.replace("\x00", "\ufffd"),
            finish_reason=FinishReason(f.finish_reason),
            usage=Usage(
                prompt_tokens=f.usage.prompt_tokens,
                cached_prompt_tokens=min(f.usage.cached_prompt_tokens, f.usage.prompt_tokens),
                completion_tokens=f.usage.completion_tokens,
            ),
            timings=timings,
            worker=self.name,
            model=self.model_name,
            error_code=ErrorCode.CANCELLED if cancelled else None,
            error_message="cancelled while running" if cancelled else None,
        )
        return Outcome(result, job, entry.messages)

    def _apply_controls(self) -> None:
        while self._controls:
            kind, ids, batch_id = self._controls.popleft()
            if kind != "cancel":
                continue
            targets = set(ids)
            self._cancelled_ids.update(ids)
            if batch_id is not None:
                self._cancelled_batches.add(batch_id)
                targets |= {jid for jid, e in self._inflight.items() if e.request.batch_id == batch_id}
            for jid in targets:
                if jid in self._inflight and self.engine.abort(jid):
                    log.info("job %s aborted (cancel)", jid)

    def _hand_back(self) -> None:
        n = 0
        for jid in list(self._inflight):
            if jid not in self._handing_back and self.engine.abort(jid):
                self._handing_back.add(jid)
                n += 1
        if n:
            self.counters.handed_back += n
            log.info("drain: %d jobs handed back uncommitted", n)


class WorkerSettings(BaseSettings):
    """The GPU worker's own settings, from FIRSTTOKEN_* variables (shared ones live in
    pipeline.settings.Settings): which model, on which device, and the worker's bounds."""

    model_config = SettingsConfigDict(env_prefix="FIRSTTOKEN_", extra="ignore", frozen=True)

    model: str = "tiny"  # preset or Hugging Face checkpoint directory
    device: str | None = None  # cuda or cpu; None: cuda when available
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 512  # as EngineConfig: the larger decode batch gave ~7% more offline throughput on an H200
    kv_cache_dtype: str = "auto"  # or "fp8": twice the cached tokens (see EngineConfig)
    max_waiting: int = 512
    drain_timeout_s: float = 30.0
    sink_max_buffer: int = 10_000


def build_worker(
    settings: Settings | None = None,
    worker_settings: WorkerSettings | None = None,
    *,
    engine: LLMEngine | None = None,
    group: str | None = None,
) -> Worker:
    """A Worker on Kafka (settings' topic and group) and the settings' database, with the model
    loaded here (call it in the worker process, after it started, never at import)."""
    from pipeline.queue.kafka import KafkaQueue
    from pipeline.settings import get_settings
    from workers.engine import EngineConfig

    s = settings or get_settings()
    ws = worker_settings or WorkerSettings()
    if engine is None:
        engine = LLMEngine(
            ws.model,
            EngineConfig(
                device=ws.device, dtype=ws.dtype, max_model_len=ws.max_model_len, max_num_seqs=ws.max_num_seqs,
                kv_cache_dtype=ws.kv_cache_dtype,
            ),
        )
    store = ResultStore.from_url(s.database_url, batch_rows=s.store_batch_rows)
    consumer = KafkaQueue(s).consumer(group)
    config = WorkerConfig(
        name=s.worker_name,
        max_waiting=ws.max_waiting,
        drain_timeout_s=ws.drain_timeout_s,
        max_poll_messages=s.max_poll_records,
        sink=SinkConfig(batch_rows=s.store_batch_rows, max_buffer=ws.sink_max_buffer),
    )
    worker = Worker(engine, consumer, store, config, model_name=ws.model)
    freeze_startup_heap()
    return worker


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, the model, the engine) out of the cyclic garbage
    collector's reach (gc.freeze), after one last collection.

    Those objects live as long as the process; without this, a full collection walks them all
    while every thread waits: 383 ms and 830 ms (the latter 3 s after the worker started, while
    it took its first jobs) in two benchmark runs on the 2-core machine; with the heap frozen no
    full collection ran at all (bench/results/pipeline-2026-11-30-run2.md). Call once per process,
    after the model is loaded.
    """
    gc.collect()
    gc.freeze()


def run_until_signalled(worker: Worker) -> int:
    """Start `worker`, and on SIGTERM or SIGINT drain it and return 0 (1 if the engine failed)."""
    import signal

    stop = threading.Event()

    def _handler(signum: int, _frame: object) -> None:
        log.info("signal %d: draining", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _handler)
    worker.start()
    while not stop.is_set():
        if worker.wait(0.2):  # the engine loop ended by itself: it failed
            break
    worker.stop(drain=True)
    return 1 if worker.failed_with is not None else 0
