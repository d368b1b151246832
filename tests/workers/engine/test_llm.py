"""LLM.generate: results in prompt order; a refused prompt raises (nothing left running) or takes
its place in the results while the others run."""

from __future__ import annotations

import pytest

from schemas.job import ErrorCode
from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, InvalidRequestError, LLMEngine
from workers.engine.llm import LLM

SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine("tiny", EngineConfig(device="cpu", max_model_len=64))


def test_results_come_in_prompt_order_and_match_one_at_a_time(engine):
    llm = LLM(engine=engine)
    prompts = [[5, 6, 7], [9] * 20, [11, 12]]
    together = llm.generate(prompts, SP)
    alone = [llm.generate([p], SP)[0] for p in prompts]
    assert [o.output_token_ids for o in together] == [o.output_token_ids for o in alone]
    assert [o.usage.prompt_tokens for o in together] == [3, 20, 2]
    assert not engine.has_unfinished()


def test_a_refused_prompt_raises_and_leaves_nothing_running(engine):
    llm = LLM(engine=engine)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[5, 6], [7] * 100, [8, 9]], SP)  # 100 tokens > max_model_len 64
    assert e.value.code == ErrorCode.PROMPT_TOO_LONG
    while engine.has_unfinished():  # the first prompt was added, then aborted
        engine.step()
    assert llm.generate([[5, 6]], SP)[0].output_token_ids == llm.generate([[5, 6]], SP)[0].output_token_ids


def test_errors_return_puts_the_error_in_its_place(engine):
    llm = LLM(engine=engine)
    outs = llm.generate([[5, 6], [7] * 100, [8, 9]], [SP, SP, SP.model_copy(update={"max_tokens": 2})],
                        errors="return")
    assert isinstance(outs[1], InvalidRequestError) and outs[1].code == ErrorCode.PROMPT_TOO_LONG
    assert len(outs[0].output_token_ids) == 4 and len(outs[2].output_token_ids) == 2
    assert not engine.has_unfinished()
