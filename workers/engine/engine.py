"""The engine: add_request / abort / step. Schedules, runs the model, turns samples into events."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from schemas.job import ErrorCode, FinishReason, Usage
from schemas.sampling import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.errors import InvalidRequestError
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.model_runner import ModelRunner
from workers.engine.outputs import (
    EngineStats,
    FinishedRequest,
    FirstTokenEvent,
    StepOutput,
    TokenLogprob,
)
from workers.engine.prompts import length_problem, load_tokenizer, sampling_problem, token_ids_problem
from workers.engine.sampled import SampledTokens
from workers.engine.scheduler import Scheduler, SchedulerOutput
from workers.engine.sequence import PENDING_TOKEN, Request, RequestStatus, RequestTimes
from workers.engine.slo import SloBudget, StepShape
from workers.engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

# guided rows of a step from which their masks are filled in llguidance's thread pool; fewer, in the
# engine's thread (a pool's hand-off costs more than a few masks)
PARALLEL_MASKS = 8

STATS_WINDOW_S = 10.0


@dataclass
class InFlightStep:
    """A launched step whose sampled tokens the host has not read yet."""

    sampled: SampledTokens
    rows: list[tuple[Request, int]]  # per sampled row: the request and the token_ids index it fills
    has_first_tokens: bool  # some row is a request's first token
    launched_at: float = 0.0  # monotonic
    num_tokens: int = 0  # tokens the step computed
    num_decodes: int = 0  # of them, decoding sequences' one token each
    shape: StepShape | None = None  # what it computes, for the SLO cost model (with a target)
    # (request, its prompt tokens computed in the step): each gets that share of the step's time
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    read: bool = False  # read back (a guided step after it may read it back before its own sampling)


def _token_logprob(token_id: int, row: tuple[float, list[int], list[float]], k: int) -> TokenLogprob:
    """A token's log-probability from a step's read-back row, with the request's own k alternatives."""
    logprob, ids, lps = row
    return TokenLogprob(token_id, logprob, tuple(zip(ids[:k], lps[:k])))


STEP_FLOOR_ENV = "FIRSTTOKEN_TEST_STEP_FLOOR_S"


