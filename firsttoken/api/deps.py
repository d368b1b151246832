"""What every route of the API shares: its state (settings, store, queue, checks), the caller
(API key -> owner), the model it serves (and the names a request may give for it), errors as
`{"error": {...}}`, and bodies read up to a limit."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from pipeline.producer import JobCheck, Producer
from pipeline.queue.base import JobQueue
from pipeline.settings import Settings
from pipeline.store import BatchRecord, JobRecord, ResultStore
from schemas.batchfile import loads_strict
from schemas.grammar import job_grammar_problem
from schemas.job import ErrorCode, JobRequest, job_id_of_owner

log = logging.getLogger(__name__)

Canceller = Callable[[Sequence[str], "str | None"], None]


def _with_grammar_check(check: JobCheck | None) -> JobCheck:
    """`check`, then the guided-decoding spec's: a spec the grammar engine refuses is the job's
    invalid_grammar at submission (checked with no tokenizer: schemas.grammar)."""

    def checked(job: JobRequest) -> tuple[ErrorCode, str] | None:
        problem = None if check is None else check(job)
        return problem or job_grammar_problem(job.sampling)

    return checked


class ApiError(Exception):
    """An error answered as `{"error": {"code", "message", "type", ...}}` with `status`."""

    def __init__(self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = str(code)
        self.message = message
        self.headers = headers
        self.extra = extra


RATE_LIMITED = "rate_limit_exceeded"  # OpenAI's code: its clients retry a 429 after Retry-After
MODEL_NOT_FOUND = "model_not_found"  # OpenAI's code (404) for a model this server does not serve

# the upstream checkpoint of a model served by a short name: a request may name either
UPSTREAM_NAMES = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def served_model_ids(model: str) -> frozenset[str]:
    """The names a request may give for the served `model` (as configured, e.g. FIRSTTOKEN_MODEL):
    that name itself; the upstream checkpoint of a downloadable model (`HuggingFaceTB/SmolLM2-135M-
    Instruct`, and without its organisation); the last component of a checkpoint directory's path
    (`/models/Llama-3.1-8B-Instruct` -> `Llama-3.1-8B-Instruct`). Names are compared exactly."""
    ids = {model}
    for name in (UPSTREAM_NAMES.get(model), model if "/" in model else None):
        if name:
            ids.add(name)
            last = name.rstrip("/").rsplit("/", 1)[-1]
            if last:
                ids.add(last)
    return frozenset(ids)


# `"model": "<name>"` without escapes: a batch line's model, found without parsing the line
_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"([^"\\]*)"')


class ConfigError(RuntimeError):
    """The API cannot start with these settings (e.g. no API keys and auth not switched off)."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: the owner of the API key (None when authentication is off: sees everything)."""

    owner: str | None

    def may_see(self, owner: str | None) -> bool:
        """True if this caller may read or change a job, batch or file of `owner`."""
        return self.owner is None or self.owner == owner


