"""Jobs: what a producer submits (JobRequest) and what a worker writes back (JobResult)."""

from __future__ import annotations

import uuid
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from schemas.sampling import SamplingParams


def _check_identifier(value: str) -> str:
    if not value or len(value) > 200 or value.strip() != value or not value.isprintable():
        raise PydanticCustomError(
            "identifier", "must be 1 to 200 printable characters with no whitespace at either end"
        )
    return value


# A job or batch id: short enough for an index and a Kafka key, safe to print in a log line.
Identifier = Annotated[str, AfterValidator(_check_identifier)]


def new_job_id() -> str:
    """A fresh job id (uuid4, 32 hex digits)."""
    return uuid.uuid4().hex


class JobStatus(StrEnum):
    """Where a job is. `succeeded`, `failed` and `cancelled` are terminal: a row in one of them is final."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """True for succeeded, failed and cancelled."""
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES: frozenset[JobStatus] = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED}
)


class ErrorCode(StrEnum):
    """Stable machine-readable reason a job failed."""

    INVALID_REQUEST = "invalid_request"  # the request is malformed (missing/extra field, bad type)
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt + max_tokens do not fit the model's context
    INVALID_SAMPLING = "invalid_sampling"  # a sampling parameter is out of range
    UNDECODABLE = "undecodable"  # the input bytes are not valid UTF-8 text
    ENGINE_ERROR = "engine_error"  # the engine failed on this job
    CANCELLED = "cancelled"  # a user cancelled the job or its batch
    INTERNAL_ERROR = "internal_error"  # anything else on our side


class FinishReason(StrEnum):
    """Why generation ended."""

    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled or aborted while running
    ERROR = "error"  # the job failed


def _text_of(content: object) -> object:
    """OpenAI content parts ([{"type": "text", "text": ...}]) joined into one string."""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise PydanticCustomError(
                    "content_part", "only text content parts are supported ({'type': 'text', 'text': ...})"
                )
            texts.append(part["text"])
        return "".join(texts)
    return content


def _check_utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "undecodable",
            "text is not valid UTF-8 (unpaired surrogate at character {pos})",
            {"pos": exc.start},
        ) from None
    return value


class ChatMessage(BaseModel):
    """One chat turn; rendered into a prompt with the checkpoint's own chat template."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Annotated[str, StringConstraints(pattern=r"^(system|developer|user|assistant|tool)$")] = Field(
        description="system, developer, user, assistant or tool"
    )
    content: str = Field(description="the turn's text")

    @field_validator("content", mode="before")
    @classmethod
    def _join_parts(cls, v: object) -> object:
        return _text_of(v)

    @field_validator("content")
    @classmethod
    def _utf8(cls, v: str) -> str:
        return _check_utf8(v)


class JobRequest(BaseModel):
    """One prompt job as a producer submits it.

    Exactly one of `prompt` (raw text) or `messages` (chat turns) is given. `priority`: higher is
    served first. `prefix_key` routes the job (Kafka key): jobs with one key land on one partition,
    hence one worker and its prefix cache; when absent it is derived from the prompt's start.
    `submitted_at` (epoch seconds) is set once, at submission.
    """

    model_config = ConfigDict(extra="forbid")

    id: Identifier = Field(default_factory=new_job_id, description="the client's id, or a generated uuid")
    batch_id: Identifier | None = Field(default=None, description="the batch this job belongs to")
    prompt: str | None = Field(default=None, min_length=1, description="raw prompt text")
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, description="chat turns")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    priority: int = Field(default=0, ge=-(2**31), lt=2**31, description="higher is served first")
    prefix_key: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = Field(
        default=None, description="routing key for prefix-cache locality"
    )
    metadata: dict[str, JsonValue] = Field(default_factory=dict, description="the client's, returned as is")
    submitted_at: float | None = Field(default=None, ge=0, description="epoch seconds, set at submission")

    @field_validator("prompt")
    @classmethod
    def _prompt_utf8(cls, v: str | None) -> str | None:
        return None if v is None else _check_utf8(v)

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError(
                "prompt_or_messages", "exactly one of 'prompt' or 'messages' must be given"
            )
        return self

    def prefix_text(self) -> str:
        """The text a derived routing key is computed from: the prompt, or the turns in order."""
        if self.prompt is not None:
            return self.prompt
        assert self.messages is not None
        return "".join(f"<{m.role}>{m.content}" for m in self.messages)

    def submitted(self, now: float) -> JobRequest:
        """This job with `submitted_at` set to `now` unless it already has one."""
        if self.submitted_at is not None:
            return self
        return self.model_copy(update={"submitted_at": now})


class Usage(BaseModel):
    """Token counts of one job. `cached_prompt_tokens` is the part of the prompt served from the prefix cache."""

    model_config = ConfigDict(extra="forbid")

    prompt_tokens: int = Field(default=0, ge=0)
    cached_prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _cached_within_prompt(self) -> Usage:
        if self.cached_prompt_tokens > self.prompt_tokens:
            raise PydanticCustomError(
                "cached_exceeds_prompt",
                "cached_prompt_tokens ({cached}) must not exceed prompt_tokens ({prompt})",
                {"cached": self.cached_prompt_tokens, "prompt": self.prompt_tokens},
            )
        return self

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else max(0.0, (b - a) * 1000.0)


