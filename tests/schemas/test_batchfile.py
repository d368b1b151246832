"""Batch-file lines: plain and OpenAI Batch API input, output lines in both formats."""

from __future__ import annotations

import json
import random

import pytest

from schemas.batchfile import BatchLineError, ParsedLine, parse_line, parse_lines
from schemas.job import (
    ErrorCode,
    FinishReason,
    JobResult,
    JobStatus,
    JobTimings,
    Usage,
    job_id_in_batch,
    job_id_of_line,
    job_id_of_owner,
)
from schemas.limits import MAX_LINE_BYTES
from schemas.openai import LineFormat, format_output_line


def _ok(line: str | bytes, **kw) -> ParsedLine:
    parsed = parse_line(line, 1, **kw)
    assert isinstance(parsed, ParsedLine), parsed
    return parsed


def _err(line: str | bytes, **kw) -> BatchLineError:
    parsed = parse_line(line, 7, **kw)
    assert isinstance(parsed, BatchLineError), parsed
    return parsed


def test_plain_line_with_top_level_sampling_and_batch():
    p = _ok('{"id": "a1", "prompt": "hi", "max_tokens": 4, "temperature": 0, "priority": 2}')
    assert p.format is LineFormat.PLAIN
    assert p.job.id == "a1" and p.job.priority == 2
    assert p.job.sampling.max_tokens == 4 and p.job.sampling.greedy
    job = p.request("b1", owner="alice")
    assert job.id == job_id_in_batch("b1", "a1") and job.custom_id == "a1" and job.client_id == "a1"
    assert (job.batch_id, job.owner, job.line_no, job.line_format) == ("b1", "alice", 1, "plain")
    assert job.submitted_at is None and job.sampling.max_tokens == 4


def test_ids_are_scoped_to_the_batch():
    p = _ok('{"id": "a1", "prompt": "hi"}')
    assert p.request("b1").id != p.request("b2").id  # the same custom id in two batches: two jobs
    assert p.request("b1").id == p.request("b1").id  # the same line again: the same job (resume)
    assert job_id_in_batch("b1", "a1") != job_id_of_line("b1", 1) != job_id_of_owner(None, "a1")


def test_plain_line_nested_sampling_and_no_id():
    p = _ok('{"prompt": "hi", "sampling": {"seed": 5}}')
    job = p.request("b1", default_max_tokens=7)
    assert p.job.id is None and job.custom_id is None and job.id == job_id_of_line("b1", 1)
    assert job.sampling.seed == 5 and job.sampling.max_tokens == 7
    # a line's own max_tokens wins over the default
    assert _ok('{"prompt": "hi", "max_tokens": 3}').request("b", default_max_tokens=7).sampling.max_tokens == 3


def test_plain_line_sampling_given_twice():
    e = _err('{"id": "x", "prompt": "hi", "seed": 1, "sampling": {"seed": 2}}')
    assert (
        e.code is ErrorCode.INVALID_REQUEST and e.message.startswith("seed: given both") and e.job_id == "x"
    )


def test_openai_chat_line():
    line = json.dumps(
        {
            "custom_id": "req-1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                "max_completion_tokens": 8,
                "temperature": 0.5,
                "n": 1,
                "stream": False,
                "user": "u",
            },
        }
    )
    p = _ok(line)
    assert p.format is LineFormat.OPENAI_CHAT
    assert p.job.id == "req-1" and p.request("b").custom_id == "req-1"
    assert p.job.messages is not None and [m.role for m in p.job.messages] == ["system", "user"]
    assert p.job.sampling.max_tokens == 8 and p.job.sampling.temperature == 0.5
    assert p.job.metadata == {"model": "tiny"}


def test_openai_lines_carry_penalties_bias_and_min_tokens():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "presence_penalty": 0.5,
            "frequency_penalty": -1, "logit_bias": {"12": -100, "7": 3}, "repetition_penalty": 1.2, "min_tokens": 2}
    p = _ok(json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    sp = p.job.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_tokens) == (0.5, -1.0, 1.2, 2)
    assert sp.logit_bias == {12: -100.0, 7: 3.0}
    # defaults as OpenAI's: a zero penalty and an empty bias change nothing
    plain = _ok(json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                            "body": {"prompt": "x", "presence_penalty": 0, "logit_bias": {}}})).job.sampling
    assert not plain.adjusts_logits


