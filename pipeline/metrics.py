"""Prometheus metrics, with vLLM's meanings under a `firsttoken:` prefix.

Job metrics (`JobMetrics`) are observed from each terminal result: time to first token as the
user waits it (queue included), inter-token latency (each job's mean time per output token after
the first), end-to-end latency, queue time, prompt and generation tokens, prefix-cache hits and
queries (in tokens, as vLLM counts them), and results by status and error code. A GPU worker
observes its own results; gauges of its engine (running, waiting, KV cache use) come from the
worker (`workers.metrics`), and the API adds the store's view: jobs by status, the age of the
oldest queued job (`firsttoken.api.metrics`).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram

from schemas.job import JobResult, JobStatus

PREFIX = "firsttoken:"

# seconds; vLLM's TTFT buckets, extended down for a pipeline that answers in milliseconds
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class JobMetrics:
    """The per-job metrics of one process, on `registry`."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.labels = labels
        names = list(labels)

        # the process's own labels are fixed: each metric's child is bound once, not per result
        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=registry).labels(**labels)

        def count(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, names, registry=registry).labels(**labels)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token: submission to first token, queue included", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Each job's mean time per output token after the first", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Submission to the last token", E2E_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Submission to admission by an engine", E2E_BUCKETS)
        self.prompt_tokens = count("prompt_tokens", "Prompt tokens of finished jobs")
        self.generation_tokens = count("generation_tokens", "Output tokens of finished jobs")
        self.prefix_hits = count("prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.prefix_queries = count("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.results = Counter(PREFIX + "request_results", "Terminal results by status and error code",
                               [*names, "status", "error_code"], registry=registry)

    def observe(self, results: Iterable[JobResult]) -> None:
        """Count these terminal results (and time the succeeded ones)."""
        lv = self.labels.values()
        for r in results:
            self.results.labels(*lv, r.status.value, "" if r.error_code is None else r.error_code.value).inc()
            if r.status is not JobStatus.SUCCEEDED:
                continue
            t, u = r.timings, r.usage
            for hist, ms in ((self.ttft, t.ttft_ms), (self.itl, t.tpot_ms), (self.e2e, t.e2e_ms), (self.queue, t.queue_ms)):
                if ms is not None:
                    hist.observe(ms / 1000.0)
            self.prompt_tokens.inc(u.prompt_tokens)
            self.generation_tokens.inc(u.completion_tokens)
            self.prefix_hits.inc(u.cached_prompt_tokens)
            self.prefix_queries.inc(u.prompt_tokens)
