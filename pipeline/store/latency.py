"""Latency history: percentiles of the jobs' timings, in SQL on Postgres, in Python on SQLite."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    func,
    select,
)

from pipeline.store.records import (
    LatencyStats,
)
from pipeline.store.rows import (
    StoreBase,
)
from pipeline.store.tables import LATENCY_METRICS, jobs
from schemas.job import (
    JobStatus,
)


def percentile_cont(sorted_values: Sequence[float], q: float) -> float | None:
    """Postgres' percentile_cont: linear interpolation between the two nearest ranks."""
    if not sorted_values:
        return None
    pos = q * (len(sorted_values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class Latency(StoreBase):
    """Latency statistics over finished jobs."""

    def latency_stats(
        self,
        *,
        since: float | None = None,
        until: float | None = None,
        metrics: Sequence[str] = ("ttft_ms", "queue_ms", "tpot_ms"),
        by: Sequence[str] = ("worker", "model"),
        time_column: str = "finished_at",
        status: JobStatus | None = JobStatus.SUCCEEDED,
        owner: str | None = None,
        batch_id: str | None = None,
    ) -> list[LatencyStats]:
        """p50/p90/p99, mean and count of each metric over jobs whose `time_column` lies in
        [since, until), grouped by `by` (a subset of worker, model; empty: one group), of one
        owner's and/or one batch's jobs when given.

        Postgres computes percentile_cont in SQL; SQLite has no percentile aggregate, so the
        values are fetched and interpolated the same way in Python.
        """
        bad = [m for m in metrics if m not in LATENCY_METRICS]
        if bad:
            raise ValueError(f"unknown latency metric {bad[0]!r}; one of {LATENCY_METRICS}")
        if any(g not in ("worker", "model") for g in by):
            raise ValueError("by: only 'worker' and 'model' can group latency stats")
        if time_column not in ("finished_at", "submitted_at"):
            raise ValueError("time_column: finished_at or submitted_at")
        tcol = jobs.c[time_column]
        conds = [tcol.is_not(None)]
        if since is not None:
            conds.append(tcol >= since)
        if until is not None:
            conds.append(tcol < until)
        if status is not None:
            conds.append(jobs.c.status == JobStatus(status).value)
        if owner is not None:
            conds.append(jobs.c.owner == owner)
        if batch_id is not None:
            conds.append(jobs.c.batch_id == batch_id)
        groups = [jobs.c[g] for g in by]
        if self.dialect == "postgresql":
            return self._latency_sql(metrics, by, groups, conds)
        return self._latency_python(metrics, by, groups, conds)

    def _latency_sql(
        self, metrics: Sequence[str], by: Sequence[str], groups: list[Any], conds: list[Any]
    ) -> list[LatencyStats]:
        cols: list[Any] = list(groups)
        for m in metrics:
            c = jobs.c[m]
            cols += [
                func.count(c),
                func.avg(c),
                func.percentile_cont(0.5).within_group(c),
                func.percentile_cont(0.9).within_group(c),
                func.percentile_cont(0.99).within_group(c),
            ]
        q = select(*cols).where(*conds)
        if groups:
            q = q.group_by(*groups).order_by(*groups)
        out = []
        with self.engine.connect() as conn:
            for row in conn.execute(q):
                key = dict(zip(by, row[: len(by)]))
                vals = row[len(by) :]
                for i, m in enumerate(metrics):
                    n, mean, p50, p90, p99 = vals[5 * i : 5 * i + 5]
                    out.append(
                        LatencyStats(
                            metric=m,
                            worker=key.get("worker"),
                            model=key.get("model"),
                            count=int(n),
                            mean=None if mean is None else float(mean),
                            p50=p50,
                            p90=p90,
                            p99=p99,
                        )
                    )
        return out

    def _latency_python(
        self, metrics: Sequence[str], by: Sequence[str], groups: list[Any], conds: list[Any]
    ) -> list[LatencyStats]:
        values: dict[tuple[Any, ...], dict[str, list[float]]] = defaultdict(lambda: {m: [] for m in metrics})
        q = select(*groups, *(jobs.c[m] for m in metrics)).where(*conds)
        with self.engine.connect() as conn:
            for row in conn.execute(q):
                key = tuple(row[: len(by)])
                bucket = values[key]
                for m, v in zip(metrics, row[len(by) :]):
                    if v is not None:
                        bucket[m].append(float(v))
        if not values and not by:
            values[()] = {m: [] for m in metrics}
        out = []
        for key in sorted(values, key=lambda k: tuple("" if x is None else str(x) for x in k)):
            named = dict(zip(by, key))
            for m in metrics:
                vs = sorted(values[key][m])
                out.append(
                    LatencyStats(
                        metric=m,
                        worker=named.get("worker"),
                        model=named.get("model"),
                        count=len(vs),
                        mean=(sum(vs) / len(vs)) if vs else None,
                        p50=percentile_cont(vs, 0.5),
                        p90=percentile_cont(vs, 0.9),
                        p99=percentile_cont(vs, 0.99),
                    )
                )
        return out
