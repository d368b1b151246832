"""Wiring a GPU worker from its settings: the engine (in a child process, or on a thread), the
Kafka consumer, the store, the reply publisher and the metrics server (`build_worker`), and a
process that runs one until a signal drains it (`run_until_signalled`)."""

from __future__ import annotations

import logging
import threading

from pipeline.replies import ReplyPublisher
from pipeline.settings import Settings
from pipeline.store import ResultStore
from workers.engine import LLMEngine
from workers.engine_core import EngineCoreClient, ProcessCore, freeze_startup_heap
from workers.settings import WorkerSettings
from workers.sink import SinkConfig
from workers.worker import Worker, WorkerConfig

log = logging.getLogger("workers.worker")


def build_worker(
    settings: Settings | None = None,
    worker_settings: WorkerSettings | None = None,
    *,
    engine: LLMEngine | None = None,
    group: str | None = None,
) -> Worker:
    """A Worker on Kafka (settings' topic and group) and the settings' database. The model is
    loaded in the engine's child process (`engine_process`, the default) or here; either way,
    call this in the worker process after it started, never at import. `engine`: run this
    LLMEngine on a thread of this process instead."""
    from pipeline.queue.kafka import KafkaQueue
    from pipeline.settings import get_settings

    s = settings or get_settings()
    ws = worker_settings or WorkerSettings()
    core: LLMEngine | EngineCoreClient
    if engine is not None:
        core = engine
    else:
        cfg = ws.engine_config()
        if ws.engine_process:
            core = ProcessCore(ws.model, cfg, torch_threads=ws.torch_threads)
        else:
            if ws.torch_threads:
                import torch

                torch.set_num_threads(ws.torch_threads)
            core = LLMEngine(ws.model, cfg)
            core.warm_guided()  # the grammar engine's vocabulary index, off the first guided job's path
    store = ResultStore.from_url(s.database_url, batch_rows=s.store_batch_rows)
    consumer = KafkaQueue(s).consumer(group)
    config = WorkerConfig(
        name=s.worker_name,
        max_waiting=ws.max_waiting,
        drain_timeout_s=ws.drain_timeout_s,
        max_deliveries=ws.max_deliveries or None,
        max_poll_messages=s.max_poll_records,
        sink=SinkConfig(batch_rows=s.store_batch_rows, max_buffer=ws.sink_max_buffer),
    )
    worker = Worker(core, consumer, store, config, model_name=ws.model, replies=ReplyPublisher(s.redis_url))
    if ws.metrics_port:
        worker.serve_metrics(ws.metrics_port)
    freeze_startup_heap()
    return worker


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
