"""Seeded sampling, stop conditions, priorities and per-request validation errors."""

from __future__ import annotations

import pytest
import torch

from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, InvalidRequestError, LLMEngine
from workers.engine.sampler import _top_k_top_p


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request) -> LLMEngine:
    """The tiny engine with synchronous and with async scheduling (the default on CUDA)."""
    return LLMEngine("tiny", EngineConfig(device="cpu", max_model_len=256, block_size=8,
                                          async_scheduling=request.param))


def drain(eng: LLMEngine) -> dict:
    done = {}
    while eng.has_unfinished():
        for f in eng.step().finished:
            done[f.request_id] = f
    return done


def test_seeded_sampling_is_reproducible_across_batches(engine):
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    engine.add_request("s1", prompt="hello there", sampling=sp)
    a = drain(engine)["s1"].output_token_ids
    # same seed, now batched with other requests: same tokens
    engine.add_request("s2", prompt="hello there", sampling=sp)
    for i in range(3):
        engine.add_request(f"other{i}", prompt=f"noise {i}", sampling=SamplingParams(max_tokens=5, temperature=1.0))
    b = drain(engine)["s2"].output_token_ids
    assert a == b
    engine.add_request("s3", prompt="hello there", sampling=sp.model_copy(update={"seed": 99}))
    c = drain(engine)["s3"].output_token_ids
    assert c != a


def test_top_k_top_p_mask():
    x = torch.tensor([[0.0, 3.0, 1.0, 2.0], [4.0, 3.0, 2.0, 1.0]])
    out = _top_k_top_p(x, torch.tensor([2, 4]), None)
    assert torch.isinf(out[0, [0, 2]]).all() and torch.isfinite(out[0, [1, 3]]).all()
    assert torch.isfinite(out[1]).all()
    # row 1 probs ~ [.64, .24, .09, .03]: top_p .7 keeps the first two
    out = _top_k_top_p(x, None, torch.tensor([0.5, 0.7]))
    assert torch.isfinite(out[1, :2]).all() and torch.isinf(out[1, 2:]).all()
    assert torch.isfinite(out[0, 1]) and torch.isinf(out[0, [0, 2, 3]]).all()


