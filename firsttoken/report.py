"""A batch's latency report: TTFT, TPOT, end-to-end, queue and overhead percentiles (printed), and
a PNG plus a self-contained HTML page (the PNG inlined) with the TTFT distribution, TTFT against
prompt length, and throughput over time. Also the one-line status of a batch and a progress bar
that follows one (`firsttoken status --watch`, `submit --wait`)."""

from __future__ import annotations

import base64
import html
import io
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from pipeline.store import BatchRecord, ResultStore, percentile_cont
from schemas.job import JobStatus

METRICS = ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "overhead_ms", "engine_ttft_ms", "prefill_ms")
ENDED = ("completed", "cancelled")


@dataclass
class BatchTimings:
    """The per-job numbers of a batch's succeeded jobs, in input order."""

    values: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METRICS})
    ttft_by_prompt: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens, ttft ms)
    finished: list[tuple[float, int]] = field(default_factory=list)  # (finished_at, output tokens)
    failed: int = 0

    @classmethod
    def of(cls, store: ResultStore, batch_id: str) -> BatchTimings:
        out = cls()
        for rec in store.iter_batch(batch_id):
            if rec.status in (JobStatus.FAILED, JobStatus.CANCELLED):
                out.failed += 1
            if rec.status is not JobStatus.SUCCEEDED:
                continue
            t = rec.timings
            for m in METRICS:
                v = getattr(t, m)
                if v is not None:
                    out.values[m].append(float(v))
            if t.ttft_ms is not None:
                out.ttft_by_prompt.append((rec.usage.prompt_tokens, t.ttft_ms))
            if t.finished_at is not None:
                out.finished.append((t.finished_at, rec.usage.completion_tokens))
        return out

    def percentiles(self) -> dict[str, dict[str, float | None]]:
        """p50/p90/p99/mean of each metric (ms), as Postgres' percentile_cont computes them."""
        out: dict[str, dict[str, float | None]] = {}
        for m, vs in self.values.items():
            s = sorted(vs)
            out[m] = {
                "count": float(len(s)),
                "p50": percentile_cont(s, 0.5),
                "p90": percentile_cont(s, 0.9),
                "p99": percentile_cont(s, 0.99),
                "mean": sum(s) / len(s) if s else None,
            }
        return out


def status_line(b: BatchRecord) -> str:
    """One line: the batch's status and counts."""
    p = b.progress
    total = p.total if p.total is not None else p.recorded
    parts = [f"{p.count(s)} {s.value}" for s in JobStatus if p.count(s)]
    return f"batch {b.id} {b.status}: {p.done}/{total} done ({', '.join(parts) or 'no jobs yet'})"


def watch(store: ResultStore, batch_id: str, *, every_s: float = 1.0, out: TextIO = sys.stderr,
          timeout_s: float | None = None, progress: bool = True) -> BatchRecord | None:
    """Follow a batch with a progress bar (on a terminal, when `progress`) until it ends (or
    `timeout_s`); its last record."""
    from tqdm import tqdm

    b = store.get_batch(batch_id)
    if b is None:
        return None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with tqdm(total=b.progress.total or b.progress.recorded, unit="job", file=out, disable=None if progress else True,
              desc=batch_id[:30], dynamic_ncols=True) as bar:
        while True:
            p = b.progress
            bar.total = p.total if p.total is not None else p.recorded
            bar.n = p.done
            bar.set_postfix(failed=p.count(JobStatus.FAILED), running=p.count(JobStatus.RUNNING), refresh=False)
            bar.refresh()
            if b.status in ENDED or (deadline is not None and time.monotonic() > deadline):
                return b
            time.sleep(every_s)
            store.finalize_batch(batch_id)  # a batch whose last row came by another path ends here too
            nb = store.get_batch(batch_id)
            if nb is None:
                return b
            b = nb


