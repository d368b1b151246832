"""One request's state inside the engine: computed tokens catching up to total tokens."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from schemas.job import FinishReason
from schemas.sampling import SamplingParams

PENDING_TOKEN = -1  # token_ids placeholder for a token sampled on the device, not yet read back


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were taken; recomputes on resume
    FINISHED = "finished"


@dataclass
class RequestTimes:
    """Monotonic instants (seconds, `time.monotonic()`) in the request's life inside the engine,
    and the durations (ms) derived from them. The one engine-side timing type: a request carries
    it while it runs, FinishedRequest a copy. A job's record (wall-clock instants across
    processes, the pipeline's own share) is schemas.job.JobTimings, built from it by the worker
    (workers/results.py)."""

    arrival: float  # add_request
    first_scheduled: float | None = None  # first step that computed any of its tokens
    first_token: float | None = None
    finished: float | None = None
    # the request's share of the steps that computed its prompt: each step's time split over the
    # step's tokens (a prompt that 30 others shared a step with pays a thirtieth of it, a cached
    # prefix nothing)
    prefill_compute_s: float = 0.0

    @property
    def queue_ms(self) -> float | None:
        """Wait in the engine before the first step computed any of the prompt."""
        return None if self.first_scheduled is None else (self.first_scheduled - self.arrival) * 1e3

    @property
    def engine_ttft_ms(self) -> float | None:
        """First token minus admission to the engine."""
        return None if self.first_token is None else (self.first_token - self.arrival) * 1e3

    @property
    def prefill_ms(self) -> float | None:
        """The request's share of its prefill steps (ms; None before its first token)."""
        return None if self.first_token is None else self.prefill_compute_s * 1e3

    @property
    def prefill_wall_ms(self) -> float | None:
        """First token minus the first step that computed the prompt (the steps it shared included)."""
        if self.first_token is None or self.first_scheduled is None:
            return None
        return (self.first_token - self.first_scheduled) * 1e3

    @property
    def e2e_ms(self) -> float | None:
        """Finished minus admission (None while it runs)."""
        return None if self.finished is None else (self.finished - self.arrival) * 1e3


@dataclass(eq=False)
class Request:
    """A request's tokens and progress.

    `token_ids` holds the prompt followed by the generated tokens. Every step computes some of
    the tokens in [num_computed_tokens, num_tokens): a prompt chunk, the rest of a prefix hit, or
    the one token sampled last step. When num_computed_tokens reaches num_tokens, the step's
    logits give the next token. Higher `priority` is scheduled first; ties go first come first served.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    priority: int
    arrival_index: int  # engine-wide admission order (FCFS tie-break)
    times: RequestTimes
    eos_token_ids: frozenset[int] = frozenset()
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks
    num_indexed_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_preemptions: int = 0
    # n > 1: the request whose prompt this one shares and whose prefill it waits on (it is forked
    # from it when that prefill samples: Scheduler.add_follower); None once forked, or alone
    follows: str | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None  # why it failed (finish_reason "error")
    fair_rank: int = 0  # among equal priorities, lower first (LLMEngine.add_request's fair_rank)
    stop_reason: int | str | None = None  # the token id or stop string that ended it
    text: str = ""  # output text so far (kept only when stop strings or streaming need it)
    stream: bool = False  # report text deltas as tokens arrive (StepOutput.deltas)
    # its sampling processes the logits (penalties, biases, min_tokens): read for every sampling
    # row of every step, so kept here rather than derived from the sampling each time
    adjusts_logits: bool = False
    streamed_chars: int = 0  # how much of `text` the deltas have reported
    # the longest stop string's length minus one (0 without stop strings): how far back a new
    # piece of text can complete a stop string, and so how much of `text` a delta holds back
    stop_holdback: int = 0
    # async scheduling: sampled tokens not read back yet sit at the end of token_ids as
    # PENDING_TOKEN (at most two: the step in flight and the one launched after it); the last
    # one's value is at row `pending_row` of its step's sampled tokens on the device
    num_pending: int = 0
    pending_row: int | None = None
    # guided decoding (sampling.guided): the grammar matcher, advanced by each token read back;
    # the next token's mask comes from its state (workers/engine/guided.py)
    guide: Any = None
    # per output token read back: its log-probability and the top alternatives (sampling.logprobs set)
    logprobs: list[Any] | None = None
    # per prompt position (None at 0, and until computed), when sampling.prompt_logprobs is set
    prompt_logprobs: list[Any] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host (all but a pending sampled token)."""
        return len(self.token_ids) - self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens known on the host (pending ones left out)."""
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - self.num_pending]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, int, int]:
        """Waiting-queue order: highest priority first, then lowest fair rank (the caller's
        round-robin over its sources: a queue partition's k-th job beside the others' k-th), then
        earliest arrival."""
        return (-self.priority, self.fair_rank, self.arrival_index)
