"""Jobs of several choices over one engine (workers.choices): a prompt's sequences are forked from
its first sequence's prefill (its full blocks shared, its last partial block copied), seeded
choices differ from each other and repeat, best_of keeps the likeliest, prompt lists answer
prompt-major, max_tokens 0 with echo scores the prompt alone, and a bad prompt leaves nothing
behind."""

from __future__ import annotations

import pytest
import torch

from schemas.job import FinishReason
from schemas.sampling import SamplingParams
from workers.choices import ChoiceGroups, choice_seed, cumulative_logprob
from workers.engine import EngineConfig, FinishedRequest, InvalidRequestError, LLMEngine

PROMPT = "Paged attention keeps the KV cache in fixed-size blocks, shared by"  # 66 byte tokens + BOS


@pytest.fixture
def engine():
    eng = LLMEngine("tiny", EngineConfig(device="cpu", max_model_len=256))
    yield eng
    eng.close()


def _ids(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def _run(engine: LLMEngine, groups: ChoiceGroups) -> dict[str, FinishedRequest]:
    done: dict[str, FinishedRequest] = {}
    while engine.has_unfinished():
        for f in groups.finished(engine.step().finished):
            done[f.request_id] = f
    return done


def _job(engine: LLMEngine, prompts: list[str | list[int]], sp: SamplingParams, job_id: str = "job"):
    groups = ChoiceGroups(engine)
    ids = [_ids(engine, p) if isinstance(p, str) else p for p in prompts]
    echoes = [p if isinstance(p, str) else engine.tokenizer.decode(p) if sp.echo else None for p in prompts]
    groups.add(job_id, ids, [e if sp.echo else None for e in echoes], sp)
    return _run(engine, groups)[job_id]


@pytest.mark.parametrize("n_prompt", [67, 65, 64])
def test_siblings_are_forked_from_the_first_sequences_prefill(engine, n_prompt):
    """n=4 sequences added together: the first computes the prompt; in that same step the other
    three are forked from it (Scheduler.add_follower). They compute no prompt token, take
    references on its full blocks and get their own copy of its last partial block (nothing to
    copy at 64, a whole number of blocks), which holds the first's K/V after the step; every
    choice's first token comes in that one step, and their greedy tokens are the lone request's."""
    bs = engine.config.block_size
    ids = (_ids(engine, PROMPT) * 2)[:n_prompt]
    n_full, partial = divmod(n_prompt, bs)
    engine.add_request("alone", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=8, temperature=0.0))
    single = {f.request_id: f for f in _drain(engine)}["alone"]
    engine.kv.pool.reset_prefix_cache()  # the job below starts from an empty cache
    hits_before = engine.kv.num_hit_tokens

    groups = ChoiceGroups(engine)
    groups.add("job", [ids], [None], SamplingParams(max_tokens=8, temperature=0.0, n=4))
    step = engine.step()
    assert step.num_batched_tokens == n_prompt  # the prompt once
    assert len(groups.first_tokens([(e.request_id, e.time) for e in step.first_tokens])) == 1
    assert len(step.first_tokens) == 4  # every choice's first token in the prefill's step
    seqs = [engine.requests[f"job\x1f{k}"] for k in range(4)]
    lead = seqs[0]
    for s in seqs[1:]:
        assert s.block_ids[:n_full] == lead.block_ids[:n_full]
        assert len(s.block_ids) == n_full + (partial > 0)
    for b in lead.block_ids[:n_full]:
        assert engine.kv.pool.blocks[b].ref_cnt == 4
    if partial:
        own = [s.block_ids[n_full] for s in seqs]
        assert len(set(own)) == 4
        for k_cache, v_cache in engine.runner.kv_caches:
            for cache in (k_cache, v_cache):
                want = cache[own[0], :partial]
                assert want.abs().sum() > 0
                for b in own[1:]:
                    assert torch.equal(cache[b, :partial], want)

    done = {f.request_id: f for f in groups.finished(step.finished)}
    done.update((f.request_id, f) for f in _run(engine, groups).values())
    f = done["job"]
    assert [c.output.usage.cached_prompt_tokens for c in f.choices] == [0, n_prompt, n_prompt, n_prompt]
    assert engine.kv.num_hit_tokens - hits_before == 3 * n_prompt
    assert [c.index for c in f.choices] == [0, 1, 2, 3]
    assert all(c.output.output_token_ids == single.output_token_ids for c in f.choices)
    # the job's usage: the prompt once, the first sequence's hits, every sequence's output
    assert f.usage.prompt_tokens == n_prompt and f.usage.cached_prompt_tokens == 0
    assert f.usage.completion_tokens == sum(c.output.usage.completion_tokens for c in f.choices)
    # the prefill share is the first sequence's alone: the others computed nothing
    shares = [c.output.timings.prefill_compute_s for c in f.choices]
    assert shares[0] > 0 and shares[1:] == [0.0, 0.0, 0.0]
    assert f.timings.prefill_compute_s == pytest.approx(sum(shares))
    assert engine.kv.pool.num_used == 0  # every reference given back


