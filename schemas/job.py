"""Jobs: what a producer submits (JobRequest) and what a worker writes back (JobResult)."""

from __future__ import annotations

import hashlib
import json
import uuid
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from schemas.limits import (
    MAX_CHOICES,
    MAX_MESSAGES,
    MAX_METADATA_BYTES,
    MAX_METADATA_DEPTH,
    MAX_PROMPT_CHARS,
    MAX_PROMPTS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    MAX_TOOLS_CHARS,
)
from schemas.sampling import SamplingParams
from schemas.tools import NamedToolChoice, Tool, ToolCall, ToolChoice, ToolUse, tool_use, tools_guide


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


def _scoped_id(kind: str, scope: str, key: str) -> str:
    # 96 bits: two of 10M jobs collide with probability ~6e-16
    digest = hashlib.blake2b(f"{kind}\0{scope}\0{key}".encode(), digest_size=12).hexdigest()
    return f"job-{digest}"


def job_id_in_batch(batch_id: str, custom_id: str) -> str:
    """The job id of the line `custom_id` of batch `batch_id`: the same custom id in two batches is
    two jobs, and the same line submitted again (a resumed batch) is the same job."""
    return _scoped_id("batch", batch_id, custom_id)


def job_id_of_line(batch_id: str, line_no: int) -> str:
    """The id of the row that holds line `line_no`'s error when the line is not a job of its own
    (unparseable, invalid without a usable id, or a duplicate id)."""
    return _scoped_id("line", batch_id, str(line_no))


def job_id_of_owner(owner: str | None, custom_id: str) -> str:
    """The job id of a single job (no batch) with the client's id `custom_id`, per owner."""
    return _scoped_id("owner", owner or "", custom_id)


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
    INVALID_GRAMMAR = "invalid_grammar"  # a guided-decoding spec (JSON schema, regex) the grammar engine refuses
    UNDECODABLE = "undecodable"  # the input bytes are not valid UTF-8 text
    DUPLICATE_ID = "duplicate_id"  # another line of the batch already has this id (the first one runs)
    TOO_LARGE = "too_large"  # the line, or a field of it, is over a size or nesting limit
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
    """One chat turn; rendered into a prompt with the checkpoint's own chat template. An assistant
    turn may carry the `tool_calls` it made (its content may then be null); a `tool` turn answers
    one of them (`tool_call_id`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Annotated[str, StringConstraints(pattern=r"^(system|developer|user|assistant|tool)$")] = Field(
        description="system, developer, user, assistant or tool"
    )
    content: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS,
                                description="the turn's text (null only for an assistant turn with tool calls)")
    name: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = Field(
        default=None, description="the participant's (or, for a tool turn, the function's) name")
    tool_calls: list[ToolCall] | None = Field(
        default=None, max_length=MAX_TOOL_CALLS, description="assistant turns: the calls it made")
    tool_call_id: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = Field(
        default=None, description="tool turns: the call this answers")

    @field_validator("content", mode="before")
    @classmethod
    def _join_parts(cls, v: object) -> object:
        return _text_of(v)

    @field_validator("content")
    @classmethod
    def _utf8(cls, v: str | None) -> str | None:
        return None if v is None else _check_utf8(v)

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("tool_calls_role", "tool_calls: assistant turns only")
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("tool_call_id", "a tool turn needs the tool_call_id it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise PydanticCustomError("tool_call_id_role", "tool_call_id: tool turns only")
        if self.content is None and not self.tool_calls:
            raise PydanticCustomError("content_missing", "content: required (null only with tool_calls)")
        return self

    @property
    def chars(self) -> int:
        """Characters of its text and of its calls' arguments."""
        return len(self.content or "") + sum(len(c.function.arguments) + 64 for c in self.tool_calls or ())

    def turn(self) -> dict[str, Any]:
        """The turn as a chat template is given it (the OpenAI message dict, unset fields left out)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        for k in ("name", "tool_call_id"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


def nests_deeper_than(value: object, limit: int) -> bool:
    """True when `value` nests lists and objects more than `limit` levels (a scalar is 0),
    walked without recursion and given up on at the first level past the limit."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if d + 1 > limit:
            return True
        stack.extend((c, d + 1) for c in children)
    return False


