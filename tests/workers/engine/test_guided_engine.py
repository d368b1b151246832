"""Guided decoding in the engine: the grammar's token masks applied on the device before sampling.

On the tiny random checkpoints (a trained byte-level BPE of 384 tokens): every guided output is in
its language (a choice, a regex, a JSON schema), greedy and sampled; the masks computed after the
step before is read back (async scheduling: that step read back while this one's forward runs)
give the same tokens as synchronous steps; unguided rows batched beside guided ones are untouched;
a spec the grammar engine refuses fails that request alone with invalid_grammar."""

from __future__ import annotations

import json
import re

import pytest

from schemas.job import ErrorCode, FinishReason
from schemas.sampling import SamplingParams
from tests.workers.engine.conftest import prompt_set, run_prompts
from workers.engine import EngineConfig, LLMEngine
from workers.engine.errors import InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fox"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


def _engine(llama_dir, async_scheduling: bool) -> LLMEngine:
    return LLMEngine(str(llama_dir), EngineConfig(device="cpu", dtype="float32", async_scheduling=async_scheduling))


def _valid(obj: dict) -> bool:
    return (set(obj) == {"name", "age", "pet"} and isinstance(obj["name"], str) and len(obj["name"]) <= 6
            and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120 and obj["pet"] in ("cat", "dog", "fox"))


GUIDES = [
    ({"kind": "choice", "choices": ["alpha", "beta", "gamma delta"]}, lambda t: t in ("alpha", "beta", "gamma delta")),
    ({"kind": "regex", "regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) is not None),
    ({"kind": "json_schema", "json_schema": SCHEMA}, lambda t: _valid(json.loads(t))),
]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guided_outputs_are_in_their_language(llama_dir, async_scheduling, temperature):
    eng = _engine(llama_dir, async_scheduling)
    prompts = prompt_set(6, seed=3)
    for k, (guide, ok) in enumerate(GUIDES):
        sp = SamplingParams(max_tokens=60, temperature=temperature, seed=11, guided=guide)
        outs = run_prompts(eng, prompts, sp, tag=f"g{k}")
        for o in outs:
            assert o.finish_reason is FinishReason.STOP, (guide["kind"], o.text)
            assert ok(o.text), (guide["kind"], o.text)


def test_async_masks_give_the_synchronous_tokens_and_leave_other_rows_alone(llama_dir):
    """Guided and unguided requests in the same steps: with async scheduling (each guided row's
    mask waits for the step before to be read back) the tokens equal synchronous stepping's, and
    the unguided rows equal their runs without any guided request beside them."""
    prompts = prompt_set(8, seed=5)
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    guided = SamplingParams(max_tokens=60, temperature=0.0, guided=GUIDES[2][0])

    deferred = []  # per guided step under async scheduling: did a guided row wait on the step before?

    def run(async_scheduling: bool, with_guided: bool) -> dict[str, list[int]]:
        eng = _engine(llama_dir, async_scheduling)
        masks = eng._guide_masks

        def watched(reqs, prev, result):
            if async_scheduling:
                deferred.append(any(r.num_pending for r in reqs if r.guide is not None))
            return masks(reqs, prev, result)

        eng._guide_masks = watched
        for i, p in enumerate(prompts):
            if i % 2 == 0:
                eng.add_request(f"p{i}", prompt_token_ids=p, sampling=plain)
            elif with_guided:
                eng.add_request(f"g{i}", prompt_token_ids=p, sampling=guided)
        got = {}
        while eng.has_unfinished():
            for f in eng.step().finished:
                got[f.request_id] = f.output_token_ids
        return got

    sync, asyn, alone = run(False, True), run(True, True), run(True, False)
    assert sum(deferred) >= 10  # the async path's masks really waited for pending tokens
    assert sync == asyn
    assert {k: v for k, v in asyn.items() if k.startswith("p")} == alone
    tok_texts = [k for k in asyn if k.startswith("g")]
    assert len(tok_texts) == 4


def test_a_refused_spec_fails_its_request_alone(llama_dir):
    eng = _engine(llama_dir, False)
    bad = SamplingParams(max_tokens=8, guided={"kind": "regex", "regex": "(unclosed"})
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("bad", prompt_token_ids=[5, 6, 7], sampling=bad)
    assert e.value.code is ErrorCode.INVALID_GRAMMAR
    assert "(unclosed" not in str(e.value)  # the spec is user data
    eng.add_request("good", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step().finished
    assert [o.request_id for o in outs] == ["good"] and len(outs[0].output_token_ids) == 4
    assert eng._num_guided == 0


def test_warm_guided_builds_the_compiler_off_the_step_loop(llama_dir):
    """warm_guided builds the grammar compiler in a thread; the first guided request uses it (one
    compiler, built once), and its output is what a cold engine gives."""
    spec = SamplingParams(max_tokens=40, temperature=0.0, guided=GUIDES[1][0])
    warm = _engine(llama_dir, False)
    warm.warm_guided()
    warm.warm_guided()  # a second call starts nothing
    assert warm._grammars_warming is not None
    warm._grammars_warming.join(60)
    built = warm._grammars
    assert built is not None and not isinstance(built, str)
    (w,) = run_prompts(warm, [[5, 6, 7]], spec, tag="w")
    assert warm._grammars is built
    (c,) = run_prompts(_engine(llama_dir, False), [[5, 6, 7]], spec, tag="c")
    assert w.output_token_ids == c.output_token_ids and GUIDES[1][1](w.text)
