"""Batch files in and out: naming a batch after its input, and writing a batch's results back as
JSONL in input order, each line in the format its input line had, to a file that appears whole
or not at all."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TextIO

from pipeline.store import JobRecord, ResultStore
from schemas.batchfile import LineFormat, format_output_line
from schemas.job import JobStatus


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (hex): what names its input when a batch is resumed."""
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def bytes_digest(data: bytes) -> str:
    """sha256 of `data` (hex)."""
    return hashlib.sha256(data).hexdigest()


def default_batch_id(path: str | Path, digest: str | None = None) -> str:
    """A batch id for a file: its name and a digest of its path and content. Running the same
    file again resumes its batch; an edited file is a new batch."""
    h = hashlib.blake2b(str(Path(path).resolve()).encode("utf-8"), digest_size=6)
    h.update((digest or file_digest(path)).encode("ascii"))
    return f"{Path(path).stem[:40]}-{h.hexdigest()}"


def _format_of(rec: JobRecord, fallback: LineFormat) -> LineFormat:
    if rec.line_format in LineFormat._value2member_map_:
        return LineFormat(rec.line_format)
    return fallback


def batch_format(input_format: str | None) -> LineFormat:
    """The format a batch's lines answer in when a row does not say (its first line's)."""
    return LineFormat(input_format) if input_format in LineFormat._value2member_map_ else LineFormat.PLAIN


def result_lines(
    store: ResultStore,
    batch_id: str,
    fallback: LineFormat = LineFormat.PLAIN,
    statuses: Collection[JobStatus] | None = None,
) -> Iterator[str]:
    """The output line of every terminal job of the batch (of those `statuses` when given), in
    input order, each in its line's format (jobs still queued or running are left out)."""
    for rec in store.iter_batch(batch_id):
        result = rec.result()
        if result is not None and (statuses is None or result.status in statuses):
            yield format_output_line(result, _format_of(rec, fallback))


def write_results(store: ResultStore, batch_id: str, out: TextIO, fallback: LineFormat = LineFormat.PLAIN) -> int:
    """Write `result_lines` to `out`. Returns lines written."""
    n = 0
    for line in result_lines(store, batch_id, fallback):
        out.write(line)
        n += 1
    return n


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[TextIO]:
    """A text file that appears at `path` only when the block ends without an error: written to
    a temporary file beside it, flushed to disk, then renamed over it. A killed run leaves the
    old file (or none), never a truncated one."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def same_file(a: str | Path, b: str | Path) -> bool:
    """True when `a` and `b` name the same file (or the same path, if `b` does not exist yet)."""
    pa, pb = Path(a), Path(b)
    try:
        return pa.samefile(pb)
    except FileNotFoundError:
        return pa.resolve() == pb.resolve()
