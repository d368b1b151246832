"""The GPU worker: Kafka intake, engine core, result sink.

    intake thread:   consumer.poll -> AddRequests -> engine core   (pause/resume on engine or sink pressure)
    engine core:     add, step, emit outputs         (its own process by default: workers.engine_core)
    results thread:  core outputs -> results -> sink
    sink thread:     upsert_results (batched, idempotent) -> intake commits those offsets

The intake hands each polled job straight to the core (no hop through another thread). Timings:
`submitted_at` comes with the job (epoch); `admitted_at` is the wall time the intake handed the
job to the engine core (the core takes it at its next step boundary, as vLLM counts a request's
arrival when it is queued to the engine core); later instants are that wall time plus durations
on the monotonic clock (one clock for the worker and its core process), so `engine_ttft_ms`,
`prefill_ms`, `tpot_ms` are monotonic measurements and `ttft_ms` = first_token_at -
submitted_at is what the user waited.
"""

from __future__ import annotations

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

from pipeline.queue import JobConsumer, Message
from pipeline.replies import ReplyPublisher, delta_message, final_message
from pipeline.store import ResultStore
from pipeline.store.records import Admission
from schemas.job import (
    ErrorCode,
    FinishReason,
    JobRequest,
    JobResult,
    JobStatus,
)
from schemas.tools import template_tools
from workers.engine import FinishedRequest, LLMEngine
from workers.engine.outputs import EngineStats
from workers.engine_core import (
    AddRequest,
    CoreOutputs,
    EngineCoreClient,
    InThreadCore,
)
from workers.intake import Intake, error_code_of
from workers.metrics import worker_registry
from workers.results import finished_result
from workers.sink import Outcome, ResultSink, SinkConfig

log = logging.getLogger(__name__)


