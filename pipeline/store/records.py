"""What the store returns: a job's row, a batch's row and progress, latency percentiles."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import TypeAdapter

from schemas.job import (
    ChatMessage,
    Choice,
    ErrorCode,
    FinishReason,
    JobRequest,
    JobResult,
    JobStatus,
    JobTimings,
    TokenLogprobs,
    Usage,
)
from schemas.sampling import SamplingParams
from schemas.tools import Tool, ToolChoice, ToolUse, tool_use


@dataclass
class Admission:
    """What ResultStore.admit found for the jobs a worker is about to run."""

    running: dict[str, int] = field(default_factory=dict)  # marked running now: id -> deliveries, this one included
    held: dict[str, int] = field(default_factory=dict)  # delivered `hold_from` times or more already: id -> deliveries
    terminal: set[str] = field(default_factory=set)  # already succeeded, failed or cancelled: not to run

@dataclass(frozen=True)
class JobRecord:
    """One row of `jobs`: the request as submitted and, once terminal, its result."""

    id: str
    batch_id: str | None
    status: JobStatus
    custom_id: str | None  # the client's id (None: a batch line that had none)
    owner: str | None
    line_no: int | None  # its line in the batch's input
    line_format: str | None  # that line's format (schemas.batchfile.LineFormat), when known
    prompt: str | None
    messages: list[ChatMessage] | None
    sampling: SamplingParams | None
    priority: int
    prefix_key: str | None
    metadata: dict[str, Any]
    text: str | None
    finish_reason: FinishReason | None
    usage: Usage
    timings: JobTimings
    worker: str | None
    model: str | None
    error_code: ErrorCode | None
    error_message: str | None
    created_at: float
    updated_at: float
    logprobs: list[TokenLogprobs] | None = None  # per output token, when the job asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token (None for the first)
    deliveries: int = 0  # times a worker took it into its engine (ResultStore.admit)
    prompts: list[str | list[int]] | None = None  # a prompt list (`prompt` is then None)
    choices: list[Choice] | None = None  # every choice, of a job that has several
    tools: dict[str, Any] | None = None  # a chat job's {"tools", "tool_choice", "parallel_tool_calls"}

    @property
    def tool_use(self) -> ToolUse | None:
        """How to read tool calls out of its output (None: plain text)."""
        if self.tools is None:
            return None
        t = self.tools
        return tool_use([Tool.model_validate(x) for x in t.get("tools") or ()],
                        TypeAdapter(ToolChoice | None).validate_python(t.get("tool_choice")),
                        t.get("parallel_tool_calls", True) is not False)

    def request(self) -> JobRequest | None:
        """The JobRequest this row was made from, or None for a row written from a result alone."""
        if self.prompt is None and self.messages is None and self.prompts is None:
            return None
        return JobRequest(
            id=self.id,
            custom_id=self.custom_id,
            batch_id=self.batch_id,
            owner=self.owner,
            line_no=self.line_no,
            line_format=self.line_format,
            prompt=self.prompt,
            prompts=self.prompts,
            messages=self.messages,
            sampling=self.sampling or SamplingParams(),
            priority=self.priority,
            prefix_key=self.prefix_key,
            metadata=self.metadata,
            submitted_at=self.timings.submitted_at,
            **(self.tools or {}),
        )

    def result(self) -> JobResult | None:
        """The JobResult of a terminal row; None while queued or running."""
        if not self.status.terminal:
            return None
        return JobResult(
            id=self.id,
            batch_id=self.batch_id,
            custom_id=self.custom_id,
            status=self.status,
            text=self.text or "",
            finish_reason=self.finish_reason,
            usage=self.usage,
            timings=self.timings,
            worker=self.worker,
            model=self.model,
            error_code=self.error_code,
            error_message=self.error_message,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            choices=self.choices,
        )


@dataclass(frozen=True)
class BatchProgress:
    """How far a batch is: job counts by status. `total` is the announced job count when known."""

    batch_id: str
    total: int | None
    counts: dict[JobStatus, int] = field(default_factory=dict)

    @property
    def recorded(self) -> int:
        """Jobs of the batch that have a row."""
        return sum(self.counts.values())

    @property
    def done(self) -> int:
        """Jobs in a terminal state."""
        return sum(n for s, n in self.counts.items() if s.terminal)

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        return self.recorded - self.done

    def count(self, status: JobStatus) -> int:
        """Jobs in `status`."""
        return self.counts.get(status, 0)

    @property
    def complete(self) -> bool:
        """True when every job of the batch is terminal (and, if announced, all of them have rows).
        An announced total of 0 (an empty input) is complete at once; a batch with no total and
        no rows yet is not (its lines are still being submitted)."""
        if self.total == 0:
            return self.recorded == 0
        expected = self.total if self.total is not None else self.recorded
        return expected > 0 and self.done >= expected and self.done == self.recorded


class BatchStatus(StrEnum):
    """A batch's status in the store (the API maps it onto OpenAI's batch statuses)."""

    OPEN = "open"  # lines are queued or running
    COMPLETED = "completed"  # every line has its result
    CANCELLED = "cancelled"  # cancelled by its owner: the jobs left were cancelled
    EXPIRED = "expired"  # its completion window passed: the jobs left were cancelled
    FAILED = "failed"  # no line of its input was a valid job

    @property
    def ended(self) -> bool:
        return self is not BatchStatus.OPEN


@dataclass(frozen=True)
class BatchRecord:
    """One row of `batches` with its progress."""

    id: str
    status: BatchStatus
    owner: str | None
    input_digest: str | None  # sha256 of the input it was made from
    input_format: str | None
    source: str | None
    output: str | None
    total_jobs: int | None
    metadata: dict[str, Any]
    created_at: float
    updated_at: float
    finished_at: float | None
    progress: BatchProgress


@dataclass(frozen=True)
class FileRecord:
    """One uploaded file (its content is read separately)."""

    id: str
    owner: str | None
    purpose: str
    filename: str
    bytes: int
    sha256: str
    created_at: float


@dataclass(frozen=True)
class LatencyStats:
    """Percentiles (percentile_cont, i.e. linear interpolation) of one latency metric, in ms,
    over one group of jobs (a worker, a model, both, or all when the grouping is empty)."""

    metric: str
    worker: str | None
    model: str | None
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
