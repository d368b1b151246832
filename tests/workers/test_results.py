"""A finished request as the job's result: text Postgres can store, in the text and the logprobs."""

from __future__ import annotations

from schemas.job import FinishReason, JobRequest, Usage
from workers.engine.outputs import FinishedRequest, TokenLogprob
from workers.engine.sequence import RequestTimes
from workers.results import finished_result


def test_nul_in_the_text_and_the_token_texts_becomes_a_replacement_character():
    """A byte-level token 0 decodes to NUL, which no Postgres text or jsonb value may hold (the
    store refuses the whole row: the job would fail though its output is fine)."""
    f = FinishedRequest(
        request_id="j", output_token_ids=[0, 65], text="\x00A", finish_reason=FinishReason.LENGTH, stop_reason=None,
        usage=Usage(prompt_tokens=2, completion_tokens=2), timings=RequestTimes(arrival=1.0, finished=2.0),
        logprobs=[TokenLogprob(0, -0.5, ((0, -0.5), (65, -1.0))), TokenLogprob(65, -0.1, ((65, -0.1),))],
        token_texts={0: "\x00", 65: "A"},
    )
    r = finished_result(JobRequest(id="j", prompt="hi"), f, submitted_at=1.0, admitted_at=1.0, admitted_mono=1.0,
                        paused_s=0.0, first_token_mono=1.5, worker="w", model="tiny")
    dumped = r.model_dump_json()
    assert "\\u0000" not in dumped and "\x00" not in dumped
    assert r.text == "\ufffdA"
    assert [lp.token for lp in r.logprobs] == ["\ufffd", "A"] and r.logprobs[0].top[0].token == "\ufffd"
    assert r.logprobs[0].top[1].token == "A" and r.logprobs[0].id == 0
