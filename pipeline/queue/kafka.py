"""KafkaQueue: jobs on a Kafka topic through kafka-python.

Producer: idempotent, acks=all; the key is the job's routing key, so jobs sharing a prefix land on
one partition. A small publish sends record by record; a large one hands the producer whole
record batches per partition (kafka_batches.py). Requests go on the wire as soon as they are
built. (Every use of kafka-python's internals is in kafka_internals.py, which checks the
installed version.) Consumer: a group member with auto-commit off and a fetch kept in
flight (the broker answers it as soon as data arrives), committing per partition up to the
lowest offset still in flight; pause/resume; on revocation it commits what finished for those
partitions and forgets their in-flight offsets; poison messages go to the dead-letter topic.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import numpy as np
from kafka import AsyncConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from kafka.errors import KafkaError, MessageSizeTooLargeError, TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata, TopicPartition

from pipeline.queue.base import (
    DLQ_ERROR,
    DLQ_ERROR_CODE,
    DLQ_ORIGIN_OFFSET,
    DLQ_ORIGIN_PARTITION,
    DLQ_ORIGIN_TOPIC,
    JobConsumer,
    JobQueue,
    PoisonReport,
    RawMessage,
    encode_job,
    routing_key,
)
from pipeline.queue.kafka_batches import BATCH_HEADER_BYTES, make_batch, partitions_for, record_size
from pipeline.queue.kafka_internals import (
    append_batches,
    batch_error,
    batch_succeeded,
    commit_in_loop,
    heartbeat_clock,
    install_eager_writes,
    membership,
    polling_thread_client,
    record_format,
)
from pipeline.settings import Settings, get_settings
from schemas.job import JobRequest
from schemas.limits import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

# The largest record batch the producer sends (max_request_size) and the broker takes
# (message.max.bytes, set by scripts/services.sh and compose.yaml; max.message.bytes on the topics
# created here): room for one job message of schemas.limits.MAX_MESSAGE_BYTES and its batch header.
# kafka-python's default (1 MiB) refused a 2 MB prompt that the line limit allows.
MAX_BATCH_BYTES = 10 * 1024 * 1024
assert MAX_BATCH_BYTES >= MAX_MESSAGE_BYTES + BATCH_HEADER_BYTES + 1024
RECONNECT_BACKOFF_MAX_MS = 1000


class _NoPasswords(logging.Filter):
    """kafka-python logs at DEBUG the admin client's whole configuration, every request a
    connection sends and its raw bytes: the SASL password among them (the config's
    sasl_plain_password, the SaslAuthenticate request's auth bytes). In those records each
    password of a client made here becomes '***'."""

    secrets: ClassVar[set[str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            try:
                message = record.getMessage()
            except Exception:  # a record whose arguments do not fit its format: the handler reports it
                return True
            if any(secret in message for secret in self.secrets):
                for secret in self.secrets:
                    message = message.replace(secret, "***")
                record.msg, record.args = message, ()
        return True


class _OnceOnly(logging.Filter):
    """The first record only (kafka-python warns on every SASL/PLAIN connection that the
    password goes in the clear: once per process says it)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        first, self.seen = not self.seen, True
        return first


# the loggers whose records carry a config, a request or its bytes (filters are per logger)
for _name in ("kafka.admin.client", "kafka.net.connection", "kafka.protocol.parser", "kafka.conn"):
    logging.getLogger(_name).addFilter(_NoPasswords())
logging.getLogger("kafka.net.sasl.plain").addFilter(_OnceOnly())


def client_config(settings: Settings) -> dict[str, Any]:
    """Settings.kafka_client_config, its password kept out of kafka-python's debug records."""
    config = settings.kafka_client_config
    password = config.get("sasl_plain_password")
    if isinstance(password, str) and password:
        _NoPasswords.secrets.add(password)
    return config


def _admin(settings: Settings, timeout_s: float) -> KafkaAdminClient:
    return KafkaAdminClient(
        **client_config(settings), client_id="firsttoken-admin", request_timeout_ms=int(timeout_s * 1000)
    )


def ensure_topics(
    settings: Settings,
    topics: dict[str, int],
    *,
    replication_factor: int = 1,
    timeout_s: float = 30.0,
) -> dict[str, int]:
    """Create the topics that are missing (name -> partition count) and wait until every one of
    them has a leader for each partition. Returns each topic's actual partition count (an
    existing topic keeps the count it has)."""
    admin = _admin(settings, timeout_s)
    try:
        existing = set(admin.list_topics())
        missing = [
            NewTopic(name, n, replication_factor, topic_configs={"max.message.bytes": str(MAX_BATCH_BYTES)})
            for name, n in topics.items()
            if name not in existing
        ]
        if missing:
            # Another process may create one in between: that is fine.
            with contextlib.suppress(TopicAlreadyExistsError):
                admin.create_topics(missing, timeout_ms=int(timeout_s * 1000))
        deadline = time.monotonic() + timeout_s
        while True:
            counts = _ready_partitions(admin, list(topics))
            if all(name in counts for name in topics):
                return counts
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"topics {sorted(set(topics) - set(counts))} have no leaders after {timeout_s:.0f} s"
                )
            time.sleep(0.1)
    finally:
        admin.close()


