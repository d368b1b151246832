"""Block pool and KV cache manager: exact block ids, eviction order, reference counts."""

from __future__ import annotations

import itertools

import pytest

from schemas.sampling import SamplingParams
from workers.engine.block_pool import BlockPool, hash_block
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.sequence import Request, RequestTimes

_ids = itertools.count()


def make_request(tokens: list[int], priority: int = 0) -> Request:
    n = next(_ids)
    return Request(f"q{n}", list(tokens), len(tokens), SamplingParams(max_tokens=4), priority, n, RequestTimes(0.0))


def test_allocate_in_order_and_free_to_back():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert [x.block_id for x in a] == [0, 1]
    assert [x.block_id for x in b] == [2, 3, 4]
    assert pool.free_block_ids() == [5]
    pool.release(reversed(a))
    assert pool.free_block_ids() == [5, 1, 0]
    assert [x.block_id for x in pool.allocate(2)] == [5, 1]
    with pytest.raises(RuntimeError):
        pool.allocate(2)


def test_cached_free_block_reused_then_evicted_lru():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    hashes = [hash_block(None, [i]) for i in range(3)]
    for blk, h in zip(blocks, hashes):
        pool.cache(blk, h)
    pool.release([blocks[1], blocks[0], blocks[2]])  # free order: 1, 0, 2
    assert pool.free_block_ids() == [1, 0, 2]
    # a cache hit takes block 0 out of the free queue without evicting it
    hit = pool.lookup(hashes[0])
    assert hit is blocks[0]
    pool.touch([hit])
    assert pool.free_block_ids() == [1, 2]
    # the next allocation evicts the least recently freed cached block: 1
    (new,) = pool.allocate(1)
    assert new.block_id == 1 and new.block_hash is None
    assert pool.lookup(hashes[1]) is None
    assert pool.lookup(hashes[2]) is blocks[2]
    assert pool.num_evictions == 1


def test_release_more_than_taken_is_an_error():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(RuntimeError):
        pool.release([b])


def test_chained_hash_depends_on_parent():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(h1, [3, 4]) == hash_block(hash_block(None, [1, 2]), [3, 4])


