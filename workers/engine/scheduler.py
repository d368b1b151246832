"""Iteration-level scheduling: which requests compute how many tokens in the next step."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas.job import FinishReason
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.sequence import Request, RequestStatus


class AdaptiveReserve:
    """`kv_reserve="auto"`: the share of the running requests' remaining output that admission keeps free KV
    blocks for, learned from the requests that end. `used` is the running mean (weight `alpha`) of the share
    of its max_tokens (counted up to `clip`) each finished request generated, from 1.0 (an answer may run to
    max_tokens) before any has ended; the reserve is `margin` x used. A step that preempts puts `used` back to
    1.0 (the requests that ended first, the short ones, made it too low). bench/sim_schedule.py, the real
    scheduler with a cost model per step (2026-12-07, session 24): on an H100's pool (KV room for 970k tokens),
    1000 prompts of 1000 tokens each answered with 1000 output tokens, 16,583 tok/s against 15,158 with no
    reserve (405 preemptions) and 16,017 reserving all; answers of 20-1000 tokens 14,347 against 14,450 / 14,254
    (0.85); chat-like answers of 50-600 tokens under a max_tokens of 4096, 20,721 against 20,790 / 19,031; an
    H200's pool as no reserve. Measured on an H100 (session 24): a fixed 0.85 ran the first case at 14,448
    tok/s against 13,023 with none."""

    def __init__(self, margin: float = 0.85, alpha: float = 1 / 32, clip: int = 4096) -> None:
        self.margin, self.alpha, self.clip = margin, alpha, clip
        self.used = 1.0

    @property
    def ratio(self) -> float:
        return self.margin * self.used

    def finished(self, output_tokens: int, max_tokens: int) -> None:
        """A request ended (its answer stopped, or reached max_tokens) with `output_tokens` generated."""
        share = min(1.0, output_tokens / max(1, min(max_tokens, self.clip)))
        self.used += self.alpha * (share - self.used)

    def update(self, preempted: bool) -> None:
        """After each step: a preemption means the reserve was short."""
        if preempted:
            self.used = 1.0


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_new_tokens: int  # tokens computed this step, starting at num_computed_tokens
    num_computed_tokens: int  # tokens already in the KV cache before this step

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token, so its logits give the next one."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What the next step computes."""

    # decodes first (exactly one new token each), then prefills (chunks, prefix-hit remainders)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_decodes: int = 0  # the first num_decodes entries of `scheduled` have one new token
    num_batched_tokens: int = 0  # total new tokens this step
    preempted: list[Request] = field(default_factory=list)  # taken off the running list this step
    # followers forked this step (Scheduler.add_follower): (follower, its leader), each sampling its
    # first token from the leader's logits row; they compute no token of their own
    forks: list[tuple[Request, Request]] = field(default_factory=list)
    # (source, destination) block ids to copy after the step's forward: a forked follower's own
    # copy of its leader's last, partial prompt block (copy on write, before either writes to it)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """Waiting requests, highest priority first, then first come first served; O(log n) push/pop.

    Priorities age: with `max_wait_s`, a request that arrived that long ago comes first whatever
    its priority (the oldest such first), so a low-priority request is late, never starved.
    Removal is lazy: a heap entry counts only while its request is still the live one for its id.
    """

    def __init__(self, max_wait_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._heap: list[tuple[tuple[int, int], int, Request]] = []
        self._fifo: list[tuple[tuple[float, int], int, Request]] = []  # by arrival: the aged come from here
        self._live: dict[str, Request] = {}
        self._pushes = 0
        self.max_wait_s = max_wait_s
        self._clock = clock

    def push(self, req: Request) -> None:
        self._pushes += 1
        heapq.heappush(self._heap, (req.sort_key(), self._pushes, req))
        if self.max_wait_s is not None:
            heapq.heappush(self._fifo, ((req.times.arrival, req.arrival_index), self._pushes, req))
        self._live[req.request_id] = req

    def _drop_stale(self) -> None:
        while self._heap and self._live.get(self._heap[0][2].request_id) is not self._heap[0][2]:
            heapq.heappop(self._heap)
        while self._fifo and self._live.get(self._fifo[0][2].request_id) is not self._fifo[0][2]:
            heapq.heappop(self._fifo)

    def _aged(self) -> Request | None:
        if not self._fifo:
            return None
        oldest = self._fifo[0][2]
        return oldest if self._clock() - oldest.times.arrival >= self.max_wait_s else None  # type: ignore[operator]

    def peek(self) -> Request | None:
        self._drop_stale()
        aged = self._aged()
        if aged is not None:
            return aged
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty waiting queue")
        del self._live[req.request_id]  # its heap entries are stale now
        self._drop_stale()
        return req

    def remove(self, req: Request) -> bool:
        if self._live.get(req.request_id) is not req:
            return False
        del self._live[req.request_id]
        return True

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, req: Request) -> bool:
        return self._live.get(req.request_id) is req


class Scheduler:
    """Continuous batching with a per-step token budget, chunked prefill, prefix reuse and preemption.

    Running requests are served first, in admission order; then waiting ones are admitted while
    the token budget, `max_num_seqs` and free blocks allow. When blocks run out, the running
    request of lowest priority, newest among equals, is preempted: its blocks are freed and it
    waits to be recomputed (its cached prefix makes the recompute cheap). With kv_reserve > 0 a waiting
    request is admitted only while the free blocks also cover that share of the remaining max_tokens of every
    running request of its priority or higher (1.0: no request admitted is ever preempted for room by one of
    its priority); "auto" learns the share from the requests that end (`AdaptiveReserve`).
    """

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        admission_batch: int = 1,
        budget_fn: Callable[[int, int], int] | None = None,
        priority_max_wait_s: float | None = None,
        kv_reserve: float | str = 0.0,
    ) -> None:
        self.kv = kv
        # admission keeps this share of every running request's remaining output (up to max_tokens) in free
        # blocks (EngineConfig.kv_reserve): 1.0 admits only what can run to its end with no preemption;
        # "auto": a share learned from the requests that end (AdaptiveReserve), each request's remaining output
        # counted up to a clip
        self.adaptive = AdaptiveReserve() if kv_reserve == "auto" else None
        self._fixed_reserve = 0.0 if self.adaptive else float(kv_reserve)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.admission_batch = max(1, admission_batch)
        # the step's token budget from the number of decodes running and the KV tokens they read
        # (an SLO policy, e.g. workers.engine.slo.SloBudget); None: always max_num_batched_tokens
        self.budget_fn = budget_fn
        self.waiting = WaitingQueue(priority_max_wait_s)
        self.running: list[Request] = []
        self.num_preemptions = 0
        # while a failed step's requests are retried apart (LLMEngine.step), only this group's
        # requests are scheduled; the others keep their state and wait
        self.isolated: frozenset[str] | None = None
        # leader request id -> the requests waiting to be forked from its prefill (add_follower)
        self.followers: dict[str, list[Request]] = {}

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.push(req)

    def add_follower(self, req: Request, leader: Request) -> None:
        """Queue `req`, whose prompt is `leader`'s (a sibling choice of one job, n > 1), to be forked
        from the leader's prefill instead of computing it: in the step that computes the leader's
        last prompt token, the follower takes references on the leader's full prompt blocks, gets
        its own copy of the last partial one (copied on the device after that step's forward) and
        samples its first token from the leader's logits row. The prompt is computed once, and
        every choice's first token comes in the leader's step. A follower that finds no sequence
        slot or free block then waits as any request does (and finds the blocks in the prefix
        cache); so does one whose leader ends first."""
        req.status = RequestStatus.WAITING
        req.follows = leader.request_id
        self.followers.setdefault(leader.request_id, []).append(req)

    def _release_followers(self, leader_id: str) -> None:
        for f in self.followers.pop(leader_id, ()):
            f.follows = None
            self.waiting.push(f)

    def _fork(self, entries: list[ScheduledRequest], now: float) -> tuple[list, list]:
        """Fork the followers of each entry that samples its leader's first token (add_follower)."""
        forks: list[tuple[Request, Request]] = []
        copies: list[tuple[int, int]] = []
        bs = self.kv.block_size
        pool = self.kv.pool
        for e in entries:
            leader = e.request
            if not e.samples or leader.num_output_tokens or leader.request_id not in self.followers:
                continue
            n = leader.num_prompt_tokens
            n_full, partial = divmod(n, bs)
            for f in self.followers.pop(leader.request_id):
                f.follows = None
                if (len(self.running) >= self.max_num_seqs or (partial and pool.num_free < 1)
                        or (self.isolated is not None and f.request_id not in self.isolated)):
                    self.waiting.push(f)
                    continue
                shared = [pool.blocks[b] for b in leader.block_ids[:n_full]]
                pool.touch(shared)
                f.block_ids = [b.block_id for b in shared]
                if partial:
                    (own,) = pool.allocate(1)
                    f.block_ids.append(own.block_id)
                    copies.append((leader.block_ids[n_full], own.block_id))
                f.block_hashes = leader.block_hashes[:n_full]
                f.num_indexed_blocks = min(leader.num_indexed_blocks, n_full)
                f.num_computed_tokens = n
                if f.num_cached_tokens is None:  # the whole prompt, computed by another sequence
                    f.num_cached_tokens = n
                    self.kv.record_hit(n, n)
                if f.times.first_scheduled is None:
                    f.times.first_scheduled = now
                f.status = RequestStatus.RUNNING
                self.running.append(f)
                forks.append((f, leader))
        return forks, copies

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def _pick_victim(self) -> Request:
        """The running request of lowest priority, newest among equals."""
        return max(self.running, key=lambda r: (-r.priority, r.arrival_index))

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(victim)

    def reset(self, req: Request) -> None:
        """Send a request of a failed step back to waiting, to be computed again from its first
        token: its blocks leave the prefix cache (the failed step may not have written them) and
        are freed; sampled tokens not read back are dropped."""
        if req.num_pending:
            del req.token_ids[len(req.token_ids) - req.num_pending :]
            req.num_pending = 0
        req.pending_row = None
        self.kv.pool.uncache(self.kv.pool.blocks[b] for b in req.block_ids)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req)
            req.status = RequestStatus.PREEMPTED
            self.waiting.push(req)
        else:
            self.kv.free(req)
        req.num_computed_tokens = 0

    def _ends_with_pending(self, req: Request) -> bool:
        """The pending sampled token is the request's last by length: nothing more to compute."""
        return req.num_output_tokens >= req.sampling.max_tokens or req.num_tokens >= self.max_model_len

    def _may_admit(self) -> bool:
        """Admission batching under saturation: with requests running, admit new ones only once
        `admission_batch` sequence slots are free (or all that wait fit). Mixed steps that add
        one prompt at a time to a full batch are small and bound by the CPU; fewer, larger
        admissions leave the rest of the steps pure decodes, which replay CUDA graphs."""
        if not self.running:
            return True
        free = self.max_num_seqs - len(self.running)
        return free >= min(self.admission_batch, len(self.waiting))

    @property
    def kv_reserve(self) -> float:
        """The share of the running requests' remaining output admission keeps free blocks for now."""
        return self.adaptive.ratio if self.adaptive else self._fixed_reserve

    def _reserve_blocks(self, req: Request) -> int:
        """Blocks the request will hold at its kv_reserve share of its remaining output tokens."""
        final = min(req.num_prompt_tokens + req.sampling.max_tokens, self.max_model_len)
        left = max(0, final - req.num_tokens)
        if self.adaptive:
            left = min(left, self.adaptive.clip)
        tokens = req.num_tokens + math.ceil(self.kv_reserve * left)
        return -(-tokens // self.kv.block_size)

    def _reserved(self, priority: int) -> int:
        """Free blocks the growth of the running requests of `priority` or higher is counted on (kv_reserve):
        those of lower priority are preempted before a request of this one would be, so their growth does not
        hold it back."""
        return sum(max(0, self._reserve_blocks(r) - len(r.block_ids)) for r in self.running if r.priority >= priority)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        if self.budget_fn is not None:
            decoding = [r.num_computed_tokens for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
            budget = max(1, min(budget, self.budget_fn(len(decoding), sum(decoding) + len(decoding))))
        full = budget
        entries: list[ScheduledRequest] = []
        preempted: list[Request] = []

        only = self.isolated
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if (
                n <= 0
                or (req.pending_row is not None and self._ends_with_pending(req))
                or (only is not None and req.request_id not in only)
            ):
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self._pick_victim()
                vi = self.running.index(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                if vi < i:  # it was scheduled earlier in this step: take it back out
                    i -= 1
                    for k, e in enumerate(entries):
                        if e.request is victim:
                            budget += e.num_new_tokens
                            del entries[k]
                            break
            else:
                entries.append(ScheduledRequest(req, n, req.num_computed_tokens))
                budget -= n
                i += 1

        if not preempted and (only is not None or self._may_admit()):
            now = time.monotonic()
            group = None if only is None else sorted(
                (r for r in self.waiting._live.values() if r.request_id in only), key=Request.sort_key, reverse=True
            )
            # (with nothing running the first request is admitted whatever it needs: it can always run, preempting;
            # the running requests' growth is summed once a request waits: O(running) a step and priority waiting)
            reserving = bool(self.kv_reserve) and only is None
            reserved: dict[int, int] = {}  # priority -> blocks held back for a request of it (_reserved)
            while budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting.peek() if group is None else (group[-1] if group else None)
                if req is None:
                    break
                cached, n_cached = self.kv.find_cached_prefix(req)
                n = min(req.num_tokens - n_cached, budget)
                if reserving and self.running:
                    held = reserved.get(req.priority)
                    if held is None:
                        held = reserved[req.priority] = self._reserved(req.priority)
                    # the blocks it will hold, less its cached ones that others hold (free ones are taken)
                    need = self._reserve_blocks(req) - sum(1 for b in cached if b.ref_cnt > 0)
                    if self.kv.pool.num_free - held < need:
                        break
                if not self.kv.allocate_slots(req, n, cached):
                    others = [] if only is None else [r for r in self.running if r.request_id not in only]
                    if not others:
                        break
                    victim = max(others, key=lambda r: (-r.priority, r.arrival_index))  # room for the group
                    self._preempt(victim)
                    preempted.append(victim)
                    continue
                if group is None:
                    self.waiting.pop()
                else:
                    self.waiting.remove(group.pop())
                if req.num_cached_tokens is None:
                    req.num_cached_tokens = n_cached
                    self.kv.record_hit(req.num_prompt_tokens, n_cached)
                if req.times.first_scheduled is None:
                    req.times.first_scheduled = now
                req.num_computed_tokens = n_cached
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                entries.append(ScheduledRequest(req, n, n_cached))
                budget -= n
                if reserved:  # its growth holds back requests of its priority or lower
                    grow = max(0, self._reserve_blocks(req) - len(req.block_ids))
                    for p in reserved:
                        if p <= req.priority:
                            reserved[p] += grow

        if self.adaptive is not None and only is None:
            self.adaptive.update(bool(preempted))
        forks, copies = self._fork(entries, time.monotonic()) if self.followers else ([], [])
        decodes = [e for e in entries if e.num_new_tokens == 1]
        prefills = [e for e in entries if e.num_new_tokens > 1]
        return SchedulerOutput(
            scheduled=decodes + prefills,
            num_decodes=len(decodes),
            num_batched_tokens=full - budget,
            preempted=preempted,
            forks=forks,
            block_copies=copies,
        )

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Take a request out of the scheduler for good and free its blocks."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.follows is not None:
            self.followers[req.follows].remove(req)
            if not self.followers[req.follows]:
                del self.followers[req.follows]
            req.follows = None
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if self.adaptive is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.adaptive.finished(req.num_output_tokens, req.sampling.max_tokens)
        if self.followers:
            self._release_followers(req.request_id)  # a leader that ends before its prefill samples
