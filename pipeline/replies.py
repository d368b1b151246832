"""Live replies: a worker tells the process waiting on a job (the API answering an OpenAI
completion) about the job's text as it grows and its result when it ends, over Redis pub/sub.

Only jobs that ask for it (`JobRequest.reply`: "final", or "stream" for text deltas too) are
published, on the channel `firsttoken:reply:<job id>`; the waiter subscribes before the job is
queued, so it misses nothing a live worker sends. Pub/sub is fire-and-forget: the result row in
the store stays the record (a waiter that hears nothing looks there), and a publisher that cannot
reach Redis drops replies without slowing the worker (it says so once).

Messages are JSON: `{"type": "delta", "text": "...", "tokens": n, "offset": chars before it}` and
`{"type": "final", "result": <JobResult as JSON>}`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Any

from schemas.job import JobResult

log = logging.getLogger(__name__)

CHANNEL_PREFIX = "firsttoken:reply:"


def reply_channel(job_id: str) -> str:
    """The pub/sub channel of one job's replies."""
    return CHANNEL_PREFIX + job_id


def delta_message(text: str, tokens: int, offset: int) -> bytes:
    """A text delta: `text` is new output starting at character `offset` of the job's text,
    `tokens` the output tokens so far. The offset lets a waiter drop what it already has when a
    job redelivered to another worker streams again from its start."""
    return json.dumps({"type": "delta", "text": text, "tokens": tokens, "offset": offset}, ensure_ascii=False).encode()


def final_message(result: JobResult) -> bytes:
    """The job's terminal result."""
    return b'{"type":"final","result":' + result.model_dump_json().encode() + b"}"


def parse_message(data: bytes | str) -> dict[str, Any]:
    """A reply message as a dict; `result` of a final one as a JobResult."""
    msg = json.loads(data)
    if msg.get("type") == "final":
        msg["result"] = JobResult.model_validate(msg["result"])
    return msg


class ReplyPublisher:
    """Publishes replies from a thread of its own, so a slow or absent Redis never holds up the
    caller: `put` queues and returns. At most `max_pending` replies wait; older ones are dropped."""

    def __init__(self, redis_url: str, *, max_pending: int = 100_000, retry_s: float = 5.0) -> None:
        self.redis_url = redis_url
        self.max_pending = max_pending
        self.retry_s = retry_s
        self._queue: deque[tuple[str, bytes]] = deque(maxlen=max_pending)
        self._cond = threading.Condition()
        self._stop = False
        self._client: Any = None
        self._down_until = 0.0
        self._warned = False
        self.published = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="reply-publisher", daemon=True)
        self._thread.start()

    def put(self, job_id: str, message: bytes) -> None:
        """Queue one reply of `job_id`."""
        with self._cond:
            if len(self._queue) == self.max_pending:
                self.dropped += 1
            self._queue.append((reply_channel(job_id), message))
            self._cond.notify()

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is queued (for up to `timeout_s`), then stop."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _connect(self) -> Any:
        if self._client is None:
            import redis

            self._client = redis.Redis.from_url(self.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        return self._client

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait(0.5)
                if not self._queue and self._stop:
                    return
                batch = list(self._queue)
                self._queue.clear()
            if time.monotonic() < self._down_until:
                self.dropped += len(batch)
                continue
            try:
                pipe = self._connect().pipeline(transaction=False)
                for channel, message in batch:
                    pipe.publish(channel, message)
                pipe.execute()
                self.published += len(batch)
                self._warned = False
            except Exception as exc:  # Redis down: drop these, try again in a while
                self.dropped += len(batch)
                self._down_until = time.monotonic() + self.retry_s
                self._client = None
                if not self._warned:
                    log.warning("replies not published (%s); the results are still stored", type(exc).__name__)
                    self._warned = True