def test_prefix_reuse_and_refcounts():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request(list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.find_cached_prefix(a) == ([], 0)
    assert kv.allocate_slots(a, 10)
    assert a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 10
    # b shares the first 8 tokens: the two full blocks are reused, not recomputed
    b = make_request(list(range(8)) + [99, 98, 97])
    blocks, n = kv.find_cached_prefix(b)
    assert [x.block_id for x in blocks] == [0, 1] and n == 8
    assert kv.allocate_slots(b, 3, blocks)
    assert b.block_ids == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    kv.free(a)
    # a's tail goes to the free queue first (evicted first), shared blocks stay held by b
    assert kv.pool.free_block_ids()[-1:] == [2]
    kv.free(b)
    assert all(x.ref_cnt == 0 for x in kv.pool.blocks)
    assert kv.pool.free_block_ids()[-4:] == [2, 3, 1, 0]
    # exactly block-aligned prompt: the last block is recomputed so its logits exist
    c = make_request(list(range(8)))
    blocks, n = kv.find_cached_prefix(c)
    assert [x.block_id for x in blocks] == [0] and n == 4


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request(list(range(12)))
    assert kv.allocate_slots(a, 12)
    b = make_request([7] * 5)
    free_before = kv.pool.free_block_ids()
    assert not kv.allocate_slots(b, 5)
    assert b.block_ids == [] and kv.pool.free_block_ids() == free_before


def test_admission_batching_under_saturation():
    from workers.engine.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, admission_batch=2)
    reqs = [make_request([i + 1] * 3) for i in range(7)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert [e.request for e in out.scheduled] == reqs[:4]  # nothing running: fill every slot
    for e in out.scheduled:
        e.request.num_computed_tokens += e.num_new_tokens
        e.request.token_ids.append(9)
    sched.finish(reqs[0], "stop")
    # one slot free, three waiting: wait for a second free slot
    out = sched.schedule()
    assert {e.request.request_id for e in out.scheduled} == {r.request_id for r in reqs[1:4]}
    for e in out.scheduled:
        e.request.num_computed_tokens += e.num_new_tokens
        e.request.token_ids.append(9)
    sched.finish(reqs[1], "stop")
    out = sched.schedule()
    assert [e.request for e in out.scheduled if e.num_computed_tokens == 0] == reqs[4:6]
    # a single waiting request is admitted as soon as one slot frees
    for e in out.scheduled:
        e.request.num_computed_tokens += e.num_new_tokens
        e.request.token_ids.append(9)
    sched.finish(reqs[2], "stop")
    out = sched.schedule()
    assert reqs[6] in [e.request for e in out.scheduled]


def test_manager_hashes_equal_hash_block_chain():
    """The manager hashes runs of blocks at once (hash_blocks); the digests are hash_block's chain."""
    from schemas.sampling import SamplingParams
    from workers.engine.kv_cache_manager import KVCacheManager
    from workers.engine.sequence import Request, RequestTimes

    kv = KVCacheManager(64, 4)
    toks = [7, 1, 99, 3, 100000, 5, 6, 2, 2, 2, 9, 8, 4]
    req = Request("r", list(toks), len(toks), SamplingParams(max_tokens=1), 0, 0, RequestTimes(0.0))
    kv.find_cached_prefix(req)  # hashes the first (13 - 1) // 4 = 3 blocks
    want, parent = [], None
    for i in range(3):
        parent = hash_block(parent, toks[4 * i : 4 * i + 4])
        want.append(parent)
    assert req.block_hashes == want


def test_priority_ages_past_the_bound_so_low_priority_is_late_not_starved():
    from workers.engine.scheduler import WaitingQueue

    now = [100.0]
    q = WaitingQueue(max_wait_s=30.0, clock=lambda: now[0])
    low = make_request([1], priority=-2)
    low.times.arrival = 100.0
    q.push(low)
    highs = []
    for i in range(3):
        r = make_request([2 + i], priority=5)
        r.times.arrival = 101.0 + i
        q.push(r)
        highs.append(r)
    assert q.peek() is highs[0]  # strict priority while nobody has waited too long
    now[0] = 129.9
    assert q.pop() is highs[0]
    now[0] = 130.0  # the low-priority request has waited 30 s: it goes next
    assert q.peek() is low and q.pop() is low
    assert [q.pop() for _ in range(2)] == highs[1:] and len(q) == 0 and q.peek() is None
    # without a bound, priority is strict however long it waits
    strict = WaitingQueue(clock=lambda: 1e9)
    strict.push(low)
    strict.push(highs[2])
    assert strict.pop() is highs[2]


def test_admission_with_a_cached_prefix_indexes_only_the_new_blocks(monkeypatch):
    """A request admitted over cached blocks counts them as indexed (lookup found them there): only the
    blocks its own step fills are offered to the index, and its chain still finds all of them next time."""
    kv = KVCacheManager(32, 4)
    first = make_request(list(range(1, 14)))  # 3 full blocks + 1
    blocks, n = kv.find_cached_prefix(first)
    assert (blocks, n) == ([], 0) and kv.allocate_slots(first, 13)
    offered = []
    real = kv.pool.cache
    monkeypatch.setattr(kv.pool, "cache", lambda b, h: (offered.append(b.block_id), real(b, h)))
    second = make_request(list(range(1, 13)) + [50, 51, 52, 53, 54])  # the same 3 blocks, then 5 new tokens
    blocks, n = kv.find_cached_prefix(second)
    assert n == 12 and [b.block_id for b in blocks] == first.block_ids[:3]
    assert kv.allocate_slots(second, 5, blocks)
    assert second.num_indexed_blocks == 4 and second.block_ids[:3] == first.block_ids[:3]
    assert offered == [second.block_ids[3]]  # the one block its 5 new tokens fill, not the 3 it found
    third = make_request(list(range(1, 13)) + [50, 51, 52, 53, 60])
    blocks, n = kv.find_cached_prefix(third)
    assert [b.block_id for b in blocks] == second.block_ids[:4] and n == 16


def drive(sched, kv, reqs: list[Request], stop_at: dict[str, int] | None = None) -> int:
    """Runs the scheduler to the end as the engine would (a step's tokens computed, a token sampled whenever a
    request's known tokens are all computed, finished at max_tokens, or with "stop" at its `stop_at` output
    tokens); returns the most blocks held at once."""
    for r in reqs:
        sched.add(r)
    stop_at = stop_at or {}
    peak = 0
    for _ in range(10_000):
        if not sched.has_work():
            return peak
        out = sched.schedule()
        peak = max(peak, kv.pool.num_used)
        for e in out.scheduled:
            r = e.request
            r.num_computed_tokens += e.num_new_tokens
            if r.num_computed_tokens == r.num_tokens:
                r.token_ids.append(7)
                if r.num_output_tokens >= stop_at.get(r.request_id, r.sampling.max_tokens):
                    sched.finish(r, "length" if r.num_output_tokens >= r.sampling.max_tokens else "stop")
    raise AssertionError("the scheduler did not finish")


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_kv_reserve_admits_only_what_runs_to_its_end(prefix_caching):
    """kv_reserve 1.0: a request is admitted only while the free blocks cover every running request's growth to
    its max_tokens, so none is ever preempted (and recomputed); the same load at 0.0 preempts. 0.5 reserves half
    the growth: fewer preemptions than 0.0."""
    from workers.engine.scheduler import Scheduler

    def load() -> list[Request]:
        out = []
        for i in range(12):  # 12 requests of 10 prompt + 30 output tokens: 10 blocks of 4 each at their end
            n = next(_ids)
            out.append(Request(f"k{n}", [100 + i] * 10, 10, SamplingParams(max_tokens=30), 0, n, RequestTimes(0.0)))
        return out

    preemptions = {}
    for reserve in (0.0, 0.5, 1.0):
        kv = KVCacheManager(num_blocks=40, block_size=4, enable_prefix_caching=prefix_caching)  # room for 4 at their end
        sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=12, max_model_len=64, kv_reserve=reserve)
        reqs = load()
        peak = drive(sched, kv, reqs)
        assert all(r.num_output_tokens == 30 for r in reqs)
        assert kv.pool.num_used == 0 and peak <= 40
        preemptions[reserve] = sched.num_preemptions
    assert preemptions[1.0] == 0
    assert preemptions[0.0] > preemptions[0.5] > 0