def delete_topics(settings: Settings, names: list[str], *, timeout_s: float = 30.0) -> list[str]:
    """Delete those of these topics that exist (throwaway topics of tests and benchmarks: a
    broker holding thousands of dead partitions carries them in its heap, and its garbage
    collections grow with them). Returns the names deleted."""
    admin = _admin(settings, timeout_s)
    try:
        existing = set(admin.list_topics())
        gone = [name for name in names if name in existing]
        if gone:
            admin.delete_topics(gone, timeout_ms=int(timeout_s * 1000))
        return gone
    finally:
        admin.close()


def _ready_partitions(admin: KafkaAdminClient, names: list[str]) -> dict[str, int]:
    # describe_topics answers with the DescribeTopicPartitions/Metadata field names of the
    # protocol version it used ("name"/"topic", "leader_id"/"leader"): accept both.
    out = {}
    for t in admin.describe_topics(names):
        if t.get("error_code", 0) != 0:
            continue
        parts = t.get("partitions") or []
        if parts and all(
            p.get("error_code", 0) == 0 and p.get("leader_id", p.get("leader", -1)) >= 0 for p in parts
        ):
            out[t.get("name") or t["topic"]] = len(parts)
    return out


class KafkaQueue(JobQueue):
    """Jobs on the Kafka topic `settings.jobs_topic` (created if missing)."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        topic: str | None = None,
        dlq_topic: str | None = None,
        partitions: int | None = None,
        create_topics: bool = True,
    ) -> None:
        self.settings = settings or get_settings()
        self.topic = topic or self.settings.jobs_topic
        self.dlq_topic = dlq_topic or self.settings.dlq_topic
        self.partitions = partitions or self.settings.jobs_partitions
        if create_topics:
            counts = ensure_topics(
                self.settings,
                {self.topic: self.partitions, self.dlq_topic: 1},
                replication_factor=self.settings.replication_factor,
            )
            self.partitions = counts[self.topic]
        self._producer: KafkaProducer | None = None

    def _get_producer(self) -> KafkaProducer:
        if self._producer is None:
            self._producer = make_producer(self.settings, client_id="firsttoken-producer")
        return self._producer

    def publish(self, jobs: Iterable[JobRequest]) -> list[JobRequest]:
        """Send jobs keyed by their routing key and wait until every one is acknowledged by all
        in-sync replicas. Raises the first send error (jobs before it may have been written:
        re-publishing is safe, the store dedupes by job id)."""
        stamped = list(self._stamp(jobs))
        prefix_chars = self.settings.prefix_key_chars
        keys = [routing_key(j, prefix_chars) for j in stamped]
        values = [encode_job(j) for j in stamped]
        if len(stamped) >= self.bulk_min_records:
            self._produce_batches(keys, values)
        else:
            self._produce_records(keys, values)
        return stamped

    # Below this many jobs a publish sends record by record (one small batch either way).
    bulk_min_records = 32

    def _produce_records(self, keys: list[bytes], values: list[bytes]) -> None:
        producer = self._get_producer()
        send, topic = producer.send, self.topic
        futures = [send(topic, key=k, value=v) for k, v in zip(keys, values, strict=True)]
        producer.flush()
        for f in futures:
            if f.failed():
                raise f.exception

    def _produce_batches(self, keys: list[bytes], values: list[bytes]) -> None:
        """Send many records as whole record batches (see pipeline.queue.kafka_batches): each
        partition's records, in order, in batches of up to `producer_batch_bytes`, appended to the
        producer's accumulator; returns once the broker acknowledged every batch (acks=all)."""
        producer = self._get_producer()
        topic = self.topic
        parts = producer.partitions_for(topic)  # waits for the topic's metadata when needed
        assigned = partitions_for(keys, len(parts))
        order = np.argsort(assigned, kind="stable")
        bounds = np.flatnonzero(np.diff(assigned[order])) + 1
        limit = producer.config["batch_size"]
        max_request = producer.config["max_request_size"]
        magic = record_format(producer)
        compression = producer.config["compression_attrs"]
        now, ts = time.monotonic(), int(time.time() * 1000)
        batches = []
        for run in np.split(order, bounds):
            tp = TopicPartition(topic, int(assigned[run[0]]))
            ks: list[bytes] = []
            vs: list[bytes] = []
            size = BATCH_HEADER_BYTES
            for i in run.tolist():
                k, v = keys[i], values[i]
                n = record_size(k, v)
                if n + BATCH_HEADER_BYTES > max_request:
                    raise MessageSizeTooLargeError(
                        f"a {n}-byte message is larger than max_request_size ({max_request})"
                    )
                if ks and size + n > limit:
                    batches.append(make_batch(tp, ks, vs, magic=magic, compression_attrs=compression,
                                              batch_size=limit, timestamp_ms=ts, now=now))
                    ks, vs, size = [], [], BATCH_HEADER_BYTES
                ks.append(k)
                vs.append(v)
                size += n
            batches.append(make_batch(tp, ks, vs, magic=magic, compression_attrs=compression,
                                      batch_size=limit, timestamp_ms=ts, now=now))
        append_batches(producer, batches)
        producer.flush()
        for b in batches:
            if not batch_succeeded(b):
                raise batch_error(b)

    def publish_raw(
        self, records: Iterable[tuple[bytes | None, bytes | None]], *, topic: str | None = None
    ) -> None:
        """Send raw (key, value) messages and wait for them (tests, and forwarding)."""
        producer = self._get_producer()
        futures = [producer.send(topic or self.topic, key=k, value=v) for k, v in records]
        producer.flush()
        for f in futures:
            if f.failed():
                raise f.exception

    def consumer(self, group: str | None = None, **overrides: Any) -> KafkaJobConsumer:
        """A new member of the consumer group (settings' consumer_group when None); it joins the
        group on its first poll."""
        return KafkaJobConsumer(self, group or self.settings.consumer_group, **overrides)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None


