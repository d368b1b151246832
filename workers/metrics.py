"""A GPU worker's Prometheus metrics: its results (pipeline.metrics.JobMetrics) and, read at each
scrape, its engine's gauges (requests running and waiting, KV cache use, steps) and its own
(jobs in flight, intake paused, results waiting for the store)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pipeline.metrics import PREFIX, JobMetrics

if TYPE_CHECKING:
    from workers.worker import Worker


class WorkerCollector(Collector):
    """The worker's gauges at scrape time."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        w = self.worker
        names, values = ["worker", "model_name"], [w.name, w.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            g.add_metric(values, value)
            return g

        st = w.engine_stats
        if st is not None:
            yield gauge("num_requests_running", "Requests the engine is running", st.running)
            yield gauge("num_requests_waiting", "Requests waiting in the engine", st.waiting)
            used = st.kv_blocks_used / st.kv_blocks_total if st.kv_blocks_total else 0.0
            yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)", used)
            yield gauge("num_preemptions", "Requests preempted so far", st.num_preemptions)
            yield gauge("kv_reserve_ratio", "Share of running requests' remaining max_tokens kept in free KV blocks "
                        "at admission (learned under kv_reserve auto)", st.kv_reserve)
            steps = CounterMetricFamily(PREFIX + "engine_steps", "Engine steps run", labels=names)
            steps.add_metric(values, st.steps)
            yield steps
        yield gauge("jobs_in_flight", "Jobs handed to the engine and not written yet", w.in_flight)
        yield gauge("intake_paused", "1 while the worker stops taking jobs (engine or store behind)", float(w.intake.paused))
        yield gauge("sink_buffered", "Results waiting to be written to the store", w.sink.buffered)
        yield gauge("store_ok", "1 when the last write to the store succeeded", float(w.sink.store_ok))


def worker_registry(worker: Worker) -> tuple[CollectorRegistry, JobMetrics]:
    """A registry with the worker's gauges and its job metrics."""
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker))
    return registry, JobMetrics(registry, {"worker": worker.name, "model_name": worker.model_name})
