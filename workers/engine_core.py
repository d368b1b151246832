"""The engine core: one LLMEngine driven by a loop that takes commands and emits outputs, in a
thread of the worker's process (`InThreadCore`) or in a process of its own (`ProcessCore`).

    worker process                                  engine core (thread or child process)
    intake thread:  poll -> submit([AddRequest]) ->  serve(): take commands, step(), emit
    control:        abort(ids)                  ->
    results thread: get() -> rows to the sink   <-  CoreOutputs (first tokens, finished,
                                                    rejected, stats)

Why a process of its own: the engine loop runs Python between kernel launches (scheduling,
inputs, sampling, detokenizing). In the worker's process it holds the GIL against the intake
thread that drives the Kafka consumer, so a job that arrived waited for the engine's Python
before the worker even read it. On the 2-core box at 100 jobs/s (bench/results/pipeline-2026-11-30-run5.md)
the Kafka-to-engine overhead was p50 6.1 / p99 22 ms with the engine in the worker's process, and
p50 ~4 / p99 ~11-14 ms with the same engine load in another process. vLLM V1 runs its
EngineCore in a separate process for the same reason.

The core's commands are applied in the order they were sent, between two steps: an abort sent
after an add always finds the request. Outputs carry monotonic instants: CLOCK_MONOTONIC is one
clock for every process of the machine, so the worker turns them into wall times as before.

A child process ends when the worker's end of the pipe closes (the worker exited or was killed),
at its next step or within `IDLE_WAIT_S` when idle. It ignores SIGINT: a Ctrl-C reaches the whole
process group, and the worker drains the core before it stops it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from schemas.sampling import SamplingParams
from workers.choices import ChoiceGroups
from workers.engine import EngineConfig, FinishedRequest, InvalidRequestError, LLMEngine
from workers.engine.outputs import EngineStats
from workers.engine.prompts import Turn, prompt_token_ids

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long an idle core blocks for commands before it looks around again
STATS_EVERY_S = 0.02  # the core sends its EngineStats at most this often


@dataclass(frozen=True, slots=True)
class AddRequest:
    """One job for the engine: its prompt (text, chat turns the core renders with the
    checkpoint's template, or a prompt list of texts and token ids), sampling, priority and
    arrival on the monotonic clock. A job with a prompt list, or n / best_of above 1, runs as
    several engine requests (workers.choices) and finishes as one, with its choices."""

    request_id: str
    prompt: str | None
    messages: tuple[Turn, ...] | None  # chat turns: (role, content), or the template's message dicts
    sampling: SamplingParams
    priority: int = 0
    arrival_time: float | None = None  # monotonic; None: when the core adds it
    stream: bool = False  # report its text deltas (CoreOutputs.deltas)
    fair_rank: int = 0  # LLMEngine.add_request's fair_rank
    prompts: tuple[str | tuple[int, ...], ...] | None = None  # a prompt list (JobBody.prompts)
    tools: list[dict[str, Any]] | None = None  # the chat template's `tools` (schemas.tools.template_tools)

    @property
    def has_choices(self) -> bool:
        """Whether it runs as several sequences (JobBody.has_choices)."""
        return self.prompts is not None or self.sampling.samples_per_prompt > 1


@dataclass(slots=True)
class CoreOutputs:
    """What the core produced since its last emit."""

    first_tokens: list[tuple[str, float]] = field(default_factory=list)  # (request id, monotonic)
    finished: list[FinishedRequest] = field(default_factory=list)
    # StepOutput.deltas of streamed ones, with the choice index: (request id, text, tokens, offset, index)
    deltas: list[tuple[str, str, int, int, int]] = field(default_factory=list)
    rejected: list[tuple[str, str, str]] = field(default_factory=list)  # (request id, code, message)
    stats: EngineStats | None = None

    def __bool__(self) -> bool:
        return bool(self.first_tokens or self.finished or self.deltas or self.rejected or self.stats is not None)


class EngineCoreError(RuntimeError):
    """The engine core failed or went away; the worker stops (uncommitted jobs are redelivered)."""


def _add(engine: LLMEngine, groups: ChoiceGroups, req: AddRequest, rejected: list[tuple[str, str, str]]) -> None:
    try:
        if req.has_choices:
            _add_choices(engine, groups, req)
            return
        ids = prompt_token_ids(engine.tokenizer, req.prompt, req.messages, req.tools)
        engine.add_request(
            req.request_id,
            prompt_token_ids=ids,
            sampling=req.sampling,
            priority=req.priority,
            arrival_time=req.arrival_time,
            stream=req.stream,
            fair_rank=req.fair_rank,
        )
    except InvalidRequestError as exc:
        rejected.append((req.request_id, exc.code, exc.message))


def _add_choices(engine: LLMEngine, groups: ChoiceGroups, req: AddRequest) -> None:
    """A job of several sequences: each prompt's token ids (and its text, for echo), then its group."""
    prompts: list[list[int]] = []
    echoes: list[str | None] = []
    for j, p in enumerate(req.prompts if req.prompts is not None else (req.prompt,)):
        try:
            if isinstance(p, str) or p is None:
                ids = prompt_token_ids(engine.tokenizer, p, req.messages, req.tools)
            else:
                ids = list(p)
        except InvalidRequestError as exc:
            raise InvalidRequestError(exc.code, f"prompt {j}: {exc.message}" if req.prompts else exc.message) from None
        prompts.append(ids)
        echoes.append(None if not req.sampling.echo else p if isinstance(p, str) else engine.tokenizer.decode(ids))
    groups.add(req.request_id, prompts, echoes, req.sampling, priority=req.priority,
               arrival_time=req.arrival_time, stream=req.stream, fair_rank=req.fair_rank)


def serve(
    engine: LLMEngine,
    receive: Callable[[float], list[tuple] | None],
    emit: Callable[[CoreOutputs], None],
) -> None:
    """The core loop: apply the commands `receive(timeout)` returns (None: the client is gone),
    step the engine while it has work, `emit` what came out. Returns on ("stop",) or when the
    client is gone. Commands: ("add", [AddRequest, ...]), ("abort", [request id, ...]), ("stop",)."""
    last_stats = 0.0
    groups = ChoiceGroups(engine)
    while True:
        cmds = receive(0.0 if engine.has_unfinished() else IDLE_WAIT_S)
        if cmds is None:
            return
        out = CoreOutputs()
        for cmd in cmds:
            kind = cmd[0]
            if kind == "add":
                for req in cmd[1]:
                    _add(engine, groups, req, out.rejected)
            elif kind == "abort":
                for request_id in cmd[1]:
                    if not groups.abort(request_id):
                        engine.abort(request_id)
            elif kind == "stop":
                return
        if engine.has_unfinished():
            step = engine.step()
            out.first_tokens.extend(groups.first_tokens([(ev.request_id, ev.time) for ev in step.first_tokens]))
            out.finished.extend(groups.finished(step.finished))
            out.deltas.extend(groups.deltas(step.deltas))
        now = time.monotonic()
        # stats ride with every output that ends requests (so that no reader sees a request
        # finished and still counted running), and at most every STATS_EVERY_S besides
        if out.finished or out.rejected or now - last_stats >= STATS_EVERY_S:
            out.stats = engine.stats()
            last_stats = now
        if out:
            emit(out)


class EngineCoreClient(Protocol):
    """What the worker uses of a core, wherever it runs."""

    model_name: str

    def start(self) -> None: ...
    def submit(self, requests: list[AddRequest]) -> None: ...
    def abort(self, request_ids: Sequence[str]) -> None: ...
    def get(self, timeout_s: float) -> CoreOutputs | None: ...
    def stop(self, timeout_s: float = 10.0) -> None: ...


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class _OutputQueue:
    """Outputs as the core produced them, for `get` on the worker's results thread."""

    def __init__(self) -> None:
        self._outputs: queue.SimpleQueue[CoreOutputs | _Failed] = queue.SimpleQueue()

    def get(self, timeout_s: float) -> CoreOutputs | None:
        """The next outputs, or None after `timeout_s`; raises EngineCoreError once the core failed."""
        try:
            item = self._outputs.get(timeout=timeout_s) if timeout_s > 0 else self._outputs.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, _Failed):
            self._outputs.put(item)  # every later call fails too
            raise item.error
        return item


