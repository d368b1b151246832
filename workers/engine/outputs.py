"""What the engine reports: first-token events and finished requests, with usage and timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.job import FinishReason, Usage
from workers.engine.sequence import RequestTimes


@dataclass(frozen=True)
class FirstTokenEvent:
    """A request's first output token was sampled."""

    request_id: str
    token_id: int
    time: float  # monotonic
    engine_ttft_ms: float


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model, and the most likely tokens at its position
    (as many as the request asked for, most likely first); their texts are in
    FinishedRequest.token_texts."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob)


@dataclass(frozen=True)
class FinishedRequest:
    """A request that left the engine: its output, why it ended, usage and timings."""

    request_id: str
    output_token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stop_reason: int | str | None  # the token id or stop string that ended it
    usage: Usage  # the job's own type: it crosses the engine-core pipe and lands in JobResult as is
    timings: RequestTimes  # a copy, `finished` set
    num_preemptions: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per output token, when the request asked
    # one per prompt token (None for the first: nothing predicts it), when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None
    token_texts: dict[int, str] | None = None  # each token id of the two above, decoded alone
    error: str | None = None  # finish_reason "error": what failed (the request made engine steps fail)
    # a job of several choices (prompt list, n, best_of; workers/choices.py): each choice's own
    # request, in index order; the fields above are then the job's (usage and timings over all
    # its sequences; text, finish and log-probabilities its first choice's)
    choices: tuple[ChoiceOutput, ...] = ()

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first (of a job with choices: the mean of its
        choices', each a sequence of its own)."""
        if self.choices:
            each = [x for c in self.choices if (x := c.output.tpot_ms) is not None]
            return sum(each) / len(each) if each else None
        t = self.timings
        n = self.usage.completion_tokens
        if t.first_token is None or t.finished is None or n < 2:
            return None
        return (t.finished - t.first_token) * 1e3 / (n - 1)


@dataclass(frozen=True)
class ChoiceOutput:
    """One choice of a job with several: the request that produced it."""

    index: int  # its place in the job's choices (prompt-major)
    prompt_index: int  # the prompt of the job's list it continues
    output: FinishedRequest
    echo: str | None = None  # the prompt's text, when the job asked for echo


@dataclass
class StepOutput:
    """Events of one engine step."""

    first_tokens: list[FirstTokenEvent] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    # (request id, new text, output tokens so far, the text's offset in the output) of streamed
    # requests: the text reported is always a prefix of the request's final text (text that could
    # still become a stop string is held back), so a client that appends the deltas, then the rest
    # of the final text, is exact
    deltas: list[tuple[str, str, int, int]] = field(default_factory=list)
    num_scheduled: int = 0  # requests that computed tokens this step
    num_batched_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load and cache."""

    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_hit_rate: float  # share of admitted prompt tokens served from the prefix cache
    num_preemptions: int
    prompt_tokens_per_s: float  # over the last stats window
    generation_tokens_per_s: float
    steps: int
    kernel_backend: str
    cuda_graphs: bool
    async_scheduling: bool = False
    kv_cache_dtype: str = ""  # the KV cache's torch dtype name, e.g. "bfloat16", "float8_e4m3fn"
    # long uncached prompts' attention runs on FP8 tensor cores (EngineConfig.fp8_attention, as it resolved)
    fp8_attention: bool = False
    # wall time spent inside step(), all steps so far: with `steps`, the mean step time over any
    # interval (the rest of a core's time goes to its loop: commands, outputs, waiting for work)
    step_seconds: float = 0.0
    # the steps' time on the device (CUDA events) read back so far; 0 on a CPU
    device_seconds: float = 0.0
    # the share of the running requests' remaining max_tokens admission keeps free blocks for now
    # (EngineConfig.kv_reserve: fixed, or learned under "auto")
    kv_reserve: float = 0.0