def _figure_png(t: BatchTimings, title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ttft = sorted(t.values["ttft_ms"])
    ax = axes[0]
    if ttft:
        ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], drawstyle="steps-post")
        for q in (0.5, 0.9, 0.99):
            v = percentile_cont(ttft, q)
            ax.axvline(v, linestyle=":", color="gray")
            ax.text(v, q, f" p{int(q * 100)} {v:.1f} ms", fontsize=8, va="bottom")
    ax.set(title="TTFT distribution (CDF)", xlabel="time to first token (ms)", ylabel="share of jobs")
    ax.grid(alpha=0.3)
    ax = axes[1]
    if t.ttft_by_prompt:
        xs, ys = zip(*t.ttft_by_prompt, strict=True)
        ax.scatter(xs, ys, s=6, alpha=0.5)
    ax.set(title="TTFT by prompt length", xlabel="prompt tokens", ylabel="TTFT (ms)")
    ax.grid(alpha=0.3)
    ax = axes[2]
    if t.finished:
        start = min(f for f, _ in t.finished)
        end = max(f for f, _ in t.finished)
        width = max(1.0, (end - start) / 60)  # about 60 buckets
        n = math.floor((end - start) / width) + 1
        jobs, toks = [0] * n, [0] * n
        for f, k in t.finished:
            i = min(n - 1, int((f - start) / width))
            jobs[i] += 1
            toks[i] += k
        xs = [i * width for i in range(n)]
        ax.plot(xs, [j / width for j in jobs], marker="o", markersize=3, label="jobs/s")
        ax2 = ax.twinx()
        ax2.plot(xs, [k / width for k in toks], marker="o", markersize=3, color="tab:orange", label="output tokens/s")
        ax2.set_ylabel("output tokens/s")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="upper right", fontsize=8)
    ax.set(title="Throughput over time", xlabel="seconds since the first result", ylabel="jobs/s")
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def percentile_table(pcts: dict[str, dict[str, float | None]]) -> str:
    """The percentiles as an aligned text table (ms)."""
    lines = [f"{'metric':<16}{'count':>8}{'p50':>11}{'p90':>11}{'p99':>11}{'mean':>11}"]
    for m, s in pcts.items():
        lines.append(f"{m:<16}{int(s['count'] or 0):>8}" + "".join(f"{_fmt(s[k]):>11}" for k in ("p50", "p90", "p99", "mean")))
    return "\n".join(lines)


def write_report(store: ResultStore, batch_id: str, out_dir: Path) -> tuple[str, Path, Path]:
    """Write `<out_dir>/report.png` and `report.html`; return (text table, png path, html path)."""
    b = store.get_batch(batch_id)
    if b is None:
        raise LookupError(batch_id)
    t = BatchTimings.of(store, batch_id)
    pcts = t.percentiles()
    table = percentile_table(pcts)
    png = _figure_png(t, f"batch {batch_id}: {len(t.values['ttft_ms'])} succeeded, {t.failed} failed")
    out_dir.mkdir(parents=True, exist_ok=True)
    png_path, html_path = out_dir / "report.png", out_dir / "report.html"
    png_path.write_bytes(png)
    rows = "".join(
        f"<tr><td>{html.escape(m)}</td><td>{int(s['count'] or 0)}</td>"
        + "".join(f"<td>{_fmt(s[k])}</td>" for k in ("p50", "p90", "p99", "mean"))
        + "</tr>"
        for m, s in pcts.items()
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>firsttoken report: {html.escape(batch_id)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}}td:first-child,th:first-child{{text-align:left}}
img{{max-width:100%}}</style></head><body>
<h1>Batch {html.escape(batch_id)}</h1>
<p>{html.escape(status_line(b))}</p>
<h2>Latency (ms)</h2>
<table><tr><th>metric</th><th>count</th><th>p50</th><th>p90</th><th>p99</th><th>mean</th></tr>{rows}</table>
<p>ttft = submission to first token (what the user waited); queue = waiting for capacity;
overhead = the pipeline's own part; tpot = time per output token after the first.</p>
<h2>Distribution, prompt length, throughput</h2>
<img alt="TTFT CDF, TTFT by prompt length, throughput over time" src="data:image/png;base64,{base64.b64encode(png).decode()}">
</body></html>
"""
    html_path.write_text(page, encoding="utf-8")
    return table, png_path, html_path