def _check_metadata(value: object) -> object:
    if nests_deeper_than(value, MAX_METADATA_DEPTH):
        raise PydanticCustomError(
            "too_large", "nests deeper than {depth} levels", {"depth": MAX_METADATA_DEPTH}
        )
    try:
        size = len(json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError):
        return value  # not JSON: the JsonValue validation names the field at fault
    if size > MAX_METADATA_BYTES:
        raise PydanticCustomError(
            "too_large", "is {size} characters of JSON; the limit is {limit}",
            {"size": size, "limit": MAX_METADATA_BYTES},
        )
    return value


TokenId = Annotated[int, Field(ge=0, lt=2**31, strict=True)]
# one prompt of a prompt list: a text, or token ids (checked against the model's vocabulary at
# submission and by the engine)
PromptItem = (
    Annotated[str, StringConstraints(min_length=1, max_length=MAX_PROMPT_CHARS)]
    | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
)


def prompt_item_problem(p: object) -> str | None:
    """What is wrong with one prompt of a prompt list (None: nothing): it is a non-empty text or a
    non-empty list of token ids (integers from 0 to 2**31 - 1)."""
    if isinstance(p, str):
        return "empty" if not p else None
    if not isinstance(p, list):
        return "a text or a list of token ids"
    if not p:
        return "an empty token list"
    for t in p:
        if isinstance(t, bool) or not isinstance(t, int):
            return "token ids are integers"
        if not 0 <= t < 2**31:
            return f"token id {t} is out of range (0 to 2**31 - 1)"
    return None


