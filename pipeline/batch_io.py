"""Batch files in and out: a JSONL file read into jobs (bad lines into `failed` results) and the
results written back as JSONL in input order, each line in the format its input line had."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

from pipeline.store import ResultStore
from schemas.batchfile import BatchLineError, LineFormat, ParsedLine, format_output_line, parse_lines
from schemas.job import JobRequest, JobResult


def default_batch_id(path: str | Path) -> str:
    """A stable batch id for a file (from its absolute path), so a re-run resumes the same batch."""
    digest = hashlib.blake2b(str(Path(path).resolve()).encode("utf-8"), digest_size=6).hexdigest()
    return f"{Path(path).stem[:40]}-{digest}"


def line_job_id(batch_id: str, line_no: int) -> str:
    """The id of a line that has none of its own: stable across runs of the same batch."""
    return f"{batch_id}-L{line_no}"


@dataclass(frozen=True)
class LineRef:
    """Where one input line's result is found, and how to write it."""

    line_no: int
    job_id: str
    format: LineFormat


@dataclass
class ReadBatch:
    """A batch file read: one ref per non-blank line (input order), the valid jobs, and a
    `failed` result for each line that is not a valid job."""

    batch_id: str
    refs: list[LineRef]
    jobs: list[JobRequest]
    failures: list[JobResult]

    @property
    def input_format(self) -> str:
        """The format of the first line ("plain", "openai_chat", ...), or "empty"."""
        return self.refs[0].format.value if self.refs else "empty"


def read_batch(
    lines: Iterable[bytes | str],
    batch_id: str,
    *,
    default_max_tokens: int | None = None,
) -> ReadBatch:
    """Parse batch-file lines. `default_max_tokens` applies to lines that do not set max_tokens."""
    out = ReadBatch(batch_id, [], [], [])
    for item in parse_lines(lines, batch_id=batch_id, id_prefix=f"{batch_id}-L"):
        if isinstance(item, ParsedLine):
            job = item.job
            if default_max_tokens is not None and "max_tokens" not in job.sampling.model_fields_set:
                sampling = job.sampling.model_copy(update={"max_tokens": default_max_tokens})
                job = job.model_copy(update={"sampling": sampling})
            out.refs.append(LineRef(item.line_no, job.id, item.format))
            out.jobs.append(job)
        else:
            out.refs.append(_failed_line(out, item, batch_id))
    return out


def _failed_line(out: ReadBatch, err: BatchLineError, batch_id: str) -> LineRef:
    result = err.result(batch_id=batch_id, fallback_id=line_job_id(batch_id, err.line_no))
    assert result is not None
    out.failures.append(result)
    return LineRef(err.line_no, result.id, err.format or LineFormat.PLAIN)


def read_batch_file(path: str | Path, batch_id: str, **kwargs: object) -> ReadBatch:
    """read_batch over a file's lines (bytes, so undecodable lines become `failed` results)."""
    with Path(path).open("rb") as f:
        return read_batch(f, batch_id, **kwargs)  # type: ignore[arg-type]


def iter_results(
    store: ResultStore, refs: list[LineRef], chunk: int = 1000
) -> Iterator[tuple[LineRef, JobResult | None]]:
    """Each ref with its stored result (None while its job is not terminal), in input order."""
    for i in range(0, len(refs), chunk):
        part = refs[i : i + chunk]
        rows = store.get_jobs([r.job_id for r in part])
        for ref in part:
            rec = rows.get(ref.job_id)
            yield ref, None if rec is None else rec.result()


def write_results(store: ResultStore, refs: list[LineRef], out: TextIO | BinaryIO) -> int:
    """Write the result line of each ref, in input order; skips jobs not yet terminal. Returns lines written."""
    n = 0
    for ref, result in iter_results(store, refs):
        if result is None:
            continue
        line = format_output_line(result, ref.format)
        if isinstance(out, TextIO) or hasattr(out, "encoding"):
            out.write(line)  # type: ignore[arg-type]
        else:
            out.write(line.encode("utf-8"))  # type: ignore[arg-type]
        n += 1
    return n
