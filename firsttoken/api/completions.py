"""OpenAI-compatible completions: `POST /v1/completions`, `POST /v1/chat/completions` (plain, or
server-sent events with `"stream": true` and `stream_options.include_usage`), `GET /v1/models`.

A completion is a job like any other, through the same queue, workers and store: it is queued
with `reply` set, and the worker that runs it publishes its text deltas (streaming) and its result
to the job's Redis channel, which this process subscribed to before queueing it. The stored row
stays the record: a waiter that hears nothing for a while reads it. Each response carries the
job's id and timings (TTFT first) under `firsttoken`.

A client that goes away cancels its job and releases its subscription at once (the disconnect
is watched, not polled), from a task of its own that the request's cancellation cannot stop;
the cancels of many clients gone together are one store update. Replies are taken only when
signed for their job (pipeline.replies); a forged or malformed one is dropped and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from firsttoken.api.deps import RATE_LIMITED, ApiError, ApiState, Principal, State, Who, read_body
from firsttoken.api.jobs import queue_one
from pipeline.replies import LiveLimitError, Subscription
from schemas.batchfile import parse_json_object
from schemas.job import (
    ErrorCode,
    JobInput,
    JobRequest,
    JobResult,
    LineError,
    describe_validation_error,
    error_code_for,
    new_job_id,
)
from schemas.openai import (
    LineFormat,
    choice_logprobs,
    echo_prompt,
    firsttoken_extension,
    openai_body_request,
    openai_response,
    openai_usage,
    result_choices,
)
from schemas.openai.stream import DONE, completion_chunk, error_event, sse, stream_text
from schemas.openai.tool_calls import ToolCallParser, delta_of, tool_finish

log = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])

POLL_STORE_S = 1.0  # with no reply for this long, look at the stored row
POLL_STORE_MAX_S = 8.0  # and again after twice as long each time, up to this: 200 queued streams are not 200 reads a second


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "firsttoken"


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


@router.get("/v1/models", response_model=ModelList)
def models(who: Who, state: State) -> ModelList:
    """The model the workers serve."""
    return ModelList(data=[ModelCard(id=state.model_name)])


@router.get("/v1/models/{model:path}", response_model=ModelCard)
def retrieve_model(model: str, who: Who, state: State) -> ModelCard:
    """The served model by any of its names; 404 model_not_found for another one."""
    state.check_model(model)
    return ModelCard(id=state.model_name)


def _bad(exc: Exception) -> ApiError:
    if isinstance(exc, LineError):
        return ApiError(413 if exc.code is ErrorCode.TOO_LARGE else 400, exc.code, exc.message)
    assert isinstance(exc, ValidationError)
    return ApiError(400, error_code_for(exc), describe_validation_error(exc))


def _job(state: ApiState, raw: bytes, fmt: LineFormat, who: Principal) -> tuple[JobRequest, bool, bool]:
    """The job of a completions body, and whether to stream and to send usage at the end."""
    try:
        body = parse_json_object(raw, max_bytes=state.settings.api_max_body_bytes)
        state.check_model(body.get("model"))  # another model: 404 model_not_found
        stream = body.pop("stream", False)
        options = body.pop("stream_options", None)
        if not isinstance(stream, bool) and stream is not None:
            raise LineError(ErrorCode.INVALID_REQUEST, "stream: must be true or false")
        if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
            raise LineError(ErrorCode.INVALID_REQUEST, "stream_options: only {'include_usage': bool}")
        include_usage = bool(options and options.get("include_usage"))
        job_input = JobInput.model_validate(openai_body_request(body, fmt))
        if stream and job_input.sampling.samples_per_prompt > job_input.sampling.n:
            raise LineError(ErrorCode.INVALID_REQUEST, "best_of: not with stream (the best are known at the end)")
    except (LineError, ValidationError) as exc:
        raise _bad(exc) from None
    job = job_input.to_request(
        new_job_id(), owner=who.owner, line_format=fmt.value, reply="stream" if stream else "final"
    )
    problem = None if state.check is None else state.check(job)
    if problem is not None:
        raise ApiError(400, problem[0], problem[1])
    return job, bool(stream), include_usage


async def _start(state: ApiState, request: Request, fmt: LineFormat, who: Principal) -> tuple[JobRequest, bool, bool, Subscription]:
    """Parse, admit and queue a completion; the subscription returned counts as one of the
    caller's completions in flight (api_max_live_completions) until it is closed."""
    raw = await read_body(request, state.settings.api_max_body_bytes)
    job, stream, include_usage = await run_in_threadpool(_job, state, raw, fmt, who)
    if state.replies is None:
        raise ApiError(503, "unavailable", "completions need the reply channel: set FIRSTTOKEN_REDIS_URL")
    await run_in_threadpool(state.admit, who, 1)
    try:  # before the job is queued: no reply is missed
        sub = await state.replies.subscribe(job.id, who.owner, state.settings.api_max_live_completions)
    except LiveLimitError as exc:
        raise ApiError(429, RATE_LIMITED, f"you have {exc.have} completions in flight and the limit is {exc.limit}",
                       headers={"Retry-After": "1"}) from None
    except Exception as exc:
        log.warning("completion %s: reply channel unavailable (%s)", job.id, type(exc).__name__)
        raise ApiError(503, "unavailable", "the reply channel (Redis) is unreachable; try again") from None
    try:
        await run_in_threadpool(queue_one, state, job, None)
    except BaseException:
        await sub.close()
        raise
    return job, stream, include_usage, sub