class JobBody(BaseModel):
    """What a job asks for: a prompt or chat turns, sampling, priority, routing key, metadata.

    Exactly one of `prompt` (raw text), `prompts` (a list of texts or token-id lists, OpenAI's
    prompt list: each prompt its own choices) or `messages` (chat turns) is given. A job runs
    `len(prompts) * sampling.n` choices (best_of sampled per prompt), at most MAX_CHOICES sequences. `priority`: higher is
    served first. `prefix_key` routes the job (Kafka key): jobs with one key land on one partition,
    hence one worker and its prefix cache; when absent it is derived from the prompt's start.
    """

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(
        default=None, min_length=1, max_length=MAX_PROMPT_CHARS, description="raw prompt text"
    )
    prompts: list[PromptItem] | None = Field(
        default=None, min_length=1, max_length=MAX_PROMPTS,
        description="prompts, each a text or a list of token ids: each gets its own choices",
    )
    messages: list[ChatMessage] | None = Field(
        default=None, min_length=1, max_length=MAX_MESSAGES, description="chat turns"
    )
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    priority: int = Field(default=0, ge=-(2**31), lt=2**31, strict=True, description="higher is served first")
    prefix_key: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = Field(
        default=None, description="routing key for prefix-cache locality"
    )
    metadata: Annotated[dict[str, JsonValue], BeforeValidator(_check_metadata)] = Field(
        default_factory=dict, description="the client's, returned as is"
    )
    # function calling (chat only): the functions the template is shown, and how the model may call them
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS, description="functions the model may call")
    tool_choice: ToolChoice | None = Field(
        default=None, description="none, auto (the default with tools), required, or one named function")
    parallel_tool_calls: bool = Field(default=True, strict=True, description="more than one call per answer")

    @field_validator("tools")
    @classmethod
    def _tools_distinct(cls, v: list[Tool] | None) -> list[Tool] | None:
        if not v:
            return None  # [] is no tools
        names = [t.function.name for t in v]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise PydanticCustomError("tool_name_twice", "function {name} is declared twice", {"name": dup})
        size = len(json.dumps([t.model_dump(exclude_none=True) for t in v], ensure_ascii=False))
        if size > MAX_TOOLS_CHARS:
            raise PydanticCustomError("too_large", "the tools are {size} characters of JSON; the limit is {limit}",
                                      {"size": size, "limit": MAX_TOOLS_CHARS})
        return v

    @model_validator(mode="after")
    def _tool_choice(self) -> JobBody:
        """tool_choice names a declared function and needs tools (unless none); required or a
        named function holds the output to the calls through sampling.guided."""
        choice = self.tool_choice
        if self.tools is None:
            if choice not in (None, "none"):
                raise PydanticCustomError("tool_choice_needs_tools", "tool_choice: only with tools")
            return self
        if self.messages is None:
            raise PydanticCustomError("tools_need_messages", "tools: chat turns only (messages)")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise PydanticCustomError("tool_choice_unknown", "tool_choice names function {name}, not among the tools",
                                      {"name": choice.function.name})
        try:
            guide = tools_guide(self.tools, choice, self.parallel_tool_calls)
        except ValueError as exc:  # (the combined schema past the guided-decoding limit)
            raise PydanticCustomError("too_large", "tool_choice: the functions' schemas together are too large "
                                      "to constrain the output ({why})", {"why": str(exc)[:200]}) from None
        if guide is not None:
            if self.sampling.guided is None:
                self.sampling = self.sampling.model_copy(update={"guided": guide})
            elif self.sampling.guided.key != guide.key:
                raise PydanticCustomError(
                    "tool_choice_guided", "tool_choice required or a named function constrains the output "
                    "itself: not with response_format (or another guided decoding)")
        return self

    @property
    def tool_use(self) -> ToolUse | None:
        """How to read tool calls out of its output (None: plain text)."""
        return tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)

    @field_validator("prompt")
    @classmethod
    def _prompt_utf8(cls, v: str | None) -> str | None:
        return None if v is None else _check_utf8(v)

    @field_validator("prompts", mode="before")
    @classmethod
    def _prompts_shape(cls, v: object) -> object:
        """One clear message per bad prompt (not one per member of the union)."""
        if isinstance(v, list):
            for i, p in enumerate(v):
                problem = prompt_item_problem(p)
                if problem is not None:
                    raise PydanticCustomError("prompt_item", "prompt {i}: {problem}", {"i": i, "problem": problem})
        return v

    @field_validator("prompts")
    @classmethod
    def _prompts_utf8(cls, v: list[str | list[int]] | None) -> list[str | list[int]] | None:
        for p in v or ():
            if isinstance(p, str):
                _check_utf8(p)
        return v

    @model_validator(mode="after")
    def _one_input(self) -> JobBody:
        if sum(x is not None for x in (self.prompt, self.prompts, self.messages)) != 1:
            raise PydanticCustomError(
                "prompt_or_messages", "exactly one of 'prompt', 'prompts' or 'messages' must be given"
            )
        if self.messages is not None and self.sampling.echo:
            raise PydanticCustomError("echo_needs_prompt", "echo: a text prompt only (chat turns have no echo)")
        if self.messages is not None and self.sampling.best_of is not None:
            raise PydanticCustomError("best_of_needs_prompt", "best_of: text completions only (chat has n)")
        if self.num_prompts * self.sampling.samples_per_prompt > MAX_CHOICES:
            raise PydanticCustomError(
                "too_many_choices",
                "{prompts} prompts times {samples} samples each is {total} sequences; the limit is {limit}",
                {"prompts": self.num_prompts, "samples": self.sampling.samples_per_prompt,
                 "total": self.num_prompts * self.sampling.samples_per_prompt, "limit": MAX_CHOICES},
            )
        if self.prompts is not None:
            chars = sum(len(p) for p in self.prompts)
            if chars > MAX_PROMPT_CHARS:
                raise PydanticCustomError(
                    "too_large",
                    "the prompts hold {chars} characters (or token ids); the limit is {limit}",
                    {"chars": chars, "limit": MAX_PROMPT_CHARS},
                )
        if self.messages is not None:
            chars = sum(m.chars for m in self.messages)
            if chars > MAX_PROMPT_CHARS:
                raise PydanticCustomError(
                    "too_large",
                    "the turns hold {chars} characters; the limit is {limit}",
                    {"chars": chars, "limit": MAX_PROMPT_CHARS},
                )
        return self

    @property
    def num_prompts(self) -> int:
        """Prompts the job holds: its prompt list's length, else 1."""
        return 1 if self.prompts is None else len(self.prompts)

    @property
    def has_choices(self) -> bool:
        """Whether the job's result is a list of choices (a prompt list, n or best_of above 1)
        rather than one output."""
        return self.prompts is not None or self.sampling.samples_per_prompt > 1

    def prefix_text(self) -> str:
        """The text a derived routing key is computed from: the prompt (the first of a list), or
        the turns in order."""
        if self.prompt is not None:
            return self.prompt
        if self.prompts is not None:
            first = self.prompts[0]
            # token ids as decimal text (the first 65536: 128k characters or more, past any routing prefix)
            return first if isinstance(first, str) else " ".join(map(str, first[:65536]))
        assert self.messages is not None
        return "".join(f"<{m.role}>{m.content or ''}" for m in self.messages)