def test_followers_that_find_no_room_wait_and_hit_the_prefix_cache(engine):
    """With one sequence slot left beside the first, the other siblings wait as requests do and
    find its blocks in the prefix cache; a job whose first sequence is aborted before its prefill
    leaves its followers to run on their own."""
    small = LLMEngine("tiny", EngineConfig(device="cpu", max_model_len=256, max_num_seqs=2))
    try:
        ids = _ids(small, PROMPT)
        groups = ChoiceGroups(small)
        groups.add("job", [ids], [None], SamplingParams(max_tokens=4, temperature=0.0, n=3))
        f = _run(small, groups)["job"]
        n = len(ids)
        full = (n - 1) // small.config.block_size * small.config.block_size
        assert [c.output.usage.cached_prompt_tokens for c in f.choices] == [0, n, full]
        assert len({tuple(c.output.output_token_ids) for c in f.choices}) == 1
    finally:
        small.close()
    ids = _ids(engine, PROMPT)
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("lead", prompt_token_ids=ids, sampling=sp)
    engine.add_request("f1", prompt_token_ids=ids, sampling=sp, follows="lead")
    engine.add_request("f2", prompt_token_ids=ids[:-1], sampling=sp, follows="lead")  # another prompt: alone
    assert engine.requests["f1"].follows == "lead" and engine.requests["f2"].follows is None
    engine.add_request("f3", prompt_token_ids=ids, sampling=sp, follows="lead")
    assert engine.abort("f3")  # a follower aborted before its fork leaves nothing behind
    assert [r.request_id for r in engine.scheduler.followers["lead"]] == ["f1"]
    assert engine.abort("lead")
    done = {f.request_id: f for f in _drain(engine)}
    assert set(done) >= {"f1", "f2"} and done["f1"].finish_reason == FinishReason.LENGTH
    assert done["f1"].usage.cached_prompt_tokens == 0  # its leader never ran: it computed the prompt itself
    assert engine.kv.pool.num_used == 0


def _drain(engine: LLMEngine) -> list[FinishedRequest]:
    out = []
    while engine.has_unfinished():
        out.extend(engine.step().finished)
    return out


def test_seeded_choices_differ_and_repeat(engine):
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, n=4)
    first = _job(engine, [PROMPT], sp, "a")
    again = _job(engine, [PROMPT], sp, "b")
    texts = [c.output.output_token_ids for c in first.choices]
    assert len({tuple(t) for t in texts}) == 4, texts  # four different samples
    assert [c.output.output_token_ids for c in again.choices] == texts  # and the same ones again
    # choice 0 samples with the job's own seed: what n=1 gives
    engine.add_request("one", prompt=PROMPT, sampling=SamplingParams(max_tokens=12, temperature=1.0, seed=1234))
    assert {f.request_id: f for f in _drain(engine)}["one"].output_token_ids == texts[0]
    assert choice_seed(1234, 0) == 1234 and len({choice_seed(1234, k) for k in range(4)}) == 4
    assert all(0 <= choice_seed(2**63 - 1, k) < 2**63 for k in range(4))  # type: ignore[operator]


def test_best_of_keeps_the_likeliest(engine):
    """best_of=4, n=2: the two of the four sequences (the same seeds as n=4) with the highest
    cumulative log-probability, likeliest first; logprobs not asked are not returned."""
    every = _job(engine, [PROMPT], SamplingParams(max_tokens=10, temperature=1.0, seed=99, n=4, logprobs=0), "all")
    ranked = sorted(every.choices, key=lambda c: cumulative_logprob(c.output), reverse=True)
    best = _job(engine, [PROMPT], SamplingParams(max_tokens=10, temperature=1.0, seed=99, n=2, best_of=4), "best")
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.output.output_token_ids for c in best.choices] == [c.output.output_token_ids for c in ranked[:2]]
    assert all(c.output.logprobs is None for c in best.choices) and best.logprobs is None
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all four were generated