def test_openai_completions_line_prompt_list_of_one():
    line = '{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": ["x"], "stop": "\\n"}}'
    p = _ok(line)
    assert p.format is LineFormat.OPENAI_COMPLETIONS and p.job.prompt == "x" and p.job.sampling.stop == ["\n"]


@pytest.mark.parametrize(
    ("line", "code", "message", "job_id"),
    [
        ("not json", ErrorCode.INVALID_REQUEST, "not valid JSON", None),
        ("[1, 2]", ErrorCode.INVALID_REQUEST, "must be a JSON object", None),
        # a line may not set what the server decides
        ('{"id": "s", "prompt": "a", "batch_id": "other"}', ErrorCode.INVALID_REQUEST, "batch_id: set by the server", "s"),
        ('{"id": "s", "prompt": "a", "submitted_at": 1}', ErrorCode.INVALID_REQUEST, "submitted_at: set by the server", "s"),
        # what used to raise out of the parser and stop the whole batch
        ("[" * 3000 + "]" * 3000, ErrorCode.TOO_LARGE, "nests deeper than", None),
        ('{"id": "d", "prompt": "a", "metadata": ' + '{"k": ' * 20 + "1" + "}" * 20 + "}", ErrorCode.TOO_LARGE, "nests deeper", "d"),
        ('{"id": "n", "prompt": "a", "max_tokens": ' + "9" * 4301 + "}", ErrorCode.INVALID_REQUEST, "not valid JSON", None),
        ('{"id": "n", "prompt": "a", "temperature": NaN}', ErrorCode.INVALID_REQUEST, "NaN is not a JSON number", None),
        ('{"id": "n", "prompt": "a", "top_p": Infinity}', ErrorCode.INVALID_REQUEST, "Infinity", None),
        ('{"id": "l", "prompt": "' + "x" * 1_000_001 + '"}', ErrorCode.TOO_LARGE, "prompt:", "l"),
        ('{"id": "l", "prompt": "a", "stop": [' + ",".join(['"s"'] * 17) + "]}", ErrorCode.TOO_LARGE, "stop", "l"),
        ('{"id": "l", "prompt": "a", "stop": ["' + "s" * 1001 + '"]}', ErrorCode.INVALID_SAMPLING, "stop", "l"),
        ('{"id": "l", "prompt": "a", "max_tokens": 2000000}', ErrorCode.INVALID_SAMPLING, "max_tokens", "l"),
        ('{"id": "l", "prompt": "a", "stop_token_ids": [-1]}', ErrorCode.INVALID_SAMPLING, "stop_token_ids", "l"),
        ('{"id": "' + "i" * 201 + '", "prompt": "a"}', ErrorCode.INVALID_REQUEST, "id:", None),
        (b'{"id": "u", "prompt": "\xff"}', ErrorCode.UNDECODABLE, "not valid UTF-8", None),
        ('{"id": "u", "prompt": "a\\udc80"}', ErrorCode.UNDECODABLE, "prompt:", "u"),
        (
            '{"id": "p", "prompt": "a", "max_tokens": 0}',
            ErrorCode.INVALID_SAMPLING,
            "max_tokens must be at least 1 (0 only with echo",
            "p",
        ),
        ('{"id": "p", "prompt": "a", "colour": 1}', ErrorCode.INVALID_REQUEST, "colour: unknown field", "p"),
        ('{"id": "p"}', ErrorCode.INVALID_REQUEST, "exactly one of 'prompt', 'prompts' or 'messages'", "p"),
        (
            '{"custom_id": "o", "method": "GET", "url": "/v1/completions", "body": {}}',
            ErrorCode.INVALID_REQUEST,
            "method: must be POST",
            "o",
        ),
        (
            '{"custom_id": "o", "method": "POST", "url": "/v1/embeddings", "body": {}}',
            ErrorCode.INVALID_REQUEST,
            "url: must be one of",
            "o",
        ),
        (
            '{"custom_id": "o", "method": "POST", "url": "/v1/chat/completions", "body": {"prompt": "x"}}',
            ErrorCode.INVALID_REQUEST,
            "body.prompt: unknown or unsupported",
            "o",
        ),
        (
            '{"custom_id": "o", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}',
            ErrorCode.INVALID_REQUEST,
            "body.messages: required",
            "o",
        ),
        (
            '{"custom_id": "o", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 3, "best_of": 2}}',
            ErrorCode.INVALID_SAMPLING,
            "best_of (2) must be at least n (3)",
            "o",
        ),
        (
            '{"custom_id": "o", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "temperature": -1}}',
            ErrorCode.INVALID_SAMPLING,
            "body.temperature: Input should be greater than or equal to 0",
            "o",
        ),
        (
            '{"custom_id": "o", "method": "POST", "url": "/v1/completions", "body": {"prompt": [1, "a"]}}',
            ErrorCode.INVALID_REQUEST,
            "body.prompt: strings, token ids and token-id lists cannot be mixed",
            "o",
        ),
    ],
)
def test_bad_lines(line, code, message, job_id):
    e = _err(line)
    assert e.line_no == 7
    assert e.code is code
    assert message in e.message
    assert e.job_id == job_id