# Fields the server sets; a client (a batch line, a POST body) that sends one gets an error
# naming it instead of having it silently applied or dropped.
SERVER_FIELDS = frozenset(
    {"batch_id", "submitted_at", "owner", "custom_id", "line_no", "line_format", "reply", "job_id"}
)


class JobInput(JobBody):
    """One job as a client sends it (a plain batch line, `POST /v1/jobs`). `id` is the client's own
    id, unique within its batch (or, for a single job, among the owner's jobs)."""

    id: Identifier | None = Field(default=None, description="the client's id for this job")

    def to_request(self, job_id: str, **server: Any) -> JobRequest:
        """The JobRequest of this job under firsttoken's `job_id`, with the server's fields
        (batch_id, owner, line_no, line_format, sampling with defaults applied, ...)."""
        fields: dict[str, Any] = {
            "prompt": self.prompt,
            "prompts": self.prompts,
            "messages": self.messages,
            "sampling": self.sampling,
            "priority": self.priority,
            "prefix_key": self.prefix_key,
            "metadata": self.metadata,
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "custom_id": self.id,
            "batch_id": None,
            "owner": None,
            "line_no": None,
            "line_format": None,
            "submitted_at": None,
            "reply": None,
        }
        fields.update(server)
        # the fields were validated as a JobInput: no second validation per line of a bulk submission
        return JobRequest.model_construct(id=job_id, **fields)


class JobRequest(JobBody):
    """One job as it travels on the queue: the client's job plus what the server decided.

    `id` is the job's id everywhere inside firsttoken (rows, queue, engine): derived from the
    batch and the client's `custom_id` (`job_id_in_batch`), or from the owner and the custom id
    for a single job. `submitted_at` (epoch seconds) is stamped by the producer, never taken
    from a client. `line_no` and `line_format` say where in the batch's input the job came from.
    """

    id: Identifier = Field(default_factory=new_job_id, description="the job's id inside firsttoken")
    custom_id: Identifier | None = Field(default=None, description="the client's id (default: id)")
    batch_id: Identifier | None = Field(default=None, description="the batch this job belongs to")
    owner: Identifier | None = Field(default=None, description="who submitted it (the API key's owner)")
    line_no: int | None = Field(default=None, ge=1, description="its line in the batch's input")
    line_format: str | None = Field(default=None, max_length=32, description="that line's format")
    submitted_at: float | None = Field(default=None, ge=0, description="epoch seconds, set at submission")
    reply: Literal["final", "stream"] | None = Field(
        default=None, description="publish the result (final) or also text deltas (stream) to a waiter"
    )

    @property
    def client_id(self) -> str:
        """The id the client knows this job by."""
        return self.custom_id if self.custom_id is not None else self.id

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
    `admitted_at` (a worker took it into its engine queue), `scheduled_at` (the engine first ran
    it), `first_token_at`, `finished_at`. Durations in milliseconds: `ttft_ms` = first token -
    submitted (what the user waits, queue included), `queue_ms` = the waiting for capacity in it
    (in Kafka while the worker held off for back-pressure, then in the engine's waiting queue until
    its first step), `overhead_ms` = the pipeline's own part of it (submitted -> admitted, less the
    back-pressure wait: produce, broker, fetch, hand-off), `engine_ttft_ms` = first token -
    admitted (the worker's monotonic clock), `prefill_ms` (the job's share of the steps that computed
    its prompt: each step's device time split over its tokens, so a cached prefix costs nothing
    and a step shared with 30 prompts is a thirtieth each), `tpot_ms`
    = mean time per output token after the first, `e2e_ms` = finished - submitted. So ttft_ms =
    overhead_ms + queue_ms + (first token - scheduled).
    """

    model_config = ConfigDict(extra="forbid")

    submitted_at: float | None = Field(default=None, ge=0)
    admitted_at: float | None = Field(default=None, ge=0)
    scheduled_at: float | None = Field(default=None, ge=0)
    first_token_at: float | None = Field(default=None, ge=0)
    finished_at: float | None = Field(default=None, ge=0)
    queue_ms: float | None = Field(default=None, ge=0)
    overhead_ms: float | None = Field(default=None, ge=0)
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
        scheduled_at: float | None = None,
        queue_ms: float | None = None,
        overhead_ms: float | None = None,
    ) -> JobTimings:
        """Timings with the cross-process durations derived from the epoch instants.

        Durations measured on the worker (`engine_ttft_ms`, `prefill_ms`, `tpot_ms`, `queue_ms`,
        `overhead_ms`) are passed in and win; when absent they are derived from the instants
        (queue_ms as submitted -> admitted, with no overhead known).
        """
        if engine_ttft_ms is None:
            engine_ttft_ms = _ms(admitted_at, first_token_at)
        if tpot_ms is None and completion_tokens > 1:
            decode_ms = _ms(first_token_at, finished_at)
            tpot_ms = None if decode_ms is None else decode_ms / (completion_tokens - 1)
        return cls(
            submitted_at=submitted_at,
            admitted_at=admitted_at,
            scheduled_at=scheduled_at,
            first_token_at=first_token_at,
            finished_at=finished_at,
            queue_ms=_ms(submitted_at, admitted_at) if queue_ms is None else queue_ms,
            overhead_ms=overhead_ms,
            ttft_ms=_ms(submitted_at, first_token_at),
            engine_ttft_ms=engine_ttft_ms,
            prefill_ms=prefill_ms,
            tpot_ms=tpot_ms,
            e2e_ms=_ms(submitted_at, finished_at),
        )


class TopLogprob(BaseModel):
    """A token and its log-probability under the model."""

    model_config = ConfigDict(extra="forbid")

    token: str = Field(description="the token decoded alone")
    id: int
    logprob: float


class TokenLogprobs(TopLogprob):
    """An output token's log-probability, and the most likely tokens at its position."""

    top: list[TopLogprob] = Field(default_factory=list, description="most likely first")