class InThreadCore(_OutputQueue):
    """The core on a thread of this process (embedded mode, tests). Commands and outputs travel
    through queues; only the core's thread touches the engine."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__()
        self.engine = engine
        self.model_name = str(getattr(engine, "model_name", "unknown"))
        self.max_num_seqs: int = engine.config.max_num_seqs
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()

    def submit(self, requests: list[AddRequest]) -> None:
        self._commands.put(("add", requests))

    def abort(self, request_ids: Sequence[str]) -> None:
        self._commands.put(("abort", list(request_ids)))

    def stop(self, timeout_s: float = 10.0) -> None:
        self._commands.put(("stop",))
        if self._thread.ident is not None:
            self._thread.join(timeout_s)

    def _receive(self, timeout_s: float) -> list[tuple]:
        cmds: list[tuple] = []
        try:
            cmds.append(self._commands.get(timeout=timeout_s) if timeout_s > 0 else self._commands.get_nowait())
            while True:
                cmds.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return cmds

    def _run(self) -> None:
        try:
            serve(self.engine, self._receive, self._outputs.put)
        except BaseException as exc:
            log.exception("the engine core failed")
            err = EngineCoreError(f"the engine failed: {exc!r}")
            err.__cause__ = exc
            self._outputs.put(_Failed(err))


class ProcessCore(_OutputQueue):
    """The core in a child process (spawned: a fresh interpreter, CUDA initialised there only).

    The model is loaded in the child; the constructor returns once it is ready (or raises
    EngineCoreError with the child's error). Commands go over a pipe; `submit` and `abort` may be
    called from any thread (a send waits at most for the core's current step: the core reads
    its commands between steps). A reader thread takes the core's outputs off the pipe as they
    come, so the core never waits on a full pipe, whatever the worker's threads are doing (a
    core blocked on its outputs would never read the command a worker thread is blocked on).
    """

    def __init__(
        self,
        model: str,
        config: EngineConfig | None = None,
        *,
        torch_threads: int | None = None,
        start_timeout_s: float = 900.0,
    ) -> None:
        super().__init__()
        self.max_num_seqs = (config or EngineConfig()).max_num_seqs
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._send_lock = threading.Lock()
        self._proc = ctx.Process(
            target=_process_main,
            args=(child, model, config or EngineConfig(), torch_threads, logging.getLogger().level),
            name="firsttoken-engine-core",
            daemon=True,  # never outlives a worker that exits normally
        )
        self._proc.start()
        child.close()
        self.model_name = model
        self.info: dict[str, Any] = {}
        try:
            ready = self._conn.poll(start_timeout_s)
            msg = self._conn.recv() if ready else None
        except (EOFError, OSError):
            msg = ("error", f"the engine process exited while starting (exit code {self._exit_code()})")
        if msg is None:
            self._kill()
            raise EngineCoreError(f"the engine process did not start within {start_timeout_s:.0f} s")
        if msg[0] != "ready":
            self._kill()
            raise EngineCoreError(f"the engine process failed to start: {msg[1]}")
        self.info = msg[1]
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()
        log.info("engine core process %d ready (%s)", self._proc.pid, self.info.get("device", "?"))

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def start(self) -> None:
        """The process started in the constructor."""

    def submit(self, requests: list[AddRequest]) -> None:
        self._send(("add", requests))

    def abort(self, request_ids: Sequence[str]) -> None:
        self._send(("abort", list(request_ids)))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop and wait for the process; kill it when it does not."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(EngineCoreError):
            self._send(("stop",))
        self._proc.join(timeout_s)
        # join returns once the process's sentinel closes, which an exiting process with a large
        # device mapping does before it can be reaped (seen on the H200: "alive" 0.2 s after the
        # stop, and killed while it exited): wait out the rest of the timeout for the exit itself
        while self._proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._proc.is_alive():
            log.warning("engine process %d did not stop within %.0f s; killing it", self._proc.pid, timeout_s)
            self._kill()
        self._reader.join(5.0)
        self._conn.close()

    def _read(self) -> None:
        """The reader thread: outputs into the queue until the core stops, fails or dies."""
        while True:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                err = EngineCoreError(f"the engine process exited (exit code {self._exit_code()})")
                break
            if kind == "error":
                err = EngineCoreError(f"the engine failed: {payload}")
                break
            self._outputs.put(payload)
        self._outputs.put(_Failed(err))

    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError) as exc:  # BrokenPipeError; ValueError: closed connection
            raise EngineCoreError(f"the engine process is gone (exit code {self._exit_code()})") from exc

    def _exit_code(self) -> int | None:
        self._proc.join(0.5)
        return self._proc.exitcode

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5.0)


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


def _process_main(conn: Any, model: str, config: EngineConfig, torch_threads: int | None, log_level: int) -> None:
    """The child process: load the engine, say ready, serve until told to stop or the worker is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level or logging.WARNING, format=f"%(asctime)s engine-core[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    try:
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        engine = LLMEngine(model, config)
        engine.warm_guided()  # the grammar engine's vocabulary index, off the first guided job's path
        device = str(engine.runner.device)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    freeze_startup_heap()
    conn.send(("ready", {"model": model, "device": device, "pid": os.getpid()}))

    def receive(timeout_s: float) -> list[tuple] | None:
        try:
            if not conn.poll(timeout_s):
                return []
            cmds = [conn.recv()]
            while conn.poll(0):
                cmds.append(conn.recv())
            return cmds
        except (EOFError, OSError):  # the worker is gone
            return None

    def emit(out: CoreOutputs) -> None:
        conn.send(("out", out))

    code = 0
    try:
        serve(engine, receive, emit)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the worker is gone
    except BaseException as exc:
        log.exception("the engine core failed")
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=20)}"))
        code = 1
    _exit_now(code)


def _exit_now(code: int) -> None:
    """End the core process without the interpreter's teardown. A spawned child otherwise exits
    through sys.exit: atexit handlers, module teardown, torch's and Triton's destructors over
    the model, its CUDA graphs and a KV cache of most of the GPU. On an H200 (Llama-3.1-8B, 256
    sequences) that took longer than the 10 s ProcessCore.stop waits, and the core was killed.
    The core holds nothing durable (its outputs went to the worker, which owns the results), and
    the driver reclaims the device memory of an exiting process."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
