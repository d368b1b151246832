"""The embedded mode: a whole batch in one process, no services.

LocalQueue stands in for Kafka and SQLite (migrated with Alembic) for Postgres; the worker is
the distributed mode's own `workers.worker.Worker`. Resumable: jobs already terminal in the
database are not run again, and the output is written from the database in input order.
This is the one place in `pipeline` that imports the engine.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from pipeline.batch_io import default_batch_id, read_batch_file, write_results
from pipeline.queue import LocalQueue
from pipeline.store import ResultStore, migrate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSummary:
    """What `run_file` did."""

    batch_id: str
    lines: int  # non-blank input lines
    invalid: int  # lines that were not valid jobs (failed rows)
    skipped: int  # jobs already terminal in the database (resume)
    ran: int  # jobs run through the engine now
    counts: dict[str, int]  # rows of the batch by status, at the end
    seconds: float
    written: int  # output lines


def run_file(
    path: str | Path,
    *,
    model: str = "tiny",
    db_url: str = "sqlite:///firsttoken.db",
    output: TextIO | None = None,
    batch_id: str | None = None,
    default_max_tokens: int | None = None,
    engine_config: object | None = None,
    worker_name: str | None = None,
) -> RunSummary:
    """Run every job of a JSONL batch file in this process; write results to the database and,
    in input order, to `output` (stdout when None)."""
    t0 = time.perf_counter()
    path = Path(path)
    batch_id = batch_id or default_batch_id(path)
    migrate(db_url)
    store = ResultStore.from_url(db_url)
    try:
        batch = read_batch_file(path, batch_id, default_max_tokens=default_max_tokens)
        store.create_batch(batch_id, input_format=batch.input_format, source=str(path.resolve()))
        store.set_batch_total(batch_id, len({r.job_id for r in batch.refs}))
        if batch.failures:
            store.upsert_results(batch.failures)
        existing = store.get_jobs([j.id for j in batch.jobs])
        seen: set[str] = set()
        todo = []
        for j in batch.jobs:
            rec = existing.get(j.id)
            if (rec is not None and rec.status.terminal) or j.id in seen:
                continue
            seen.add(j.id)
            todo.append(j)
        skipped = len({j.id for j in batch.jobs}) - len(todo)
        if todo:
            store.insert_queued(todo)
            _run_jobs(todo, store, model, engine_config, worker_name)
        store.finalize_batch(batch_id)
        written = write_results(store, batch.refs, output if output is not None else sys.stdout)
        progress = store.batch_progress(batch_id)
    finally:
        store.close()
    return RunSummary(
        batch_id=batch_id,
        lines=len(batch.refs),
        invalid=len(batch.failures),
        skipped=skipped,
        ran=len(todo),
        counts={s.value: n for s, n in progress.counts.items()},
        seconds=time.perf_counter() - t0,
        written=written,
    )


def _run_jobs(
    todo: list, store: ResultStore, model: str, engine_config: object | None, worker_name: str | None
) -> None:
    from workers.engine import EngineConfig, LLMEngine
    from workers.worker import Worker, WorkerConfig

    cfg = engine_config if isinstance(engine_config, EngineConfig) else EngineConfig()
    engine = LLMEngine(model, cfg)
    queue = LocalQueue(partitions=1)
    worker = Worker(
        engine, queue.consumer(), store, WorkerConfig(name=worker_name or "embedded"), model_name=model
    )
    worker.start()
    try:
        for i in range(0, len(todo), 10_000):
            queue.publish(todo[i : i + 10_000])
        end = queue.end_offsets()
        while queue.committed() != end:
            if worker.failed_with is not None:
                raise RuntimeError(f"the engine failed: {worker.failed_with!r}") from worker.failed_with
            time.sleep(0.02)
    finally:
        worker.stop(drain=True, timeout_s=5.0)
    log.info("ran %d jobs", len(todo))