async def _stored_result(state: ApiState, job_id: str) -> JobResult | None:
    rec = await run_in_threadpool(state.st.get_job, job_id)
    return None if rec is None else rec.result()


_DETACHED: set[asyncio.Task[Any]] = set()  # clean-ups under way (held here: a task only weakly referenced may vanish)


def _detach(coro: Any) -> None:
    """Run `coro` as a task of its own: the cancellation of the request that started it (a client
    gone) does not reach it."""
    task = asyncio.get_running_loop().create_task(coro)
    _DETACHED.add(task)
    task.add_done_callback(_DETACHED.discard)


class Abandoner:
    """Cancels the jobs of clients that went away: the ids that gather while one store update runs
    go in the next one, so 200 clients gone at once cost a few updates, not 200."""

    def __init__(self, state: ApiState) -> None:
        self.state = state
        self._pending: set[str] = set()
        self._since = 0.0  # when the oldest pending id came
        self._task: asyncio.Task[None] | None = None
        # threads of their own: the store's cancels never wait behind the shared pool's reads, nor
        # behind the GPU workers' broadcast (a Celery round trip; the workers also read the store)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="firsttoken-abandon")
        self._broadcast = ThreadPoolExecutor(1, thread_name_prefix="firsttoken-abandon-broadcast")

    def add(self, job_id: str) -> None:
        if not self._pending:
            self._since = time.monotonic()
        self._pending.add(job_id)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._pending:
            ids, since = sorted(self._pending), self._since
            self._pending.clear()
            loop = asyncio.get_running_loop()
            try:
                n = await loop.run_in_executor(self._thread, self._cancel, ids)
                if n:
                    loop.run_in_executor(self._broadcast, self.state.cancel, ids, None)  # (it logs its own failure)
            except Exception as exc:  # the store away: the worker finishes them, nobody reads them
                log.warning("could not cancel %d jobs of clients gone: %s", len(ids), type(exc).__name__)
            else:
                log.info("cancelled %d of %d jobs whose clients went away (%.0f ms after the first left)",
                         n, len(ids), 1000 * (time.monotonic() - since))

    def _cancel(self, ids: list[str]) -> int:
        return self.state.st.cancel(job_ids=ids, reason="the client disconnected")


def _abandoner(state: ApiState) -> Abandoner:
    if state.abandoner is None:
        state.abandoner = Abandoner(state)
    return state.abandoner