class JobTimings(BaseModel):
    """When things happened to one job and how long they took.

    Instants that cross processes are wall-clock epoch seconds: `submitted_at` (producer),
    `admitted_at` (a worker took it into its engine queue), `first_token_at`, `finished_at`. Durations in milliseconds:
    `queue_ms` = admitted - submitted, `ttft_ms` = first token - submitted (what the user waits,
    queue included), `engine_ttft_ms` = first token - admitted (measured on the worker's monotonic
    clock), `prefill_ms` (the prompt's forward passes), `tpot_ms` = mean time per output token after
    the first, `e2e_ms` = finished - submitted.
    """

    model_config = ConfigDict(extra="forbid")

    submitted_at: float | None = Field(default=None, ge=0)
    admitted_at: float | None = Field(default=None, ge=0)
    first_token_at: float | None = Field(default=None, ge=0)
    finished_at: float | None = Field(default=None, ge=0)
    queue_ms: float | None = Field(default=None, ge=0)
    ttft_ms: float | None = Field(default=None, ge=0)
    engine_ttft_ms: float | None = Field(default=None, ge=0)
    prefill_ms: float | None = Field(default=None, ge=0)
    tpot_ms: float | None = Field(default=None, ge=0)
    e2e_ms: float | None = Field(default=None, ge=0)

    @classmethod
    def from_instants(
        cls,
        *,
        submitted_at: float | None,
        admitted_at: float | None,
        first_token_at: float | None,
        finished_at: float | None,
        completion_tokens: int = 0,
        engine_ttft_ms: float | None = None,
        prefill_ms: float | None = None,
        tpot_ms: float | None = None,
    ) -> JobTimings:
        """Timings with the cross-process durations derived from the epoch instants.

        Durations measured on the worker's monotonic clock (`engine_ttft_ms`, `prefill_ms`,
        `tpot_ms`) are passed in and win; when absent they are derived from the instants.
        """
        if engine_ttft_ms is None:
            engine_ttft_ms = _ms(admitted_at, first_token_at)
        if tpot_ms is None and completion_tokens > 1:
            decode_ms = _ms(first_token_at, finished_at)
            tpot_ms = None if decode_ms is None else decode_ms / (completion_tokens - 1)
        return cls(
            submitted_at=submitted_at,
            admitted_at=admitted_at,
            first_token_at=first_token_at,
            finished_at=finished_at,
            queue_ms=_ms(submitted_at, admitted_at),
            ttft_ms=_ms(submitted_at, first_token_at),
            engine_ttft_ms=engine_ttft_ms,
            prefill_ms=prefill_ms,
            tpot_ms=tpot_ms,
            e2e_ms=_ms(submitted_at, finished_at),
        )


class JobResult(BaseModel):
    """The outcome of one job, as the sink writes it: a terminal status, the text, usage and timings.

    A `failed` result carries an `error_code` and a message; a `succeeded` one carries neither.
    """

    model_config = ConfigDict(extra="forbid")

    id: Identifier
    batch_id: Identifier | None = None
    status: JobStatus
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage = Field(default_factory=Usage)
    timings: JobTimings = Field(default_factory=JobTimings)
    worker: str | None = Field(default=None, max_length=200)
    model: str | None = Field(default=None, max_length=200)
    error_code: ErrorCode | None = None
    error_message: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> JobResult:
        if not self.status.terminal:
            raise PydanticCustomError(
                "terminal_status",
                "a result's status must be succeeded, failed or cancelled, not {status}",
                {"status": self.status.value},
            )
        if self.status is JobStatus.FAILED and self.error_code is None:
            raise PydanticCustomError("error_code_missing", "a failed result needs an error_code")
        if self.status is JobStatus.SUCCEEDED and self.error_code is not None:
            raise PydanticCustomError(
                "error_code_on_success", "a succeeded result must not have an error_code"
            )
        return self

    @classmethod
    def failure(
        cls,
        job_id: str,
        code: ErrorCode,
        message: str,
        *,
        batch_id: str | None = None,
        submitted_at: float | None = None,
        finished_at: float | None = None,
        worker: str | None = None,
        model: str | None = None,
    ) -> JobResult:
        """A `failed` result (or `cancelled` for ErrorCode.CANCELLED) that never reached the engine's output."""
        status = JobStatus.CANCELLED if code is ErrorCode.CANCELLED else JobStatus.FAILED
        return cls(
            id=job_id,
            batch_id=batch_id,
            status=status,
            finish_reason=FinishReason.ABORT if status is JobStatus.CANCELLED else FinishReason.ERROR,
            timings=JobTimings.from_instants(
                submitted_at=submitted_at, admitted_at=None, first_token_at=None, finished_at=finished_at
            ),
            worker=worker,
            model=model,
            error_code=code,
            error_message=message,
        )


def describe_validation_error(exc: ValidationError, *, prefix: str = "") -> str:
    """One line naming each failing field and its rule, e.g. `sampling.max_tokens: Input should be >= 1`."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        if not loc:
            loc = "prompt/messages" if err["type"] == "prompt_or_messages" else "request"
        where = f"{prefix}{loc}"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def error_code_for(exc: ValidationError) -> ErrorCode:
    """The ErrorCode a validation failure of a JobRequest maps to."""
    errors = exc.errors(include_url=False)
    if any(
        e["type"] in ("undecodable", "string_unicode")
        or (e["type"] == "json_invalid" and "surrogate" in e["msg"])
        for e in errors
    ):
        return ErrorCode.UNDECODABLE
    if errors and all(e["loc"] and e["loc"][0] == "sampling" for e in errors):
        return ErrorCode.INVALID_SAMPLING
    return ErrorCode.INVALID_REQUEST


def job_id_hint(raw: Any) -> str | None:
    """The job id a raw (maybe invalid) request object claims, if it is a usable id, else None."""
    if isinstance(raw, dict):
        value = raw.get("id", raw.get("custom_id"))
        if (
            isinstance(value, str)
            and 0 < len(value) <= 200
            and value.strip() == value
            and value.isprintable()
        ):
            return value
    return None
