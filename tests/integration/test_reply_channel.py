"""The API's reply channel on a real Redis: every live completion shares one subscriber connection,
each message reaches its own job's waiter only, a subscription is confirmed by Redis before
`subscribe` returns (so a job queued after it cannot publish unheard), and closing a waiter
unsubscribes its channel."""

from __future__ import annotations

import asyncio
import uuid

import redis

from pipeline.replies import ReplyWaiter, delta_message, reply_channel, sign_message

KEY = b"reply-channel-test-key-0123456789"  # the HMAC key the workers and this API share (Settings.reply_key)


def _signed(job_id: str, message: bytes) -> bytes:
    return sign_message(KEY, job_id, message)


def _pubsub_clients(client: redis.Redis) -> int:
    """Connections of this Redis in subscriber mode (CLIENT LIST flags 'P')."""
    return sum(1 for c in client.client_list() if "P" in c.get("flags", ""))


def test_many_completions_share_one_subscriber_connection(redis_url):
    client = redis.Redis.from_url(redis_url)
    before = _pubsub_clients(client)
    run = uuid.uuid4().hex[:8]
    jobs = [f"reply-{run}-{i}" for i in range(200)]

    async def main() -> None:
        waiter = ReplyWaiter(redis_url, key=KEY)
        subs = await asyncio.gather(*(waiter.subscribe(j) for j in jobs))
        assert waiter.live == len(jobs)
        # confirmed by Redis: a publish right after subscribe() returns reaches its subscriber
        counts = client.pubsub_numsub(*(reply_channel(j) for j in jobs))
        assert all(n == 1 for _, n in counts), counts[:3]
        assert _pubsub_clients(client) == before + 1  # one connection for the 200
        for i, j in enumerate(jobs):
            client.publish(reply_channel(j), _signed(j, delta_message(f"text {i}", 1, 0)))
        got = await asyncio.gather(*(s.next(5.0) for s in subs))
        assert [g["text"] for g in got] == [f"text {i}" for i in range(len(jobs))]  # each to its own job
        assert await subs[0].next(0.2) is None  # nothing more for it
        # half of them finish: their channels are unsubscribed, the rest still hear theirs
        await asyncio.gather(*(s.close() for s in subs[:100]))
        assert waiter.live == 100
        counts = dict(client.pubsub_numsub(*(reply_channel(j) for j in jobs)))
        assert counts[reply_channel(jobs[0]).encode()] == 0 and counts[reply_channel(jobs[150]).encode()] == 1
        client.publish(reply_channel(jobs[150]), _signed(jobs[150], delta_message("late", 1, 0)))
        assert (await subs[150].next(5.0))["text"] == "late"
        await asyncio.gather(*(s.close() for s in subs[100:]))
        assert waiter.live == 0
        # the reader stops with nobody listening, and a new subscription starts it again
        sub = await waiter.subscribe(f"reply-{run}-again")
        client.publish(reply_channel(f"reply-{run}-again"), _signed(f"reply-{run}-again", delta_message("again", 1, 0)))
        assert (await sub.next(5.0))["text"] == "again"
        await waiter.close()

    asyncio.run(main())
    assert _pubsub_clients(client) == before  # closed: its connection is gone


def test_completions_in_flight_are_counted_per_owner_and_released_once(redis_url):
    """The per-owner limit of live completions (api_max_live_completions) is the waiter's own count
    of each owner's open subscriptions: checked and counted before any wait, given back once."""
    from pipeline.replies import LiveLimitError

    run = uuid.uuid4().hex[:8]

    async def main() -> None:
        waiter = ReplyWaiter(redis_url, key=KEY)
        a1 = await waiter.subscribe(f"{run}-a1", "alice", 2)
        a2 = await waiter.subscribe(f"{run}-a2", "alice", 2)
        try:
            await waiter.subscribe(f"{run}-a3", "alice", 2)
        except LiveLimitError as exc:
            assert (exc.have, exc.limit) == (2, 2)
        else:
            raise AssertionError("a third live subscription past the limit")
        assert waiter.live == 2  # the refused one left nothing behind
        b = await waiter.subscribe(f"{run}-b", "bob", 2)  # another owner has its own
        await a1.close()
        await a1.close()  # a second close gives nothing back
        assert waiter.live_of("alice") == 1 and waiter.live_of("bob") == 1
        a3 = await waiter.subscribe(f"{run}-a3", "alice", 2)
        try:
            await waiter.subscribe(f"{run}-a4", "alice", 2)
        except LiveLimitError:
            pass
        else:
            raise AssertionError("past the limit again")
        for s in (a2, a3, b):
            await s.close()
        assert waiter.live == 0 and waiter.live_of("alice") == 0
        # no owner (no auth), or no limit: not limited
        subs = [await waiter.subscribe(f"{run}-n{i}", None, 2) for i in range(3)]
        subs += [await waiter.subscribe(f"{run}-u{i}", "alice", 0) for i in range(3)]
        assert waiter.live == 6
        await waiter.close()

    asyncio.run(main())


def test_an_unreachable_redis_fails_the_subscription_not_the_process():
    async def main() -> None:
        waiter = ReplyWaiter("redis://127.0.0.1:1/0", key=KEY, confirm_timeout_s=1.0)  # nothing listens on port 1
        try:
            await waiter.subscribe("nobody")
        except (redis.RedisError, OSError, TimeoutError) as exc:
            assert waiter.live == 0, exc
        else:
            raise AssertionError("subscribed to an unreachable Redis")
        await waiter.close()

    asyncio.run(main())


def test_a_restarted_redis_is_subscribed_again(tmp_path):
    """A Redis of the test's own, stopped and started again on its port while a completion waits:
    redis-py reconnects and subscribes again to every channel, so the replies published after the
    restart reach their waiters (what was published while it was down is read from the store)."""
    import shutil
    import socket
    import subprocess
    import time

    server = shutil.which("redis-server")
    assert server is not None, "redis-server is needed (scripts/services.sh installs it)"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def start() -> subprocess.Popen:
        p = subprocess.Popen([server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                              "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=port, socket_connect_timeout=0.2).ping():
                    return p
            except redis.RedisError:
                time.sleep(0.05)
        p.kill()
        raise AssertionError("the test's redis-server did not start")

    proc = start()
    url = f"redis://127.0.0.1:{port}/0"

    async def main() -> None:
        nonlocal proc
        waiter = ReplyWaiter(url, key=KEY)
        sub = await waiter.subscribe("restart-job")
        redis.Redis.from_url(url).publish(reply_channel("restart-job"), _signed("restart-job", delta_message("before", 1, 0)))
        assert (await sub.next(5.0))["text"] == "before"
        proc.terminate()
        proc.wait(10)
        assert await sub.next(1.0) is None  # Redis is gone: nothing arrives, and nothing raises
        proc = start()
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 20
        while client.pubsub_numsub(reply_channel("restart-job"))[0][1] == 0:  # subscribed again
            assert time.monotonic() < deadline, "the waiter did not subscribe again"
            await asyncio.sleep(0.1)
        client.publish(reply_channel("restart-job"), _signed("restart-job", delta_message("after", 2, 6)))
        got = await sub.next(5.0)
        assert got is not None and got["text"] == "after"
        await sub.close()
        await waiter.close()

    try:
        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait(10)
