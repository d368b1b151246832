"""A finished engine request as the job's result: its timings on the wall clock (from the
engine's monotonic instants and the worker's admission), its usage, text and log-probabilities."""

from __future__ import annotations

from schemas.job import (
    Choice,
    ErrorCode,
    FinishReason,
    JobRequest,
    JobResult,
    JobStatus,
    JobTimings,
    TokenLogprobs,
    TopLogprob,
)
from workers.engine import FinishedRequest
from workers.engine.outputs import TokenLogprob


def finished_result(
    job: JobRequest, f: FinishedRequest, *, submitted_at: float, admitted_at: float, admitted_mono: float,
    paused_s: float, first_token_mono: float | None, worker: str, model: str | None,
) -> JobResult:
    """The result of `job`, which the engine finished (or aborted: then it is cancelled).
    `admitted_at` / `admitted_mono`: when the worker handed it to its engine, on the wall and the
    monotonic clock; `paused_s`: how long the worker held off (back-pressure) before that;
    `first_token_mono`: when its first token came out (the worker's own clock of it, if any)."""
    t = f.timings

    def wall(mono: float | None) -> float | None:
        return None if mono is None else admitted_at + (mono - admitted_mono)

    transit_ms = max(0.0, (admitted_at - submitted_at) * 1e3)
    paused_ms = min(transit_ms, paused_s * 1e3)
    queue_ms = None
    if t.first_scheduled is not None:  # back-pressure wait, then the engine's waiting queue
        queue_ms = paused_ms + max(0.0, (t.first_scheduled - admitted_mono) * 1e3)
    timings = JobTimings.from_instants(
        submitted_at=submitted_at,
        admitted_at=admitted_at,
        scheduled_at=wall(t.first_scheduled),
        first_token_at=wall(first_token_mono),
        finished_at=wall(t.finished),
        completion_tokens=f.usage.completion_tokens,
        engine_ttft_ms=None if first_token_mono is None else max(0.0, (first_token_mono - admitted_mono) * 1e3),
        prefill_ms=t.prefill_ms,
        tpot_ms=f.tpot_ms,
        queue_ms=queue_ms,
        overhead_ms=transit_ms - paused_ms,
    )
    cancelled = f.finish_reason == FinishReason.ABORT
    return JobResult(
        id=job.id,
        batch_id=job.batch_id,
        status=JobStatus.CANCELLED if cancelled else JobStatus.SUCCEEDED,
        text=_text(f.text),
        finish_reason=FinishReason(f.finish_reason),
        usage=f.usage,
        timings=timings,
        worker=worker,
        model=model,
        error_code=ErrorCode.CANCELLED if cancelled else None,
        error_message="cancelled while running" if cancelled else None,
        logprobs=_logprobs(f),
        prompt_logprobs=_prompt_logprobs(f),
        choices=None if not f.choices else [
            Choice(index=c.index, prompt_index=c.prompt_index, text=_text(c.output.text),
                   finish_reason=FinishReason(c.output.finish_reason), logprobs=_logprobs(c.output),
                   prompt_logprobs=_prompt_logprobs(c.output), echo=None if c.echo is None else _text(c.echo))
            for c in f.choices],
    )


def _text(text: str) -> str:
    # NUL is valid output (a byte-level token 0) but no Postgres text or jsonb value may hold it
    return text.replace("\x00", "\ufffd")


def _logprobs(f: FinishedRequest) -> list[TokenLogprobs] | None:
    return None if f.logprobs is None else [_token_logprobs(lp, f.token_texts) for lp in f.logprobs]


def _prompt_logprobs(f: FinishedRequest) -> list[TokenLogprobs | None] | None:
    if f.prompt_logprobs is None:
        return None
    return [None if lp is None else _token_logprobs(lp, f.token_texts) for lp in f.prompt_logprobs]


def _token_logprobs(lp: TokenLogprob, texts: dict[int, str] | None) -> TokenLogprobs:
    """The engine's log-probability of a token as the result's, with the tokens' texts."""
    texts = texts or {}
    return TokenLogprobs(token=_text(texts.get(lp.token_id, "")), id=lp.token_id, logprob=lp.logprob,
                         top=[TopLogprob(token=_text(texts.get(t, "")), id=t, logprob=v) for t, v in lp.top])