def test_a_prompt_list_answers_prompt_major(engine):
    a, b = "Kafka partitions carry jobs", "The quick brown fox"
    sp = SamplingParams(max_tokens=6, temperature=0.0, n=2)
    f = _job(engine, [_ids(engine, a), b], sp)
    assert [(c.index, c.prompt_index) for c in f.choices] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    for p, got in ((a, f.choices[0]), (b, f.choices[2])):
        engine.add_request("x", prompt=p, sampling=SamplingParams(max_tokens=6, temperature=0.0))
        assert {g.request_id: g for g in _drain(engine)}["x"].text == got.output.text
    assert f.usage.prompt_tokens == len(_ids(engine, a)) + len(_ids(engine, b))
    assert f.text == f.choices[0].output.text


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(engine):
    f = _job(engine, [PROMPT], SamplingParams(max_tokens=0, echo=True, logprobs=1, temperature=0.0))
    (c,) = f.choices
    assert c.output.output_token_ids == [] and c.output.text == "" and c.output.logprobs == []
    assert c.output.finish_reason is FinishReason.LENGTH and f.usage.completion_tokens == 0
    lps = c.output.prompt_logprobs
    assert lps is not None and lps[0] is None and len(lps) == len(_ids(engine, PROMPT))
    assert all(lp is not None and lp.logprob <= 0 for lp in lps[1:])
    assert c.echo == PROMPT
    engine.add_request("plain", prompt=PROMPT, sampling=SamplingParams(max_tokens=0, echo=True))
    (g,) = _drain(engine)
    assert g.output_token_ids == [] and g.usage.completion_tokens == 0 and g.finish_reason is FinishReason.LENGTH
    with pytest.raises(InvalidRequestError, match="0 only with echo"):
        engine.add_request("bad", prompt=PROMPT, sampling=SamplingParams.model_construct(max_tokens=0))


def test_a_bad_prompt_in_a_list_refuses_the_job_and_leaves_nothing(engine):
    groups = ChoiceGroups(engine)
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match=f"prompt 1: token id {vocab} is outside the vocabulary"):
        groups.add("j", [[5, 6, 7], [5, vocab]], [None, None], SamplingParams(max_tokens=4, n=2))
    assert "j" not in groups
    assert _run(engine, groups) == {}  # the sequences added before the bad prompt: aborted, never reported
    assert not engine.requests


def test_aborting_a_job_ends_all_its_sequences(engine):
    groups = ChoiceGroups(engine)
    groups.add("j", [_ids(engine, PROMPT)], [None], SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    groups.finished(engine.step().finished)
    assert groups.abort("j")
    done = _run(engine, groups)
    assert list(done) == ["j"] and done["j"].finish_reason is FinishReason.ABORT
    assert len(done["j"].choices) == 3 and not engine.requests


def test_prompt_logprobs_come_from_the_first_sequence_and_the_others_share_its_blocks(engine):
    """echo with logprobs and n=3: the prompt's log-probabilities are computed once (its first
    sequence needs every prompt position computed), the other two are forked from its prefill
    (they compute none of the prompt), and every choice reports the same prompt
    log-probabilities, those of the lone request, with their tokens' texts."""
    ids = _ids(engine, PROMPT)
    engine.add_request("alone", prompt_token_ids=ids, sampling=SamplingParams(
        max_tokens=3, temperature=0.0, echo=True, logprobs=2))
    alone = {f.request_id: f for f in _drain(engine)}["alone"]
    f = _job(engine, [ids], SamplingParams(max_tokens=3, temperature=0.0, echo=True, logprobs=2, n=3))
    assert [c.output.usage.cached_prompt_tokens for c in f.choices] == [0, len(ids), len(ids)]
    assert all(c.output.output_token_ids == alone.output_token_ids for c in f.choices)
    want = [None if lp is None else (lp.token_id, round(lp.logprob, 4), tuple(t for t, _ in lp.top))
            for lp in alone.prompt_logprobs]
    for c in f.choices:
        got = [None if lp is None else (lp.token_id, round(lp.logprob, 4), tuple(t for t, _ in lp.top))
               for lp in c.output.prompt_logprobs]
        assert got == want
        assert all(t in c.output.token_texts for lp in c.output.prompt_logprobs if lp is not None
                   for t in (lp.token_id, *(x for x, _ in lp.top)))
