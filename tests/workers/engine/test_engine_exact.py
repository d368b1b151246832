"""Exact greedy outputs under prefix hits, shared prefixes, chunked prefill, preemption and aborts."""

from __future__ import annotations

import time

import pytest

from schemas.sampling import SamplingParams
from tests.workers.engine.conftest import hf_greedy, prompt_set, run_prompts
from workers.engine import EngineConfig, LLMEngine

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompt_set(8, seed=5, min_len=5, max_len=61)


@pytest.fixture(scope="module")
def shared_prompts() -> list[list[int]]:
    prefix = prompt_set(1, seed=9, min_len=37, max_len=37)[0]
    tails = prompt_set(6, seed=10, min_len=1, max_len=20)
    return [prefix + t for t in tails]


@pytest.fixture(scope="module")
def want(llama_dir, prompts):
    return hf_greedy(llama_dir, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def want_shared(llama_dir, shared_prompts):
    return hf_greedy(llama_dir, shared_prompts, MAX_NEW)


_MODE = {"async": False}


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async"])
def scheduling_mode(request):
    """Every test runs with synchronous and with async scheduling (the default on CUDA)."""
    _MODE["async"] = request.param
    return request.param


def make_engine(path, **cfg) -> LLMEngine:
    cfg.setdefault("block_size", 4)
    cfg.setdefault("async_scheduling", _MODE["async"])
    return LLMEngine(str(path), EngineConfig(device="cpu", dtype="float32", **cfg))


def run_all(engine: LLMEngine, prompts, tag: str = "r", sampling=GREEDY):
    return run_prompts(engine, prompts, sampling, tag)


def assert_pool_clean(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sorted(pool.free_block_ids()) == list(range(pool.num_blocks))


def test_second_run_hits_prefix_cache(llama_dir, prompts, want):
    eng = make_engine(llama_dir)
    t0 = time.perf_counter()
    first = run_all(eng, prompts, "a")
    wall = time.perf_counter() - t0
    assert [f.output_token_ids for f in first] == want
    # the time inside step() is counted, and is part of the run's wall time
    st = eng.stats()
    assert st.steps > 0 and 0 < st.step_seconds <= wall
    assert all(f.usage.cached_prompt_tokens == 0 for f in first)
    second = run_all(eng, prompts, "b")
    assert [f.output_token_ids for f in second] == want
    for f, p in zip(second, prompts):
        # every full block but the one holding the last prompt token comes from the cache
        assert f.usage.cached_prompt_tokens == ((len(p) - 1) // 4) * 4
    assert eng.stats().prefix_hit_rate > 0.4
    assert_pool_clean(eng)


def test_large_blocks_with_prefix_hits_and_chunks(llama_dir):
    """Blocks of 64 tokens (TensorRT-LLM serves 32-64): chunked prefills of 48 tokens, so a chunk fills
    part of a block, and a second run whose prefix hits come in whole 64-token blocks."""
    prefix = prompt_set(1, seed=31, min_len=140, max_len=140)[0]
    prompts = [prefix + t for t in prompt_set(3, seed=32, min_len=1, max_len=30)]
    want = hf_greedy(llama_dir, prompts, MAX_NEW)
    eng = make_engine(llama_dir, block_size=64, max_num_batched_tokens=48)
    assert [f.output_token_ids for f in run_all(eng, prompts, "a")] == want
    second = run_all(eng, prompts, "b")
    assert [f.output_token_ids for f in second] == want
    assert [f.usage.cached_prompt_tokens for f in second] == [((len(p) - 1) // 64) * 64 for p in prompts]
    assert_pool_clean(eng)


def test_shared_prefix_in_one_batch(llama_dir, shared_prompts, want_shared):
    eng = make_engine(llama_dir)
    got = run_all(eng, shared_prompts)
    assert [f.output_token_ids for f in got] == want_shared
    # the first request computes the 36 tokens of full prefix blocks; the others reuse them
    assert got[0].usage.cached_prompt_tokens == 0
    assert all(f.usage.cached_prompt_tokens >= 36 for f in got[1:])
    assert_pool_clean(eng)


@pytest.mark.parametrize("budget", [7, 16])
def test_chunked_prefill(llama_dir, prompts, want, budget):
    eng = make_engine(llama_dir, max_num_batched_tokens=budget)
    steps_with_partial = 0
    steps_in_flight = 0
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", prompt_token_ids=p, sampling=GREEDY)
    done = {}
    while eng.has_unfinished():
        out = eng.step()
        steps_in_flight += eng._in_flight is not None
        assert out.num_batched_tokens <= budget
        if any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
            steps_with_partial += 1
        for f in out.finished:
            done[f.request_id] = f
    assert steps_with_partial > 0
    # async: decode steps stay in flight while the next is scheduled (their inputs read on the device)
    assert (steps_in_flight > 0) == eng.async_scheduling
    assert [done[f"r{i}"].output_token_ids for i in range(len(prompts))] == want
    assert_pool_clean(eng)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes_exactly(llama_dir, prompts, want, prefix_caching):
    # 24 blocks of 4 tokens: far less than the 8 requests need together (~330 tokens); no reserve: admitted while
    # each prompt fits, so the running requests' growth preempts
    eng = make_engine(llama_dir, num_blocks=24, enable_prefix_caching=prefix_caching, kv_reserve=0.0)
    got = run_all(eng, prompts)
    assert eng.scheduler.num_preemptions > 0
    assert sum(f.num_preemptions for f in got) == eng.scheduler.num_preemptions
    assert [f.output_token_ids for f in got] == want
    assert_pool_clean(eng)


def test_kv_reserve_runs_the_same_load_with_no_preemption(llama_dir, prompts, want):
    """The load that preempts above (24 blocks of 4), admitted with kv_reserve 1.0: requests wait for room to run to
    their end instead, none is preempted, and the tokens are transformers' still."""
    eng = make_engine(llama_dir, num_blocks=24, kv_reserve=1.0)
    got = run_all(eng, prompts)
    assert eng.scheduler.num_preemptions == 0 and sum(f.num_preemptions for f in got) == 0
    assert [f.output_token_ids for f in got] == want
    assert_pool_clean(eng)


def test_abort_midway(llama_dir, prompts, want):
    eng = make_engine(llama_dir, max_num_batched_tokens=32)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", prompt_token_ids=p, sampling=GREEDY)
    done = {}
    aborted = {"r1", "r4", "r7"}
    for step in range(200):
        if step == 3:
            # r1 is decoding, r4 mid-prefill or waiting, r7 still waiting
            for rid in aborted:
                assert eng.abort(rid)
            assert not eng.abort("r1"), "a second abort of the same id finds nothing"
        for f in eng.step().finished:
            done[f.request_id] = f
        if not eng.has_unfinished():
            break
    assert set(done) == {f"r{i}" for i in range(8)}
    for rid in aborted:
        assert done[rid].finish_reason == "abort"
        assert len(done[rid].output_token_ids) < MAX_NEW
    for i in range(8):
        if f"r{i}" not in aborted:
            assert done[f"r{i}"].finish_reason == "length"
            assert done[f"r{i}"].output_token_ids == want[i]
    assert_pool_clean(eng)
