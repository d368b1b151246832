"""A step that raises never stops the engine: its requests are retried apart until the one that
makes steps fail is alone, and only that one fails (finish_reason "error", with a message)."""

from __future__ import annotations

import pytest

from schemas.sampling import SamplingParams
from tests.workers.engine.conftest import hf_greedy, prompt_set
from workers.engine import EngineConfig, LLMEngine

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    prefix = prompt_set(1, seed=21, min_len=13, max_len=13)[0]  # shared: prefix-cache hits across retries
    return [prefix + t for t in prompt_set(9, seed=22, min_len=2, max_len=30)]


@pytest.fixture(scope="module")
def want(llama_dir, prompts):
    return hf_greedy(llama_dir, prompts, MAX_NEW)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def engine(request, llama_dir) -> LLMEngine:
    return LLMEngine(str(llama_dir), EngineConfig(device="cpu", dtype="float32", block_size=4,
                                                  max_num_seqs=16, async_scheduling=request.param))


def fail_steps_with(engine: LLMEngine, poison: set[str], *, together: bool = False, exc=RuntimeError) -> list[int]:
    """Make engine steps raise when they compute a poisoned request (all of them, `together`);
    returns a list that counts the failed steps."""
    real = engine.runner.execute
    failures: list[int] = []

    def execute(out, prev=None, guide=None):
        ids = {e.request.request_id for e in out.scheduled}
        if (poison <= ids) if together else (poison & ids):
            failures.append(len(ids))
            raise exc("device-side trouble in the sampler")
        return real(out, prev, guide)

    engine.runner.execute = execute  # type: ignore[method-assign]
    return failures


def run(engine: LLMEngine, prompts, ids) -> dict:
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, prompt_token_ids=p, sampling=GREEDY)
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for f in engine.step().finished:
            assert f.request_id not in done, "a request finished twice"
            done[f.request_id] = f
    assert not engine.has_unfinished(), "the engine never finished"
    return done


def assert_pool_clean(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_one_poisoned_request_fails_alone_and_the_others_are_exact(engine, prompts, want):
    ids = [f"r{i}" for i in range(len(prompts))]
    failures = fail_steps_with(engine, {"r4"})
    done = run(engine, prompts, ids)
    assert done["r4"].finish_reason == "error"
    assert "RuntimeError" in done["r4"].error and "device-side trouble" in done["r4"].error
    assert done["r4"].output_token_ids == []
    for i, rid in enumerate(ids):
        if rid != "r4":
            assert done[rid].finish_reason == "length", rid
            assert done[rid].output_token_ids == want[i], rid  # recomputed from scratch, still exact
            assert done[rid].error is None
    # bisection: 9 requests -> at most ceil(log2(9)) + 1 failed steps, the last with r4 alone
    assert 2 <= len(failures) <= 5 and failures[-1] == 1
    assert engine.scheduler.isolated is None
    assert_pool_clean(engine)
    # the engine goes on serving afterwards, with the prefix cache it kept
    again = run(engine, prompts[:3], ["s0", "s1", "s2"])
    assert [again[f"s{i}"].output_token_ids for i in range(3)] == want[:3]


def test_a_pair_that_fails_only_together_both_finish_once_apart(engine, prompts, want):
    ids = [f"r{i}" for i in range(len(prompts))]
    failures = fail_steps_with(engine, {"r1", "r7"}, together=True)
    done = run(engine, prompts, ids)
    assert failures, "the pair never met in a step: the test tests nothing"
    for i, rid in enumerate(ids):
        assert done[rid].finish_reason == "length", rid
        assert done[rid].output_token_ids == want[i], rid
    assert_pool_clean(engine)


def test_a_request_failing_late_in_its_decode_keeps_its_neighbours_exact(engine, prompts, want):
    """The failure comes after some tokens were generated (mid-decode, with tokens in flight under
    async scheduling): the neighbours' partial outputs are recomputed and stay exact."""
    real = engine.runner.execute
    failures: list[int] = []

    def execute(out, prev=None, guide=None):
        for e in out.scheduled:
            r = e.request
            if r.request_id == "r2" and r.num_output_tokens >= 3:
                failures.append(len(out.scheduled))
                raise ValueError("Overflow when unpacking long long")
        return real(out, prev, guide)

    engine.runner.execute = execute  # type: ignore[method-assign]
    ids = [f"r{i}" for i in range(len(prompts))]
    done = run(engine, prompts, ids)
    assert failures and failures[-1] == 1
    assert done["r2"].finish_reason == "error" and "Overflow" in done["r2"].error
    for i, rid in enumerate(ids):
        if rid != "r2":
            assert done[rid].output_token_ids == want[i], rid
    assert_pool_clean(engine)


def test_a_device_context_error_is_not_retried(engine, prompts):
    class AcceleratorError(RuntimeError):
        pass

    fail_steps_with(engine, {"r0"}, exc=AcceleratorError)
    with pytest.raises(AcceleratorError):
        run(engine, prompts[:3], ["r0", "r1", "r2"])


def test_blocks_of_a_failed_step_leave_the_prefix_cache(engine, prompts):
    """A failed step may not have written the blocks it was to fill: no later request may find them."""
    engine.add_request("a", prompt_token_ids=prompts[0], sampling=GREEDY)
    fail_steps_with(engine, {"a"})
    out = engine.step()
    assert [f.finish_reason for f in out.finished] == ["error"]
    assert engine.kv.pool._cached == {}
    assert all(b.block_hash is None for b in engine.kv.pool.blocks)
