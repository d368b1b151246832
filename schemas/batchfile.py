"""Batch-file lines: parsing input JSONL into JobRequests (output lines: schemas.openai.responses).

Two input formats, told apart line by line:

- plain: `{"id": "a1", "prompt": "..."}` or `{"id": ..., "messages": [...]}`, with optional
  `sampling` (an object) or sampling fields at the top level (`"max_tokens": 16`), `priority`,
  `prefix_key`, `metadata` (fields the server sets, such as `batch_id` or `submitted_at`, are
  refused);
- OpenAI Batch API: `{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
  "body": {"model": ..., "messages": [...], "max_tokens": 16, ...}}` (or `/v1/completions` with
  `"prompt"`).

A line's id (`id` or `custom_id`) is the client's: the job's own id is scoped to its batch
(`ParsedLine.request`), so the same id in two batches is two jobs. A line that cannot become a
job gives a `BatchLineError` with an ErrorCode, a message naming the field and rule, and the id
the line claims when it has a usable one, so that the caller can record a `failed` row for that
line instead of stopping. Nothing a line holds makes the parser raise.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from schemas.job import (
    SERVER_FIELDS,
    ErrorCode,
    JobInput,
    JobRequest,
    JobResult,
    LineError,
    describe_validation_error,
    error_code_for,
    job_id_hint,
    job_id_in_batch,
    job_id_of_line,
    nests_deeper_than,
)
from schemas.limits import MAX_JSON_DEPTH, MAX_LINE_BYTES
from schemas.openai.formats import OPENAI_URLS, LineFormat
from schemas.openai.requests import openai_body_request
from schemas.sampling import SamplingParams

_SAMPLING_FIELDS = frozenset(SamplingParams.model_fields)
_PLAIN_FIELDS = frozenset(JobInput.model_fields)

@dataclass(frozen=True)
class ParsedLine:
    """A batch-file line that became a job (as the client wrote it: ids are not scoped yet)."""

    line_no: int  # 1-based line number in the file
    format: LineFormat
    job: JobInput

    def request(
        self, batch_id: str, *, owner: str | None = None, default_max_tokens: int | None = None
    ) -> JobRequest:
        """The job of this line in batch `batch_id`: its id scoped to the batch (the line's own
        id, or its line number when it has none), `max_tokens` defaulted when the line has none."""
        job = self.job
        sampling = job.sampling
        if default_max_tokens is not None and "max_tokens" not in sampling.model_fields_set:
            sampling = sampling.model_copy(update={"max_tokens": default_max_tokens})
        job_id = job_id_of_line(batch_id, self.line_no) if job.id is None else job_id_in_batch(batch_id, job.id)
        return job.to_request(
            job_id,
            batch_id=batch_id,
            owner=owner,
            line_no=self.line_no,
            line_format=self.format.value,
            sampling=sampling,
        )


@dataclass(frozen=True)
class BatchLineError:
    """A batch-file line that did not become a job."""

    line_no: int
    format: LineFormat | None  # None when the line is not even a JSON object
    code: ErrorCode
    message: str
    job_id: str | None  # the client's id the line claims, when it has a usable one

    def result(self, batch_id: str) -> JobResult:
        """The `failed` result of this line in batch `batch_id`, in a row of the line's own (so it
        never takes the place of another line's job that has the same id)."""
        return JobResult.failure(
            job_id_of_line(batch_id, self.line_no),
            self.code,
            f"line {self.line_no}: {self.message}",
            batch_id=batch_id,
            custom_id=self.job_id,
        )


def _server_field(key: str, where: str = "") -> LineError:
    return LineError(
        ErrorCode.INVALID_REQUEST, f"{where}{key}: set by the server, not by a line (remove it)"
    )


