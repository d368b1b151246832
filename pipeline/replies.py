"""Live replies: a worker tells the process waiting on a job (the API answering an OpenAI
completion) about the job's text as it grows and its result when it ends, over Redis pub/sub.

Only jobs that ask for it (`JobRequest.reply`: "final", or "stream" for text deltas too) are
published, on the channel `firsttoken:reply:<job id>`; the waiter subscribes before the job is
queued, so it misses nothing a live worker sends. Pub/sub is fire-and-forget: the result row in
the store stays the record (a waiter that hears nothing looks there), and a publisher that cannot
reach Redis drops replies without slowing the worker (it says so once).

Messages are JSON: `{"type": "delta", "text": "...", "tokens": n, "offset": chars before it}` (and
`"index"`: the choice, when not 0) and
`{"type": "final", "result": <JobResult as JSON>}`, each sent bound to its job: `v1.<HMAC>.<JSON>`,
the HMAC-SHA256 (Settings.reply_key, which the API and the workers share) of the job id and the
JSON. Whoever can PUBLISH on Redis without the key cannot make the API serve a reply: a message
that is not signed for its channel's job, or that does not parse, is dropped (ReplyRejected).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import threading
import time
from collections import Counter, deque
from typing import Any

from schemas.job import JobResult

log = logging.getLogger(__name__)

CHANNEL_PREFIX = "firsttoken:reply:"


def reply_channel(job_id: str) -> str:
    """The pub/sub channel of one job's replies."""
    return CHANNEL_PREFIX + job_id


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def delta_message(text: str, tokens: int, offset: int, index: int = 0) -> bytes:
    """A text delta of choice `index`: `text` is new output starting at character `offset` of
    that choice's text, `tokens` its output tokens so far. The offset lets a waiter drop what it
    already has when a job redelivered to another worker streams again from its start."""
    msg: dict[str, object] = {"type": "delta", "text": text, "tokens": tokens, "offset": offset}
    if index:
        msg["index"] = index
    return json.dumps(msg, ensure_ascii=False).encode()


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
            if not isinstance(msg.get("text"), str) or not _count(msg.get("offset", 0)) \
                    or not _count(msg.get("index", 0)):
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


# --- the waiting side (the API: one shared subscriber connection per process) ---------------


class ReplyWaiter:
    """Jobs' reply channels on Redis over one shared subscriber connection (redis.asyncio): a reader
    task routes each message to its job's `Subscription`, so a thousand live completions hold one
    Redis connection, not a thousand, and a new one costs a SUBSCRIBE, not a connection.

    `subscribe` returns once Redis has confirmed the subscription, so a job queued after it cannot
    publish before anyone listens. A connection lost meanwhile is re-made by redis-py, which
    subscribes again to every channel; what was published in the gap is read from the store by
    the waiters (firsttoken.api.completions.POLL_STORE_S).
    """

    def __init__(self, redis_url: str, *, key: bytes, confirm_timeout_s: float = 5.0) -> None:
        import redis.asyncio

        self._key = key
        self.rejected = 0  # messages dropped: not signed for their channel's job, or malformed
        self._redis = redis.asyncio.Redis.from_url(redis_url, socket_connect_timeout=2.0)
        self._pubsub = self._redis.pubsub()
        self._subs: dict[bytes, Subscription] = {}  # channel -> its waiter
        self._owners: Counter[str] = Counter()  # owner -> its subscriptions open here
        self._reader: asyncio.Task[None] | None = None
        # one command at a time on the shared connection (the first one also makes the connection)
        self._send = asyncio.Lock()
        self.confirm_timeout_s = confirm_timeout_s

    @property
    def live(self) -> int:
        """Subscriptions open now."""
        return len(self._subs)

    def live_of(self, owner: str) -> int:
        """Subscriptions of `owner` open now."""
        return self._owners[owner]

    async def subscribe(self, job_id: str, owner: str | None = None, max_live: int = 0) -> Subscription:
        """Subscribe to a job's replies, as one of `owner`'s; LiveLimitError when `owner` holds
        `max_live` (0: no limit) already (checked and counted before any wait: no race)."""
        if max_live and owner is not None and self._owners[owner] >= max_live:
            raise LiveLimitError(self._owners[owner], max_live)
        channel = reply_channel(job_id).encode()
        sub = Subscription(self, channel, job_id, owner)
        self._subs[channel] = sub
        if owner is not None:
            self._owners[owner] += 1
        try:
            async with self._send:
                await self._pubsub.subscribe(channel)
            if self._reader is None or self._reader.done():
                self._reader = asyncio.get_running_loop().create_task(self._read(), name="firsttoken-replies")
            await asyncio.wait_for(sub.confirmed.wait(), self.confirm_timeout_s)
        except BaseException:
            await self.unsubscribe(channel)
            raise
        return sub

    async def unsubscribe(self, channel: bytes) -> None:
        """Drop a subscription (once: a second call does nothing)."""
        sub = self._subs.pop(channel, None)
        if sub is not None:
            if sub.owner is not None:
                self._owners[sub.owner] -= 1
                if not self._owners[sub.owner]:
                    del self._owners[sub.owner]
            with contextlib.suppress(Exception):
                async with self._send:
                    await self._pubsub.unsubscribe(channel)

    async def _read(self) -> None:
        """Route messages until no subscription is left (the next subscribe starts it again)."""
        while self._subs:
            try:
                msg = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis unreachable: the waiters read the store meanwhile
                log.warning("reply channel: %s; retrying", type(exc).__name__)
                await asyncio.sleep(0.5)
                continue
            if msg is None:
                continue
            sub = self._subs.get(msg["channel"])
            if sub is None:
                continue
            if msg["type"] == "subscribe":
                sub.confirmed.set()
            elif msg["type"] == "message":
                try:
                    sub.queue.put_nowait(parse_message(msg["data"], sub.job_id, self._key))
                except ReplyRejected as exc:  # never served; the content is not logged
                    self.rejected += 1
                    log.warning("reply channel of job %s: dropped a message (%s)", sub.job_id, exc)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        self._subs.clear()
        self._owners.clear()
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()
        await self._redis.aclose()


class LiveLimitError(Exception):
    """An owner holds as many live subscriptions as it may."""

    def __init__(self, have: int, limit: int) -> None:
        super().__init__(f"{have} live of at most {limit}")
        self.have, self.limit = have, limit


class Subscription:
    """One job's replies, as the shared reader hands them over."""

    def __init__(self, waiter: ReplyWaiter, channel: bytes, job_id: str, owner: str | None = None) -> None:
        self._waiter = waiter
        self.channel = channel
        self.job_id = job_id
        self.owner = owner
        self.confirmed = asyncio.Event()
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def next(self, timeout_s: float) -> dict[str, Any] | None:
        """The next reply (checked: signed for this job, well formed), or None after `timeout_s` without one."""
        try:
            return await asyncio.wait_for(self.queue.get(), timeout_s)
        except TimeoutError:
            return None

    async def close(self) -> None:
        await self._waiter.unsubscribe(self.channel)