class Choice(BaseModel):
    """One choice of a job that has several (a prompt list, n, best_of): its output, in the order
    OpenAI gives them (prompt-major: prompt i's choices are i*n ... i*n + n-1)."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0)
    prompt_index: int = Field(default=0, ge=0, description="the prompt (of the job's list) it continues")
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    echo: str | None = Field(default=None, description="the prompt's text, when the job asked for echo")


class JobResult(BaseModel):
    """The outcome of one job, as the sink writes it: a terminal status, the text, usage and timings.

    A `failed` result carries an `error_code` and a message; a `succeeded` one carries neither. A
    job with several choices has them all in `choices`; `text`, `finish_reason` and the
    log-probabilities are then its first choice's (what SQL over the rows reads).
    """

    model_config = ConfigDict(extra="forbid")

    id: Identifier
    batch_id: Identifier | None = None
    custom_id: Identifier | None = Field(default=None, description="the client's id (default: id)")
    status: JobStatus
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage = Field(default_factory=Usage)
    timings: JobTimings = Field(default_factory=JobTimings)
    worker: str | None = Field(default=None, max_length=200)
    model: str | None = Field(default=None, max_length=200)
    error_code: ErrorCode | None = None
    error_message: str | None = None
    logprobs: list[TokenLogprobs] | None = Field(
        default=None, description="per output token, when the job's sampling asked for logprobs"
    )
    prompt_logprobs: list[TokenLogprobs | None] | None = Field(
        default=None, description="per prompt token (null for the first), when the job asked for prompt_logprobs"
    )
    choices: list[Choice] | None = Field(
        default=None, description="every choice, in index order, when the job has several (JobBody.has_choices)"
    )

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
        custom_id: str | None = None,
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
            custom_id=custom_id,
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


class LineError(Exception):
    """Why a line (or a request body) is not a job; `job_id`: the client's id it claims, when
    it has a usable one and the error came before the caller could read it."""

    def __init__(self, code: ErrorCode, message: str, job_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.job_id = job_id


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
    if any(e["type"] in ("too_large", "string_too_long", "too_long") for e in errors):
        return ErrorCode.TOO_LARGE
    if errors and all(e["loc"] and e["loc"][0] == "sampling" for e in errors):
        return ErrorCode.INVALID_SAMPLING
    return ErrorCode.INVALID_REQUEST


def job_id_hint(raw: Any) -> str | None:
    """The client's id a raw (maybe invalid) line or body claims (`id` or `custom_id`), if usable."""
    if isinstance(raw, dict):
        value = raw.get("custom_id", raw.get("id"))
        if (
            isinstance(value, str)
            and 0 < len(value) <= 200
            and value.strip() == value
            and value.isprintable()
        ):
            return value
    return None
