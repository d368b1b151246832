"""The Celery side against real Celery workers: a GPU worker (`--pool solo -Q gpu`, whose bootstep
loads the tiny model and runs the Kafka intake, engine and sink) and a CPU worker (`-Q cpu`, the
control-plane tasks), on real Redis, Kafka and Postgres.

- a batch file ingested by the `workers.tasks.ingest_batch` task ends with one terminal row per line
  (invalid lines `failed`) and is finalized by `finalize_batch`;
- `workers.celery_app.engine_stats()` reaches both workers (the GPU one with its counters and
  engine stats);
- cancelling running jobs (the `workers.tasks.cancel` task, and `broadcast_cancel`) aborts them in the
  engine, their rows end `cancelled`, other jobs are untouched;
- SIGQUIT (cold shutdown) stops the GPU worker at once, without draining: it leaves the Kafka group,
  and a second GPU worker runs what it handed back: every job exactly once;
- SIGTERM drains the GPU worker (exit 0), and a third GPU worker finishes what it handed back:
  every job exactly once.

One pair of workers serves the whole module (the SIGQUIT and SIGTERM tests, last, each replace the
GPU worker).
Each run gets its own Kafka topic and group, and its own Redis database (claimed with a key), so
that no other Celery worker on the shared Redis sees these tasks or broadcasts. Only observable
behaviour is checked: rows, task results, remote-control replies, exit codes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from pipeline_util import ROOT, make_jobs, terminal_count, wait_until, wait_while_progressing, worker_env
from sqlalchemy import func, select

from pipeline.producer import Producer
from pipeline.queue.kafka import KafkaQueue
from pipeline.settings import Settings
from pipeline.store import ResultStore
from pipeline.store.tables import jobs as jobs_table
from schemas.job import ErrorCode, JobStatus

pytestmark = pytest.mark.integration

CLAIM_KEY = "firsttoken-test-celery-claim"
DRAIN_TIMEOUT_S = 1.0  # the GPU workers' FIRSTTOKEN_DRAIN_TIMEOUT_S
# the stop tests' long jobs, and the cancel test's: each step of a GPU worker's engine takes a floor at
# least (FIRSTTOKEN_TEST_STEP_FLOOR_S), so that a long job lasts at least 19 s on the worker that is
# signalled, whatever the machine: still running at a signal sent when the first 8-token job has ended,
# well past the 1 s drain. A token count alone bounded nothing (400 tokens once took seconds here; by
# 2026-12-03 all 36 jobs of the SIGQUIT test ended within the 1.4 s before the signal).
# Each successor runs the jobs handed back to it at its own floor, so the floors fall from worker to
# worker: gpu0 (the cancel and SIGQUIT tests) QUIT_LONG_TOKENS x FIRST_STEP_FLOOR_S = 20 s; gpu1 (SIGQUIT's
# successor, SIGTERM's stopped worker) LONG_TOKENS x STEP_FLOOR_S = 19 s, and it reruns the SIGQUIT
# test's long jobs in 4 s, not 19 s; gpu2 (SIGTERM's successor, the last, never signalled) no floor.
FIRST_STEP_FLOOR_S = 0.05
QUIT_LONG_TOKENS = 400
STEP_FLOOR_S = 0.01
LONG_TOKENS = 1900


# --- Redis: a database of our own ------------------------------------------------------------------


def _with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{db}"))


def _claim_redis_db(url: str) -> tuple[str, redis.Redis]:
    """An empty Redis database (1-15), claimed with a key so that a concurrent run skips it.

    Kombu prefixes fanout channels (remote control) with the database number, so workers on
    another database never see this run's broadcasts, nor this run theirs."""
    dbs = list(range(1, 16))
    random.shuffle(dbs)
    for db in dbs:
        client = redis.Redis.from_url(_with_db(url, db))
        if client.dbsize() == 0 and client.set(CLAIM_KEY, uuid.uuid4().hex, nx=True, ex=1800):
            if client.dbsize() == 1:
                return _with_db(url, db), client
            client.delete(CLAIM_KEY)
        client.close()
    pytest.fail(f"no empty Redis database (1-15) at {url} for the Celery tests", pytrace=False)


