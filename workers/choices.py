"""Jobs of several choices (OpenAI's prompt lists, `n`, `best_of`) over one engine: each sequence is
an engine request of its own, and the job's one FinishedRequest is made when the last of them ends.

    job "j" with prompts [p0, p1], n=2  ->  requests j\\x1f0, j\\x1f1 (over p0), j\\x1f2, j\\x1f3 (over p1)
                                        ->  one FinishedRequest "j" with choices 0..3 (prompt-major)

A prompt is computed once: its sequences after the first are added as its followers
(`LLMEngine.add_request(follows=...)`), forked from the first's prefill in the step that samples
its first token. They share its full blocks by reference, get a device copy of its last partial
block and sample their first tokens from its logits row, so every choice's first token comes in
that one step (tests/workers/test_choices.py checks the blocks and the copy). A follower that
finds no sequence slot or block then waits as any request does and takes the blocks from the
prefix cache.

A job that asks for prompt log-probabilities (echo with logprobs) computes them in each prompt's
first sequence only (the others are forked from it all the same); every choice reports them.

Seeds: a seeded job's k-th sequence of each prompt samples with `choice_seed(seed, k)` (the
seed itself for the first), so the choices differ from each other and repeat run to run.
best_of: each prompt samples best_of sequences and keeps the n with the highest cumulative
log-probability (of the model's raw distribution, as the job's logprobs report), likeliest first.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas.job import ErrorCode, FinishReason, Usage
from schemas.sampling import SamplingParams
from workers.engine import FinishedRequest, InvalidRequestError, LLMEngine
from workers.engine.outputs import ChoiceOutput
from workers.engine.sequence import RequestTimes

SEP = "\x1f"  # between a job id and a sequence number: no job id holds it (ids are printable)


def choice_seed(seed: int | None, k: int) -> int | None:
    """The seed of a job's k-th sequence of a prompt: the job's own for the first, then a hash of
    (seed, k) below 2**63 (None stays None: unseeded sampling)."""
    if seed is None or k == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def cumulative_logprob(f: FinishedRequest) -> float:
    """The sum of a sequence's output tokens' log-probabilities (0 for none)."""
    return sum(lp.logprob for lp in f.logprobs or ())


@dataclass
class _Group:
    job_id: str
    sampling: SamplingParams
    prompt_lens: list[int]
    echoes: list[str | None]  # per prompt: its text when the job asked for echo
    children: list[str]  # request ids, prompt-major, samples_per_prompt each
    done: dict[str, FinishedRequest] = field(default_factory=dict)
    first_token: bool = False  # the job's first token was reported


class ChoiceGroups:
    """The jobs of several choices in one engine: add them, route their requests' outputs to the
    job (first token, streamed deltas with their choice index, one finished result)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._groups: dict[str, _Group] = {}
        self._of: dict[str, tuple[_Group, int]] = {}  # request id -> its job's group, its sequence number
        self._dropped: set[str] = set()  # requests of a job refused while being added: outputs dropped

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._groups

    def add(self, job_id: str, prompts: Sequence[list[int]], echoes: Sequence[str | None],
            sampling: SamplingParams, **kw: Any) -> None:
        """Add a job's sequences (each prompt's token ids, samples_per_prompt times). Raises
        InvalidRequestError, naming the prompt at fault in a list, with nothing of the job left in
        the engine. `kw`: LLMEngine.add_request's priority, arrival_time, stream, fair_rank."""
        if job_id in self._groups:
            raise InvalidRequestError(ErrorCode.DUPLICATE_ID, f"request {job_id!r} is already in the engine")
        samples = sampling.samples_per_prompt
        selects = samples > sampling.n
        child_sp = {"n": 1, "best_of": None}
        if selects and sampling.logprobs is None:
            child_sp["logprobs"] = 0  # the sampled tokens' log-probabilities rank the sequences
        if selects:
            kw = {**kw, "stream": False}  # (best_of is not streamed: the API refuses it)
        group = _Group(job_id, sampling, [len(p) for p in prompts], list(echoes), [])
        try:
            for j, ids in enumerate(prompts):
                for k in range(samples):
                    request_id = f"{job_id}{SEP}{j * samples + k}"
                    update = {**child_sp, "seed": choice_seed(sampling.seed, k)}
                    if k:  # a prompt's log-probabilities are its first sequence's (_merge): the others
                        update["prompt_logprobs"] = None  # skip them, and so can take its cached blocks
                    sp = sampling.model_copy(update=update)
                    lead = {"follows": f"{job_id}{SEP}{j * samples}"} if k else {}
                    self.engine.add_request(request_id, prompt_token_ids=ids, sampling=sp, **kw, **lead)
                    group.children.append(request_id)
        except InvalidRequestError as exc:
            for request_id in group.children:
                self.engine.abort(request_id)
                self._dropped.add(request_id)
            where = f"prompt {j}: " if len(prompts) > 1 else ""
            raise InvalidRequestError(exc.code, where + exc.message) from None
        self._groups[job_id] = group
        for i, request_id in enumerate(group.children):
            self._of[request_id] = (group, i)

    def abort(self, job_id: str) -> bool:
        """Abort every sequence of the job still running (their ends come out as usual)."""
        group = self._groups.get(job_id)
        if group is None:
            return False
        for request_id in group.children:
            if request_id not in group.done:
                self.engine.abort(request_id)
        return True

    def first_tokens(self, events: Sequence[tuple[str, float]]) -> list[tuple[str, float]]:
        """(request id, time) first-token events, a job's sequences' as the job's first only."""
        out = []
        for request_id, t in events:
            of = self._of.get(request_id)
            if of is None:
                if request_id not in self._dropped:
                    out.append((request_id, t))
            elif not of[0].first_token:
                of[0].first_token = True
                out.append((of[0].job_id, t))
        return out

    def deltas(self, deltas: Sequence[tuple[str, str, int, int]]) -> list[tuple[str, str, int, int, int]]:
        """Streamed (request id, text, tokens, offset) as (job id, text, tokens, offset, choice index)."""
        out = []
        for request_id, text, tokens, offset in deltas:
            of = self._of.get(request_id)
            if of is None:
                if request_id not in self._dropped:
                    out.append((request_id, text, tokens, offset, 0))
            else:
                out.append((of[0].job_id, text, tokens, offset, of[1]))  # (n sequences per prompt: index = number)
        return out

    def finished(self, finished: Sequence[FinishedRequest]) -> list[FinishedRequest]:
        """Finished requests, a job's sequences held until its last one, then the job's."""
        out = []
        for f in finished:
            of = self._of.pop(f.request_id, None)
            if of is None:
                if f.request_id in self._dropped:
                    self._dropped.discard(f.request_id)
                else:
                    out.append(f)
                continue
            group = of[0]
            group.done[f.request_id] = f
            if f.finish_reason is FinishReason.ERROR:  # it failed the engine's steps: so does the job
                self.abort(group.job_id)
            if len(group.done) == len(group.children):
                del self._groups[group.job_id]
                out.append(_merge(group))
        return out