def make_producer(settings: Settings, *, client_id: str, **overrides: Any) -> KafkaProducer:
    """An idempotent, acks=all producer batched for bulk submission."""
    install_eager_writes()
    config: dict[str, Any] = {
        **client_config(settings),
        "client_id": client_id,
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": settings.producer_linger_ms,
        "batch_size": settings.producer_batch_bytes,
        "compression_type": None if settings.producer_compression == "none" else settings.producer_compression,
        "max_in_flight_requests_per_connection": 5,
        "allow_auto_create_topics": False,
        "max_request_size": MAX_BATCH_BYTES,
        "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
        # kafka-python's client metrics (sensors updated on every request and record) are read by
        # nothing here and cost CPU, and GIL time, on every batch
        "metrics_enabled": False,
    }
    config.update(overrides)
    return KafkaProducer(**config)


class StuckClientWatch:
    """When a consumer's client is stuck out of its group: no heartbeat answer (or, revoked, no
    assignment) for `stuck_after_s` while the broker is up.

    Time the broker was down does not count: silence is measured from the last heartbeat answer
    (or revocation) or from when a probe last found the broker down, whichever is later. So a
    client gets the whole bound once the broker is back, to reconnect (within
    reconnect_backoff_max_ms) and be heard under its member id, with no rebalance; a new client
    would join as a new member and wait for the old one's session to expire. The broker is probed
    (a TCP connection: its port is open once it serves, measured) every `probe_every_s` from
    `probe_after_s` of silence on and until it is found up, so an outage's end is known within a
    second. (Probing only
    once the bound had passed found, now and then, a broker just back from a kill -9, whose
    restart takes ~16 s on the 2-core box and more under load: the client was rebuilt and results
    resumed 23-47 s after the broker was ready instead of 1-3 s.)"""

    def __init__(self, *, stuck_after_s: float, probe_after_s: float, probe_every_s: float = 1.0) -> None:
        self.stuck_after_s = stuck_after_s
        self.probe_after_s = min(probe_after_s, stuck_after_s)
        self.probe_every_s = probe_every_s
        self.broker_down_at = 0.0  # monotonic: when a probe last found no broker
        self.broker_down = False  # what the last probe found: probed every probe_every_s while so
        self.last_probe = -float("inf")
        self.silent_s = 0.0  # as of the last check
        self.unassigned_s = 0.0

    def stuck(self, now: float, heard: float, revoked_at: float | None, reachable: Callable[[], bool]) -> bool:
        """Whether to rebuild now. `heard`: the last heartbeat answer (or join); `revoked_at`: the
        revocation not followed by an assignment (None: assigned); `reachable()`: the probe."""
        self.silent_s = now - max(heard, self.broker_down_at)
        self.unassigned_s = 0.0 if revoked_at is None else now - max(revoked_at, self.broker_down_at)
        quiet = max(self.silent_s, self.unassigned_s)
        if now - self.last_probe < self.probe_every_s:
            return False
        if quiet < self.probe_after_s and not self.broker_down:
            return False
        self.last_probe = now
        self.broker_down = not reachable()
        if self.broker_down:
            self.broker_down_at = now
            return False
        return quiet >= self.stuck_after_s