def test_line_too_large_is_refused_before_parsing():
    e = _err(b'{"prompt": "' + b"x" * (MAX_LINE_BYTES + 1) + b'"}')
    assert e.code is ErrorCode.TOO_LARGE and f"limit is {MAX_LINE_BYTES}" in e.message


def test_bad_line_becomes_failed_result_in_a_row_of_its_own():
    e = _err('{"id": "p", "prompt": "a", "max_tokens": 0}')
    r = e.result("b")
    assert r.status is JobStatus.FAILED and r.error_code is ErrorCode.INVALID_SAMPLING
    assert r.error_message is not None and r.error_message.startswith("line 7: ")
    # keyed by its line, not its id: a valid line with the same id keeps its own job
    assert r.id == job_id_of_line("b", 7) != job_id_in_batch("b", "p") and r.custom_id == "p"
    assert _err("nope").result("b").custom_id is None


def test_parse_lines_skips_blanks_and_numbers_lines():
    out = list(parse_lines(['{"prompt": "a"}', "", "  ", '{"prompt": "b"}']))
    assert [p.line_no for p in out] == [1, 4]


def test_no_line_makes_the_parser_raise():
    # whatever a line holds, parse_line returns its result or its error
    rng = random.Random(7)
    pieces = ['{"', '"prompt"', ":", '"x"', "[", "]", "{", "}", ",", "1e999", "-0", "null", "\\u", '"\\ud800"',
              "9" * 50, "true", " ", "\n", "NaN", '"id"', '"custom_id"', '"body"', '"messages"']
    for n in range(2000):
        line = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        parsed = parse_line(line, n + 1)
        assert parsed is None or isinstance(parsed, (ParsedLine, BatchLineError))
    for raw in (b"\x00\x01", b"\xc3\x28", b"{\"prompt\": \"\xed\xa0\x80\"}"):
        assert isinstance(parse_line(raw, 1), BatchLineError)


def _result(status=JobStatus.SUCCEEDED, **kw) -> JobResult:
    return JobResult(
        id="r1",
        status=status,
        text="hello",
        finish_reason=FinishReason.LENGTH,
        usage=Usage(prompt_tokens=5, cached_prompt_tokens=2, completion_tokens=3),
        timings=JobTimings(finished_at=1700000000.5),
        model="tiny",
        **kw,
    )


def test_output_plain():
    out = json.loads(format_output_line(_result(custom_id="mine"), LineFormat.PLAIN))
    assert out["id"] == "mine" and out["job_id"] == "r1"
    assert out["text"] == "hello" and out["usage"]["cached_prompt_tokens"] == 2
    job_id = out.pop("job_id")
    back = {**out, "id": job_id, "custom_id": "mine"}
    assert JobResult.model_validate(back) == _result(custom_id="mine")