def _merge(g: _Group) -> FinishedRequest:
    """The job's FinishedRequest from its sequences': choices prompt-major (best_of: each prompt's
    n likeliest, likeliest first), usage and timings over every sequence."""
    outs = [g.done[c] for c in g.children]
    sp = g.sampling
    samples = sp.samples_per_prompt
    choices: list[ChoiceOutput] = []
    for j in range(len(g.prompt_lens)):
        seqs = outs[j * samples : (j + 1) * samples]
        if sp.prompt_logprobs is not None:  # the prompt's, computed by its first sequence alone
            head = seqs[0]
            seqs = [head, *(dataclasses.replace(o, prompt_logprobs=head.prompt_logprobs,
                                                token_texts={**(head.token_texts or {}), **(o.token_texts or {})})
                            for o in seqs[1:])]
        if samples > sp.n:
            seqs = sorted(seqs, key=cumulative_logprob, reverse=True)[: sp.n]
            if sp.logprobs is None:  # computed to rank them, not asked for
                seqs = [dataclasses.replace(o, logprobs=None) for o in seqs]
        choices.extend(ChoiceOutput(j * sp.n + k, j, o, g.echoes[j]) for k, o in enumerate(seqs))
    reasons = [o.finish_reason for o in outs]
    first = choices[0].output
    finish = first.finish_reason
    error = None
    if FinishReason.ERROR in reasons:
        finish = FinishReason.ERROR
        error = next(o.error for o in outs if o.finish_reason is FinishReason.ERROR)
    elif FinishReason.ABORT in reasons:
        finish = FinishReason.ABORT
    usage = Usage(
        prompt_tokens=sum(g.prompt_lens),  # once per prompt, however many sequences continue it
        cached_prompt_tokens=sum(outs[j * samples].usage.cached_prompt_tokens for j in range(len(g.prompt_lens))),
        completion_tokens=sum(o.usage.completion_tokens for o in outs),  # best_of's unreturned ones too
    )

    def earliest(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return min(known) if known else None

    times = RequestTimes(
        arrival=min(o.timings.arrival for o in outs),
        first_scheduled=earliest([o.timings.first_scheduled for o in outs]),
        first_token=earliest([o.timings.first_token for o in outs]),
        finished=max((o.timings.finished for o in outs if o.timings.finished is not None), default=None),
        prefill_compute_s=sum(o.timings.prefill_compute_s for o in outs),
    )
    return FinishedRequest(
        request_id=g.job_id,
        output_token_ids=first.output_token_ids,
        text=first.text,
        finish_reason=finish,
        stop_reason=first.stop_reason,
        usage=usage,
        timings=times,
        num_preemptions=sum(o.num_preemptions for o in outs),
        logprobs=first.logprobs,
        prompt_logprobs=first.prompt_logprobs,
        token_texts=first.token_texts,
        error=error,
        choices=tuple(choices),
    )