class _Rebalance(AsyncConsumerRebalanceListener):
    """kafka-python 3 calls the rebalance listener from inside its event loop (on the polling
    thread, or on its IO thread with `consumer_io_thread`), where a blocking call (a synchronous
    commit) is refused: the listener is async and awaits the revocation commit, so it completes
    before the consumer rejoins, while the loop (heartbeats) keeps running."""

    def __init__(self, owner: KafkaJobConsumer) -> None:
        self.owner = owner

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.owner._on_revoked({tp.partition for tp in revoked if tp.topic == self.owner.topic})

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.owner._on_assigned({tp.partition for tp in assigned if tp.topic == self.owner.topic})

    async def on_partitions_lost(self, lost: Any) -> None:
        # no longer the owner (evicted): nothing can be committed, only forgotten
        self.owner._forget({tp.partition for tp in lost if tp.topic == self.owner.topic})


class KafkaJobConsumer(JobConsumer):
    """A member of the workers' consumer group on the jobs topic."""

    def __init__(self, queue: KafkaQueue, group: str, **overrides: Any) -> None:
        super().__init__()
        s = queue.settings
        self.topic = queue.topic
        self.dlq_topic = queue.dlq_topic
        self.group = group
        config: dict[str, Any] = {
            **client_config(s),
            "group_id": group,
            "client_id": f"firsttoken-consumer-{group}",
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            # A fetch returns as soon as any data is there, and waits at most this long when none is.
            "fetch_max_wait_ms": s.fetch_max_wait_ms,
            "fetch_min_bytes": 1,
            "max_poll_records": s.max_poll_records,
            # per partition, most bytes a fetch brings (see Settings.max_partition_fetch_bytes):
            # every partition's messages arrive side by side, and poll hands them out round-robin
            "max_partition_fetch_bytes": s.max_partition_fetch_bytes,
            "session_timeout_ms": s.session_timeout_ms,
            "heartbeat_interval_ms": max(500, s.session_timeout_ms // 5),
            "max_poll_interval_ms": s.max_poll_interval_ms,
            "allow_auto_create_topics": False,
            # A group leader whose metadata misses a partition assigns without it until the next
            # refresh: keep that window short (kafka-python's default is 5 minutes).
            "metadata_max_age_ms": 10_000,
            # A lost SyncGroup/Heartbeat/Fetch is retried after this, not after the 30 s default
            # (JoinGroup, which the broker may hold for the rebalance timeout, is exempt).
            "request_timeout_ms": 10_000,
            # after a broker restart, reconnect within a second (kafka-python's backoff grows to
            # 30 s: a 10 s outage cost ~21 s more before the client tried again)
            "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
            "metrics_enabled": False,  # see make_producer
        }
        if s.group_instance_id:  # static membership: a restart under the same id rebalances nothing
            config["group_instance_id"] = s.group_instance_id
        if not s.consumer_io_thread:
            config["kafka_client"] = polling_thread_client
        config.update(overrides)
        self._config = config
        install_eager_writes()
        # Seen with kafka-python 3.0.12 on Kafka 4.1: after a quick leader rejoin the client stops
        # heartbeating and fetching; the broker drops it after the session timeout and it never
        # rejoins. Such a client is rebuilt (StuckClientWatch says when).
        self._watch = StuckClientWatch(
            stuck_after_s=s.session_timeout_ms / 1000.0 + 5.0,
            probe_after_s=2 * config["heartbeat_interval_ms"] / 1000.0,
        )
        self._revoked_at: float | None = None
        self.recreated = 0
        self._seek_pending: set[int] = set()  # assigned again, to be rewound to _dropped_from
        self._dropped_from: dict[int, int] = {}  # first offset fetched and dropped at a revocation
        self._consumer = self._new_client()
        self._dlq = make_producer(s, client_id=f"firsttoken-dlq-{group}", linger_ms=0)
        self._dlq_futures: list[Any] = []
        self._want_paused: set[int] = set()
        self._pause_all = False

    def _new_client(self) -> KafkaConsumer:
        consumer = KafkaConsumer(**self._config)
        self._consumer = consumer
        self._await_topic_metadata(timeout_s=30.0)
        consumer.subscribe([self.topic], listener=_Rebalance(self))
        self._revoked_at = None
        return consumer

    @property
    def stuck_after_s(self) -> float:
        """Silent (no heartbeat answer) or revoked without an assignment this long, with the
        broker up, the client is rebuilt."""
        return self._watch.stuck_after_s

    def _recreate_if_stuck(self) -> None:
        """Rebuild the client when a rejoin never completed (see StuckClientWatch). Messages in
        flight from the lost partitions are redelivered to their next owner; the store's
        idempotent upsert keeps one row per job."""
        now = time.monotonic()
        heard = heartbeat_clock(self._consumer)
        heard = now if heard is None else heard
        watch, down_before = self._watch, self._watch.broker_down_at
        if not watch.stuck(now, heard, self._revoked_at, self._broker_reachable):
            if watch.broker_down_at > down_before and down_before < heard:  # once an outage
                log.warning("consumer of %s: the broker does not answer; waiting for it", self.group)
            return
        silent, unassigned = watch.silent_s, watch.unassigned_s
        log.warning(
            "consumer of %s is out of its group (%.0f s without a heartbeat answer, %.0f s revoked "
            "without an assignment; %s): rejoining with a new client", self.group, silent, unassigned,
            membership(self._consumer),
        )
        for p in list(self._tracker.partitions()):
            self._tracker.revoke(p)
        self._drop_buffered()
        self._dropped_from.clear()  # a new client starts from the committed offsets
        self._handed_next.clear()
        self._want_paused.clear()
        self._async_commit_sent_at = None  # its answer would come to the old client
        with contextlib.suppress(Exception):
            self._consumer.close(autocommit=False)
        self._new_client()
        self.recreated += 1

    def _broker_reachable(self, timeout_s: float = 0.5) -> bool:
        """Whether some bootstrap server accepts a TCP connection now."""
        for server in self._config["bootstrap_servers"]:
            host, _, port = str(server).rpartition(":")
            try:
                with socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=timeout_s):
                    return True
            except (OSError, ValueError):
                continue
        return False

    def _await_topic_metadata(self, timeout_s: float) -> None:
        # kafka-python can run the group's partition assignment before the subscribed topic's
        # metadata has arrived, and then assigns nothing ("No partition metadata for topic")
        # until the next metadata refresh. Knowing the topic's partitions before subscribing
        # avoids that race.
        deadline = time.monotonic() + timeout_s
        while not self._consumer.partitions_for_topic(self.topic):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no metadata for topic {self.topic} after {timeout_s:.0f} s")
            time.sleep(0.05)

    # --- rebalance (kafka-python 3 runs these inside its event loop, during a poll() that holds
    # the lock: on the polling thread itself, or on the IO thread while the polling thread waits) ---

    async def _on_revoked(self, partitions: set[int]) -> None:
        self._revoked_at = time.monotonic()
        try:
            offsets = self._tracker.committable(partitions)
            if offsets:
                self._flush_dead_letters()
                await commit_in_loop(self._consumer, self._offset_map(offsets))
                self._tracker.committed(offsets)
                log.info("revoked %s: committed %s", sorted(partitions), offsets)
        except KafkaError as exc:
            log.warning(
                "revoked %s: commit failed (%s); the next owner re-reads from the last commit",
                sorted(partitions),
                exc,
            )
        self._forget(partitions)

    def _forget(self, partitions: set[int]) -> None:
        self._revoked_at = time.monotonic()
        self._drop_buffered(partitions)
        for p in partitions:
            self._tracker.revoke(p)
            self._want_paused.discard(p)

    def _on_assigned(self, partitions: set[int]) -> None:
        self._revoked_at = None
        # a partition this member held before the rebalance comes back at the position
        # kafka-python kept: past the messages this consumer had fetched and not handed out when
        # it was revoked (dropped then, as another member could get it). Read those again.
        self._seek_pending |= partitions & set(self._dropped_from)
        for p in set(self._dropped_from) - partitions:  # another member's now: it reads them
            del self._dropped_from[p]
        for p in set(self._handed_next) - partitions:
            del self._handed_next[p]
        for p in partitions:
            if p not in self._tracker.partitions():
                self._tracker.assign(p)
        if self._pause_all:
            self._want_paused |= partitions
        if self._want_paused & partitions:
            self._consumer.pause(*(TopicPartition(self.topic, p) for p in self._want_paused & partitions))
        log.info("assigned %s of %s", sorted(partitions), self.topic)

    # --- JobConsumer ---

    def _rewind_dropped(self) -> None:
        """Partitions assigned again since the last fetch: back to the first message dropped at
        their revocation, when kafka-python's position is past it (outside its event loop: the
        position lookup may block)."""
        pending, self._seek_pending = self._seek_pending & self.assignment(), set()
        for p in sorted(pending):
            # never before what this consumer has handed out already (a drop recorded at an
            # earlier rebalance may be older than what was read since)
            first = max(self._dropped_from.pop(p), self._handed_next.get(p, 0))
            tp = TopicPartition(self.topic, p)
            if self._consumer.position(tp) > first:
                self._consumer.seek(tp, first)

    def _drop_buffered(self, partitions: Iterable[int] | None = None) -> None:
        for p in list(self._buffers) if partitions is None else partitions:
            b = self._buffers.get(p)
            if b:
                self._dropped_from[p] = min(b[0].offset, self._dropped_from.get(p, b[0].offset))
        super()._drop_buffered(partitions)

    def _fetch(self, timeout_s: float, max_messages: int) -> list[RawMessage]:
        self._recreate_if_stuck()
        if self._seek_pending:
            self._rewind_dropped()
        records = self._consumer.poll(
            timeout_ms=int(timeout_s * 1000), max_records=max_messages, update_offsets=True
        )
        out = []
        for tp, msgs in records.items():
            if tp.partition in self._seek_pending:
                continue  # assigned again during this poll: read from the first dropped message next
            for r in msgs:
                out.append(RawMessage(tp.topic, tp.partition, r.offset, r.key, r.value, r.timestamp))
        return out

    def _offset_map(self, offsets: dict[int, int]) -> dict[TopicPartition, OffsetAndMetadata]:
        return {TopicPartition(self.topic, p): OffsetAndMetadata(off, "", -1) for p, off in offsets.items()}

    def _commit_offsets(self, offsets: dict[int, int]) -> None:
        self._consumer.commit(self._offset_map(offsets))

    def _commit_offsets_async(
        self, offsets: dict[int, int], on_done: Callable[[dict[int, int], BaseException | None], None]
    ) -> None:
        # kafka-python calls the callback from a later poll() on this consumer's polling thread
        def callback(_offsets: Any, response: Any) -> None:
            on_done(offsets, response if isinstance(response, BaseException) else None)

        self._consumer.commit_async(self._offset_map(offsets), callback=callback)

    def _dead_letter(self, raw: RawMessage, report: PoisonReport) -> None:
        headers = [
            (DLQ_ERROR, report.error.encode("utf-8")),
            (DLQ_ERROR_CODE, report.code.encode("utf-8")),
            (DLQ_ORIGIN_TOPIC, raw.topic.encode("utf-8")),
            (DLQ_ORIGIN_PARTITION, str(raw.partition).encode("ascii")),
            (DLQ_ORIGIN_OFFSET, str(raw.offset).encode("ascii")),
        ]
        self._dlq_futures.append(
            self._dlq.send(self.dlq_topic, key=raw.key, value=raw.value, headers=headers)
        )

    def _flush_dead_letters(self) -> None:
        if not self._dlq_futures:
            return
        self._dlq.flush()
        futures, self._dlq_futures = self._dlq_futures, []
        for f in futures:
            if f.failed():
                raise f.exception

    def pause(self, partitions: Iterable[int] | None = None) -> None:
        with self._lock:
            assigned = self.assignment()
            if partitions is None:
                self._pause_all = True
                wanted = assigned
            else:
                wanted = set(partitions)
            self._want_paused |= wanted
            tps = [TopicPartition(self.topic, p) for p in wanted & assigned]
            if tps:
                self._consumer.pause(*tps)

    def resume(self, partitions: Iterable[int] | None = None) -> None:
        with self._lock:
            if partitions is None:
                self._pause_all = False
                wanted = set(self._want_paused) | self.paused()
            else:
                wanted = set(partitions)
            self._want_paused -= wanted
            tps = [TopicPartition(self.topic, p) for p in wanted & self.assignment()]
            if tps:
                self._consumer.resume(*tps)

    def paused(self) -> set[int]:
        with self._lock:
            return {tp.partition for tp in self._consumer.paused() if tp.topic == self.topic}

    def assignment(self) -> set[int]:
        with self._lock:
            return {tp.partition for tp in self._consumer.assignment() if tp.topic == self.topic}

    def committed(self) -> dict[int, int | None]:
        """The group's committed offsets of the assigned partitions, read from the broker."""
        with self._lock:
            return {p: self._consumer.committed(TopicPartition(self.topic, p)) for p in self.assignment()}

    def _close_client(self) -> None:
        try:
            self._flush_dead_letters()
        finally:
            self._dlq.close()
            self._consumer.close(autocommit=False)