def test_output_openai_chat_and_completions():
    chat = json.loads(format_output_line(_result(custom_id="req-9"), LineFormat.OPENAI_CHAT))
    assert chat["custom_id"] == "req-9" and chat["error"] is None
    body = chat["response"]["body"]
    assert chat["response"]["status_code"] == 200
    assert body["object"] == "chat.completion" and body["created"] == 1700000000
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert body["firsttoken"]["job_id"] == "r1" and body["firsttoken"]["timings"]["finished_at"] == 1700000000.5
    comp = json.loads(format_output_line(_result(), LineFormat.OPENAI_COMPLETIONS))
    assert comp["response"]["body"]["choices"][0]["text"] == "hello"


def test_output_openai_failure():
    failed = JobResult.failure("r2", ErrorCode.PROMPT_TOO_LONG, "too long")
    out = json.loads(format_output_line(failed, LineFormat.OPENAI_CHAT))
    assert out["response"]["status_code"] == 400
    assert out["response"]["body"]["error"] == {
        "message": "too long",
        "type": "invalid_request_error",  # OpenAI's type for a 400; the code says which rule
        "code": "prompt_too_long",
        "param": None,
    }


def test_openai_logprobs_requests():
    def n(body: dict, url: str = "/v1/chat/completions"):
        line = json.dumps({"custom_id": "c", "method": "POST", "url": url, "body": body})
        return _ok(line).job.sampling.logprobs

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert n(chat) is None and n({**chat, "logprobs": False}) is None
    assert n({**chat, "logprobs": True}) == 0 and n({**chat, "logprobs": True, "top_logprobs": 5}) == 5
    comp = {"prompt": "hi"}
    assert n({**comp, "logprobs": 3}, "/v1/completions") == 3 and n({**comp, "logprobs": 0}, "/v1/completions") == 0
    assert n({**comp, "logprobs": None}, "/v1/completions") is None
    plain = _ok('{"id": "p", "prompt": "hi", "logprobs": 2}').job.sampling.logprobs
    assert plain == 2  # plain lines: the sampling field itself
    for body, url, msg in (
        ({**chat, "top_logprobs": 2}, "/v1/chat/completions", "needs logprobs: true"),
        ({**chat, "logprobs": 3}, "/v1/chat/completions", "true or false"),
        ({**chat, "logprobs": True, "top_logprobs": 21}, "/v1/chat/completions", "from 0 to 20"),
        ({**comp, "logprobs": True}, "/v1/completions", "from 0 to 20"),
        ({**comp, "logprobs": -1}, "/v1/completions", "from 0 to 20"),
        ({**comp, "top_logprobs": 1}, "/v1/completions", "chat completions only"),
    ):
        err = _err(json.dumps({"custom_id": "c", "method": "POST", "url": url, "body": body}))
        want = ErrorCode.INVALID_SAMPLING if "from 0 to" in msg else ErrorCode.INVALID_REQUEST
        assert err.code is want and msg in err.message, (body, err.message)


def test_output_logprobs_in_each_format():
    from schemas.job import TokenLogprobs, TopLogprob

    lps = [TokenLogprobs(token="hel", id=5, logprob=-0.1, top=[TopLogprob(token="hel", id=5, logprob=-0.1),
                                                                TopLogprob(token="he", id=9, logprob=-2.5)]),
           TokenLogprobs(token="lo", id=7, logprob=-0.7, top=[TopLogprob(token="lo", id=7, logprob=-0.7),
                                                               TopLogprob(token="é", id=3, logprob=-1.0)])]
    r = _result(custom_id="x", logprobs=lps)
    chat = json.loads(format_output_line(r, LineFormat.OPENAI_CHAT))["response"]["body"]["choices"][0]["logprobs"]
    assert chat["refusal"] is None and [c["token"] for c in chat["content"]] == ["hel", "lo"]
    assert chat["content"][1]["top_logprobs"][1] == {"token": "é", "logprob": -1.0, "bytes": [195, 169]}
    comp = json.loads(format_output_line(r, LineFormat.OPENAI_COMPLETIONS))["response"]["body"]["choices"][0]["logprobs"]
    assert comp == {"tokens": ["hel", "lo"], "token_logprobs": [-0.1, -0.7],
                    "top_logprobs": [{"hel": -0.1, "he": -2.5}, {"lo": -0.7, "é": -1.0}], "text_offset": [0, 3]}
    plain = json.loads(format_output_line(r, LineFormat.PLAIN))
    assert plain["logprobs"][1]["top"][1] == {"token": "é", "id": 3, "logprob": -1.0}
    assert "logprobs" not in json.loads(format_output_line(_result(), LineFormat.PLAIN))  # not asked: not there
    none = json.loads(format_output_line(_result(), LineFormat.OPENAI_CHAT))["response"]["body"]["choices"][0]
    assert none["logprobs"] is None


