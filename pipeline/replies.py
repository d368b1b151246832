"""Live replies: a worker tells the process waiting on a job (the API answering an OpenAI
completion) about the job's text as it grows and its result when it ends, over Redis pub/sub.

Only jobs that ask for it (`JobRequest.reply`: "final", or "stream" for text deltas too) are
published, on the channel `firsttoken:reply:<job id>`; the waiter subscribes before the job is
queued, so it misses nothing a live worker sends. Pub/sub is fire-and-forget: the result row in
the store stays the record (a waiter that hears nothing looks there), and a publisher that cannot
reach Redis drops replies without slowing the worker (it says so once).

Messages are JSON: `{"type": "delta", "text": "...", "tokens": n, "offset": chars before it}` and
`{"type": "final", "result": <JobResult as JSON>}`, each sent bound to its job: `v1.<HMAC>.<JSON>`,
the HMAC-SHA256 (Settings.reply_key, which the API and the workers share) of the job id and the
JSON. Whoever can PUBLISH on Redis without the key cannot make the API serve a reply: a message
that is not signed for its channel's job, or that does not parse, is dropped (ReplyRejected).
"""

from __future__ import annotations

import hashlib
import hmac
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


SIGNED_PREFIX = b"v1."
_MAC_HEX = 64


class ReplyRejected(ValueError):
    """A message on a job's reply channel that is not a reply of that job (unsigned, signed for
    another job or with another key, or malformed). Its text names the reason, never the content."""


def _mac(key: bytes, job_id: str, body: bytes) -> bytes:
    return hmac.new(key, job_id.encode("utf-8", "surrogatepass") + b"\n" + body, hashlib.sha256).hexdigest().encode()


def sign_message(key: bytes, job_id: str, body: bytes) -> bytes:
    """`body` (a delta or final message) as sent on `job_id`'s channel: bound to that job by an HMAC."""
    return SIGNED_PREFIX + _mac(key, job_id, body) + b"." + body


def parse_message(data: bytes | str, job_id: str, key: bytes) -> dict[str, Any]:
    """A reply of `job_id` as a dict (`result` of a final one as a JobResult). Raises ReplyRejected
    when it is not signed with `key` for this job, or is not a well-formed delta or final message."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if not raw.startswith(SIGNED_PREFIX) or raw[len(SIGNED_PREFIX) + _MAC_HEX : len(SIGNED_PREFIX) + _MAC_HEX + 1] != b".":
        raise ReplyRejected("not a signed reply")
    mac = raw[len(SIGNED_PREFIX) : len(SIGNED_PREFIX) + _MAC_HEX]
    body = raw[len(SIGNED_PREFIX) + _MAC_HEX + 1 :]
    if not hmac.compare_digest(mac, _mac(key, job_id, body)):
        raise ReplyRejected("signed for another job or with another key")
    try:
        msg = json.loads(body)
        kind = msg.get("type") if isinstance(msg, dict) else None
        if kind == "final":
            msg["result"] = JobResult.model_validate(msg["result"])
            if msg["result"].id != job_id:
                raise ReplyRejected("a result of another job")
        elif kind == "delta":
            if not isinstance(msg.get("text"), str) or not isinstance(msg.get("offset", 0), int) \
                    or isinstance(msg.get("offset", 0), bool) or msg.get("offset", 0) < 0:
                raise ReplyRejected("a malformed delta")
        else:
            raise ReplyRejected("neither a delta nor a final message")
    except ReplyRejected:
        raise
    except Exception as exc:  # bad JSON, a result that does not validate
        raise ReplyRejected(f"malformed ({type(exc).__name__})") from None
    return msg


class ReplyPublisher:
    """Publishes replies from a thread of its own, so a slow or absent Redis never holds up the
    caller: `put` queues and returns. At most `max_pending` replies wait; older ones are dropped.
    Each reply is signed for its job with `key` (default: the process settings' reply_key)."""

    def __init__(self, redis_url: str, *, key: bytes | None = None, max_pending: int = 100_000,
                 retry_s: float = 5.0) -> None:
        if key is None:
            from pipeline.settings import get_settings

            key = get_settings().reply_key
        self._key = key
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
            self._queue.append((job_id, message))  # signed on the publisher's thread
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
                for job_id, message in batch:
                    pipe.publish(reply_channel(job_id), sign_message(self._key, job_id, message))
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