def default_worker_name() -> str:
    """host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class WorkerConfig:
    """Bounds and timeouts of one worker."""

    name: str | None = None  # written with each result; host:pid when None
    max_waiting: int = 512  # pause intake when more jobs than this wait (sent to the core, not running)
    kv_high_watermark: float = 0.95  # pause intake when this share of KV blocks is in use
    poll_timeout_s: float = 0.02
    max_poll_messages: int = 256
    # Offsets are committed on the intake thread (asynchronously while running). A later commit
    # only means more re-deliveries after a crash (written once each, by job id).
    commit_interval_s: float = 0.25
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight jobs may run before being handed back
    sink: SinkConfig = field(default_factory=SinkConfig)
    # A job taken into an engine this many times without a result (each time, the worker running
    # it died) is failed with engine_error and its message copied to the dead-letter topic instead
    # of run again. Counted in the store, with one lookup per fetch that also marks the jobs
    # running and skips those already terminal (a redelivered message whose row is written). A
    # job delivered `hold_from` times without a result runs alone among such jobs (one at a time,
    # beside the fresh ones), so that the job that kills workers is the one its deaths count
    # against, not the jobs that happened to run beside it. None: no lookup (every job runs).
    max_deliveries: int | None = 3
    hold_from: int = 2
    # How often the worker asks the store which of its running jobs were cancelled (by a user, a
    # batch cancel, or a client that went away), and drops them from its engine: cancels reach
    # every worker this way, the plain `firsttoken worker` too (Celery workers also hear them at
    # once through the control plane). A quarter second keeps a cancel's way into the engine
    # (this poll, then the next step boundary) well inside a second; the query is one indexed
    # lookup of the worker's in-flight ids. None: never.
    cancel_poll_s: float | None = 0.25
    # Per partition, at most this many offsets from the lowest job still in flight to the last
    # handed out: a job that waits (low priority, a long generation) holds its partition back
    # instead of letting the committed offset trail ever more finished jobs (all of them delivered
    # again after a crash, each a lookup to skip). None: the worker's in-flight
    # window, max_waiting + the engine's max_num_seqs.
    commit_span: int | None = None
    # Python's GIL switch interval for this process (default 5 ms): a thread woken by the network
    # waits up to that long for the GIL while another thread runs Python; None: unchanged
    gil_switch_interval_s: float | None = 0.0005


@dataclass
class _InFlight:
    request: JobRequest
    messages: list[Message]
    submitted_at: float  # epoch
    admitted_at: float  # epoch, when the intake handed it to the engine core
    admitted_mono: float
    first_token_mono: float | None = None
    paused_s: float = 0.0  # of submitted -> admitted, the time this worker held off (back-pressure)
    fair_rank: int = 0  # its place in the round-robin over the partitions (Worker._fair_rank)


@dataclass
class WorkerCounters:
    """What the worker has done since it started."""

    admitted: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    duplicates: int = 0  # messages for a job already in the engine
    skipped: int = 0  # messages of jobs already terminal in the store (delivered again): not run
    poisoned: int = 0  # jobs failed after max_deliveries deliveries without a result (dead-lettered)
    held: int = 0  # jobs delivered hold_from times without a result, run one at a time
    handed_back: int = 0  # aborted at shutdown, left uncommitted


class Worker:
    """Runs an engine core over the jobs of `consumer` and writes results to `store`.

    `engine` is an engine core client (`ProcessCore`: the engine in a child process) or an
    LLMEngine, which then runs on a thread of this process (`InThreadCore`). `start()` starts
    the threads; `stop(drain=True)` lets in-flight jobs finish (up to `drain_timeout_s`), hands
    back the rest uncommitted, writes what finished and commits it, and stops the core.
    `cancel(job_ids, batch_id)` may be called from any thread.
    """

    def __init__(
        self,
        engine: LLMEngine | EngineCoreClient,
        consumer: JobConsumer,
        store: ResultStore,
        config: WorkerConfig | None = None,
        *,
        model_name: str | None = None,
        replies: ReplyPublisher | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.core: EngineCoreClient = engine if hasattr(engine, "submit") else InThreadCore(engine)  # type: ignore[arg-type]
        self.config = config or WorkerConfig()
        self.name = self.config.name or default_worker_name()
        self.model_name = model_name or self.core.model_name
        self.replies = replies  # live replies to the jobs that ask for them (JobRequest.reply)
        self.registry, self.metrics = worker_registry(self)  # Prometheus: serve with serve_metrics()
        self.metrics_port: int | None = None  # where serve_metrics serves them
        self._wall = wall_clock
        self.counters = WorkerCounters()
        # Guards what the intake, the results thread and control calls share: the in-flight
        # jobs, the cancelled sets, the hand-back set, and the order of commands to the core.
        self._lock = threading.Lock()
        self._inflight: dict[str, _InFlight] = {}
        self._cancelled_ids: set[str] = set()
        self._cancelled_batches: set[str] = set()
        self._handing_back: set[str] = set()
        self._draining = threading.Event()
        self._drain_deadline = float("inf")
        self._stopped = threading.Event()
        self._engine_error: BaseException | None = None
        self._stats: EngineStats | None = None  # the core's latest
        self._running = 0
        self._kv_used = 0.0
        self.store = store
        consumer.max_span = self.config.commit_span or (
            self.config.max_waiting + int(getattr(self.core, "max_num_seqs", 0) or self.config.max_waiting))
        self._admit_error: str | None = None  # why the last admission lookup failed (logged once)
        self._held: deque[Message] = deque()  # delivered too often: run one at a time (WorkerConfig.hold_from)
        self._held_running: str | None = None  # the held job in the engine now
        self._next_cancel_poll = 0.0  # monotonic
        self._redo: list[Message] = []  # delivered while their job finished here: looked up again
        self._fair_next: dict[int, int] = {}  # per partition, the fair rank of its next job
        self._fair_top = 0
        self.sink = ResultSink(store, self._on_durable, self.config.sink)
        self.intake = Intake(
            consumer,
            self._deliver,
            self._overloaded,
            poll_timeout_s=self.config.poll_timeout_s,
            max_messages=self.config.max_poll_messages,
            commit_interval_s=self.config.commit_interval_s,
            each_poll=self._each_poll,
            room=self._room,
        )
        self._thread = threading.Thread(target=self._results_loop, name="engine-results", daemon=True)

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Worker:
        """Start the sink, the engine core, the results thread and the intake."""
        if self.config.gil_switch_interval_s is not None:
            sys.setswitchinterval(self.config.gil_switch_interval_s)
        self.sink.start()
        self.core.start()
        self._thread.start()
        self.intake.start()
        log.info("worker %s started (model %s)", self.name, self.model_name)
        return self

    def stop(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop taking jobs; let in-flight ones finish (drain) or hand them back at once; write
        and commit what finished; leave the group; stop the engine core. Safe to call twice."""
        if self._stopped.is_set():
            return
        timeout = self.config.drain_timeout_s if timeout_s is None else timeout_s
        self.intake.stop_taking()
        with self._lock:
            self._drain_deadline = time.monotonic() + (timeout if drain else 0.0)
            self._draining.set()
        self._thread.join(timeout + 30.0)
        self.sink.stop(timeout_s=max(5.0, timeout))
        self.intake.stop()
        self.core.stop()
        if self.replies is not None:
            self.replies.close()
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
        """Block until the results loop ends (after stop(), or on an engine failure). True if it ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def failed_with(self) -> BaseException | None:
        """The exception that ended the engine, if one did."""
        return self._engine_error

    # --- control (any thread) --------------------------------------------------------------------

    def cancel(self, job_ids: Iterable[str] = (), batch_id: str | None = None) -> None:
        """Abort these jobs (or every job of the batch) if they are in the engine, and cancel them
        when they arrive later; each gets a `cancelled` row."""
        ids = tuple(job_ids)
        with self._lock:
            self._cancelled_ids.update(ids)
            targets = {jid for jid in ids if jid in self._inflight}
            if batch_id is not None:
                self._cancelled_batches.add(batch_id)
                targets |= {jid for jid, e in self._inflight.items() if e.request.batch_id == batch_id}
            if targets:
                self.core.abort(sorted(targets))
        if targets:
            log.info("cancelling %d running jobs", len(targets))

    @property
    def engine_stats(self) -> EngineStats | None:
        """The engine core's latest stats (None before the first)."""
        return self._stats

    @property
    def in_flight(self) -> int:
        """Jobs handed to the engine and not written yet."""
        return len(self._inflight)

    def serve_metrics(self, port: int, addr: str = "0.0.0.0", tries: int = 16) -> int | None:
        """Serve this worker's Prometheus metrics at http://addr:port/metrics (a daemon thread); a
        port in use moves it to the next one, up to `tries` ports. Returns the port, or None when
        none was free (the worker runs on without metrics, and says so)."""
        from prometheus_client import start_http_server

        for p in range(port, port + tries):
            try:
                start_http_server(p, addr=addr, registry=self.registry)
            except OSError:
                continue
            log.info("metrics on %s:%d/metrics", addr, p)
            self.metrics_port = p
            return p
        log.warning("metrics not served: ports %d-%d are all in use", port, port + tries - 1)
        return None

    def stats(self) -> dict[str, Any]:
        """The engine's latest stats and this worker's counters, JSON-ready."""
        return {
            "worker": self.name,
            "model": self.model_name,
            "engine": {} if self._stats is None else asdict(self._stats),
            "in_flight": len(self._inflight),
            "sink_buffered": self.sink.buffered,
            "store_ok": self.sink.store_ok,
            "intake_paused": self.intake.paused,
            "counters": asdict(self.counters),
        }

    # --- intake / sink callbacks -----------------------------------------------------------------

    def _admission(self, messages: list[Message], wall: float) -> tuple[Admission, set[str]] | None:
        """One store round trip for a fetch: the jobs not in flight here are marked running and
        count a delivery (those delivered `hold_from` times already are held instead, and those
        terminal are left out). Returns what the store found and the ids asked about. None when
        there is no lookup, or the store is unreachable (then every job runs: results are
        idempotent by id, and the sink waits for the store)."""
        if self.config.max_deliveries is None:
            return None
        fresh = [m.job for m in messages if m.job.id not in self._inflight]
        if not fresh:
            return Admission(), set()
        try:
            got = self.store.admit(fresh, worker=self.name, admitted_at=wall, hold_from=self.config.hold_from)
        except Exception as exc:
            if self._admit_error is None:
                log.warning("admission lookup failed (%s); running the jobs unchecked", type(exc).__name__)
            self._admit_error = type(exc).__name__
            return None
        if self._admit_error is not None:
            log.info("admission lookups work again")
            self._admit_error = None
        return got, {j.id for j in fresh}

    def _deliver(self, messages: list[Message], *, held: bool = False) -> None:
        """On the intake thread: each new job goes to the engine core at once (after one lookup
        per fetch: a job already terminal is skipped, one delivered too often is held or fails).
        `held`: the one held job released now (admitted already)."""
        wall, mono = self._wall(), time.monotonic()
        if self._draining.is_set() or self._engine_error is not None:
            return  # never admitted: left uncommitted, delivered again
        lookup = None if held else self._admission(messages, wall)
        admitted, looked_up = lookup if lookup is not None else (None, set())
        adds: list[AddRequest] = []
        outcomes: list[Outcome] = []
        skipped: list[Message] = []
        poison: list[tuple[JobRequest, Message]] = []
        with self._lock:
            if self._draining.is_set() or self._engine_error is not None:
                return  # never admitted: left uncommitted, delivered again
            waiting = [e.fair_rank for e in self._inflight.values() if e.first_token_mono is None]
            floor = min(waiting) if waiting else self._fair_top
            for msg in messages:
                job = msg.job
                running = self._inflight.get(job.id)
                if running is not None:  # the same job delivered again while it runs: one result
                    running.messages.append(msg)
                    self.counters.duplicates += 1
                    continue
                if admitted is not None and job.id not in admitted.running:
                    if job.id not in looked_up:
                        # it ran here when the lookup was made and has finished since: its row
                        # may not be durable yet, so look it up again at the next poll
                        self._redo.append(msg)
                        continue
                    deliveries = admitted.held.get(job.id)
                    if deliveries is None:  # terminal already (or it just finished here): nothing to run
                        skipped.append(msg)
                        self.counters.skipped += 1
                    elif deliveries >= self.config.max_deliveries:  # type: ignore[operator]
                        poison.append((job, msg))
                    else:
                        self._held.append(msg)
                        self.counters.held += 1
                    continue
                submitted = job.submitted_at
                if submitted is None:
                    submitted = msg.timestamp_ms / 1000.0 if msg.timestamp_ms else wall
                if job.id in self._cancelled_ids or (
                    job.batch_id is not None and job.batch_id in self._cancelled_batches
                ):
                    outcomes.append(
                        self._failure(job, [msg], ErrorCode.CANCELLED, "cancelled before it ran", submitted)
                    )
                    continue
                adds.append(
                    AddRequest(
                        job.id,
                        job.prompt,
                        None if job.messages is None else tuple(m.turn() for m in job.messages),
                        job.sampling,
                        job.priority,
                        # the engine's clock: submission time moved onto the monotonic clock
                        mono - max(0.0, wall - submitted),
                        stream=job.reply == "stream",
                        fair_rank=(rank := self._fair_rank(msg.partition, floor)),
                        prompts=None if job.prompts is None else tuple(
                            p if isinstance(p, str) else tuple(p) for p in job.prompts),
                        tools=template_tools(job.tools),
                    )
                )
                paused = self.intake.paused_between(submitted, wall)
                self._inflight[job.id] = _InFlight(job, [msg], submitted, wall, mono, paused_s=paused, fair_rank=rank)
                self.counters.admitted += 1
            if adds:
                self.core.submit(adds)  # under the lock: a cancel's abort always follows the add
        if skipped:
            self.intake.commit_later(skipped)
        if poison:
            outcomes.extend(self._poisoned(poison))
        if outcomes:
            self._finished(outcomes)
            self.sink.put(outcomes)

    def _each_poll(self) -> None:
        """On the intake thread, before each poll: the next held job, and (every cancel_poll_s)
        the cancels recorded in the store."""
        self._release_held()
        if self._redo:
            redo, self._redo = self._redo, []
            self._deliver(redo)
        every = self.config.cancel_poll_s
        if every is None or not self._inflight:
            return
        now = time.monotonic()
        if now < self._next_cancel_poll:
            return
        self._next_cancel_poll = now + every
        with self._lock:
            ids = [jid for jid in self._inflight if jid not in self._cancelled_ids]
        if not ids:
            return
        try:
            gone = self.store.cancelled_among(ids)
        except Exception as exc:  # the store is away: the next poll asks again
            log.debug("cancel poll failed: %s", type(exc).__name__)
            return
        if gone:
            self.cancel(sorted(gone))

    def _fair_rank(self, partition: int, floor: int) -> int:
        """A job's rank in the engine's queue among equal priorities: the k-th job of a partition
        beside the other partitions' k-th (counted from the lowest rank still waiting, so a
        partition that was idle starts level with the others, not ahead). However the fetches
        brought them in (a partition's whole backlog first), the engine serves the partitions
        in turn (bench/bench_fairness.py)."""
        rank = max(self._fair_next.get(partition, 0), floor)
        self._fair_next[partition] = rank + 1
        self._fair_top = max(self._fair_top, rank + 1)
        return rank

    def _release_held(self) -> None:
        """On the intake thread, before each poll: when no held job is in the engine, the next one
        goes in (admitted now: its delivery counted)."""
        if not self._held or (self._held_running is not None and self._held_running in self._inflight):
            return
        if self._draining.is_set() or self._engine_error is not None:
            return
        msg = self._held[0]
        try:
            got = self.store.admit([msg.job], worker=self.name, admitted_at=self._wall(), hold_from=None)
        except Exception as exc:  # the store is away: try again at the next poll
            if self._admit_error is None:
                log.warning("admission of a held job failed (%s); retrying", type(exc).__name__)
            self._admit_error = type(exc).__name__
            return
        self._held.popleft()
        if msg.job.id in got.terminal:
            self.counters.skipped += 1
            self.intake.commit_later([msg])
            return
        self._held_running = msg.job.id
        self._deliver([msg], held=True)

    def _poisoned(self, poison: list[tuple[JobRequest, Message]]) -> list[Outcome]:
        """Jobs taken into engines max_deliveries times without a result: copy their messages to
        the dead-letter topic, then fail them (their rows, then the commit, follow as any result's)."""
        n = self.config.max_deliveries
        error = f"taken into an engine {n} times without a result (the workers running it stopped): not run again"
        self.intake.consumer.dead_letter([m for _, m in poison], ErrorCode.ENGINE_ERROR.value, error)
        self.counters.poisoned += len(poison)
        log.warning("%d jobs failed after %d deliveries without a result; copied to the dead-letter topic",
                    len(poison), n)
        return [
            self._failure(job, [msg], ErrorCode.ENGINE_ERROR, error,
                          job.submitted_at if job.submitted_at is not None else self._wall())
            for job, msg in poison
        ]

    def _room(self) -> int:
        """Jobs the engine can take before the backlog bound (max_waiting beyond those running)."""
        backlog = len(self._inflight) - self._running + len(self._held)
        return self.config.max_waiting - backlog

    def _overloaded(self) -> bool:
        if self.sink.full:
            return True
        backlog = len(self._inflight) - self._running + len(self._held)  # not running yet
        if self.intake.paused:  # hysteresis: resume once half drained
            return (
                backlog > self.config.max_waiting // 2 or self._kv_used > self.config.kv_high_watermark - 0.1
            )
        return backlog >= self.config.max_waiting or self._kv_used >= self.config.kv_high_watermark

    def _on_durable(self, messages: list[Message]) -> None:
        self.intake.commit_later(messages)

    # --- the results thread ----------------------------------------------------------------------

    def _results_loop(self) -> None:
        try:
            while True:
                out = self.core.get(0.05)
                while out is not None:
                    self._apply(out)
                    out = self.core.get(0.0)
                if self._draining.is_set():
                    with self._lock:
                        idle = not self._inflight
                    if idle:
                        break
                    if time.monotonic() >= self._drain_deadline:
                        self._hand_back()
        except BaseException as exc:  # the engine failed: stop; uncommitted jobs are redelivered
            self._engine_error = exc
            log.error("engine failed; stopping this worker: %s", exc)
            self.intake.stop_taking()

    def _apply(self, out: CoreOutputs) -> None:
        if out.stats is not None:
            st = out.stats
            self._stats = st
            self._running = st.running
            self._kv_used = st.kv_blocks_used / st.kv_blocks_total if st.kv_blocks_total else 0.0
        done: list[tuple[_InFlight, FinishedRequest]] = []
        outcomes: list[Outcome] = []
        handed_back: list[str] = []
        with self._lock:
            for job_id, t in out.first_tokens:
                entry = self._inflight.get(job_id)
                if entry is not None:
                    entry.first_token_mono = t
            if self.replies is not None:
                for job_id, text, tokens, offset, index in out.deltas:
                    if job_id in self._inflight:
                        self.replies.put(job_id, delta_message(text, tokens, offset, index))
            for job_id, code, message in out.rejected:
                entry = self._inflight.pop(job_id, None)
                if entry is not None:
                    outcomes.append(
                        self._failure(entry.request, entry.messages, error_code_of(code), message, entry.submitted_at)
                    )
            for f in out.finished:
                entry = self._inflight.pop(f.request_id, None)
                if entry is None:
                    continue
                if f.request_id in self._handing_back:
                    self._handing_back.discard(f.request_id)
                    if f.finish_reason == FinishReason.ABORT:  # no result, no commit: the queue delivers it again
                        self.counters.handed_back += 1
                        handed_back.append(f.request_id)
                        continue
                if f.finish_reason == FinishReason.ERROR:  # it made engine steps fail, alone: it fails, the others go on
                    outcomes.append(self._failure(entry.request, entry.messages, ErrorCode.ENGINE_ERROR,
                                                  f.error or "the engine failed on this job", entry.submitted_at))
                    continue
                done.append((entry, f))
        outcomes.extend(self._outcome(entry, f) for entry, f in done)
        if outcomes:
            self._finished(outcomes)
            self.sink.put(outcomes)
        if handed_back and self.config.max_deliveries is not None:
            try:  # queued again, that delivery not counted (the job did not stop this worker)
                self.store.hand_back(handed_back)
            except Exception as exc:
                log.warning("could not mark %d handed-back jobs queued (%s)", len(handed_back), type(exc).__name__)

    def _finished(self, outcomes: list[Outcome]) -> None:
        """Count these results, and tell the waiters of the jobs that asked (JobRequest.reply)."""
        self.metrics.observe(o.result for o in outcomes)
        if self.replies is None:
            return
        for o in outcomes:
            if o.request is not None and o.request.reply is not None:
                self.replies.put(o.result.id, final_message(o.result))

    def _failure(
        self, job: JobRequest, messages: list[Message], code: ErrorCode, message: str, submitted: float
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
        return Outcome(result, job, messages)

    def _outcome(self, entry: _InFlight, f: FinishedRequest) -> Outcome:
        first_mono = entry.first_token_mono if entry.first_token_mono is not None else f.timings.first_token
        result = finished_result(
            entry.request, f, submitted_at=entry.submitted_at, admitted_at=entry.admitted_at,
            admitted_mono=entry.admitted_mono, paused_s=entry.paused_s, first_token_mono=first_mono,
            worker=self.name, model=self.model_name,
        )
        if result.status is JobStatus.CANCELLED:
            self.counters.cancelled += 1
        else:
            self.counters.succeeded += 1
        return Outcome(result, entry.request, entry.messages)

    def _hand_back(self) -> None:
        """Drain deadline: abort what still runs; those jobs get no row and stay uncommitted."""
        with self._lock:
            ids = [jid for jid in self._inflight if jid not in self._handing_back]
            self._handing_back.update(ids)
            if ids:
                self.core.abort(ids)
        if ids:
            log.info("drain: handing back %d jobs uncommitted", len(ids))
