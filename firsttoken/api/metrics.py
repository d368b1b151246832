"""The API's Prometheus metrics at `GET /metrics`: its requests (count and duration by route and
status); the backlog: jobs queued and running, and the age of the oldest queued job
(`firsttoken:queue_lag_seconds`); and what users waited, across every worker, from the rows the
workers write: the user-facing TTFT of each job that succeeded (submission to first token, queue
included: `firsttoken:api_time_to_first_token_seconds`) and its prompt tokens and those the prefix
cache had (`firsttoken:api_prompt_tokens_total`, `firsttoken:api_prefix_cache_hit_tokens_total`:
their rates' ratio is the hit rate). The store is read at most once every api_metrics_max_age_s
however often /metrics is scraped (a scrape flood costs no database query). The job figures are
the store's: every API replica exports the same ones (take one replica's, not their sum). Open, as
Prometheus expects, unless FIRSTTOKEN_API_METRICS_KEY is set: then it needs that key as a Bearer
token. The GPU workers serve their own (engine gauges and job histograms: workers.metrics)."""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from firsttoken.api.deps import ApiError, State
from pipeline.metrics import PREFIX
from schemas.job import JobStatus

router = APIRouter(tags=["metrics"])


class BacklogCollector(Collector):
    """Jobs queued and running, and the queue's lag, from the store: read again only when the
    last reading is older than `max_age_s` (one scrape at a time reads; the others use it)."""

    def __init__(self, store_of: Callable[[], object], max_age_s: float = 5.0,
                 finished: FinishedJobs | None = None) -> None:
        self.store_of = store_of
        self.max_age_s = max_age_s
        self.finished = finished  # read with the backlog: the jobs that succeeded since
        self.reads = 0  # store queries made
        self._lock = threading.Lock()
        self._last: tuple[float, tuple[dict[JobStatus, int], float | None]] | None = None

    def refresh(self, store: object) -> tuple[dict[JobStatus, int], float | None] | None:
        """The backlog (and the jobs finished since), read again when the last reading is older
        than max_age_s; None while another scrape makes the first reading."""
        last = self._last
        if last is not None and time.monotonic() - last[0] < self.max_age_s:
            return last[1]
        if not self._lock.acquire(blocking=last is None):  # another scrape is reading: its last value
            return None if last is None else last[1]
        try:
            if self._last is not None and time.monotonic() - self._last[0] < self.max_age_s:
                return self._last[1]
            self.reads += 1
            value = store.backlog()  # type: ignore[attr-defined]
            if self.finished is not None:
                self.finished.read(store)
            self._last = (time.monotonic(), value)
            return value
        finally:
            self._lock.release()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        store = self.store_of()
        if store is None:
            return
        backlog = self.refresh(store)
        if backlog is None:
            return
        counts, oldest = backlog
        jobs = GaugeMetricFamily(PREFIX + "jobs", "Jobs not finished yet, by status", labels=["status"])
        for status in (JobStatus.QUEUED, JobStatus.RUNNING):
            jobs.add_metric([status.value], counts.get(status, 0))
        yield jobs
        lag = GaugeMetricFamily(PREFIX + "queue_lag_seconds", "Age of the oldest job still queued (0: none)")
        lag.add_metric([], 0.0 if oldest is None else max(0.0, time.time() - oldest))
        yield lag


TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)  # queue waits of a bulk batch reach hours: the last buckets are wide