def _plain_request(obj: dict[str, Any]) -> dict[str, Any]:
    # one pass over the line's keys (this runs for every line of a bulk submission)
    request: dict[str, Any] = {}
    sampling_top: dict[str, Any] = {}
    unknown: list[str] = []
    for k, v in obj.items():
        if k in _PLAIN_FIELDS:
            request[k] = v
        elif k in _SAMPLING_FIELDS:
            sampling_top[k] = v
        elif k in SERVER_FIELDS:
            raise _server_field(k)
        else:
            unknown.append(k)
    if unknown:
        raise LineError(ErrorCode.INVALID_REQUEST, f"{min(unknown)}: unknown field (plain line)")
    if sampling_top:
        nested = request.get("sampling") or {}
        if not isinstance(nested, dict):
            raise LineError(ErrorCode.INVALID_REQUEST, "sampling: must be an object")
        both = sorted(set(nested) & set(sampling_top))
        if both:
            raise LineError(
                ErrorCode.INVALID_REQUEST, f"{both[0]}: given both at the top level and in 'sampling'"
            )
        request["sampling"] = {**nested, **sampling_top}
    return request


def _openai_request(obj: dict[str, Any]) -> tuple[LineFormat, dict[str, Any]]:
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise LineError(ErrorCode.INVALID_REQUEST, f"{unknown[0]}: unknown field (OpenAI batch line)")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(ErrorCode.INVALID_REQUEST, "custom_id: must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise LineError(ErrorCode.INVALID_REQUEST, "method: must be POST")
    url = obj.get("url")
    if url not in OPENAI_URLS:
        raise LineError(ErrorCode.INVALID_REQUEST, f"url: must be one of {sorted(OPENAI_URLS)}, got {_short(url)}")
    fmt = OPENAI_URLS[url]
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(ErrorCode.INVALID_REQUEST, "body: must be an object")
    return fmt, openai_body_request(body, fmt, custom_id)


def _short(value: object, limit: int = 60) -> str:
    """repr(value) cut to `limit` characters: an error message never echoes a huge input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(exc: ValidationError, fmt: LineFormat) -> str:
    if fmt is LineFormat.PLAIN:
        return describe_validation_error(exc)
    # OpenAI lines: the fields sit in `body`, sampling fields directly in it.
    return describe_validation_error(exc, prefix="body.").replace("body.sampling.", "body.")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class UnsafeText(ValueError):
    """A JSON document holding what no store can keep: a NUL character, an unpaired surrogate
    (`code` undecodable: not UTF-8 text), a number past a float's range."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> None:
        super().__init__(message)
        self.code = code


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: JSON, but no store or queue can carry it back as a number
        raise UnsafeText(f"a number ({_short(text, 24)}) is past a 64-bit float's range")
    return value


# NUL: no Postgres text or JSONB value holds it. U+D800-U+DFFF: json decodes a surrogate pair
# into one character, so one left over is unpaired, and no UTF-8 encoder takes it.
_UNSAFE = re.compile("[\x00\ud800-\udfff]")


def _check_text(obj: Any) -> None:
    """Raise UnsafeText naming the first string (a key or a value, at any depth) that holds a NUL
    or an unpaired surrogate. One pass, without recursion."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    search = _UNSAFE.search
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            m = search(v)
            if m is not None:
                _unsafe(path or "value", m.group())
        elif isinstance(v, dict):
            for k, x in v.items():
                where = f"{path}.{k}" if path else str(k)
                m = search(k)
                if m is not None:
                    _unsafe(f"{path + '.' if path else ''}<key>", m.group())
                if isinstance(x, (str, dict, list)):
                    stack.append((x, where))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]") for i, x in enumerate(v) if isinstance(x, (str, dict, list)))


def _unsafe(path: str, char: str) -> None:
    # the path names fields, not values: a key of the client's is shown only when it is safe to print
    shown = path if _UNSAFE.search(path) is None and len(path) <= 120 else "a field"
    if char == "\x00":
        raise UnsafeText(f"{shown}: holds a NUL character (\\u0000), which no text field may hold")
    raise UnsafeText(f"{shown}: not valid UTF-8 text (an unpaired surrogate, U+{ord(char):04X})", ErrorCode.UNDECODABLE)


def loads_strict(text: str | bytes, *, check_text: bool = True) -> Any:
    """json.loads that refuses what JSON allows but no store or queue here can carry: NaN,
    Infinity, numbers past a 64-bit float's range (1e400), and strings (keys or values, at any
    depth) holding a NUL or an unpaired surrogate.

    Raises ValueError (json.JSONDecodeError, too many digits in an integer, NaN, UnsafeText) or
    RecursionError (nesting deeper than the interpreter's stack)."""
    obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    if check_text:
        _check_text(obj)
    return obj


def parse_json_object(raw: str | bytes, *, max_bytes: int = MAX_LINE_BYTES) -> dict[str, Any]:
    """One JSON object from a line or a request body, within the size and nesting limits.

    Raises LineError with the code and message of the first rule it breaks; never anything else.
    """
    if len(raw) > max_bytes:
        raise LineError(ErrorCode.TOO_LARGE, f"{len(raw)} bytes; the limit is {max_bytes}")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise LineError(ErrorCode.UNDECODABLE, f"not valid UTF-8 (byte {exc.start})") from None
    try:
        obj = loads_strict(raw, check_text=False)
    except json.JSONDecodeError as exc:
        raise LineError(ErrorCode.INVALID_REQUEST, f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise LineError(ErrorCode.TOO_LARGE, f"JSON nests deeper than {MAX_JSON_DEPTH} levels") from None
    except UnsafeText as exc:
        raise LineError(ErrorCode.INVALID_REQUEST, str(exc)) from None
    except ValueError as exc:  # an integer of more than 4300 digits, NaN, Infinity, 1e400
        raise LineError(ErrorCode.INVALID_REQUEST, f"not valid JSON: {str(exc)[:120]}") from None
    if not isinstance(obj, dict):
        raise LineError(ErrorCode.INVALID_REQUEST, "must be a JSON object")
    if nests_deeper_than(obj, MAX_JSON_DEPTH):
        raise LineError(ErrorCode.TOO_LARGE, f"JSON nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        _check_text(obj)
    except UnsafeText as exc:
        raise LineError(exc.code, str(exc), job_id_hint(obj)) from None
    return obj


def parse_line(line: str | bytes, line_no: int) -> ParsedLine | BatchLineError | None:
    """Parse one batch-file line into a ParsedLine or a BatchLineError; blank lines give None.

    Never raises: whatever is wrong with the line (bad bytes, bad JSON, too big, too deep, an
    invalid field, an unexpected error) is that line's BatchLineError.
    """
    if not line.strip():
        return None
    fmt: LineFormat | None = None
    obj: Any = None
    try:
        obj = parse_json_object(line)
        fmt = LineFormat.PLAIN
        if "custom_id" in obj:
            fmt = OPENAI_URLS.get(obj.get("url"), LineFormat.OPENAI_CHAT)  # type: ignore[arg-type]
            fmt, request = _openai_request(obj)
        else:
            request = _plain_request(obj)
        job = JobInput.model_validate(request)
    except LineError as exc:
        return BatchLineError(line_no, fmt, exc.code, exc.message, exc.job_id or job_id_hint(obj))
    except ValidationError as exc:
        assert fmt is not None
        return BatchLineError(line_no, fmt, error_code_for(exc), _describe(exc, fmt), job_id_hint(obj))
    except Exception as exc:  # a line must never stop the batch
        return BatchLineError(
            line_no, fmt, ErrorCode.INVALID_REQUEST, f"could not be read ({type(exc).__name__})", job_id_hint(obj)
        )
    return ParsedLine(line_no, fmt, job)


def parse_lines(lines: Iterable[str | bytes]) -> Iterator[ParsedLine | BatchLineError]:
    """Parse every non-blank line (numbered from 1, blank lines counted)."""
    for line_no, line in enumerate(lines, start=1):
        parsed = parse_line(line, line_no)
        if parsed is not None:
            yield parsed