@dataclass
class ApiState:
    """The app's long-lived parts, built at startup (never at import)."""

    settings: Settings
    authenticate: Callable[[Request], Principal]
    store: ResultStore | None = None
    queue: JobQueue | None = None
    check: JobCheck | None = None
    canceller: Canceller | None = None
    replies: Any = None  # pipeline.replies.ReplyWaiter, when Redis is configured
    model_name: str = "smollm2-135m"  # the served model's id (GET /v1/models, `model` of responses)
    owned: list[Any] = field(default_factory=list)  # closed at shutdown
    abandoner: Any = None  # firsttoken.api.completions.Abandoner: cancels the jobs of clients gone
    model_ids: frozenset[str] = field(init=False)  # the names a request may give for it (served_model_ids)

    def __post_init__(self) -> None:
        self.model_ids = served_model_ids(self.model_name)
        self.check = _with_grammar_check(self.check)

    def check_model(self, name: object, where: str = "model") -> None:
        """Nothing when a request's `model` names the served model (or is absent); 404
        model_not_found when it names another one, 400 when it is not a string."""
        if name is None or name in self.model_ids:
            return
        if not isinstance(name, str):
            raise ApiError(400, ErrorCode.INVALID_REQUEST, f"{where}: must be a string", param=where)
        raise ApiError(404, MODEL_NOT_FOUND, self.model_not_found_message(name), param=where)

    def model_not_found_message(self, name: str) -> str:
        return f"this model does not exist here: this server serves {self.model_name!r}"  # (never the input)

    def unserved_models(self, lines: Iterable[bytes | str], limit: int = 20) -> list[tuple[int, str]]:
        """(line number, model) of the first `limit` OpenAI batch lines whose `body.model` names a
        model not served here (lines numbered from 1, blank ones counted, as in the batch).

        A line is parsed only when it may name another model: a line whose every `"model"` field
        reads (unescaped) as a served name is taken as it is. A line that does not parse (bad JSON,
        a NUL or a lone surrogate in any string) is left to the submission, which fails it alone."""
        ids = {i.encode() for i in self.model_ids}
        found: list[tuple[int, str]] = []
        for line_no, line in enumerate(lines, start=1):
            raw = line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line
            if b"model" not in raw and b"\\u" not in raw:
                continue
            named = _MODEL_FIELD.findall(raw)
            if named and len(named) == raw.count(b'"model"') and all(n in ids for n in named):
                continue
            try:
                obj = loads_strict(raw)
            except (ValueError, RecursionError):  # a NUL in its model too: that line's own error
                continue
            body = obj.get("body") if isinstance(obj, dict) and "custom_id" in obj else None
            model = body.get("model") if isinstance(body, dict) else None
            if model is not None and model not in self.model_ids:
                found.append((line_no, model if isinstance(model, str) else repr(model)))
                if len(found) >= limit:
                    break
        return found

    def admit(self, who: Principal, jobs: int) -> None:
        """429 when `jobs` more would take the caller past api_max_unfinished_jobs (its queued and
        running jobs); nothing is queued then. Callers without an owner (no auth) are not limited."""
        limit = self.settings.api_max_unfinished_jobs
        if not limit or who.owner is None or jobs <= 0:
            return
        if jobs > limit:  # no wait makes room for it: not a 429 to retry
            raise ApiError(413, ErrorCode.TOO_LARGE, f"these {jobs} jobs are more than your limit of {limit} "
                           "unfinished jobs: split them")
        have = self.st.count_unfinished(who.owner)
        if have + jobs > limit:
            raise ApiError(429, RATE_LIMITED, f"you have {have} unfinished jobs and the limit is {limit}: "
                           f"these {jobs} would pass it; send them once some finish",
                           headers={"Retry-After": str(max(1, int(self.settings.api_retry_after_s)))})

    @property
    def st(self) -> ResultStore:
        assert self.store is not None, "the app has not started"
        return self.store

    def producer(self) -> Producer:
        return Producer(self.queue, self.store)  # type: ignore[arg-type]

    def cancel(self, job_ids: Sequence[str], batch_id: str | None) -> None:
        """Tell the GPU workers to abort these jobs (the rows are cancelled already)."""
        if self.canceller is None:
            return
        try:
            self.canceller(job_ids, batch_id)
        except Exception as exc:  # a worker finishing one writes nothing over a cancelled row
            log.warning("could not reach the GPU workers to cancel: %s", exc)

    def find_job(self, who: Principal, job_id: str) -> JobRecord:
        """The caller's job by firsttoken's id, or by the custom id it gave a single job; 404 otherwise."""
        rec = self.st.get_job(job_id)
        if rec is None or not who.may_see(rec.owner):
            rec = self.st.get_job(job_id_of_owner(who.owner, job_id))
        if rec is None or not who.may_see(rec.owner):
            raise ApiError(404, "not_found", "no such job")
        return rec

    def batch_id_for(self, who: Principal, given: str) -> str:
        """The stored id of the batch a caller names `given`: that id itself when it is a batch of
        the caller's (or there is no owner: no authentication), else the caller's own id for that
        name (batch_id_of_owner). Another owner's batch id is so as a name never used: the caller
        neither reads nor adds to it, nor learns that it exists."""
        if who.owner is None:
            return given
        b = self.st.get_batch(given)
        if b is not None and b.owner == who.owner:
            return given
        return batch_id_of_owner(who.owner, given)

    def find_batch(self, who: Principal, batch_id: str) -> BatchRecord:
        """The caller's batch by its id or by the name the caller gave it; 404 otherwise."""
        b = self.st.get_batch(self.batch_id_for(who, batch_id))
        if b is None or not who.may_see(b.owner):
            raise ApiError(404, "not_found", "no such batch")
        return b


def batch_id_of_owner(owner: str, name: str) -> str:
    """The id of the batch `owner` named `name` (POST /v1/batches?batch_id=name): its own, apart
    from every other owner's batch of that name."""
    return "batch_" + hashlib.blake2b(f"batch of owner\0{owner}\0{name}".encode("utf-8", "surrogatepass"),
                                      digest_size=12).hexdigest()


def api_state(request: Request) -> ApiState:
    """The app's ApiState."""
    return request.app.state.api


def _principal(request: Request) -> Principal:
    return request.app.state.api.authenticate(request)


State = Annotated[ApiState, Depends(api_state)]
Who = Annotated[Principal, Depends(_principal)]


def authenticator(settings: Settings) -> Callable[[Request], Principal]:
    """The caller of a request from its Bearer key. Raises ConfigError when there are no keys and
    authentication is not switched off."""
    keys = settings.api_key_owners
    if not keys and not settings.api_no_auth:
        raise ConfigError(
            "no API keys: set FIRSTTOKEN_API_KEYS=owner:key,... (keys of 16+ characters), or switch "
            "authentication off for local use with FIRSTTOKEN_API_NO_AUTH=true (`firsttoken api --no-auth`)"
        )
    if settings.api_no_auth:

        def anyone(request: Request) -> Principal:
            return Principal(None)

        return anyone
    pairs = [(k.encode(), owner) for k, owner in keys.items()]

    def authenticate(request: Request) -> Principal:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "unauthorized", "send an API key: Authorization: Bearer <key>")
        given = token.strip().encode("utf-8", "replace")
        found = None
        for key, owner in pairs:  # every key compared, in constant time each
            if hmac.compare_digest(key, given):
                found = owner
        if found is None:
            raise ApiError(401, "unauthorized", "the API key is not valid")
        return Principal(found)

    return authenticate


async def limited_stream(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The request body's chunks as they arrive; 413 (and no more reading) once more than
    `limit` bytes came, whatever Content-Length said (a chunked body has none)."""
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # the rest is not read: the connection closes after the answer
            raise ApiError(413, ErrorCode.TOO_LARGE, f"the body is over the limit of {limit} bytes",
                           headers={"Connection": "close"})
        yield chunk


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, ErrorCode.TOO_LARGE, f"the body is over the limit of {limit} bytes",
                       headers={"Connection": "close"})
    return b"".join([chunk async for chunk in limited_stream(request, limit)])