def test_top_k_one_is_greedy(engine):
    engine.add_request("g", prompt="abc", sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.add_request("k1", prompt="abc", sampling=SamplingParams(max_tokens=8, temperature=0.7, top_k=1,
                                                                  ignore_eos=True))
    done = drain(engine)
    assert done["g"].output_token_ids == done["k1"].output_token_ids


def test_stop_token_and_length(engine):
    engine.add_request("free", prompt="xyz", sampling=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    free = drain(engine)["free"]
    assert free.finish_reason == "length" and len(free.output_token_ids) == 6
    stop_tok = free.output_token_ids[3]
    first = free.output_token_ids.index(stop_tok)
    engine.add_request("st", prompt="xyz", sampling=SamplingParams(max_tokens=6, temperature=0,
                                                                  stop_token_ids=[stop_tok], ignore_eos=True))
    st = drain(engine)["st"]
    assert st.finish_reason == "stop" and st.stop_reason == stop_tok
    assert st.output_token_ids == free.output_token_ids[: first + 1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_string_is_cut_from_text(llama_dir, async_scheduling):
    # a trained BPE tokenizer, so the output is real text pieces
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cpu", async_scheduling=async_scheduling))
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    eng.add_request("free", prompt="The quick brown", sampling=sp)
    text = drain(eng)["free"].text
    assert len(text) >= 6
    stop = text[3:6]
    eng.add_request("ss", prompt="The quick brown", sampling=sp.model_copy(update={"stop": [stop, "never-seen"]}))
    ss = drain(eng)["ss"]
    assert ss.finish_reason == "stop" and ss.stop_reason == stop
    assert ss.text == text[: text.index(stop)]


def test_eos_stops_unless_ignored(engine):
    sp = SamplingParams(max_tokens=8, temperature=0)
    engine.add_request("free", prompt="abc", sampling=sp.model_copy(update={"ignore_eos": True}))
    free = drain(engine)["free"].output_token_ids
    eos = free[2]
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({eos})  # pretend the model's end-of-sequence id is that token
    try:
        engine.add_request("e", prompt="abc", sampling=sp)
        engine.add_request("ign", prompt="abc", sampling=sp.model_copy(update={"ignore_eos": True}))
        done = drain(engine)
    finally:
        engine.eos_token_ids = saved
    assert done["e"].finish_reason == "stop" and done["e"].stop_reason == eos
    assert done["e"].output_token_ids == free[: free.index(eos) + 1]
    assert done["e"].text == engine.tokenizer.decode(free[: free.index(eos)])
    assert done["ign"].output_token_ids == free and done["ign"].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, code",
    [
        ({"prompt": ""}, "invalid_request"),
        ({"prompt_token_ids": []}, "invalid_request"),
        ({"prompt_token_ids": [1, 2, 100000]}, "invalid_request"),
        ({"prompt_token_ids": [5] * 256}, "prompt_too_long"),
        ({"prompt_token_ids": [5] * 200, "sampling": {"max_tokens": 100}}, "prompt_too_long"),
        ({"prompt": "hi", "sampling": {"max_tokens": 256}}, "prompt_too_long"),  # max_tokens past the context alone
        ({"prompt": "hi", "sampling": {"max_tokens": 0}}, "invalid_sampling"),
        ({"prompt": "hi", "sampling": {"temperature": -1}}, "invalid_sampling"),
        ({"prompt": "hi", "sampling": {"top_p": 0}}, "invalid_sampling"),
        ({"prompt": "hi", "sampling": {"top_p": 1.5}}, "invalid_sampling"),
        ({"prompt": "hi", "sampling": SamplingParams.model_construct(max_tokens=0)}, "invalid_sampling"),
        ({"prompt": "hi", "sampling": SamplingParams.model_construct(max_tokens=4, temperature=-2.0, top_p=1.0,
                                                                     top_k=None)}, "invalid_sampling"),
    ],
)
def test_invalid_requests_fail_alone(engine, kwargs, code):
    engine.add_request("ok", prompt="fine", sampling=SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(InvalidRequestError) as ei:
        engine.add_request("bad", **kwargs)
    assert ei.value.code == code
    assert "bad" not in engine.requests
    done = drain(engine)
    assert set(done) == {"ok"} and len(done["ok"].output_token_ids) == 3


def test_duplicate_id_rejected(engine):
    engine.add_request("dup", prompt="a", sampling=SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError) as ei:
        engine.add_request("dup", prompt="b")
    assert ei.value.code == "duplicate_id"
    drain(engine)


def test_priority_then_fcfs():
    eng = LLMEngine("tiny", EngineConfig(device="cpu", max_num_seqs=1, max_model_len=128))
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    eng.add_request("low-early", prompt="a", sampling=sp, priority=0)
    eng.add_request("high", prompt="b", sampling=sp, priority=5)
    eng.add_request("low-late", prompt="c", sampling=sp, priority=0)
    order = []
    while eng.has_unfinished():
        order += [f.request_id for f in eng.step().finished]
    assert order == ["high", "low-early", "low-late"]


def test_timings_and_stats(engine):
    engine.add_request("t", prompt="timing", sampling=SamplingParams(max_tokens=5, ignore_eos=True))
    out = engine.step()
    assert [e.request_id for e in out.first_tokens] == ["t"]
    done = drain(engine)["t"]
    t = done.timings
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished
    assert done.timings.engine_ttft_ms >= done.timings.prefill_ms >= 0
    assert done.tpot_ms is not None and done.tpot_ms >= 0
    s = engine.stats()
    assert s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0
    assert s.kv_blocks_free == s.kv_blocks_total


@pytest.mark.parametrize("job", [
    {"prompt": "x" * 300},
    {"prompt": "hi", "sampling": {"max_tokens": 256}},
    {"prompt": "x" * 200, "sampling": {"max_tokens": 100}},
    {"prompt": "hi", "sampling": {"max_tokens": 4, "top_k": 1000}},
    {"prompt": "fine", "sampling": {"max_tokens": 4}},
    # guided decoding: a spec the grammar engine refuses, after the prompt's own checks
    {"prompt": "hi", "sampling": {"max_tokens": 4, "guided": {"kind": "regex", "regex": "a(b"}}},
    {"prompt": "hi", "sampling": {"max_tokens": 4, "guided": {"kind": "json_schema",
                                                              "json_schema": {"type": "array", "uniqueItems": True}}}},
    {"prompt": "x" * 300, "sampling": {"max_tokens": 4, "guided": {"kind": "regex", "regex": "a(b"}}},
    {"prompt": "fine", "sampling": {"max_tokens": 4, "guided": {"kind": "choice", "choices": ["yes", "no"]}}},
])
def test_the_submission_check_and_the_engine_refuse_alike(engine, job):
    """One admission check with one set of codes: what SubmitCheck says at submission is what the
    engine says on the worker (the same code and message, or both let the job in)."""
    from schemas.job import JobRequest
    from workers.engine.prompts import SubmitCheck

    request = JobRequest(id="j", prompt=job["prompt"], sampling=SamplingParams(**job.get("sampling", {})))
    check = SubmitCheck(engine.tokenizer, engine.max_model_len, engine.model_config.vocab_size)
    at_submission = check(request)
    try:
        engine.add_request("j", prompt=request.prompt, sampling=request.sampling)
        in_engine = None
    except InvalidRequestError as exc:
        in_engine = (exc.code, exc.message)
    assert at_submission == in_engine
    drain(engine)


def test_a_prompt_pays_its_share_of_the_steps_it_shared():
    """prefill_ms is each prompt's share of its prefill steps, split by tokens: two prompts computed
    in one step pay in proportion to their tokens (their wall prefill is the same step); a prompt
    whose prefix is cached pays only for the rest."""
    from workers.engine.llm import LLM

    eng = LLMEngine("tiny", EngineConfig(device="cpu", block_size=16, max_num_batched_tokens=1024))
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    small, big = [7] * 10, list(range(3, 403))
    a, b = LLM(engine=eng).generate([small, big], sp)
    assert a.timings.prefill_wall_ms == pytest.approx(b.timings.prefill_wall_ms)  # one step for both
    assert a.timings.prefill_ms / b.timings.prefill_ms == pytest.approx(10 / 400)
    assert b.timings.prefill_ms <= b.timings.prefill_wall_ms
    # the same prompt again (384 of its 400 tokens cached: 16 computed) beside a new one of 400
    again, fresh = LLM(engine=eng).generate([big, [t % 500 + 5 for t in range(1000, 1400)]], sp)
    assert again.usage.cached_prompt_tokens == 384 and fresh.usage.cached_prompt_tokens == 0
    assert again.timings.prefill_ms / fresh.timings.prefill_ms == pytest.approx(16 / 400)
