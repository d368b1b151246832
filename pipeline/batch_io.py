"""Batch files in and out: naming a batch after its input, and writing a batch's results back as
JSONL in input order, each line in the format its input line had, to a file that appears whole
or not at all."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import stat
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TextIO

from pipeline.store import JobRecord, ResultStore
from schemas.job import JobStatus
from schemas.openai import LineFormat, echo_prompt, format_output_line


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
            fmt = _format_of(rec, fallback)
            yield format_output_line(result, fmt, echo_prompt(rec.prompt, rec.sampling, fmt), rec.tool_use)


def write_results(store: ResultStore, batch_id: str, out: TextIO, fallback: LineFormat = LineFormat.PLAIN) -> int:
    """Write `result_lines` to `out`. Returns lines written."""
    n = 0
    for line in result_lines(store, batch_id, fallback):
        out.write(line)
        n += 1
    return n


class OutputError(ValueError):
    """An output path that is not written (a directory, a FIFO, another run writing it, ...): one
    line for the user."""


def output_problem(path: str | Path) -> str | None:
    """Why `path` cannot be an output (a directory, a FIFO or socket, a block device, no directory
    to hold it), or None: a regular file (new or not) and a character device (/dev/null, a
    terminal) are outputs."""
    p = Path(path)
    try:
        mode = p.stat().st_mode  # through symlinks: what would be written
    except FileNotFoundError:
        parent = p.parent
        if p.is_symlink():
            return "is a symlink to nothing"
        if not parent.is_dir():
            return f"directory {parent} does not exist"
        return None
    except OSError as exc:
        return f"cannot use it ({exc.strerror or exc})"
    if stat.S_ISREG(mode) or stat.S_ISCHR(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory"
    if stat.S_ISFIFO(mode):
        return "is a FIFO (a pipe), not a regular file; leave out -o to write to stdout"
    if stat.S_ISBLK(mode):
        return "is a block device, not a regular file"
    return "is not a regular file"


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would change it for every thread)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # no /proc: set and restore at once
    os.umask(mask)
    return mask


def _locked_part(part: Path) -> int:
    """A descriptor of `part`, created or a killed run's leftover, locked for this run (the lock
    goes with the process: a run killed by SIGKILL leaves a file the next one takes over). Raises
    OutputError while another run holds it."""
    for _ in range(20):
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            now = os.stat(part, follow_symlinks=False)
            mine = os.fstat(fd)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return fd
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"another run is writing it now (it holds {part})") from None
        except FileNotFoundError:
            pass  # renamed into place by the run that held it just now: make a new one
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise OutputError(f"could not take {part}: other runs keep replacing it")


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[TextIO]:
    """A text file that appears at `path` only when the block ends without an error: written to
    `.NAME.part` beside it, flushed to disk, then renamed over it. A killed run leaves the old file
    (or none), never a truncated one, and its `.part` file is taken over and removed by the next
    run of the same output. A new file gets the mode the umask gives, a replaced one keeps its
    mode; through a symlink the file it names is replaced, not the link.

    A character device (/dev/null, a terminal) is written through, never replaced. Raises
    OutputError for a directory, a FIFO or socket, a block device, or while another run writes
    the same output."""
    target = Path(path)
    problem = output_problem(target)
    if problem is not None:
        raise OutputError(f"{target}: {problem}")
    try:
        st: os.stat_result | None = target.stat()
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISCHR(st.st_mode):
        with target.open("w", encoding="utf-8") as f:
            yield f
        return
    real = Path(os.path.realpath(target))
    part = real.with_name(f".{real.name}.part")
    mode = stat.S_IMODE(st.st_mode) & 0o777 if st is not None else 0o666 & ~_umask()
    try:
        fd = _locked_part(part)
    except OutputError as exc:
        raise OutputError(f"{target}: {exc}") from None
    except OSError as exc:
        raise OutputError(f"{target}: cannot write {part} ({exc.strerror or exc})") from None
    try:
        os.ftruncate(fd, 0)
        os.fchmod(fd, mode)
        f = os.fdopen(fd, "w", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise
    with f:  # closed (and unlocked) only after the rename or the removal
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
            os.replace(part, real)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
            raise


def same_file(a: str | Path, b: str | Path) -> bool:
    """True when `a` and `b` name the same file (or the same path, if `b` does not exist yet)."""
    pa, pb = Path(a), Path(b)
    try:
        return pa.samefile(pb)
    except FileNotFoundError:
        return pa.resolve() == pb.resolve()