def test_prompt_logprobs_request_and_output():
    from schemas.job import TokenLogprobs, TopLogprob

    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "prompt_logprobs": 2}}
    assert _ok(json.dumps(line)).job.sampling.prompt_logprobs == 2
    assert _ok('{"id": "p", "prompt": "hi", "prompt_logprobs": 0}').job.sampling.prompt_logprobs == 0
    bad = {**line, "body": {"prompt": "hi", "prompt_logprobs": 99}}
    assert _err(json.dumps(bad)).code is ErrorCode.INVALID_SAMPLING
    plp = [None, TokenLogprobs(token="i", id=4, logprob=-3.0, top=[TopLogprob(token="!", id=2, logprob=-1.0)])]
    r = _result(custom_id="x", prompt_logprobs=plp)
    choice = json.loads(format_output_line(r, LineFormat.OPENAI_COMPLETIONS))["response"]["body"]["choices"][0]
    assert choice["prompt_logprobs"] == [None, {"token": "i", "logprob": -3.0,
                                                "top_logprobs": [{"token": "!", "logprob": -1.0}]}]
    assert json.loads(format_output_line(r, LineFormat.PLAIN))["prompt_logprobs"][0] is None
    assert "prompt_logprobs" not in json.loads(format_output_line(_result(), LineFormat.OPENAI_CHAT))["response"][
        "body"]["choices"][0]


def test_openai_error_types_follow_the_http_status():
    """Every error body carries the type OpenAI gives its HTTP status; the code keeps the rule."""
    from schemas.openai import HTTP_STATUS, error_body, error_type

    assert {s: error_type(s) for s in (400, 401, 403, 404, 409, 413, 422, 429, 499, 500, 503)} == {
        400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
        404: "not_found_error", 409: "invalid_request_error", 413: "invalid_request_error",
        422: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error",
        500: "server_error", 503: "server_error"}
    assert set(HTTP_STATUS) == set(ErrorCode)  # every error code has its status
    body = error_body(ErrorCode.ENGINE_ERROR, "boom", status=HTTP_STATUS[ErrorCode.ENGINE_ERROR], param="x")
    assert body == {"error": {"code": "engine_error", "type": "server_error", "message": "boom", "param": "x"}}