def step_floor_s() -> float:
    """A test's lower bound on a step's wall time, in seconds (FIRSTTOKEN_TEST_STEP_FLOOR_S; 0: none).

    The worker-stop tests need long jobs that are still running when a worker is signalled, however
    fast the engine on the machine has become: a floor per step bounds a job of N tokens below by N
    floors, where a token count alone bounded it by nothing (1900 tokens once ended within the 1.4 s
    before the signal). A step that runs nothing does not sleep. Never set in production."""
    raw = os.environ.get(STEP_FLOOR_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{STEP_FLOOR_ENV} must be a number of seconds, not {raw!r}") from None
    if not 0.0 <= value <= 10.0:
        raise ValueError(f"{STEP_FLOOR_ENV} must be between 0 and 10 seconds, not {raw!r}")
    return value


class LLMEngine:
    """Continuous batching over one paged KV cache with prefix reuse.

    `model` is a preset name (random weights: "tiny", "llama3-8b") or a Hugging Face checkpoint
    directory. Not thread-safe: one thread calls add_request/abort/step.
    """

    def __init__(self, model: str = "tiny", config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        self.config = config or EngineConfig()
        self.model_name = model
        self.runner = ModelRunner(model, self.config)
        self.model_config = self.runner.model_config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
        self.max_model_len = self.runner.max_model_len
        self.kv = KVCacheManager(self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        c = self.config
        # a TPOT target sizes each step from a cost model of measured steps (workers/engine/slo.py)
        self.slo = (
            None if c.tpot_target_ms is None else SloBudget(c.tpot_target_ms / 1e3, c.max_num_batched_tokens,
                                                            prefill_graph=self.runner.prefill_graph_limits,
                                                            mixed_graph=self.runner.mixed_graph_limits)
        )
        self._last_done = 0.0
        self.scheduler = Scheduler(
            self.kv, c.max_num_batched_tokens, c.max_num_seqs, self.max_model_len,
            admission_batch=c.admission_batch if c.admission_batch is not None else max(1, c.max_num_seqs // 8),
            budget_fn=self.slo,
            priority_max_wait_s=c.priority_max_wait_s,
            kv_reserve=c.kv_reserve,
        )
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()
        self._pending_finished: list[FinishedRequest] = []
        self._steps = 0
        self._step_seconds = 0.0  # wall time spent in step(), all steps
        # the steps' time on the device (CUDA events, summed as each step is read back; 0 on a CPU):
        # against step_seconds, how much of the loop the device was busy
        self._device_seconds = 0.0
        self.async_scheduling = (
            c.async_scheduling if c.async_scheduling is not None else self.runner.device.type == "cuda"
        )
        self._in_flight: InFlightStep | None = None  # launched, not read back (async scheduling)
        self._isolation: deque[frozenset[str]] = deque()  # a failed step's requests, in groups retried apart
        self._history: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, generated tokens)
        # guided decoding: the grammar compiler (built at the first guided request), the live
        # guided requests, and two host buffers for their masks (pinned on CUDA: copied while
        # the step before runs, each reused every other step)
        self._grammars: Any = None
        self._grammars_warming: threading.Thread | None = None
        self._num_guided = 0
        self._mask_bufs: list[torch.Tensor] = []
        self._mask_turn = 0
        self._step_floor_s = step_floor_s()

    # ---- requests ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        stream: bool = False,
        fair_rank: int = 0,
        follows: str | None = None,
    ) -> None:
        """Queue a request. Raises InvalidRequestError (with a code) for this request only.

        `stream`: report its text as it grows (StepOutput.deltas). `fair_rank`: among requests of
        equal priority, lower ranks are admitted first (the worker's round-robin over its queue
        partitions), then first come first served. `follows`: the id of a request with the same
        prompt that has not sampled yet (another choice of one job): this one is forked from its
        prefill (Scheduler.add_follower) rather than computing the prompt again; ignored when
        that request is gone, has sampled, or holds other tokens."""
        if request_id in self.requests:
            raise InvalidRequestError(ErrorCode.DUPLICATE_ID, f"request {request_id!r} is already in the engine")
        sp = self._validate_sampling(sampling)
        vocab = self.model_config.vocab_size
        problem = sampling_problem(sp, vocab_size=vocab)
        if problem is not None:
            raise InvalidRequestError(*problem)
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError(ErrorCode.INVALID_REQUEST, "give a prompt or prompt_token_ids")
            ids = self.tokenizer.encode(prompt)
            packed = array("q", ids)
        else:
            try:
                packed = array("q", prompt_token_ids)  # ints checked and converted in C
            except (TypeError, OverflowError, ValueError) as e:
                raise InvalidRequestError(ErrorCode.INVALID_REQUEST, f"prompt_token_ids must be integers ({e})") from None
            ids = packed.tolist()
        # the range check over the packed ids (numpy, no int objects): Python's min and max took 68 us for
        # 2176 ids on the 2-core box, this 5
        if packed:
            a = np.frombuffer(packed, dtype=np.int64)
            if int(a.min()) < 0 or int(a.max()) >= vocab:
                raise InvalidRequestError(*token_ids_problem(ids, vocab))  # type: ignore[misc]
        n = len(ids)
        problem = length_problem(n, sp, max_model_len=self.max_model_len,
                                 kv_capacity=self.runner.num_blocks * self.config.block_size)
        if problem is not None:
            raise InvalidRequestError(*problem)
        req = Request(
            request_id=request_id,
            token_ids=ids,
            num_prompt_tokens=n,
            sampling=sp,
            priority=int(priority),
            arrival_index=next(self._arrivals),
            times=RequestTimes(arrival=arrival_time if arrival_time is not None else time.monotonic()),
            eos_token_ids=frozenset() if sp.ignore_eos else self.eos_token_ids,
        )
        req.stream = stream
        req.adjusts_logits = sp.adjusts_logits
        req.fair_rank = int(fair_rank)
        req.logprobs = None if sp.logprobs is None else []
        req.prompt_logprobs = None if sp.prompt_logprobs is None else [None] * n
        req.stop_holdback = max((len(s) for s in sp.stop), default=1) - 1
        if sp.guided is not None:
            req.guide = self._grammar_compiler().matcher(sp.guided)  # InvalidRequestError: invalid_grammar
            self._num_guided += 1
        self.requests[request_id] = req
        if sp.stop or stream:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, ids)
        leader = self.requests.get(follows) if follows is not None else None
        if (leader is not None and leader is not req and not leader.is_finished and leader.follows is None
                and sp.prompt_logprobs is None and leader.num_tokens == leader.num_prompt_tokens == n
                and leader.token_ids == ids):
            self.scheduler.add_follower(req, leader)
        else:
            self.scheduler.add(req)

    @staticmethod
    def _validate_sampling(sampling: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        if sampling is None:
            return SamplingParams()
        if not isinstance(sampling, SamplingParams):
            try:
                return SamplingParams.model_validate(dict(sampling))
            except ValidationError as e:
                raise InvalidRequestError(ErrorCode.INVALID_SAMPLING, _pydantic_message(e)) from None
        # re-check what model_construct() could have skipped
        s = sampling
        if s.max_tokens < 0 or (s.max_tokens == 0 and not s.echo):
            raise InvalidRequestError(ErrorCode.INVALID_SAMPLING, "max_tokens must be at least 1 (0 only with echo)")
        if s.temperature < 0:
            raise InvalidRequestError(ErrorCode.INVALID_SAMPLING, "temperature must be >= 0")
        if not 0 < s.top_p <= 1:
            raise InvalidRequestError(ErrorCode.INVALID_SAMPLING, "top_p must be in (0, 1]")
        if s.top_k is not None and s.top_k < 0:
            raise InvalidRequestError(ErrorCode.INVALID_SAMPLING, "top_k must be >= 0")
        return s

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; the next step reports it finished (FinishReason.ABORT)."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, FinishReason.ABORT)
        self._pending_finished.append(self._finish(req, time.monotonic()))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending_finished)

    @property
    def device_seconds(self) -> float:
        """The steps' time on the device so far (CUDA events, as each step is read back; 0 on a CPU)."""
        return self._device_seconds

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- one iteration ----------------------------------------------------------------
    def step(self) -> StepOutput:
        """Schedule and launch one step; return the first-token and finished events read back.

        Synchronous: the events are this step's. Async scheduling: the step is launched, then the
        previous one is read back, so the host's work (reading back, scheduling, inputs) overlaps
        the device's; this step's events come with the next call. A step that samples some
        request's first token is read back at once, so first tokens are never late by a step.
        """
        t0 = time.perf_counter()
        result = StepOutput(finished=self._pending_finished)
        self._pending_finished = []
        prev = self._in_flight
        self._in_flight = None
        self._next_isolation_group()
        out: SchedulerOutput | None = None
        launched = None
        try:
            out = self.scheduler.schedule()
            if not out.is_empty:
                t_launch = time.monotonic()
                guide = None
                if self._num_guided:
                    def guide(reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor] | None:
                        return self._guide_masks(reqs, prev, result)
                sampled = self.runner.execute(out, prev.sampled if prev is not None else None, guide)
                launched = self._launched(out, sampled, t_launch)
                result.num_scheduled = len(out.scheduled)
                result.num_batched_tokens = out.num_batched_tokens
            if prev is not None and not prev.read:
                self._read_back(prev, result)
            if launched is not None:
                if self.async_scheduling and not launched.has_first_tokens:
                    self._in_flight = launched
                else:
                    self._read_back(launched, result)
        except Exception as exc:
            if _is_fatal(exc):
                raise
            suspects = ([e.request for e in out.scheduled] + [f for f, _ in out.forks] if out is not None
                        else list(self.scheduler.running))
            for step in (prev, launched):
                if step is not None:
                    suspects.extend(req for req, _ in step.rows)
            self._step_failed(exc, suspects, result)
        if self._isolation:
            self._next_isolation_group()
        if self._step_floor_s and not (out is None or out.is_empty):
            time.sleep(max(0.0, self._step_floor_s - (time.perf_counter() - t0)))
        self._step_seconds += time.perf_counter() - t0
        return result

    # ---- a step that fails ------------------------------------------------------------
    def _step_failed(self, exc: Exception, suspects: list[Request], result: StepOutput) -> None:
        """Retry a failed step's requests apart: each half of them runs alone (nothing else is
        scheduled beside it) until it finishes, and a half that fails again is split again, so a
        request that makes steps fail ends up alone and fails with `engine_error`; the others go
        on. Every suspect is computed again from its first token (its KV blocks may not hold what
        the failed step was to write)."""
        live = list({id(r): r for r in suspects if r.status is not RequestStatus.FINISHED}.values())
        if not live:
            raise exc
        live.sort(key=lambda r: r.arrival_index)
        what = f"{type(exc).__name__}: {str(exc)[:200]}"  # an exception's text, never a prompt's
        if len(live) == 1:
            req = live[0]
            log.warning("engine step failed on request %s alone (%s): it fails", req.request_id, what)
            self.scheduler.reset(req)
            self.scheduler.finish(req, FinishReason.ERROR)
            req.error = f"the engine failed on this request ({what})"
            result.finished.append(self._finish(req, time.monotonic()))
            return
        log.warning("engine step failed with %d requests (%s): retrying them apart", len(live), what)
        for req in live:
            self.scheduler.reset(req)
        ids = [r.request_id for r in live]
        half = len(ids) // 2
        if self._isolation and set(ids) <= self._isolation[0]:
            self._isolation.popleft()  # the group that failed is replaced by its halves
        self._isolation.appendleft(frozenset(ids[half:]))
        self._isolation.appendleft(frozenset(ids[:half]))
        self._next_isolation_group()

    def _next_isolation_group(self) -> None:
        """Point the scheduler at the first isolation group with a request left (None: no group)."""
        while self._isolation and not any(request_id in self.requests for request_id in self._isolation[0]):
            self._isolation.popleft()
        self.scheduler.isolated = self._isolation[0] if self._isolation else None

    def _launched(self, out: SchedulerOutput, sampled: SampledTokens, t_launch: float) -> InFlightStep:
        """Advance the scheduled requests past the launched step; sampled tokens become placeholders."""
        self._steps += 1
        prompt_tokens = 0
        rows: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []
        first = False
        for e in out.scheduled:
            req = e.request
            req.num_computed_tokens += e.num_new_tokens
            n_prompt = max(0, min(req.num_computed_tokens, req.num_prompt_tokens) - e.num_computed_tokens)
            prompt_tokens += n_prompt
            if n_prompt:
                prefills.append((req, n_prompt))
            if not e.samples:
                continue
            req.pending_row = len(rows)
            req.num_pending += 1
            rows.append((req, len(req.token_ids)))
            req.token_ids.append(PENDING_TOKEN)
            first = first or req.times.first_token is None
        for req, _ in out.forks:  # sampled after the entries' rows (ModelRunner._run_step)
            req.pending_row = len(rows)
            req.num_pending += 1
            rows.append((req, len(req.token_ids)))
            req.token_ids.append(PENDING_TOKEN)
            first = True
        now = time.monotonic()
        self._history.append((now, prompt_tokens, len(rows)))
        while self._history and now - self._history[0][0] > STATS_WINDOW_S:
            self._history.popleft()
        shape = StepShape.of(out.scheduled, out.num_decodes, self.runner.last_path) if self.slo is not None else None
        return InFlightStep(sampled, rows, first, t_launch, out.num_batched_tokens, out.num_decodes, shape, prefills)

    # ---- guided decoding ---------------------------------------------------------------
    def warm_guided(self) -> None:
        """Build the grammar compiler in a background thread now, so the first guided request does
        not hold up the step loop while llguidance indexes the vocabulary (a worker calls this at
        start; without it the first guided request builds it)."""
        if self._grammars is None and self._grammars_warming is None:
            def build() -> None:
                with contextlib.suppress(InvalidRequestError):  # kept: the refusal guided requests get
                    self._grammar_compiler()

            self._grammars_warming = threading.Thread(target=build, name="grammar-warm", daemon=True)
            self._grammars_warming.start()

    def _grammar_compiler(self) -> Any:
        """The engine's grammar compiler, built at the first guided request (llguidance indexes the
        vocabulary: 0.3-0.6 s for SmolLM2's 49k tokens on the 2-core CPU) or by `warm_guided`. A
        tokenizer it cannot take refuses every guided request with invalid_grammar, the engine
        running on."""
        warming = self._grammars_warming
        if warming is not None and warming is not threading.current_thread():
            warming.join()
            self._grammars_warming = None
        if isinstance(self._grammars, str):
            raise InvalidRequestError(ErrorCode.INVALID_GRAMMAR, self._grammars)
        if self._grammars is None:
            from workers.engine.guided import GrammarCompiler

            try:  # the model's end ids (GrammarCompiler leaves out those its tokenizer cannot name)
                self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                 sorted(self.eos_token_ids) or None)
            except Exception as exc:
                log.warning("guided decoding unavailable: %s: %s", type(exc).__name__, str(exc)[:200])
                self._grammars = f"guided decoding is not available for this model's tokenizer ({type(exc).__name__})"
                raise InvalidRequestError(ErrorCode.INVALID_GRAMMAR, self._grammars) from None
        return self._grammars

    def _guide_masks(self, reqs: list[Request], prev: InFlightStep | None,
                     result: StepOutput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The token bitmasks of a step's guided rows, on the device: called by the runner with the
        forward launched. A guided row whose last token is still pending on the step before
        (async scheduling) needs it: that step is read back here, while this one's forward runs."""
        from workers.engine.guided import bitmask_words

        rows = [i for i, r in enumerate(reqs) if r.guide is not None]
        if not rows:
            return None
        if prev is not None and not prev.read and any(reqs[i].num_pending for i in rows):
            self._read_back(prev, result)
        dev = self.runner.device
        words = bitmask_words(self.model_config.vocab_size)
        if not self._mask_bufs:
            n = self.config.max_num_seqs
            pin = dev.type == "cuda"
            self._mask_bufs = [torch.empty((n, words), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        buf = self._mask_bufs[self._mask_turn][: len(rows)]
        self._mask_turn ^= 1
        live = []
        for j, i in enumerate(rows):
            req = reqs[i]
            if req.status is RequestStatus.FINISHED:
                buf[j].fill_(-1)  # stopped by the step read back just now: its token here is dropped
            else:
                live.append((req.guide, j))
        if len(live) >= PARALLEL_MASKS:
            self._grammars.fill_bitmasks(live, buf)  # in llguidance's threads
        else:
            for m, j in live:
                m.fill_bitmask(buf, j)
        index = torch.tensor(rows, dtype=torch.int64)
        return index.to(dev, non_blocking=True), buf.to(dev, non_blocking=True)

    def _read_back(self, step: InFlightStep, result: StepOutput) -> None:
        """Wait for a launched step's tokens; put them in place, report first tokens, check stops."""
        step.read = True
        tokens = step.sampled.tolist()
        now = time.monotonic()
        # the step's time on the device (CUDA events: exact under async scheduling); on a CPU,
        # from its launch or from when the one before it ended. The host's read-back times
        # mispredicted steps by 54-680% on the H200 (bench/results/2026-12-01-*-h200.*)
        sec = step.sampled.device_seconds()
        if sec is None:
            sec = now - max(step.launched_at, self._last_done)
        else:
            self._device_seconds += sec
        self._last_done = now
        if self.slo is not None:
            self.slo.model.observe_shape(step.shape, sec)  # type: ignore[union-attr,arg-type]
            self.slo.account(step.num_decodes, sec)
        # each prompt's share of the step, by tokens: a job's prefill cost, whatever shared its steps
        per_token = sec / max(1, step.num_tokens)
        for req, n in step.prefills:
            req.times.prefill_compute_s += n * per_token
        logprobs = step.sampled.logprobs()  # None unless a request of the step asked
        for req, start, rows in step.sampled.prompt_logprobs():  # by position: a recomputed chunk rewrites its own
            for pos, row in enumerate(rows, start + 1):
                req.prompt_logprobs[pos] = _token_logprob(req.token_ids[pos], row, req.sampling.prompt_logprobs)  # type: ignore[index]
        for i, ((req, pos), tok) in enumerate(zip(step.rows, tokens)):
            if req.status is RequestStatus.FINISHED:
                continue  # aborted, or stopped by an earlier token: this one is dropped
            req.token_ids[pos] = tok
            if req.guide is not None and (not (tok in req.eos_token_ids or req.guide.accept(tok))
                                          or req.guide.error is not None):
                self._guide_failed(req, tok, pos, result, now)
                continue
            if req.logprobs is not None and logprobs is not None:  # read back in order: one per output token
                req.logprobs.append(_token_logprob(tok, logprobs[i], req.sampling.logprobs))  # type: ignore[arg-type]
            req.num_pending -= 1
            if req.num_pending == 0:
                req.pending_row = None
            if req.times.first_token is None:
                req.times.first_token = now
                result.first_tokens.append(
                    FirstTokenEvent(req.request_id, tok, now, (now - req.times.arrival) * 1e3)
                )
            reason = self._check_stop(req, tok, pos + 1)
            if reason is not None:
                del req.token_ids[pos + 1 :]  # tokens launched after the stop are dropped
                req.num_pending = 0
                req.pending_row = None
                self.scheduler.finish(req, reason)
                result.finished.append(self._finish(req, now))
            elif req.stream:
                self._stream_delta(req, pos + 1 - req.num_prompt_tokens, result)

    def _guide_failed(self, req: Request, tok: int, pos: int, result: StepOutput, now: float) -> None:
        """A guided request's grammar stopped short: it refused the sampled token (its mask should
        prevent that) or hit a parser limit computing a mask (which then allowed only the end). It
        fails alone rather than return output outside its grammar, or cut short as if complete."""
        why = req.guide.error or f"it refused sampled token {tok}"  # bounded, no tokens or grammar
        log.warning("request %s: its grammar stopped short (%s)", req.request_id, why)
        del req.token_ids[pos:]
        req.num_pending = 0
        req.pending_row = None
        self.scheduler.finish(req, FinishReason.ERROR)
        req.error = f"guided decoding failed: {why}"
        result.finished.append(self._finish(req, now))

    def _check_stop(self, req: Request, tok: int, num_tokens: int) -> FinishReason | None:
        """Why the request stops at `tok`, its token number `num_tokens` (prompt included), if it does."""
        sp = req.sampling
        if sp.max_tokens == 0:  # the prompt alone (echo): its one sampled token is dropped (_finish)
            return FinishReason.LENGTH
        # below min_tokens nothing but the length ends it (the sampler bans the end tokens too)
        may_stop = num_tokens - req.num_prompt_tokens >= sp.min_tokens
        if may_stop and (tok in sp.stop_token_ids or tok in req.eos_token_ids):
            req.stop_reason = tok
            return FinishReason.STOP
        detok = self._detok.get(req.request_id)
        if detok is not None:
            delta = detok.add(tok)
            if delta:
                start = max(0, len(req.text) - req.stop_holdback)
                req.text += delta
                for s in sp.stop if may_stop else ():
                    pos = req.text.find(s, start)
                    if pos != -1:
                        req.text = req.text[:pos]
                        req.stop_reason = s
                        return FinishReason.STOP
        if req.guide is not None and req.guide.done:  # the grammar has ended: nothing may follow
            return FinishReason.STOP
        if num_tokens - req.num_prompt_tokens >= sp.max_tokens or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _stream_delta(req: Request, num_output: int, result: StepOutput) -> None:
        """Report the text a streamed request gained, short of what might yet become a stop string."""
        safe = len(req.text) - req.stop_holdback
        if safe > req.streamed_chars:
            result.deltas.append((req.request_id, req.text[req.streamed_chars : safe], num_output, req.streamed_chars))
            req.streamed_chars = safe

    def _finish(self, req: Request, now: float) -> FinishedRequest:
        req.times.finished = now
        if req.guide is not None:
            self._num_guided -= 1
        del self.requests[req.request_id]
        self.runner.release(req.request_id)
        out_ids = req.output_token_ids
        if req.sampling.max_tokens == 0:  # computed to score the prompt (echo): no output
            out_ids = []
            if req.logprobs is not None:
                req.logprobs = []
        if isinstance(req.stop_reason, str):
            text = req.text
        else:
            shown = out_ids[:-1] if isinstance(req.stop_reason, int) else out_ids
            text = self.tokenizer.decode(shown)
        self._detok.pop(req.request_id, None)
        t = req.times  # finished: now
        return FinishedRequest(
            request_id=req.request_id,
            output_token_ids=list(out_ids),
            text=text,
            finish_reason=req.finish_reason or FinishReason.ABORT,
            stop_reason=req.stop_reason,
            usage=Usage(prompt_tokens=req.num_prompt_tokens,
                        cached_prompt_tokens=min(req.num_cached_tokens or 0, req.num_prompt_tokens),
                        completion_tokens=len(out_ids)),
            timings=dataclasses.replace(t),
            num_preemptions=req.num_preemptions,
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_logprobs,
            token_texts=self._token_texts(req),
            error=req.error,
        )

    def _token_texts(self, req: Request) -> dict[int, str] | None:
        """Each token id of the request's log-probabilities decoded alone, once (None: none asked)."""
        if req.logprobs is None and req.prompt_logprobs is None:
            return None
        lps = [lp for lp in (*(req.logprobs or ()), *(req.prompt_logprobs or ())) if lp is not None]
        ids = sorted({lp.token_id for lp in lps} | {t for lp in lps for t, _ in lp.top})
        return dict(zip(ids, self.tokenizer.decode_each(ids))) if ids else {}

    # ---- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Give back what the engine holds on its device (weights, KV cache, graphs); idempotent.

        A closed engine takes no more requests. A second engine in the same process can then use
        the memory."""
        self.requests.clear()
        self._detok.clear()
        self._pending_finished = []
        self._in_flight = None
        self.runner.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- introspection ----------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool = self.kv.pool
        if len(self._history) >= 2:
            span = self._history[-1][0] - self._history[0][0]
            p = sum(h[1] for h in list(self._history)[1:])
            g = sum(h[2] for h in list(self._history)[1:])
            pt, gt = (p / span, g / span) if span > 0 else (0.0, 0.0)
        else:
            pt = gt = 0.0
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used,
            kv_blocks_free=pool.num_free,
            prefix_hit_rate=self.kv.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_per_s=pt,
            generation_tokens_per_s=gt,
            steps=self._steps,
            step_seconds=self._step_seconds,
            device_seconds=self._device_seconds,
            kernel_backend=self.runner.ops.name,
            cuda_graphs=self.runner.graphs is not None,
            async_scheduling=self.async_scheduling,
            kv_cache_dtype=str(self.runner.kv_dtype).removeprefix("torch."),
            fp8_attention=self.runner.fp8_attention,
            kv_reserve=self.scheduler.kv_reserve,
        )


def _is_fatal(exc: BaseException) -> bool:
    """An error after which the engine cannot go on (its device context is lost): the worker
    stops instead of retrying requests apart, and their messages are delivered again elsewhere."""
    text = str(exc)
    return isinstance(exc, MemoryError) or type(exc).__name__ == "AcceleratorError" or (
        "CUDA error" in text and "out of memory" not in text
    )


def _pydantic_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts)
