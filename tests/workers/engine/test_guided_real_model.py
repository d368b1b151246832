"""Guided decoding on the real small model (SmolLM2-135M-Instruct, CPU): every output of the
grammar tests' specs (16 JSON schemas, json_object, a regex, a choice) parses and validates
against its schema, greedy and sampled (seeded), all of them batched in the same steps under
async scheduling (the masks wait for the step before; tests/workers/engine/test_guided_engine.py
compares that with synchronous steps).

A grammar bounds the language, not the length: a 135M model asked for an unbounded string or
integer may repeat a digit until max_tokens (seen: "sku": "1234567890123456789..."), which no
mask can prevent and which OpenAI reports the same way (finish_reason "length"). So the schemas
here bound their strings and numbers where they do not already (`bounded`), as a client that
wants complete output would; and the two specs that nothing can bound (json_object, a recursive
schema) must, when max_tokens cuts them, be a prefix their grammar accepts token by token."""

from __future__ import annotations

import pytest

from schemas.job import FinishReason
from schemas.sampling import SamplingParams
from tests.workers.engine.test_guided import all_specs, in_language
from workers.engine import EngineConfig, LLMEngine
from workers.engine.prompts import prompt_token_ids

pytestmark = pytest.mark.slow


def bounded(schema: object) -> object:
    """The schema with a length on every string and a range on every number that lack them."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v) for k, v in schema.items()}
    types = out.get("type")
    types = types if isinstance(types, list) else [types]
    if "string" in types and "maxLength" not in out and "format" not in out and "pattern" not in out:
        out["maxLength"] = 16
    if ("integer" in types or "number" in types) and "maximum" not in out and "exclusiveMaximum" not in out:
        out["maximum"] = 999
    if ("integer" in types or "number" in types) and "minimum" not in out and "exclusiveMinimum" not in out:
        out["minimum"] = -999
    if "number" in types:
        out["multipleOf"] = 0.5  # a bounded number of decimals
    return out


def test_every_output_is_in_its_language():
    eng = LLMEngine("smollm2-135m", EngineConfig(device="cpu", async_scheduling=True))
    specs = [(n, s if s.kind != "json_schema" else s.model_copy(update={"json_schema": bounded(s.json_schema)}))
             for n, s in all_specs()]
    asks = {}
    for name, spec in specs:
        what = "a JSON value" if spec.kind.startswith("json") else "an answer"
        ids = prompt_token_ids(eng.tokenizer, None, [("user", f"Give {what} for a record called {name}.")])
        for mode, sp in (("greedy", SamplingParams(max_tokens=120, temperature=0.0, guided=spec)),
                         ("sampled", SamplingParams(max_tokens=120, temperature=0.8, seed=5, guided=spec))):
            rid = f"{name}-{mode}"
            eng.add_request(rid, prompt_token_ids=ids, sampling=sp)
            asks[rid] = (name, spec)
    done = {}
    while eng.has_unfinished():
        for f in eng.step().finished:
            done[f.request_id] = f
    assert set(done) == set(asks)
    unbounded = {"json_object", "recursive"}
    bad = {}
    for rid, f in done.items():
        name, spec = asks[rid]
        if f.finish_reason is FinishReason.STOP:
            ok = in_language(name, spec, f.text)
        else:
            m = eng._grammar_compiler().matcher(spec)
            ok = (name in unbounded and f.finish_reason is FinishReason.LENGTH
                  and all(m.accept(t) for t in f.output_token_ids))
        if not ok:
            bad[rid] = (str(f.finish_reason), f.text[:60])
    assert not bad, sorted(bad)
    assert sum(f.finish_reason is FinishReason.STOP for f in done.values()) >= len(done) - 2 * len(unbounded)


def test_a_grammar_that_stops_short_fails_its_request_alone():
    """A regex whose lexer grows past llguidance's limits a few tokens in: its request fails with
    the grammar engine's reason (not a 'stop' with its text cut short), and a request beside it
    in the same steps ends as it would alone."""
    eng = LLMEngine("smollm2-135m", EngineConfig(device="cpu"))
    ids = eng.tokenizer.encode("Write some words:")
    eng.add_request("bad", prompt_token_ids=ids, sampling=SamplingParams(
        max_tokens=40, temperature=0.0, guided={"kind": "regex", "regex": "(([a-z]{1,50}){1,50}){1,50}"}))
    eng.add_request("ok", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=8, temperature=0.0))
    done = {}
    while eng.has_unfinished():
        for f in eng.step().finished:
            done[f.request_id] = f
    assert done["bad"].finish_reason is FinishReason.ERROR
    assert done["bad"].error.startswith("guided decoding failed:") and "[a-z]" not in done["bad"].error
    alone = LLMEngine("smollm2-135m", EngineConfig(device="cpu"))
    alone.add_request("ok", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=8, temperature=0.0))
    while alone.has_unfinished():
        for f in alone.step().finished:
            assert f.output_token_ids == done["ok"].output_token_ids and f.finish_reason is FinishReason.LENGTH
