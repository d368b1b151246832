"""logit_bias, repetition_penalty, frequency/presence penalties and min_tokens: greedy tokens equal
transformers' generate with its logits processors (SequenceBias, RepetitionPenalty,
MinNewTokensLength; the OpenAI penalties, which transformers lacks, as a processor written here
from OpenAI's formula), for requests batched with others, with async scheduling (the tables are
updated on the device before the host reads the step back) and without."""

from __future__ import annotations

import pytest
import torch

from schemas.job import ErrorCode
from schemas.sampling import SamplingParams
from tests.workers.engine.conftest import prompt_set
from workers.engine import EngineConfig, LLMEngine
from workers.engine.llm import LLM
from workers.engine.prompts import sampling_problem

MAX_NEW = 12
EOS = 1  # the tiny checkpoints' eos_token_id


class OpenAIPenalties:
    """logits[t] -= frequency * count(t in the output) + presence * (count > 0) (OpenAI's formula)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_generate(model, prompt: list[int], sp: SamplingParams) -> list[int]:
    from transformers import LogitsProcessorList

    ids = torch.tensor([prompt])
    kwargs: dict = {}
    if sp.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = sp.repetition_penalty
    if sp.logit_bias:
        kwargs["sequence_bias"] = {(t,): b for t, b in sp.logit_bias.items()}
    if sp.min_tokens:
        kwargs["min_new_tokens"] = sp.min_tokens
    procs = LogitsProcessorList()
    if sp.frequency_penalty or sp.presence_penalty:
        procs.append(OpenAIPenalties(len(prompt), sp.frequency_penalty, sp.presence_penalty))
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=sp.max_tokens, do_sample=False,
                           eos_token_id=None if sp.ignore_eos else EOS, pad_token_id=0, logits_processor=procs,
                           **kwargs)
    return g[0, len(prompt):].tolist()


CASES = [
    SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),  # none: a plain row beside the others
    SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, repetition_penalty=0.6),
    SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logit_bias={7: 4.0, 100: -100.0, 5: 1.5}),
    SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, frequency_penalty=1.2),
    SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, frequency_penalty=-0.5,
                   presence_penalty=0.7, repetition_penalty=1.3, logit_bias={9: 2.0}),
    # EOS is the argmax (biased) but min_tokens holds it off for 5 tokens; then it ends the output
    SamplingParams(max_tokens=MAX_NEW, temperature=0.0, min_tokens=5, logit_bias={EOS: 100.0}),
]


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_logits_processing_equals_transformers(llama_dir, hf_model, async_scheduling):
    prompts = prompt_set(len(CASES), seed=13, min_len=4, max_len=40)
    prompts[1] = prompts[1][:6] * 4  # a prompt that repeats itself: the repetition penalty bites
    want = [hf_generate(hf_model, p, sp) for p, sp in zip(prompts, CASES)]
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cpu", dtype="float32", async_scheduling=async_scheduling))
    got = LLM(engine=eng).generate(prompts, CASES)
    assert [o.output_token_ids for o in got] == want
    plain = want[0]
    assert any(w != hf_generate(hf_model, p, CASES[0]) for w, p in zip(want[1:], prompts[1:])), \
        "the processors changed nothing: the test would not see them"
    assert plain == hf_generate(hf_model, prompts[0], CASES[0])
    last = got[-1]
    assert len(last.output_token_ids) == 6 and last.output_token_ids[-1] == EOS and last.finish_reason == "stop"
    assert eng.runner.logits_processor._slots == {}  # every slot given back


def test_a_slot_outlives_its_growth_and_is_reused(llama_dir):
    """More penalised requests than the tables' first rows: they grow, and slots are reused."""
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cpu", dtype="float32", async_scheduling=True))
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, presence_penalty=1.0)
    prompts = prompt_set(20, seed=5, min_len=3, max_len=12)
    first = [o.output_token_ids for o in LLM(engine=eng).generate(prompts, sp)]
    assert eng.runner.logits_processor.counts.shape[0] >= 20
    again = [o.output_token_ids for o in LLM(engine=eng).generate(prompts, sp)]
    assert first == again


def test_stop_strings_and_stop_ids_wait_for_min_tokens(llama_dir):
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cpu", dtype="float32"))
    free = LLM(engine=eng).generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop_id = free.output_token_ids[1]
    early = LLM(engine=eng).generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                                 stop_token_ids=[stop_id]))[0]
    assert len(early.output_token_ids) <= 2
    held = LLM(engine=eng).generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                                stop_token_ids=[stop_id], min_tokens=4))[0]
    assert len(held.output_token_ids) >= 4 and stop_id not in held.output_token_ids[:4]


def test_the_sampling_fields_are_checked():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repetition_penalty": 0.0},
                {"logit_bias": {"7": 101}}, {"logit_bias": {"x": 1}}, {"logit_bias": {"7": True}},
                {"logit_bias": {"-1": 1}}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    sp = SamplingParams(logit_bias={"12": -100, 3: 2})  # JSON object keys are strings
    assert sp.logit_bias == {12: -100.0, 3: 2.0}
    assert SamplingParams.model_validate_json(sp.model_dump_json()) == sp  # through a queue message
    code, message = sampling_problem(SamplingParams(logit_bias={384: 1.0}), vocab_size=384)
    assert code is ErrorCode.INVALID_SAMPLING and "vocabulary" in message
    assert sampling_problem(SamplingParams(logit_bias={383: 1.0}), vocab_size=384) is None
    # built past the schema (model_construct): a negative id would index the logits from the end
    unchecked = SamplingParams.model_construct(logit_bias={-1: 1.0})
    assert sampling_problem(unchecked, vocab_size=None)[0] is ErrorCode.INVALID_SAMPLING
