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

from pipeline.batch_io import batch_format, default_batch_id, file_digest, write_results
from pipeline.producer import Producer
from pipeline.queue import LocalQueue
from pipeline.settings import DEFAULT_MODEL
from pipeline.store import BatchStatus, ResultStore, migrate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSummary:
    """What `run_file` did."""

    batch_id: str
    lines: int  # non-blank input lines
    invalid: int  # lines that got a `failed` row at submission (unparseable, invalid, duplicate id, too long)
    skipped: int  # jobs already terminal in the database (resume)
    ran: int  # jobs run through the engine now
    counts: dict[str, int]  # rows of the batch by status, at the end
    seconds: float
    written: int  # output lines
    batch_status: str  # the batch's status at the end (completed once every line has its result)

    @property
    def all_succeeded(self) -> bool:
        """True when every line's job succeeded (an empty input too: it has no line that did not)."""
        return self.counts.get("succeeded", 0) == self.lines


def run_file(
    path: str | Path,
    *,
    model: str = DEFAULT_MODEL,
    db_url: str = "sqlite:///firsttoken.db",
    output: TextIO | None = None,
    batch_id: str | None = None,
    default_max_tokens: int | None = None,
    engine_config: object | None = None,
    worker_name: str | None = None,
    progress: bool | None = None,
) -> RunSummary:
    """Run every job of a JSONL batch file in this process; write results to the database and,
    in input order, to `output` (stdout when None).

    Lines are checked against the model's context as they are submitted (prompt_too_long at
    once). Raises BatchConflict when `batch_id` already holds another input. `progress`: a
    progress bar on stderr (None: when stderr is a terminal).
    """
    from workers.engine import EngineConfig
    from workers.engine.prompts import SubmitCheck

    t0 = time.perf_counter()
    path = Path(path)
    digest = file_digest(path)
    batch_id = batch_id or default_batch_id(path, digest)
    cfg = engine_config if isinstance(engine_config, EngineConfig) else EngineConfig()
    check = SubmitCheck.for_model(model, cfg.max_model_len)
    migrate(db_url)
    store = ResultStore.from_url(db_url)
    try:
        existing = store.get_batch(batch_id)
        queue = LocalQueue(partitions=1)
        # the engine starts before the jobs are stamped submitted, so a job's TTFT is not its
        # wait for the model to load; a batch already ended needs no engine at all
        worker = None
        if (existing is None or existing.status is BatchStatus.OPEN) and _has_lines(path):
            worker = _start_worker(queue, store, model, cfg, worker_name)
        try:
            sub = Producer(queue, store).submit_file(
                path, batch_id=batch_id, default_max_tokens=default_max_tokens, check=check
            )
            if sub.submitted:
                if worker is None:  # rows of an ended batch were removed: run them after all
                    worker = _start_worker(queue, store, model, cfg, worker_name)
                _wait_until_done(queue, worker, progress)
        finally:
            if worker is not None:
                worker.stop(drain=True, timeout_s=5.0)
        store.finalize_batch(batch_id)
        b = store.get_batch(batch_id)
        assert b is not None
        written = write_results(store, batch_id, output if output is not None else sys.stdout,
                                batch_format(b.input_format))
    finally:
        store.close()
    log.info("ran %d jobs", sub.submitted)
    return RunSummary(
        batch_id=batch_id,
        lines=sub.lines,
        invalid=sub.invalid,
        skipped=sub.already_done,
        ran=sub.submitted,
        counts={s.value: n for s, n in b.progress.counts.items()},
        seconds=time.perf_counter() - t0,
        written=written,
        batch_status=b.status,
    )


def _has_lines(path: Path) -> bool:
    """True when the file holds a non-blank line (an empty input needs no engine)."""
    with path.open("rb") as f:
        return any(line.strip() for line in f)


def _start_worker(
    queue: LocalQueue, store: ResultStore, model: str, cfg: object, worker_name: str | None
) -> object:
    from workers.engine import LLMEngine
    from workers.worker import Worker, WorkerConfig

    engine = LLMEngine(model, cfg)  # type: ignore[arg-type]
    worker = Worker(
        engine, queue.consumer(), store, WorkerConfig(name=worker_name or "embedded"), model_name=model
    )
    worker.start()
    return worker


def _wait_until_done(queue: LocalQueue, worker: object, progress: bool | None) -> None:
    """Until every job's offset is committed; the bar counts results as they are written (offsets
    are committed in order, up to the lowest job still running: they lag the results)."""
    from tqdm import tqdm

    end = queue.end_offsets()
    total = sum(end.values())
    with tqdm(total=total, unit="job", disable=None if progress is None else not progress, file=sys.stderr,
              dynamic_ncols=True) as bar:
        while True:
            committed = queue.committed()
            done = committed == end
            bar.n = total if done else min(total, worker.sink.results_durable)  # type: ignore[attr-defined]
            bar.refresh()
            if done:
                return
            failed = worker.failed_with  # type: ignore[attr-defined]
            if failed is not None:
                raise RuntimeError(f"the engine failed: {failed!r}") from failed
            time.sleep(0.05)