def _release_redis_db(client: redis.Redis) -> None:
    """Delete what Celery left in our database (queues, bindings, results, unacked ETA tasks)."""
    with contextlib.suppress(redis.RedisError):
        for pattern in ("celery-task-meta-*", "_kombu.binding*", "unacked*", "cpu", "gpu", "celery"):
            keys = list(client.scan_iter(match=pattern, count=1000))
            if keys:
                client.delete(*keys)
        client.delete(CLAIM_KEY)
    client.close()


@contextlib.contextmanager
def _app_on(url: str) -> Iterator[object]:
    """workers.celery_app's app pointed at `url` (broker and results) for the block.

    The app reads FIRSTTOKEN_REDIS_URL once, when first imported (maybe earlier in this session):
    its configuration is changed and its cached connection pools dropped, then restored."""
    from workers import celery_app

    app = celery_app.app

    def point(broker: str, backend: str) -> None:
        app.conf.update(broker_url=broker, result_backend=backend)
        app._pool = None  # the cached connection pool, the producer pool and the result backend
        app.amqp._producer_pool = None
        app._backend_cache = None
        app._local = threading.local()  # the per-thread result backend

    old = (app.conf.broker_url, app.conf.result_backend)
    point(url, url)
    try:
        with app.connection_for_write() as conn:
            assert conn.as_uri().endswith(urlsplit(url).path), conn.as_uri()
        yield app
    finally:
        point(*old)


# --- worker processes -------------------------------------------------------------------------------


