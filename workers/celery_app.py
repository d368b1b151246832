"""The Celery app: Redis broker, settings from FIRSTTOKEN_* variables.

Two kinds of worker process run from it:

    celery -A workers.celery_app worker --pool solo -Q gpu -n gpu0@%h    # one per GPU
    celery -A workers.celery_app worker -Q cpu -n cpu@%h                 # control-plane tasks

A worker consuming the `gpu` queue loads the model once, after it started (workers.bootstep),
in its engine core process, and runs the Kafka intake and the result sink in its own threads;
jobs never travel through Celery. Celery carries the control plane (workers.tasks): ingest a batch file,
finalize a batch, cancel jobs; and remote-control commands that reach the GPU workers:

    celery -A workers.celery_app inspect engine_stats                  # waits out --timeout (1 s)
    celery -A workers.celery_app inspect engine_stats -d gpu0@host     # returns once gpu0 replied
    celery -A workers.celery_app control cancel_jobs job-1,job-2       # or a JSON list: '["job-1"]'
    celery -A workers.celery_app control cancel_jobs '' BATCH_ID       # every job of a batch
"""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery

from pipeline.settings import get_settings

GPU_QUEUE = "gpu"
CPU_QUEUE = "cpu"

app = Celery("firsttoken", include=["workers.tasks"])
_settings = get_settings()
app.conf.update(
    broker_url=_settings.redis_url,
    result_backend=_settings.redis_url,
    task_default_queue=CPU_QUEUE,
    task_routes={"firsttoken.*": {"queue": CPU_QUEUE}},
    task_serializer="json",
    accept_content=["json"],
    result_serializer="json",
    result_expires=3600,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

# The bootstep and the remote-control commands register themselves on import.
from workers import bootstep  # noqa: E402

bootstep.install(app)


def broadcast_cancel(job_ids: Sequence[str] = (), batch_id: str | None = None) -> None:
    """Tell every GPU worker to abort these jobs (or the batch's): fire and forget."""
    app.control.broadcast("cancel_jobs", arguments={"job_ids": list(job_ids), "batch_id": batch_id})


def engine_stats(
    timeout_s: float = 2.0, *, expect: int | None = None, nodes: Sequence[str] | None = None
) -> dict[str, dict]:
    """Each worker's engine stats by Celery node name (`{"gpu": False}` from a CPU worker).

    Asks every worker, or only `nodes`, and returns as soon as `expect` of them replied (with
    `nodes`, by default all of them). `timeout_s` bounds the wait for each next reply: when fewer
    answer, it returns `timeout_s` after the last reply; without `expect` or `nodes` it cannot know
    who is left to answer and always waits that long.
    """
    if expect is not None and expect < 1:
        raise ValueError(f"expect must be at least 1, not {expect}")
    if nodes is not None and not nodes:
        raise ValueError("nodes is empty: name at least one node, or pass None to ask every worker")
    replies = app.control.broadcast(
        "engine_stats",
        reply=True,
        timeout=timeout_s,
        destination=None if nodes is None else list(nodes),
        limit=expect if expect is not None else (None if nodes is None else len(nodes)),
    )
    out: dict[str, dict] = {}
    for r in replies or []:
        out.update(r)
    return out