class _Run:
    """One completion's clean-up: its subscription closed and, unless it ended, its job cancelled;
    once, whichever of the response, the generator or a disconnect gets there first."""

    def __init__(self, state: ApiState, job: JobRequest, sub: Subscription) -> None:
        self.state, self.job, self.sub = state, job, sub
        self.ended = False  # the result was sent (or the job is terminal): nothing to cancel
        self._cleaned = False

    def clean_up(self) -> None:
        """Start the clean-up (idempotent; never awaits, so no cancellation can cut it short)."""
        if self._cleaned:
            return
        self._cleaned = True
        if not self.ended:
            _abandoner(self.state).add(self.job.id)
        _detach(self.sub.close())


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _wait_final(state: ApiState, job: JobRequest, sub: Subscription) -> JobResult | None:
    deadline = time.monotonic() + state.settings.api_completion_timeout_s
    wait = POLL_STORE_S
    while time.monotonic() < deadline:
        msg = await sub.next(min(wait, max(0.01, deadline - time.monotonic())))
        if msg is not None and msg["type"] == "final":
            return msg["result"]
        if msg is None:
            stored = await _stored_result(state, job.id)
            if stored is not None:
                return stored
            wait = min(wait * 2, POLL_STORE_MAX_S)
    return None


async def _final(state: ApiState, request: Request, run: _Run) -> JobResult:
    result_task = asyncio.ensure_future(_wait_final(state, run.job, run.sub))
    gone_task = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (result_task, gone_task):
            if not t.done():
                t.cancel()
    if not result_task.done() or result_task.cancelled():
        raise ApiError(499, ErrorCode.CANCELLED, "the client disconnected")
    result = result_task.result()
    if result is None:
        raise ApiError(504, "timeout", f"no result within {state.settings.api_completion_timeout_s:.0f} s; "
                       "the job was cancelled")
    run.ended = True
    return result


def _stream_echoes(job: JobRequest, fmt: LineFormat) -> list[str | None]:
    """Per choice of a streamed job, the prompt text its stream starts with (echo), "" for none,
    or None when the prompt is token ids (its text comes with the result)."""
    n = job.sampling.n
    if job.prompts is None:
        return [echo_prompt(job.prompt, job.sampling, fmt) or ""] * n
    if echo_prompt("", job.sampling, fmt) is None:
        return [""] * (n * len(job.prompts))
    return [p if isinstance(p, str) else None for p in job.prompts for _ in range(n)]


async def _events(run: _Run, fmt: LineFormat, include_usage: bool) -> AsyncIterator[bytes]:
    # a client that goes away stops the response: CompletionStream cleans up (_Run.clean_up)
    state, job, sub = run.state, run.job, run.sub
    model, created = state.model_name, int(time.time())
    echoes = _stream_echoes(job, fmt)  # one per choice, prompt-major
    sent = [""] * len(echoes)  # per choice: the output text sent so far
    # an echoed prompt of token ids: its text is known with the result only, so its choice's
    # output waits for it (sent whole at the end) rather than go out before its prompt
    held = {i for i, e in enumerate(echoes) if e is None}
    use = job.tool_use if fmt is LineFormat.OPENAI_CHAT else None
    # a job with tools: each choice's text goes through its parser, which sends content and tool-call deltas
    parsers = None if use is None else [ToolCallParser(use, job.id, i) for i in range(len(echoes))]

    def tool_chunks(i: int, events: list[Any]) -> list[bytes]:
        out = []
        for e in events:
            chunk = completion_chunk(job.id, fmt, model, created, None, None, index=i)
            chunk["choices"][0]["delta"] = delta_of(e)
            out.append(sse(chunk))
        return out

    try:
        for i in range(len(echoes)):
            yield sse(completion_chunk(job.id, fmt, model, created, "" if fmt is LineFormat.OPENAI_CHAT else None,
                                       None, role=True, index=i))
        for i, echo in enumerate(echoes):
            if echo:  # the prompt first, as OpenAI's echo streams it
                yield sse(completion_chunk(job.id, fmt, model, created, echo, None, index=i))
        deadline = time.monotonic() + state.settings.api_completion_timeout_s
        result: JobResult | None = None
        wait = POLL_STORE_S
        while result is None:
            if time.monotonic() > deadline:
                break
            msg = await sub.next(min(wait, max(0.01, deadline - time.monotonic())))
            if msg is None:
                result = await _stored_result(state, job.id)
                wait = min(wait * 2, POLL_STORE_MAX_S)
                continue
            wait = POLL_STORE_S
            if msg["type"] == "delta":
                i = msg.get("index", 0)
                if i >= len(sent) or i in held:
                    continue
                new = stream_text(sent[i], msg)
                if new:
                    sent[i] += new
                    if parsers is not None:
                        for event in tool_chunks(i, parsers[i].feed(new)):
                            yield event
                    else:
                        yield sse(completion_chunk(job.id, fmt, model, created, new, None, index=i))
            elif msg["type"] == "final":
                result = msg["result"]
        run.ended = result is not None  # terminal (done, failed or run again): nothing to cancel
        choices = [] if result is None or result.error_code is not None else result_choices(
            result, echo_prompt(job.prompt, job.sampling, fmt))
        if result is None:  # nobody will read it now: the clean-up cancels it
            yield error_event("timeout", "no result in time", status=504)
        elif result.error_code is not None:
            yield sse(openai_response(result, fmt)[1])
        elif len(choices) != len(sent) or any(not c.text.startswith(sent[c.index]) for c in choices):
            # a sampled job run again after its worker died, and this run's text differs from what was sent
            yield error_event("restarted", "the job was run again after its worker failed and its text changed; "
                                           f"the full text is on job {job.id}")
        else:
            for c in choices:
                finish = None if c.finish_reason is None else c.finish_reason.value
                rest = ((c.echo or "") if c.index in held else "") + c.text[len(sent[c.index]):]
                if parsers is not None:  # the rest through the parser, then a last chunk of no text
                    p = parsers[c.index]
                    for event in tool_chunks(c.index, p.feed(rest) + p.finish()):
                        yield event
                    rest, finish = None, tool_finish(c.finish_reason, p.calls > 0)
                last = completion_chunk(job.id, fmt, model, created, rest, finish, index=c.index)
                # all of them with the last chunk: a client that joins the chunks' log-probabilities gets the list
                last["choices"][0]["logprobs"] = choice_logprobs(c, fmt, c.echo)
                if c is choices[-1]:
                    last["firsttoken"] = firsttoken_extension(result)
                yield sse(last)
            if include_usage:
                usage = completion_chunk(job.id, fmt, model, created, None, None)
                usage["choices"] = []
                usage["usage"] = openai_usage(result)
                yield sse(usage)
        yield DONE
    finally:
        run.clean_up()