class Cluster:
    """The module's Celery worker processes, their settings and a store on their database."""

    def __init__(self, settings: Settings, redis_url: str, log_dir: Path, app: object) -> None:
        self.settings = settings
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.app = app
        self.tag = uuid.uuid4().hex[:6]
        self.host = socket.gethostname()
        self.procs: dict[str, subprocess.Popen] = {}
        self.step_floors: dict[str, float] = {}  # each worker's FIRSTTOKEN_TEST_STEP_FLOOR_S
        self.logs: dict[str, Path] = {}
        self.store = ResultStore.from_url(settings.database_url)
        self.gpu_name = ""  # the GPU worker's name (its results' `worker`) and node
        self.gpu_node = ""
        self.cpu_node = ""

    # processes

    def start(self, kind: str, name: str, step_floor_s: float = STEP_FLOOR_S) -> str:
        """Start a Celery worker (kind "gpu" or "cpu") named `name`, its engine's steps taking
        `step_floor_s` at least (0: no floor); returns its node name."""
        node = f"{name}-{self.tag}@{self.host}"
        env = worker_env(self.settings, name)
        env.update(
            {
                "FIRSTTOKEN_REDIS_URL": self.redis_url,
                "FIRSTTOKEN_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S),
                "FIRSTTOKEN_TEST_STEP_FLOOR_S": str(step_floor_s),
                "PYTHONUNBUFFERED": "1",
            }
        )
        argv = [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-Q", kind, "-n", node]
        argv += ["--pool", "solo"] if kind == "gpu" else ["--concurrency", "2"]
        # no mingle/gossip/heartbeat: nothing to sync with, and mingle alone waits ~1 s at start
        argv += ["--without-mingle", "--without-gossip", "--without-heartbeat", "--loglevel", "INFO"]
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as log:
            self.procs[name] = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.logs[name] = log_path
        self.step_floors[name] = step_floor_s
        return node

    def reply(self, command: str, node: str, timeout_s: float = 1.0) -> dict | None:
        """One node's reply to a remote-control command, or None."""
        replies = self.app.control.broadcast(
            command, reply=True, destination=[node], timeout=timeout_s, limit=1
        )
        for r in replies or []:
            if node in r:
                return r[node]
        return None

    def gpu_stats(self) -> dict:
        stats = self.reply("engine_stats", self.gpu_node)
        assert stats is not None, f"no engine_stats reply from {self.gpu_node}"
        return stats

    def wait_ready(self, node: str, name: str, *, gpu: bool, timeout_s: float = 90) -> None:
        def ready() -> bool:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise AssertionError(f"worker {name} exited with {proc.returncode} before it was ready")
            r = self.reply("engine_stats", node, timeout_s=0.5)
            return r is not None and r.get("gpu") is gpu

        wait_until(ready, timeout_s, f"the Celery worker {node} to answer", every_s=0.2)

    def kill_all(self) -> None:
        """SIGKILL every worker's process group: the worker and whatever it started (an exited
        worker's children too)."""
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    # diagnostics

    def tails(self, lines: int = 40) -> str:
        out = []
        for name, path in self.logs.items():
            text = path.read_text(errors="replace").splitlines() if path.exists() else []
            # kafka-python's connection chatter says little here
            text = [t for t in text if "kafka." not in t and "Kafka" not in t and "IO loop" not in t]
            out.append(f"----- {name} ({path}), last {lines} lines -----")
            out.extend(text[-lines:])
        return "\n".join(out)

    @contextlib.contextmanager
    def logs_on_failure(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            print(self.tails())
            raise

    # jobs

    def submit(self, jobs: list) -> None:
        queue = KafkaQueue(self.settings)
        try:
            Producer(queue, self.store).submit(jobs)
        finally:
            queue.close()

    def group_members(self) -> list:
        """The members of the GPU workers' Kafka consumer group, as the broker sees them."""
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(**self.settings.kafka_client_config, request_timeout_ms=10_000)
        try:
            group = self.settings.consumer_group
            return admin.describe_groups([group])[group]["members"]
        finally:
            admin.close()

    def replace_gpu_worker(self, stopped: str, name: str, step_floor_s: float = STEP_FLOOR_S) -> None:
        """Start the GPU worker `name` after `stopped` exited, and wait until it answers."""
        assert self.procs[stopped].poll() is not None
        self.gpu_name, self.gpu_node = name, self.start("gpu", name, step_floor_s)
        self.wait_ready(self.gpu_node, name, gpu=True)

    def rows(self, batch_id: str) -> list:
        return self.store.list_jobs(batch_id=batch_id, limit=10_000)

    def row_count(self, batch_id: str) -> int:
        with self.store.engine.connect() as conn:
            return conn.execute(select(func.count()).where(jobs_table.c.batch_id == batch_id)).scalar()


@pytest.fixture(scope="module")
def cluster(kafka_bootstrap, postgres_url, redis_url, tmp_path_factory) -> Iterator[Cluster]:
    tag = uuid.uuid4().hex[:10]
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        jobs_topic=f"test.celery.{tag}",
        dlq_topic=f"test.celery.{tag}.dlq",
        consumer_group=f"test-celery-{tag}",
        jobs_partitions=4,
        session_timeout_ms=20_000,
        database_url=postgres_url,
    )
    KafkaQueue(settings).close()  # create the topics before the workers join the group
    url, claim = _claim_redis_db(redis_url)
    log_dir = tmp_path_factory.mktemp("celery-logs")
    c = None
    try:
        with _app_on(url) as app:
            c = Cluster(settings.model_copy(update={"redis_url": url}), url, log_dir, app)
            c.gpu_name, c.gpu_node = "gpu0", c.start("gpu", "gpu0", FIRST_STEP_FLOOR_S)
            c.cpu_node = c.start("cpu", "cpu0")
            try:
                c.wait_ready(c.cpu_node, "cpu0", gpu=False)
                c.wait_ready(c.gpu_node, "gpu0", gpu=True)
            except BaseException:
                print(c.tails())
                raise
            yield c
    finally:
        if c is not None:
            c.kill_all()
            c.store.close()
        _release_redis_db(claim)


# --- the tests ----------------------------------------------------------------------------------


def test_ingest_batch_file_runs_and_finalizes(cluster: Cluster, tmp_path):
    from workers.tasks import ingest_batch

    batch = f"ingest-{uuid.uuid4().hex[:8]}"
    path = tmp_path / "batch.jsonl"
    lines = []
    for i in range(30):
        line = {"id": f"{batch}-{i}", "prompt": f"ingest {i}: a line about {i * 13}", "ignore_eos": True}
        if i % 2:
            line["max_tokens"] = 3  # its own max_tokens; the others take the task's max_tokens
        lines.append(json.dumps(line))
    lines.append('{"id": "not json')
    lines.append(json.dumps({"id": f"{batch}-neg", "prompt": "x", "max_tokens": -1}))
    lines.append(json.dumps({"id": f"{batch}-noprompt"}))
    path.write_text("\n".join(lines) + "\n")

    with cluster.logs_on_failure():
        t0 = time.monotonic()
        res = ingest_batch.delay(str(path), batch_id=batch, max_tokens=5, finalize_after_s=4.0)
        summary = res.get(timeout=60)
        assert summary == {"batch_id": batch, "submitted": 30, "invalid": 3}

        wait_until(lambda: terminal_count(cluster.store, batch) == 33, 60, "33 terminal rows")
        rows = {r.custom_id or f"line-{r.line_no}": r for r in cluster.rows(batch)}  # by the client's ids
        assert len(rows) == 33 == cluster.row_count(batch)
        failed = {jid for jid, r in rows.items() if r.status is JobStatus.FAILED}
        assert failed == {"line-31", f"{batch}-neg", f"{batch}-noprompt"}
        assert all(rows[j].error_code is not None and rows[j].error_message for j in failed)
        for i in range(30):
            r = rows[f"{batch}-{i}"]
            assert r.status is JobStatus.SUCCEEDED, (r.id, r.status, r.error_code, r.error_message)
            assert r.usage.completion_tokens == (3 if i % 2 else 5)
            assert r.worker == "gpu0" and r.text is not None and r.timings.ttft_ms is not None

        # finalize_batch ran 4 s after the ingestion (then again after 10 s, 20 s... while jobs were left)
        wait_until(
            lambda: cluster.store.get_batch(batch).status == "completed", 30, "the batch to be finalized"
        )
        b = cluster.store.get_batch(batch)
        assert b.total_jobs == 33 and b.finished_at is not None
        assert b.progress.counts == {JobStatus.SUCCEEDED: 30, JobStatus.FAILED: 3}
        print(f"ingest -> completed batch in {time.monotonic() - t0:.1f} s")


def test_engine_stats_reaches_both_workers(cluster: Cluster):
    from workers.celery_app import engine_stats

    with cluster.logs_on_failure():
        # with the replies it expects, it returns once they came, well before its timeout
        t0 = time.monotonic()
        before = engine_stats(timeout_s=10, expect=2)
        took = time.monotonic() - t0
        assert took < 3, f"engine_stats(expect=2) took {took:.1f} s"
        assert set(before) == {cluster.gpu_node, cluster.cpu_node}, sorted(before)
        assert before[cluster.cpu_node] == {"gpu": False}
        gpu = before[cluster.gpu_node]
        assert gpu["gpu"] is True and gpu["worker"] == "gpu0" and gpu["model"] == "tiny"
        assert gpu["store_ok"] is True and gpu["in_flight"] == 0
        assert gpu["engine"]["kv_blocks_total"] > 0 and gpu["engine"]["running"] == 0

        batch = f"stats-{uuid.uuid4().hex[:8]}"
        cluster.submit(make_jobs(5, batch, batch_id=batch, max_tokens=4))
        wait_until(lambda: terminal_count(cluster.store, batch) == 5, 60, "5 rows")
        # a job is counted when it finishes, before its row is written: all 5 are counted
        t0 = time.monotonic()
        only_gpu = engine_stats(timeout_s=10, nodes=[cluster.gpu_node])
        took = time.monotonic() - t0
        assert took < 3, f"engine_stats(nodes=[gpu]) took {took:.1f} s"
        assert set(only_gpu) == {cluster.gpu_node}
        after = only_gpu[cluster.gpu_node]
        assert after["counters"]["succeeded"] - gpu["counters"]["succeeded"] == 5
        assert after["counters"]["admitted"] - gpu["counters"]["admitted"] == 5
        assert after["engine"]["steps"] > gpu["engine"]["steps"]


def test_cancel_running_jobs(cluster: Cluster):
    tag = uuid.uuid4().hex[:8]
    by_batch, by_ids, short = f"cancel-b-{tag}", f"cancel-i-{tag}", f"keep-{tag}"
    # long jobs: 2000 tokens each, at least 100 s at gpu0's step floor (FIRST_STEP_FLOOR_S); cancelled ones must
    # end at once
    doomed_batch = make_jobs(4, by_batch, batch_id=by_batch, max_tokens=2000)
    ids_batch = make_jobs(3, by_ids, batch_id=by_ids, max_tokens=2000)
    ids_batch[2] = ids_batch[2].model_copy(
        update={"sampling": ids_batch[2].sampling.model_copy(update={"max_tokens": 40})}
    )
    keep = make_jobs(5, short, batch_id=short, max_tokens=4)
    doomed_ids = [j.id for j in ids_batch[:2]]

    from workers.celery_app import broadcast_cancel
    from workers.tasks import cancel

    with cluster.logs_on_failure():
        cluster.store.create_batch(by_batch)
        start = cluster.gpu_stats()["counters"]
        cluster.submit(doomed_batch + ids_batch + keep)
        wait_until(
            lambda: cluster.gpu_stats()["counters"]["admitted"] - start["admitted"] >= 12,
            60,
            "all 12 jobs admitted by the GPU worker",
            every_s=0.2,
        )
        assert cluster.gpu_stats()["in_flight"] >= 6  # the 6 long ones run

        t0 = time.monotonic()
        n = cancel.delay(batch_id=by_batch).get(timeout=30)
        assert n == 4  # the 4 queued rows of the batch (the worker writes no `running` rows)
        broadcast_cancel(job_ids=doomed_ids)

        # aborted in the engine, not left to run (~20 s each): counted as cancelled, not succeeded
        wait_until(
            lambda: cluster.gpu_stats()["counters"]["cancelled"] - start["cancelled"] == 6,
            30,
            "the GPU worker to abort the 6 cancelled jobs",
            every_s=0.2,
        )
        aborted_s = time.monotonic() - t0
        wait_until(
            lambda: (st := cluster.gpu_stats())["in_flight"] == 0 and st["engine"]["running"] == 0,
            30,
            "nothing left running in the engine",
            every_s=0.2,
        )
        wait_until(lambda: terminal_count(cluster.store, by_ids) == 3, 30, "the by-ids batch's rows")
        wait_until(lambda: terminal_count(cluster.store, short) == 5, 30, "the short batch's rows")

        for r in cluster.rows(by_batch):  # cancelled in the store by the task, aborted by the worker
            assert r.status is JobStatus.CANCELLED and r.error_code is ErrorCode.CANCELLED
        assert cluster.store.get_batch(by_batch).status == "cancelled"
        rows = {r.id: r for r in cluster.rows(by_ids)}
        for jid in doomed_ids:  # written by the worker itself, after the abort
            r = rows[jid]
            assert r.status is JobStatus.CANCELLED and r.error_code is ErrorCode.CANCELLED, r
            assert r.worker == "gpu0" and r.usage.completion_tokens < 2000
        survivor = rows[ids_batch[2].id]
        assert survivor.status is JobStatus.SUCCEEDED and survivor.usage.completion_tokens == 40
        for r in cluster.rows(short):
            assert r.status is JobStatus.SUCCEEDED and r.usage.completion_tokens == 4
        end = cluster.gpu_stats()["counters"]
        assert end["succeeded"] - start["succeeded"] == 6
        assert end["failed"] == start["failed"]
        print(f"cancel: 6 running jobs aborted {aborted_s:.1f} s after the cancel")


def rows_at_exit(cluster: Cluster, batch: str, want: dict[str, int], old: str) -> dict:
    """The rows a stopped GPU worker left: each complete and its own, and not all of the batch."""
    at_exit = {r.id: r for r in cluster.rows(batch) if r.status.terminal}
    assert all(r.status is JobStatus.SUCCEEDED and r.worker == old for r in at_exit.values())
    assert all(r.usage.completion_tokens == want[jid] for jid, r in at_exit.items())
    assert 0 < len(at_exit) < len(want), f"{len(at_exit)} of {len(want)} rows: nothing was left to hand back"
    return at_exit


def successor_finishes_the_rest(
    cluster: Cluster,
    batch: str,
    want: dict[str, int],
    at_exit: dict,
    old: str,
    new: str,
    step_floor_s: float = STEP_FLOOR_S,
) -> None:
    """Start `new` in place of the stopped `old`: every job ends with one row, those `old` wrote are
    never written again, and `new` ran only the jobs handed back (`old` committed what it wrote)."""
    n = len(want)
    cluster.replace_gpu_worker(old, new, step_floor_s)

    def progress() -> tuple:  # rows written, and the successor's engine steps (its long jobs write at their end)
        stats = cluster.reply("engine_stats", cluster.gpu_node, timeout_s=1.0)
        return terminal_count(cluster.store, batch), None if stats is None else stats["engine"].get("steps")

    wait_while_progressing(lambda: terminal_count(cluster.store, batch) == n, progress,
                           f"all {n} rows after the restart")
    assert cluster.row_count(batch) == n
    rows = {r.id: r for r in cluster.rows(batch)}
    assert set(rows) == set(want)
    for jid, r in rows.items():
        assert r.status is JobStatus.SUCCEEDED and r.usage.completion_tokens == want[jid], r
    for jid, r in at_exit.items():
        assert (rows[jid].worker, rows[jid].updated_at, rows[jid].text) == (old, r.updated_at, r.text)
    assert {jid for jid, r in rows.items() if r.worker == new} == set(rows) - set(at_exit)
    counters = cluster.gpu_stats()["counters"]
    assert counters["succeeded"] == n - len(at_exit), counters


def test_sigquit_stops_gpu_worker_at_once_and_another_finishes(cluster: Cluster):
    """Cold shutdown: the GPU worker stops without draining, and leaves its successor in its place."""
    batch = f"quit-{uuid.uuid4().hex[:8]}"
    # short jobs finish first; the long ones are still running at the SIGQUIT (QUIT_LONG_TOKENS steps at
    # gpu0's floor, 20 s at least)
    jobs = make_jobs(32, batch, batch_id=batch, max_tokens=8)
    jobs += make_jobs(4, f"{batch}-long", batch_id=batch, max_tokens=QUIT_LONG_TOKENS)
    n = len(jobs)
    want = {j.id: j.sampling.max_tokens for j in jobs}
    old = cluster.gpu_name
    assert QUIT_LONG_TOKENS * cluster.step_floors[old] >= 19, cluster.step_floors
    with cluster.logs_on_failure():
        first = cluster.procs[old]
        assert len(cluster.group_members()) == 1
        cluster.submit(jobs)
        wait_until(lambda: terminal_count(cluster.store, batch) >= 1, 90, "the first rows")
        t0 = time.monotonic()
        first.send_signal(signal.SIGQUIT)
        bound = 15
        try:
            rc = first.wait(bound)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the GPU worker did not exit within {bound} s of SIGQUIT") from None
        took = time.monotonic() - t0
        # it left the Kafka group as it stopped: its partitions go to the next worker at once, not
        # when the broker gives up on it (session timeout, 20 s here)
        wait_until(lambda: cluster.group_members() == [], 5, "the stopped worker to be out of the group")

        # what it wrote before it stopped is complete and final; the long jobs were handed back
        at_exit = rows_at_exit(cluster, batch, want, old)
        successor_finishes_the_rest(cluster, batch, want, at_exit, old, "gpu1")
        print(f"SIGQUIT: exit {rc} in {took:.1f} s with {len(at_exit)}/{n} rows written; the rest by gpu1")


def test_sigterm_drains_gpu_worker_and_another_finishes(cluster: Cluster):
    """Last in the module: it stops the GPU worker and leaves its successor in its place."""
    batch = f"drain-{uuid.uuid4().hex[:8]}"
    # short jobs finish first; the long ones (LONG_TOKENS steps at gpu1's floor, 19 s at least) cannot
    # finish within the drain timeout, so that the worker must hand them back
    jobs = make_jobs(96, batch, batch_id=batch, max_tokens=8)
    jobs += make_jobs(6, f"{batch}-long", batch_id=batch, max_tokens=LONG_TOKENS)
    n = len(jobs)
    want = {j.id: j.sampling.max_tokens for j in jobs}
    old = cluster.gpu_name
    assert LONG_TOKENS * cluster.step_floors[old] >= 19, cluster.step_floors
    with cluster.logs_on_failure():
        first = cluster.procs[old]
        cluster.submit(jobs)
        wait_until(lambda: terminal_count(cluster.store, batch) >= 1, 90, "the first rows")
        t0 = time.monotonic()
        first.send_signal(signal.SIGTERM)
        bound = DRAIN_TIMEOUT_S + 25
        try:
            rc = first.wait(bound)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the GPU worker did not exit within {bound:.0f} s of SIGTERM") from None
        took = time.monotonic() - t0
        assert rc == 0, f"the GPU worker exited with {rc} after SIGTERM"

        # what the drained worker wrote: every row it finished is there, complete and final
        at_exit = rows_at_exit(cluster, batch, want, old)
        # gpu2 is the module's last GPU worker, never signalled: no step floor, so that it runs the
        # handed-back long jobs at the engine's speed instead of LONG_TOKENS floors (19 s)
        successor_finishes_the_rest(cluster, batch, want, at_exit, old, "gpu2", step_floor_s=0.0)
        print(f"SIGTERM: exit 0 in {took:.1f} s with {len(at_exit)}/{n} rows written; the rest by gpu2")
