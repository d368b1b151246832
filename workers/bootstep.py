"""The GPU worker's bootstep: one engine per Celery worker process, loaded after it started.

Included only in workers that consume the `gpu` queue. `start` builds the worker: its engine
core starts in a spawned child process that loads the model (never at import, never forked:
CUDA and fork do not mix), and the intake, results and sink threads start here; `stop`
(SIGTERM, warm shutdown) drains them and stops the core; `terminate` (SIGQUIT, cold shutdown)
stops them at once, handing running jobs back uncommitted. Also here: the
remote-control commands `engine_stats` (inspect) and `cancel_jobs` (control).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from celery import Celery, bootsteps
from celery.worker.control import control_command, inspect_command

log = logging.getLogger(__name__)

_current: dict[str, Any] = {"worker": None}
_lock = threading.Lock()


def current_worker() -> Any:
    """The GPU Worker of this process, once started (None elsewhere)."""
    return _current["worker"]


def _consumes_gpu(worker: Any) -> bool:
    try:
        queues = worker.app.amqp.queues.consume_from or {}
        return "gpu" in queues
    except Exception:
        return False


class GPUWorkerStep(bootsteps.StartStopStep):
    """Owns one engine and its worker threads for the life of the Celery worker process."""

    requires = ("celery.worker.components:Pool",)

    def include_if(self, w: Any) -> bool:
        return _consumes_gpu(w)

    def start(self, w: Any) -> None:
        from workers.wiring import build_worker

        with _lock:
            if _current["worker"] is not None:
                return
            log.info("loading the model for the GPU worker %s", getattr(w, "hostname", "?"))
            worker = build_worker()
            worker.start()
            _current["worker"] = worker

    def stop(self, w: Any) -> None:
        """Warm shutdown (SIGTERM): let in-flight jobs finish, up to the drain timeout."""
        worker = _take_worker()
        if worker is not None:
            log.info("draining the GPU worker")
            worker.stop(drain=True)

    def terminate(self, w: Any) -> None:
        """Cold shutdown (SIGQUIT): no drain. Jobs still running are aborted and left uncommitted,
        for another worker to run; what already finished is written and committed."""
        worker = _take_worker()
        if worker is not None:
            log.info("stopping the GPU worker without draining")
            worker.stop(drain=False, timeout_s=0.0)


def _take_worker() -> Any:
    """The process's GPU worker, now no longer current (None when there is none): stopped once."""
    with _lock:
        worker, _current["worker"] = _current["worker"], None
    return worker


def install(app: Celery) -> None:
    """Add the GPU bootstep to `app`'s workers."""
    app.steps["worker"].add(GPUWorkerStep)


@inspect_command()
def engine_stats(state: Any) -> dict[str, Any]:
    """This worker's engine stats and counters (`celery inspect engine_stats`)."""
    worker = current_worker()
    if worker is None:
        return {"gpu": False}
    return {"gpu": True, **worker.stats()}


def job_id_list(value: str | list[str]) -> list[str]:
    """The job ids of a `celery control cancel_jobs` argument: a JSON list (`'["a", "b"]'`) or
    comma-separated ids (`a,b`; empty: none). Celery applies an argument's type to the command
    line's text, where `list` would split it into characters."""
    if isinstance(value, list):
        return [str(v) for v in value]
    text = value.strip()
    if text.startswith("["):
        ids = json.loads(text)
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ValueError(f"job_ids: expected a JSON list of strings, got {text!r}")
        return ids
    return [part.strip() for part in text.split(",") if part.strip()]


@control_command(args=[("job_ids", job_id_list), ("batch_id", str)], signature="[job_ids] [batch_id]")
def cancel_jobs(state: Any, job_ids: list[str] | None = None, batch_id: str | None = None) -> dict[str, Any]:
    """Abort these jobs (or every job of the batch) on this worker; they get `cancelled` rows."""
    worker = current_worker()
    if worker is None:
        return {"ok": "no engine here"}
    worker.cancel(job_ids or (), batch_id or None)
    return {"ok": f"cancelling {len(job_ids or ())} jobs" + (f" and batch {batch_id}" if batch_id else "")}