class CompletionStream(StreamingResponse):
    """The server-sent events of a streamed completion; however the response ends (finished, the
    client gone, the server stopping), its run is cleaned up."""

    def __init__(self, run: _Run, content: AsyncIterator[bytes], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.run = run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def watched() -> Any:  # the disconnect starts the clean-up at once: the stream's task may be
            message = await receive()  # waiting on a store read in a thread, which no cancel interrupts
            if message["type"] == "http.disconnect":
                self.run.clean_up()
            return message

        try:
            await super().__call__(scope, watched, send)
        finally:
            self.run.clean_up()
            # the generator may be parked at a yield: close it, from outside this (cancelled) task
            _detach(_aclose(self.body_iterator))


async def _aclose(gen: Any) -> None:
    with contextlib.suppress(BaseException):
        await gen.aclose()


async def _complete(request: Request, who: Principal, state: ApiState, fmt: LineFormat) -> Any:
    job, stream, include_usage, sub = await _start(state, request, fmt, who)
    run = _Run(state, job, sub)
    if stream:
        return CompletionStream(run, _events(run, fmt, include_usage), media_type="text/event-stream",
                                headers={"cache-control": "no-cache", "x-firsttoken-job-id": job.id})
    try:
        result = await _final(state, request, run)
    finally:
        run.clean_up()
    status, body = openai_response(result, fmt, state.model_name, echo_prompt(job.prompt, job.sampling, fmt),
                                   job.tool_use if fmt is LineFormat.OPENAI_CHAT else None)
    return JSONResponse(body, status_code=status)


@router.post("/v1/completions")
async def completions(request: Request, who: Who, state: State) -> Any:
    """A text completion (OpenAI's /v1/completions), through the queue and a GPU worker."""
    return await _complete(request, who, state, LineFormat.OPENAI_COMPLETIONS)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, who: Who, state: State) -> Any:
    """A chat completion (OpenAI's /v1/chat/completions), through the queue and a GPU worker."""
    return await _complete(request, who, state, LineFormat.OPENAI_CHAT)