class FinishedJobs:
    """The jobs that succeeded since the last reading, each counted once, into the TTFT histogram
    and the prompt and prefix-cache token counters. Rows are read by their write time (updated_at)
    from a little before the last one seen (OVERLAP_S: writers' clocks and transactions land out of
    order), and ids already counted in that window are skipped. Counting starts when the API
    starts (no history is replayed)."""

    OVERLAP_S = 30.0
    PAGE = 5000
    MAX_PAGES = 20  # per reading: a backlog past 100k rows is caught up over the next readings

    def __init__(self, registry: CollectorRegistry, now: float | None = None) -> None:
        self.cursor = self.start = time.time() if now is None else now
        self._seen: dict[str, float] = {}  # id -> updated_at, of the rows inside the overlap window
        self.ttft = Histogram(PREFIX + "api_time_to_first_token_seconds",
                              "Time to first token of each job that succeeded, from its submission (queue "
                              "included), across every worker", registry=registry, buckets=TTFT_BUCKETS)
        self.prompt_tokens = Counter(PREFIX + "api_prompt_tokens", "Prompt tokens of the jobs that succeeded",
                                     registry=registry)
        self.cached_tokens = Counter(PREFIX + "api_prefix_cache_hit_tokens",
                                     "Prompt tokens of the jobs that succeeded that the prefix cache had",
                                     registry=registry)

    def read(self, store: object) -> int:
        """Count what succeeded since the last reading; returns the jobs counted."""
        counted, since = 0, self.cursor - self.OVERLAP_S
        for _ in range(self.MAX_PAGES):
            rows = store.succeeded_since(since, limit=self.PAGE)  # type: ignore[attr-defined]
            for job_id, updated_at, ttft_ms, prompt, cached in rows:
                if job_id in self._seen or updated_at < self.start:  # counted already, or before the start
                    continue
                self._seen[job_id] = updated_at
                counted += 1
                if ttft_ms is not None:
                    self.ttft.observe(ttft_ms / 1000.0)
                self.prompt_tokens.inc(prompt)
                self.cached_tokens.inc(cached)
            if rows:
                self.cursor = max(self.cursor, rows[-1][1])
            if len(rows) < self.PAGE or rows[-1][1] == since:
                break
            since = rows[-1][1]
        floor = self.cursor - self.OVERLAP_S
        self._seen = {k: v for k, v in self._seen.items() if v >= floor}
        return counted


class CompletionsCollector(Collector):
    """Completions this process is waiting on (one reply subscription each)."""

    def __init__(self, replies_of: Callable[[], object]) -> None:
        self.replies_of = replies_of

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replies = self.replies_of()
        live = GaugeMetricFamily(PREFIX + "api_completions_in_flight",
                                 "Completions (plain or streamed) this API process is waiting on")
        live.add_metric([], float(getattr(replies, "live", 0)))
        yield live


class ApiMetrics:
    """The API's registry: request counts and durations (a 429 is a refusal past an owner's
    limit), completions in flight, and the backlog collector."""

    def __init__(self, store_of: Callable[[], object], replies_of: Callable[[], object] = lambda: None, *,
                 max_age_s: float = 5.0) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "api_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=self.registry)
        self.duration = Histogram(PREFIX + "api_request_duration_seconds", "HTTP request duration by route",
                                  ["route", "method"], registry=self.registry,
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.finished = FinishedJobs(self.registry)
        self.backlog = BacklogCollector(store_of, max_age_s, self.finished)
        self.registry.register(self.backlog)
        self.registry.register(CompletionsCollector(replies_of))

    def render(self) -> bytes:
        """The text format, after the store's reading is brought up to date (a registry collects in
        the order it was built: the job histogram would show the reading before last)."""
        store = self.backlog.store_of()
        if store is not None:
            self.backlog.refresh(store)
        return generate_latest(self.registry)

    async def middleware(self, request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        t0 = time.perf_counter()
        status = 500
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            route = request.scope.get("route")
            path = getattr(route, "path", "unmatched")  # the route's template: no ids in labels
            self.requests.labels(path, request.method, str(status)).inc()
            self.duration.labels(path, request.method).observe(time.perf_counter() - t0)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, state: State) -> Response:
    """Prometheus text format (counts and durations only, never prompts); behind
    FIRSTTOKEN_API_METRICS_KEY when it is set."""
    key = state.settings.api_metrics_key
    if key is not None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode("utf-8", "replace")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, key.get_secret_value().encode()):
            raise ApiError(401, "unauthorized", "/metrics needs the metrics key: Authorization: Bearer <key>")
    m: ApiMetrics = request.app.state.metrics
    body = await run_in_threadpool(m.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