def test_echo_lines_and_outputs():
    from schemas.job import TokenLogprobs, TopLogprob
    from schemas.openai import echo_prompt
    from schemas.sampling import SamplingParams

    # echo with logprobs scores the prompt too; chat turns have no echo
    line = {"custom_id": "e", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "ab c", "echo": True, "logprobs": 1, "max_tokens": 2}}
    job = _ok(json.dumps(line)).job
    assert job.sampling.echo and job.sampling.prompt_logprobs == 1
    chat = {"custom_id": "e", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "echo": True}}
    assert isinstance(parse_line(json.dumps(chat), 1), BatchLineError)
    bad = parse_line(json.dumps({"messages": [{"role": "user", "content": "hi"}], "sampling": {"echo": True}}), 1)
    assert isinstance(bad, BatchLineError) and "echo" in bad.message
    assert echo_prompt("ab c", job.sampling, LineFormat.OPENAI_COMPLETIONS) == "ab c"
    assert echo_prompt("ab c", job.sampling, LineFormat.OPENAI_CHAT) is None
    assert echo_prompt("ab c", SamplingParams(), LineFormat.OPENAI_COMPLETIONS) is None

    def lp(tok: str, v: float) -> TokenLogprobs:
        return TokenLogprobs(token=tok, id=ord(tok[-1]), logprob=v, top=[TopLogprob(token=tok, id=ord(tok[-1]), logprob=v)])

    # prompt "ab c" as tokens "ab", " c": the first is predicted by nothing (its text only)
    r = _result(logprobs=[lp("!", -0.5), lp("!", -0.25)], prompt_logprobs=[None, lp(" c", -2.0)])
    r = r.model_copy(update={"text": "!!"})
    body = json.loads(format_output_line(r, LineFormat.OPENAI_COMPLETIONS, "ab c"))["response"]["body"]
    choice = body["choices"][0]
    assert choice["text"] == "ab c!!"
    lps = choice["logprobs"]
    assert lps["tokens"] == ["ab", " c", "!", "!"] and "".join(lps["tokens"]) == choice["text"]
    assert lps["token_logprobs"] == [None, -2.0, -0.5, -0.25]
    assert lps["top_logprobs"][0] is None and lps["top_logprobs"][1] == {" c": -2.0}
    assert lps["text_offset"] == [0, 2, 4, 5]
    assert "prompt_logprobs" not in choice  # folded into logprobs
    plain = json.loads(format_output_line(r, LineFormat.PLAIN, "ab c"))
    assert plain["text"] == "ab c!!"
    assert json.loads(format_output_line(r, LineFormat.OPENAI_COMPLETIONS))["response"]["body"]["choices"][0]["text"] == "!!"


@pytest.mark.parametrize(
    "prompt, fields",
    [
        ("a", {"prompt": "a", "prompts": None}),
        (["a"], {"prompt": "a", "prompts": None}),
        (["a", "b"], {"prompt": None, "prompts": ["a", "b"]}),
        ([1, 2, 3], {"prompt": None, "prompts": [[1, 2, 3]]}),
        ([[1, 2], [3]], {"prompt": None, "prompts": [[1, 2], [3]]}),
    ],
)
def test_openai_prompt_shapes(prompt, fields):
    line = {"custom_id": "p", "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, "n": 2}}
    job = _ok(json.dumps(line)).job
    assert {"prompt": job.prompt, "prompts": job.prompts} == fields and job.sampling.n == 2
    assert job.has_choices  # n=2


def test_choices_answer_in_index_order_each_with_its_echo():
    from schemas.job import Choice, TokenLogprobs

    lp = TokenLogprobs(token="!", id=33, logprob=-0.5)
    choices = [Choice(index=0, prompt_index=0, text="!", finish_reason=FinishReason.LENGTH, logprobs=[lp],
                      prompt_logprobs=[None], echo="a"),
               Choice(index=1, prompt_index=1, text="?", finish_reason=FinishReason.STOP, logprobs=[lp],
                      prompt_logprobs=[None], echo="bc")]
    r = _result(choices=choices).model_copy(update={"text": "!"})
    body = json.loads(format_output_line(r, LineFormat.OPENAI_COMPLETIONS))["response"]["body"]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "a!", "length"),
                                                                                      (1, "bc?", "stop")]
    assert body["choices"][1]["logprobs"]["tokens"] == ["bc", "!"]  # the echoed prompt's token first
    chat = json.loads(format_output_line(r.model_copy(update={"choices": [c.model_copy(update={"echo": None})
                                                                          for c in choices]}),
                                         LineFormat.OPENAI_CHAT))["response"]["body"]
    assert [c["message"]["content"] for c in chat["choices"]] == ["!", "?"]
    plain = json.loads(format_output_line(r, LineFormat.PLAIN))
    assert plain["text"] == "a!" and [c["text"] for c in plain["choices"]] == ["a!", "bc?"]
    assert "echo" not in plain["choices"][0] and plain["choices"][1]["prompt_index"] == 1