def test_adaptive_reserve_learns_the_share_of_max_tokens_answers_use():
    """kv_reserve "auto": 0.85 of the share of max_tokens that finished requests used, from 1.0 before any ended;
    aborted ones teach nothing, a preempting step puts the share back to 1.0, and a huge max_tokens counts up
    to the clip."""
    from workers.engine.scheduler import AdaptiveReserve

    a = AdaptiveReserve()
    assert a.ratio == pytest.approx(0.85)
    for _ in range(400):  # answers that stop at a tenth of their max_tokens
        a.finished(10, 100)
    assert a.ratio == pytest.approx(0.085, rel=0.01)
    a.update(preempted=False)
    assert a.ratio == pytest.approx(0.085, rel=0.01)
    a.update(preempted=True)
    assert a.ratio == pytest.approx(0.85)
    b = AdaptiveReserve()
    for _ in range(400):  # 2048 of a max_tokens of 100k: half of the clip (4096), not 2%
        b.finished(2048, 100_000)
    assert b.ratio == pytest.approx(0.425, rel=0.01)


def test_auto_reserve_packs_short_answers_and_spares_long_ones():
    """The scheduler with kv_reserve "auto". Answers that run to max_tokens: it reserves like 0.85 does (no more
    preemptions than a fixed 0.5). Answers that stop at 3 of their 30 tokens: after the first ones end it admits
    past what a fixed 0.85 allows (more blocks held at once) and finishes in fewer steps, with no preemption."""
    from workers.engine.scheduler import Scheduler

    def load(tag: str) -> list[Request]:
        out = []
        for i in range(64):  # 10 prompt tokens, max_tokens 30: 10 blocks of 4 each at their end
            n = next(_ids)
            out.append(Request(f"{tag}{n}", [100 + i] * 10, 10, SamplingParams(max_tokens=30), 0, n, RequestTimes(0.0)))
        return out

    def run(reserve, short: bool) -> tuple[int, int, int]:
        kv = KVCacheManager(num_blocks=40, block_size=4, enable_prefix_caching=False)
        sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=64, max_model_len=64, kv_reserve=reserve)
        reqs = load("s" if short else "l")
        stop_at = {r.request_id: 3 for r in reqs} if short else None
        steps = 0
        real = sched.schedule

        def counted():
            nonlocal steps
            steps += 1
            return real()

        sched.schedule = counted
        peak = drive(sched, kv, reqs, stop_at)
        assert kv.pool.num_used == 0 and all(r.status.name == "FINISHED" for r in reqs)
        return sched.num_preemptions, peak, steps

    long_auto, long_half = run("auto", False), run(0.5, False)
    assert long_auto[0] <= long_half[0]
    short_auto, short_fixed = run("auto", True), run(0.85, True)
    assert short_auto[0] == short_fixed[0] == 0
    assert short_auto[1] > short_fixed[1] and short_auto[2] < short_fixed[2]


def test_a_reserve_for_low_priority_growth_does_not_hold_back_a_higher_priority_request():
    """kv_reserve 1.0: blocks kept for the growth of running low-priority requests hold back a waiting request of
    their priority, not one of a higher priority (the low ones would be preempted first); the high one is
    admitted, and every request still finishes."""
    from workers.engine.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=24, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, kv_reserve=1.0)

    def req(tag: str, priority: int) -> Request:
        n = next(_ids)  # 8 prompt tokens, 32 output: 2 blocks now, 10 at the end
        return Request(f"{tag}{n}", [50 + n % 7] * 8, 8, SamplingParams(max_tokens=32), priority, n, RequestTimes(0.0))

    low = [req("low", 0) for _ in range(2)]
    for r in low:
        sched.add(r)
    sched.schedule()
    assert all(r.status.name == "RUNNING" for r in low)  # 20 blocks held or kept for them: 4 free past the reserve
    same, high = req("same", 0), req("high", 5)
    sched.add(same)
    sched.schedule()
    assert same.status.name == "WAITING"  # its priority's growth is reserved: no room to run to its end
    sched.add(high)
    sched.schedule()
    assert high.status.name == "RUNNING" and same.status.name == "WAITING"
    reqs = [*low, same, high]
    drive(sched, kv, [])  # to the end (nothing more to add)
    assert all(r.status.name == "FINISHED" for r in reqs) and kv.pool.num_used == 0
