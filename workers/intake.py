"""The intake: a thread that owns the queue consumer, feeds jobs to the engine loop, and commits.

The consumer (kafka-python's is not thread-safe) is used by this thread only: it polls in short
slices so that a busy GPU never keeps the group from hearing from this worker, pauses every
partition while the engine (or the sink) is over its bound and resumes them when it drains, and
commits the offsets the sink reports durable. Poison messages never reach the engine: the
consumer sends them to the dead-letter topic.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from pipeline.queue import JobConsumer, Message
from schemas.job import ErrorCode

log = logging.getLogger(__name__)

def error_code_of(engine_code: str) -> ErrorCode:
    """The ErrorCode of a request the engine refused (its InvalidRequestError's code, which crossed
    the engine core's pipe as a string)."""
    try:
        return ErrorCode(engine_code)
    except ValueError:
        return ErrorCode.ENGINE_ERROR


class Intake:
    """Polls `consumer` on its own thread and hands each batch of jobs to `deliver`.

    `overloaded()` is asked before every poll: while it is true every partition is paused (the
    poll goes on, so the group keeps this member), and when it turns false they are resumed.
    `commit_later(messages)` may be called from any thread; the commits happen on this one.
    """

    def __init__(
        self,
        consumer: JobConsumer,
        deliver: Callable[[list[Message]], None],
        overloaded: Callable[[], bool] = lambda: False,
        *,
        poll_timeout_s: float = 0.02,
        max_messages: int = 256,
        commit_interval_s: float = 0.05,
        name: str = "intake",
        each_poll: Callable[[], None] = lambda: None,
        room: Callable[[], int] | None = None,
    ) -> None:
        self.consumer = consumer
        self._deliver = deliver
        self._overloaded = overloaded
        self._each_poll = each_poll  # on this thread before every poll (work the worker holds back)
        # how many jobs the worker can take now: a poll takes no more, so what waits in the
        # consumer (round-robin over its partitions) is handed out as room frees, not all at once
        self._room = room
        self.poll_timeout_s = poll_timeout_s
        self.max_messages = max_messages
        self.commit_interval_s = commit_interval_s
        self._to_commit: deque[Message] = deque()
        self._taking = True  # false while draining: poll (stay in the group) but deliver nothing
        self._stop = threading.Event()
        self._paused = False
        # back-pressure intervals (wall clock), the open one last with end None: how long a job
        # waited because this worker held off (firsttoken's queue time, not its overhead)
        self._pause_log: deque[list[float | None]] = deque(maxlen=4096)
        self._last_commit = 0.0
        self._commit_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.delivered = 0
        self.committed_messages = 0
        self.pauses = 0
        self.errors = 0

    # --- any thread ------------------------------------------------------------------------------

    def commit_later(self, messages: list[Message]) -> None:
        """Messages whose results are durable: commit their offsets on the intake thread."""
        self._to_commit.extend(messages)

    def stop_taking(self) -> None:
        """Deliver nothing more (draining); the consumer keeps polling and committing."""
        self._taking = False

    @property
    def paused(self) -> bool:
        """True while the partitions are paused for back-pressure (or draining)."""
        return self._paused

    def paused_between(self, start: float, end: float) -> float:
        """Seconds of [start, end] (wall clock) this intake spent paused: what a job submitted at
        `start` and taken at `end` waited for this worker to have room. On the intake thread (the
        one that writes the log: no copy, no lock)."""
        total = 0.0
        for a, b in reversed(self._pause_log):
            b = end if b is None else b
            if b <= start:
                break  # the log is in time order: the rest ended earlier still
            total += max(0.0, min(b, end) - max(a, start))  # type: ignore[type-var,operator]
        return total

    def start(self) -> None:
        """Start the polling thread."""
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Commit what is durable, leave the group and stop the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("intake thread did not stop within %.0f s", timeout_s)
            return
        try:
            self.consumer.close(commit=True)
        except Exception as exc:
            log.warning("closing the consumer: %s", exc)

    # --- the intake thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._commit(force=False)
                if self._taking:
                    self._each_poll()
                self._apply_backpressure()
                n = self.max_messages if self._room is None else max(1, min(self.max_messages, self._room()))
                messages = self.consumer.poll(self.poll_timeout_s, n)
            except Exception as exc:  # broker down, rebalance failure: keep going, the client reconnects
                self.errors += 1
                log.warning("intake: %s: %s", type(exc).__name__, exc)
                self._stop.wait(0.5)
                continue
            if messages and self._taking:
                self.delivered += len(messages)
                self._deliver(messages)
        try:
            self._commit(force=True)
        except Exception as exc:
            log.warning("intake: final commit failed (%s); uncommitted jobs will be delivered again", exc)

    def _apply_backpressure(self) -> None:
        want = (not self._taking) or self._overloaded()
        if want and not self._paused:
            self.consumer.pause()
            self._paused = True
            self.pauses += 1
            self._pause_log.append([time.time(), None])
            log.debug("intake paused")
        elif not want and self._paused:
            self.consumer.resume()
            self._paused = False
            if self._pause_log:
                self._pause_log[-1][1] = time.time()
            log.debug("intake resumed")

    def _commit(self, *, force: bool) -> None:
        """Commit the offsets of the durable messages: asynchronously while running (a synchronous
        commit kept this thread from polling for a broker round trip, 2-5 ms, every interval: a
        job arriving then waited), synchronously at the end."""
        now = time.monotonic()
        if not force and now - self._last_commit < self.commit_interval_s:
            return
        done: list[Message] = []
        while self._to_commit:
            done.append(self._to_commit.popleft())
        if not done and self._commit_error is None and not force:
            return
        self._last_commit = now
        try:
            if force:
                self.consumer.commit(done)
            else:
                self.consumer.commit_async(done)
        except Exception as exc:
            # The tracker already holds them as done: the next successful commit includes them.
            if self._commit_error is None:
                log.warning("offset commit failed (%s); retrying", exc)
            self._commit_error = str(exc)
            return
        if self._commit_error is not None and self.consumer.commit_error is None:
            log.info("offset commits work again")
        # an asynchronous commit that failed is retried at the next interval
        self._commit_error = self.consumer.commit_error
        self.committed_messages += len(done)
