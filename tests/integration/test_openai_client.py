"""The official `openai` client against a running `firsttoken api` (a subprocess on a real port)
on real Kafka, Postgres and Redis, with a GPU worker (tiny model on CPU) doing the jobs: models;
chat and text completions, plain and streamed (the streamed text equals the plain greedy text);
files and batches (upload, create, poll, list, download output and error files, cancel)."""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from pipeline_util import ROOT, in_process_worker, wait_until, worker_env

from pipeline.settings import Settings

pytestmark = pytest.mark.integration

KEY = "openai-test-key-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(kafka_bootstrap, postgres_url, redis_url, tmp_path_factory):
    yield from _stack("tiny", kafka_bootstrap, postgres_url, redis_url, tmp_path_factory)


@pytest.fixture(scope="module")
def real_stack(kafka_bootstrap, postgres_url, redis_url, tmp_path_factory):
    yield from _stack("smollm2-135m", kafka_bootstrap, postgres_url, redis_url, tmp_path_factory)


def _stack(model, kafka_bootstrap, postgres_url, redis_url, tmp_path_factory):
    from workers.engine import EngineConfig, LLMEngine

    tag = uuid.uuid4().hex[:10]
    s = Settings(
        kafka_bootstrap=kafka_bootstrap,
        jobs_topic=f"test.jobs.{tag}",
        dlq_topic=f"test.jobs.{tag}.dlq",
        consumer_group=f"test-group-{tag}",
        jobs_partitions=2,
        session_timeout_ms=20_000,
        database_url=postgres_url,
        redis_url=redis_url,
    )
    port = _free_port()
    env = worker_env(s, "api")
    env.update({"FIRSTTOKEN_REDIS_URL": redis_url, "FIRSTTOKEN_API_KEYS": f"tester:{KEY}", "FIRSTTOKEN_MODEL": model,
                "FIRSTTOKEN_CHECK_MODEL": model, "FIRSTTOKEN_API_MAX_LIVE_COMPLETIONS": "1"})
    log = (tmp_path_factory.mktemp("api") / "api.log").open("wb")
    api = subprocess.Popen([sys.executable, "-m", "firsttoken.cli", "api", "--port", str(port)], cwd=ROOT, env=env,
                           stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    worker = in_process_worker(s, LLMEngine(model, EngineConfig(device="cpu")), f"w-openai-{model}").start()
    try:
        def up() -> bool:
            assert api.poll() is None, "the API exited"
            try:
                return httpx.get(base + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 90, "the API to answer")
        yield base
    finally:
        worker.stop()
        api.terminate()
        api.wait(30)
        from pipeline.queue.kafka import delete_topics

        delete_topics(s, [s.jobs_topic, s.dlq_topic])


@pytest.fixture
def client(stack):
    import openai

    return openai.OpenAI(base_url=stack + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_models_and_auth(client, stack):
    import openai

    assert [m.id for m in client.models.list()] == ["tiny"]
    bad = openai.OpenAI(base_url=stack + "/v1", api_key="not-a-key-0000000000", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_chat_plain_and_streamed_give_the_same_text(client):
    messages = [{"role": "user", "content": "Say something about Kafka."}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.choices[0].finish_reason in ("length", "stop")
    assert 1 <= r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    ext = r.model_extra["firsttoken"]
    assert ext["job_id"] and ext["timings"]["ttft_ms"] is not None and ext["timings"]["queue_ms"] is not None

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: the same tokens, delivered piece by piece
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["firsttoken"]["timings"]["ttft_ms"] is not None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_a_second_completion_in_flight_is_rate_limited(client):
    """FIRSTTOKEN_API_MAX_LIVE_COMPLETIONS=1 for this server: while one completion streams, the
    next gets 429 rate_limit_exceeded (the client's RateLimitError); once it ended, there is room."""
    import openai

    first = client.completions.create(model="tiny", prompt="A long story:", max_tokens=300, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
    chunks = iter(first)
    next(chunks)  # the stream has begun: the completion holds its slot
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
    assert err.value.code == "rate_limit_exceeded" and err.value.response.headers["retry-after"] == "1"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(text) > 0

    def room() -> bool:
        try:
            return client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0).usage.completion_tokens > 0
        except openai.RateLimitError:
            return False

    wait_until(room, 10, "the finished stream to give its slot back")


def test_logprobs_plain_and_streamed(client):
    """Log-probabilities through the whole pipeline, as the openai client reads them: text
    completions (logprobs=N), chat (logprobs + top_logprobs), and streamed (all of them with the
    last chunk, so the chunks joined hold the list)."""
    comp = client.completions.create(model="tiny", prompt="Kafka", max_tokens=6, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == comp.usage.completion_tokens == 6
    # each token's text at its offset (the tiny model's byte tokens may be partial UTF-8: no join test)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for val, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and len(top) <= 3 and max(top.values()) == pytest.approx(val)  # greedy: the likeliest
    messages = [{"role": "user", "content": "Say something about Kafka."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert bytes(content[0].bytes).decode("utf-8", "replace") == content[0].token
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None  # not asked: none
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    # the same tokens; the log-probabilities equal to fp32 rounding: the first request computed the
    # prompt, the later ones find its full blocks in the prefix cache (another order of the same
    # sums: 5e-7 apart when this test runs first, equal when an earlier test cached the prompt)
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], rel=1e-5, abs=1e-5)
    # scoring a text: vLLM's prompt_logprobs extension, a log-probability per prompt token after the first
    scored = client.completions.create(model="tiny", prompt="Kafka partitions", max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    plp = scored.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == scored.usage.prompt_tokens and plp[0] is None
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in plp[1:])


def test_text_completions_and_errors(client):
    import openai

    r = client.completions.create(model="tiny", prompt="The first token", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and 1 <= r.usage.completion_tokens <= 6
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="The first token", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:  # checked at submission against the model's context
        client.completions.create(model="tiny", prompt="x" * 3000, max_tokens=4)
    assert e.value.code == "prompt_too_long"
    with pytest.raises(openai.BadRequestError):  # best_of is text completions' only
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                       extra_body={"best_of": 3})


def test_a_model_not_served_here_is_model_not_found(client):
    import openai

    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found"
    for model in ("gpt-4o", "smollm2-135m"):  # another model than the one served (tiny here)
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.status_code == 404 and e.value.code == "model_not_found" and "'tiny'" in e.value.message and model not in e.value.message
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model=model, prompt="hi", max_tokens=2)
        assert e.value.code == "model_not_found"
    # a batch whose line names another model fails its validation (as OpenAI's does): nothing runs
    lines = [{"custom_id": f"m{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": "hi", "max_tokens": 2}} for i, model in enumerate(["tiny", "gpt-4o"])]
    f = client.files.create(file=("m.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())),
                            purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert b.status == "failed" and b.errors is not None and b.request_counts.total == 0
    assert [(x.code, x.line, x.param) for x in b.errors.data] == [("model_not_found", 2, "body.model")]


def test_files_and_batches(client):
    import openai

    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4,
                  "temperature": 0}}
        for i in range(5)
    ]
    lines.insert(2, {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}})
    lines.append({"custom_id": "req-0", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "dup"}]}})
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
    assert f.bytes == len(data) and f.purpose == "batch"
    assert client.files.content(f.id).content == data
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"run": "test"})
    assert b.status in ("in_progress", "completed") and b.input_file_id == f.id and b.metadata == {"run": "test"}
    deadline = time.monotonic() + 120
    while b.status != "completed":
        assert time.monotonic() < deadline, b
        time.sleep(0.3)
        b = client.batches.retrieve(b.id)
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (7, 5, 2)
    assert b.completed_at is not None and b.output_file_id and b.error_file_id
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(5)]  # input order
    assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["object"] == "chat.completion"
               for x in out)
    errors = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert [(x["custom_id"], x["response"]["body"]["error"]["code"]) for x in errors] == [
        ("bad", "invalid_sampling"), ("req-0", "duplicate_id")]
    assert b.id in [x.id for x in client.batches.list(limit=100)]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    # the output and error files' real sizes, as files.retrieve gives them
    for fid in (b.output_file_id, b.error_file_id):
        assert client.files.retrieve(fid).bytes == len(client.files.content(fid).content) > 0
    # files.list pages through the caller's files (newest first), files.delete removes one
    f_extra = client.files.create(file=("extra.jsonl", io.BytesIO(data)), purpose="batch")
    listed = [x.id for x in client.files.list()]
    assert listed.index(f_extra.id) < listed.index(f.id)
    first = client.files.list(limit=1)
    assert [x.id for x in first.data] == [listed[0]] and first.has_more
    assert [x.id for x in client.files.list(limit=1, after=listed[0]).data] == [listed[1]]
    gone = client.files.delete(f_extra.id)
    assert gone.deleted and gone.id == f_extra.id and f_extra.id not in [x.id for x in client.files.list()]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f_extra.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(f_extra.id)
    with pytest.raises(openai.BadRequestError):
        client.files.delete(b.output_file_id)  # made from the batch's rows

    # cancel: long jobs, cancelled at once
    long = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"long {i}", "max_tokens": 1500, "ignore_eos": True}} for i in range(40)]
    f2 = client.files.create(file=("long.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in long).encode())),
                             purpose="batch")
    b2 = client.batches.create(input_file_id=f2.id, endpoint="/v1/completions", completion_window="24h")
    c = client.batches.cancel(b2.id)
    assert c.status == "cancelled" and c.cancelled_at is not None and c.request_counts.failed > 0


def test_the_real_model_answers_through_the_whole_pipeline(real_stack):
    """SmolLM2-135M-Instruct behind the API, the queue and a worker: a real answer, in its chat
    template, streamed and plain alike."""
    import openai

    client = openai.OpenAI(base_url=real_stack + "/v1", api_key=KEY, max_retries=0, timeout=180)
    assert [m.id for m in client.models.list()] == ["smollm2-135m"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24, temperature=0)
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=24, temperature=0, stream=True) if c.choices)
    assert streamed == answer
    # the chat template's own tokens, no second BOS: the prompt is exactly the ChatML rendering
    from workers.engine.prompts import load_tokenizer, prompt_token_ids

    tok = load_tokenizer("smollm2-135m")
    assert r.usage.prompt_tokens == len(prompt_token_ids(tok, None, [("user", messages[0]["content"])]))


def test_penalties_bias_and_min_tokens_reach_the_real_model(real_stack):
    """presence/frequency penalties and logit_bias (OpenAI's fields), repetition_penalty and
    min_tokens (vLLM's, through extra_body) from the openai client to SmolLM2 behind the queue:
    a banned answer is not given, min_tokens holds off the end, and the served tokens are the
    in-process engine's for the same parameters."""
    import openai

    from schemas.sampling import SamplingParams
    from workers.engine import EngineConfig, LLMEngine
    from workers.engine.llm import LLM
    from workers.engine.prompts import load_tokenizer, prompt_token_ids

    client = openai.OpenAI(base_url=real_stack + "/v1", api_key=KEY, max_retries=0, timeout=180)
    tok = load_tokenizer("smollm2-135m")
    question = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
    plain = client.chat.completions.create(model="smollm2-135m", messages=question, max_tokens=24, temperature=0)
    assert "Paris" in plain.choices[0].message.content and plain.choices[0].finish_reason == "stop"
    short = plain.usage.completion_tokens
    # ban every token whose text holds "Paris" (with or without its leading space)
    banned = {t: -100 for t in range(tok.vocab_size) if "Paris" in tok.decode([t])}
    assert banned
    r = client.chat.completions.create(model="smollm2-135m", messages=question, max_tokens=24, temperature=0,
                                       logit_bias={str(t): v for t, v in banned.items()})
    assert r.choices[0].message.content != plain.choices[0].message.content
    held = client.chat.completions.create(model="smollm2-135m", messages=question, max_tokens=40, temperature=0,
                                          extra_body={"min_tokens": short + 10})
    assert held.usage.completion_tokens >= short + 10
    # the penalties: the same tokens as the engine in this process gives
    story = [{"role": "user", "content": "Write the word 'cat' twenty times."}]
    asks = {"presence_penalty": 0.8, "frequency_penalty": 1.1}
    extra = {"repetition_penalty": 1.3}
    served = client.chat.completions.create(model="smollm2-135m", messages=story, max_tokens=30, temperature=0,
                                            **asks, extra_body=extra).choices[0].message.content
    unpenalised = client.chat.completions.create(model="smollm2-135m", messages=story, max_tokens=30,
                                                 temperature=0).choices[0].message.content
    assert served != unpenalised
    llm = LLM(engine=LLMEngine("smollm2-135m", EngineConfig(device="cpu")))
    ids = prompt_token_ids(tok, None, [("user", story[0]["content"])])
    local = llm.generate([ids], SamplingParams(max_tokens=30, temperature=0.0, **asks, **extra))[0]
    assert served == local.text
    q_ids = prompt_token_ids(tok, None, [("user", question[0]["content"])])
    local_banned = llm.generate([q_ids], SamplingParams(max_tokens=24, temperature=0.0, logit_bias=banned))[0]
    assert r.choices[0].message.content == local_banned.text
    assert not set(local_banned.output_token_ids) & set(banned)


def test_echo_live_streamed_and_in_batch_files(client):
    """Text completions with echo: the text starts with the prompt, plain and streamed alike; with
    logprobs the prompt's tokens come first (the first with a null log-probability, as OpenAI's);
    a batch file's echo lines answer the same way."""
    prompt = "Kafka brokers"
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == echoed.choices[0].text
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                       logprobs=2)
    lp = scored.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == scored.usage.prompt_tokens + scored.usage.completion_tokens
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # in a batch file
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"echo {i}", "max_tokens": 3, "temperature": 0, "echo": i % 2 == 0}}
             for i in range(4)]
    out = {k: x["response"]["body"]["choices"][0]["text"]
           for k, x in _batch_output(client, "/v1/completions", lines).items()}
    for i in range(4):
        assert out[f"e{i}"].startswith(f"echo {i}") == (i % 2 == 0), out


def _batch_output(client, endpoint: str, lines: list[dict]) -> dict[str, dict]:
    """Run `lines` as an OpenAI batch; each output line by its custom id."""
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
    deadline = time.monotonic() + 180
    while b.status != "completed":
        assert time.monotonic() < deadline, b
        time.sleep(0.3)
        b = client.batches.retrieve(b.id)
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    if b.error_file_id:
        out += [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    return {x["custom_id"]: x for x in out}


def _streamed_choices(stream) -> tuple[dict[int, str], dict[int, str]]:
    """The texts (chat contents) and finish reasons of a stream's chunks, joined per choice index."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                assert c.index not in finish, "one finish per choice"
                finish[c.index] = c.finish_reason
    return texts, finish


def test_prompt_lists_and_token_ids_live_streamed_and_in_batch_files(client):
    """/v1/completions takes OpenAI's four prompt shapes (a string, strings, token ids, token-id
    lists): each prompt its own choices, prompt-major, plain, streamed and in a batch file; the
    same prompt as text or as its token ids answers the same; max_tokens 0 with echo gives the
    prompt alone (with its log-probabilities when asked); bad token ids and empty prompts are 400s
    live and failed lines in a batch."""
    import openai

    from workers.engine.prompts import load_tokenizer

    tok = load_tokenizer("tiny")
    prompts = ["Kafka brokers", "Postgres rows", "Redis"]
    ids = [tok.encode(p) for p in prompts]
    single = [client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0, extra_body={
        "ignore_eos": True}).choices[0].text for p in prompts]
    listed = client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in listed.choices] == [0, 1, 2] and [c.text for c in listed.choices] == single
    assert listed.usage.prompt_tokens == sum(len(x) for x in ids) and listed.usage.completion_tokens == 12
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert [c.text for c in by_ids.choices] == single
    one = client.completions.create(model="tiny", prompt=ids[1], max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in one.choices] == [single[1]]
    # n per prompt, prompt-major
    two_each = client.completions.create(model="tiny", prompt=prompts[:2], n=2, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert [(c.index, c.text) for c in two_each.choices] == [(0, single[0]), (1, single[0]), (2, single[1]),
                                                             (3, single[1])]
    # streamed: each choice's chunks carry its index, one finish each
    texts, finish = _streamed_choices(client.completions.create(
        model="tiny", prompt=[ids[0], ids[2]], max_tokens=4, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert texts == {0: single[0], 1: single[2]} and finish == {0: "length", 1: "length"}
    # echo of token ids: their text; streamed too (that choice's text comes whole with the result)
    for shape in (ids[:2], prompts[:2]):
        echoed = client.completions.create(model="tiny", prompt=shape, max_tokens=4, temperature=0,
                                           echo=True, extra_body={"ignore_eos": True})
        assert [c.text for c in echoed.choices] == [prompts[0] + single[0], prompts[1] + single[1]]
        texts, _ = _streamed_choices(client.completions.create(
            model="tiny", prompt=shape, max_tokens=4, temperature=0, echo=True, stream=True,
            extra_body={"ignore_eos": True}))
        assert texts == {0: prompts[0] + single[0], 1: prompts[1] + single[1]}
    # max_tokens 0 with echo: the prompt alone, scored when logprobs are asked
    bare = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=0, echo=True)
    assert bare.choices[0].text == prompts[0] and bare.usage.completion_tokens == 0
    assert bare.choices[0].finish_reason == "length"
    scored = client.completions.create(model="tiny", prompt=ids[:2], max_tokens=0, echo=True, logprobs=1)
    for c, p, x in zip(scored.choices, prompts, ids):
        assert c.text == p and len(c.logprobs.tokens) == len(x) and c.logprobs.token_logprobs[0] is None
        assert all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    # refused: 400 invalid_request_error with its code, nothing queued
    for bad, needle in (([[5, 6], [7, 99999]], "prompt 1: token id 99999 is outside the vocabulary (512 tokens"),
                        ([], "empty list"), ([[]], "empty token list"), ([1, "a"], "cannot be mixed"),
                        ("", "empty"), ([-3], "out of range")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=bad, max_tokens=2)
        assert e.value.code == "invalid_request" and needle in e.value.message, (bad, e.value.message)
        assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=0)  # 0: with echo only
    assert e.value.code == "invalid_sampling"
    # in a batch file: the same answers, a bad line failed with its code
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/completions",
              "body": {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra}}
             for name, prompt, extra in (("list", prompts, {}), ("ids", ids[0], {}), ("idlists", ids[1:], {"n": 2}),
                                         ("bad", [[1, 2], [600]], {}), ("empty", [[]], {}),
                                         ("bare", ids[0], {"max_tokens": 0, "echo": True}))]
    out = _batch_output(client, "/v1/completions", lines)
    assert [c["text"] for c in out["list"]["response"]["body"]["choices"]] == single
    assert [c["text"] for c in out["ids"]["response"]["body"]["choices"]] == [single[0]]
    got = out["idlists"]["response"]["body"]["choices"]
    assert [(c["index"], c["text"]) for c in got] == [(0, single[1]), (1, single[1]), (2, single[2]), (3, single[2])]
    assert [c["text"] for c in out["bare"]["response"]["body"]["choices"]] == [prompts[0]]
    for name, needle in (("bad", "token id 600 is outside the vocabulary"), ("empty", "empty token list")):
        line = out[name]
        err = line["error"] or line["response"]["body"]["error"]
        assert err["code"] == "invalid_request" and needle in err["message"], line


def test_n_and_best_of_on_the_real_model(real_stack):
    """n (chat and text) and best_of (text) on SmolLM2 through the whole stack: one job, n choices;
    seeded, the choices differ from each other and repeat run to run (live, streamed with each
    chunk's index, and in a batch file); best_of keeps the n of its sequences with the highest
    cumulative log-probability; the stored row keeps every choice; greedy choices are the n=1 text."""
    import openai

    client = openai.OpenAI(base_url=real_stack + "/v1", api_key=KEY, max_retries=0, timeout=180)
    story = [{"role": "user", "content": "Tell me a very short story about a cat."}]
    ask = dict(model="smollm2-135m", messages=story, max_tokens=12, temperature=1.0, seed=7)
    r = client.chat.completions.create(n=3, **ask)
    contents = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(contents)) == 3, contents
    assert [c.message.content for c in client.chat.completions.create(n=3, **ask).choices] == contents
    assert client.chat.completions.create(**ask).choices[0].message.content == contents[0]  # choice 0: the seed's
    scored = client.chat.completions.create(n=3, logprobs=True, **ask)  # (logprobs never change the samples)
    assert [c.message.content for c in scored.choices] == contents
    assert scored.usage.completion_tokens == sum(len(c.logprobs.content) for c in scored.choices)
    assert scored.usage.prompt_tokens == r.usage.prompt_tokens  # the prompt once, not once per choice
    texts, finish = _streamed_choices(client.chat.completions.create(n=3, stream=True, **ask))
    assert texts == dict(enumerate(contents)) and set(finish) == {0, 1, 2}
    # the stored row keeps them all
    job = httpx.get(f"{real_stack}/v1/jobs/{r.model_extra['firsttoken']['job_id']}",
                    headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert [c["text"] for c in job["choices"]] == contents and job["text"] == contents[0]
    # greedy: every choice is the n=1 answer
    greedy = dict(model="smollm2-135m", messages=story, max_tokens=12, temperature=0)
    one = client.chat.completions.create(**greedy).choices[0].message.content
    assert [c.message.content for c in client.chat.completions.create(n=2, **greedy).choices] == [one, one]
    # best_of: the two likeliest of the four sequences n=4 samples with the same seed
    text = dict(model="smollm2-135m", prompt="The cat sat on the", max_tokens=8, temperature=1.0, seed=11)
    four = client.completions.create(n=4, logprobs=0, **text)

    def cumulative(c) -> float:
        return sum(c.logprobs.token_logprobs)

    ranked = sorted(four.choices, key=cumulative, reverse=True)
    best = client.completions.create(n=2, best_of=4, logprobs=0, **text)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert cumulative(best.choices[0]) >= cumulative(best.choices[1])
    assert best.usage.completion_tokens == four.usage.completion_tokens  # all four were generated
    unasked = client.completions.create(n=2, best_of=4, **text)
    assert [c.text for c in unasked.choices] == [c.text for c in best.choices]
    assert all(c.logprobs is None for c in unasked.choices)  # ranked by them, not returned
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(n=1, best_of=2, stream=True, **text)
    assert "best_of" in e.value.message and e.value.body["type"] == "invalid_request_error"
    # a batch file: the same seeded choices as live
    out = _batch_output(client, "/v1/chat/completions", [
        {"custom_id": "n3", "method": "POST", "url": "/v1/chat/completions",
         "body": ask | {"n": 3}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
         "body": ask | {"n": 3, "best_of": 4}}])
    assert [c["message"]["content"] for c in out["n3"]["response"]["body"]["choices"]] == contents
    err = out["bad"]["response"]["body"]["error"]
    assert err["code"] == "invalid_request" and "best_of" in err["message"]


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
         {"type": "function", "function": {"name": "now", "description": "The time now"}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "now": {"type": "object", "properties": {}, "additionalProperties": False}}


def _valid_calls(calls) -> list[tuple[str, dict]]:
    """Each call's (name, arguments), having checked its id, type, and arguments against its schema."""
    import jsonschema

    out = []
    for c in calls:
        c = c if isinstance(c, dict) else c.model_dump()
        assert c["id"].startswith("call_") and c["type"] == "function", c
        args = json.loads(c["function"]["arguments"])
        jsonschema.validate(args, SCHEMAS[c["function"]["name"]])
        out.append((c["function"]["name"], args))
    return out


def _streamed_tool_calls(stream) -> tuple[list[dict], str | None, str | None, int]:
    """A chat stream's tool calls joined from their delta chunks (the header with id, type and name
    first, then argument pieces), its content, its finish reason, and how many argument pieces came."""
    calls: dict[int, dict] = {}
    content, finish, pieces = None, None, 0
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.content:
                content = (content or "") + c.delta.content
            for d in c.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name and d.function.arguments == "", d
                    calls[d.index] = {"id": d.id, "type": "function",
                                      "function": {"name": d.function.name, "arguments": ""}}
                else:
                    assert d.id is None and d.function.name is None
                    calls[d.index]["function"]["arguments"] += d.function.arguments
                    pieces += 1
            if c.finish_reason:
                assert finish is None
                finish = c.finish_reason
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)], content, finish, pieces


def test_tools_on_the_real_model_live_streamed_and_in_batch_files(real_stack):
    """tools / tool_choice on SmolLM2 through the whole stack with the openai client: a named
    function and required hold the output to calls whose arguments validate against the function's
    schema (greedy and sampled, n > 1), with finish_reason tool_calls; streamed, the tool-call
    deltas join into the plain answer; a conversation with an assistant turn's tool calls and a
    tool turn is rendered and answered; auto and none answer (SmolLM2's template ignores tools:
    a plain message unless it writes a call); bad tools are 400 invalid_request_error live and a
    failed line in a batch file, whose other lines answer as live."""
    import openai

    from workers.engine.prompts import load_tokenizer, prompt_token_ids

    client = openai.OpenAI(base_url=real_stack + "/v1", api_key=KEY, max_retries=0, timeout=180)
    ask = dict(model="smollm2-135m", max_tokens=60, temperature=0, tools=TOOLS)
    # one question for each function that takes arguments (each question costs ~6 s of the suite, live and batched)
    questions = ["What is the weather in Paris?", "Add 2 and 40."]
    named = {"type": "function", "function": {"name": "get_weather"}}
    live: dict[tuple[str, str], object] = {}
    for q in questions:
        messages = [{"role": "user", "content": q}]
        r = client.chat.completions.create(messages=messages, tool_choice=named, **ask)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert [n for n, _ in _valid_calls(c.message.tool_calls)] == ["get_weather"]
        live[(q, "named")] = c.message
        if q == questions[0]:  # the stored row: the raw text, and the same calls read out of it
            job = httpx.get(f"{real_stack}/v1/jobs/{r.model_extra['firsttoken']['job_id']}",
                            headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
            assert job["tool_calls"] == [t.model_dump() for t in c.message.tool_calls]
            assert json.loads(job["text"]) == json.loads(c.message.tool_calls[0].function.arguments)
        r = client.chat.completions.create(messages=messages, tool_choice="required", **ask)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls, c
        assert {n for n, _ in _valid_calls(c.message.tool_calls)} <= set(SCHEMAS)
        live[(q, "required")] = c.message
    # sampled, several choices: every one a valid call; one call only without parallel calls
    r = client.chat.completions.create(messages=[{"role": "user", "content": questions[1]}], tool_choice="required",
                                       n=3, seed=5, **(ask | {"temperature": 1.0, "max_tokens": 300}))
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and _valid_calls(c.message.tool_calls)
    # streamed, several choices: each index's deltas join into that choice's calls
    chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": questions[1]}],
                                                 tool_choice="required", n=3, seed=5, stream=True,
                                                 **(ask | {"temperature": 1.0, "max_tokens": 300})))
    for c in r.choices:
        mine = [ch.model_copy(update={"choices": [x for x in ch.choices if x.index == c.index]}) for ch in chunks]
        calls, content, finish, _ = _streamed_tool_calls(iter(mine))
        assert finish == "tool_calls" and content is None
        assert [x["function"] for x in calls] == [t.function.model_dump() for t in c.message.tool_calls]
    one = client.chat.completions.create(messages=[{"role": "user", "content": questions[0]}], tool_choice="required",
                                         parallel_tool_calls=False, **ask).choices[0]
    assert len(_valid_calls(one.message.tool_calls)) == 1
    # streamed: the deltas join into the plain answer
    for q, mode in [(questions[0], "named"), (questions[1], "required")]:
        calls, content, finish, pieces = _streamed_tool_calls(client.chat.completions.create(
            messages=[{"role": "user", "content": q}], tool_choice=named if mode == "named" else "required",
            stream=True, **ask))
        assert finish == "tool_calls" and content is None and pieces > 3  # the arguments as they were written
        # the plain answer's calls, argument text for argument text (the ids are each job's own)
        assert [c["function"] for c in calls] == [t.function.model_dump() for t in live[(q, mode)].tool_calls]
        assert all(c["id"].startswith("call_") for c in calls)
    # the conversation goes on: the call and its result rendered, a normal answer
    call = live[(questions[0], "named")].tool_calls[0]
    conversation = [{"role": "user", "content": questions[0]},
                    {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    for choice in ("none", "auto"):
        r = client.chat.completions.create(messages=conversation, tool_choice=choice, **ask)
        c = r.choices[0]
        if c.message.tool_calls:  # auto: SmolLM2 wrote a call of its own
            assert choice == "auto" and _valid_calls(c.message.tool_calls) and c.finish_reason == "tool_calls"
        else:
            assert isinstance(c.message.content, str) and c.finish_reason in ("stop", "length")
    tok = load_tokenizer("smollm2-135m")
    turns = [{"role": "user", "content": questions[0]},
             {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": conversation[2]["content"]}]
    assert r.usage.prompt_tokens == len(prompt_token_ids(tok, None, turns, TOOLS))
    text = tok.decode(prompt_token_ids(tok, None, turns, TOOLS), skip_special_tokens=False)
    assert "<tool_call>" in text and '"sky": "clear"' in text  # what it called and what came back
    # bad tools: 400 invalid_request_error
    msgs = [{"role": "user", "content": "hi"}]
    for bad, needle in [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}), "fly"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "name"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]), "object"),
        (dict(tool_choice="required"), "only with tools"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=5, **bad)
        assert e.value.body["type"] == "invalid_request_error" and needle in e.value.message, e.value.message
    # a batch file: the same calls as live, and a failed line
    lines = [{"custom_id": f"{mode}-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "smollm2-135m", "messages": [{"role": "user", "content": q}], "max_tokens": 60,
                       "temperature": 0, "tools": TOOLS, "tool_choice": named if mode == "named" else "required"}}
             for i, q in enumerate(questions) for mode in ("named", "required")]
    lines.append({"custom_id": "unknown", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": msgs, "tools": TOOLS, "tool_choice": {"type": "function",
                                                                             "function": {"name": "fly"}}}})
    out = _batch_output(client, "/v1/chat/completions", lines)
    for i, q in enumerate(questions):
        for mode in ("named", "required"):
            body = out[f"{mode}-{i}"]["response"]["body"]
            choice = body["choices"][0]
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
            want = live[(q, mode)].tool_calls
            # the same calls (ids are the job's own)
            assert _valid_calls(choice["message"]["tool_calls"]) == _valid_calls(want)
    err = out["unknown"]["response"]["body"]["error"]
    assert out["unknown"]["response"]["status_code"] == 400
    assert err["code"] == "invalid_request" and "fly" in err["message"]


def test_auto_reads_the_calls_the_real_model_writes(real_stack):
    """tool_choice auto on SmolLM2 (its template ignores tools, so guided decoding makes it write):
    a Hermes `<tool_call>` block after some content is read into tool_calls with that content,
    plain and streamed alike (the content streams first, the call after); a bare JSON call
    (response_format) is a call too; an answer with no call stays a message; with none, the same
    text is never read."""
    import openai

    client = openai.OpenAI(base_url=real_stack + "/v1", api_key=KEY, max_retries=0, timeout=180)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = dict(model="smollm2-135m", messages=messages, max_tokens=80, temperature=0, tools=TOOLS)
    hermes = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
              r'\{"city": "(Paris|Oslo)", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')
    r = client.chat.completions.create(tool_choice="auto", extra_body={"guided_regex": hermes}, **ask)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check.", c
    ((name, args),) = _valid_calls(c.message.tool_calls)
    assert name == "get_weather" and args["city"] in ("Paris", "Oslo")
    chunks = list(client.chat.completions.create(tool_choice="auto", extra_body={"guided_regex": hermes},
                                                 stream=True, **ask))
    kinds = [("content" if ch.choices[0].delta.content else "call") for ch in chunks
             if ch.choices and (ch.choices[0].delta.content or ch.choices[0].delta.tool_calls)]
    assert kinds[0] == "content" and kinds[-1] == "call" and kinds == sorted(kinds, key=lambda k: k == "call")
    calls, content, finish, _ = _streamed_tool_calls(iter(chunks))
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [x["function"] for x in calls] == [t.function.model_dump() for t in c.message.tool_calls]
    # a bare JSON call of a declared function
    bare = {"type": "object", "properties": {"name": {"const": "now"}, "arguments": {
        "type": "object", "properties": {}, "additionalProperties": False}}, "required": ["name", "arguments"],
        "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": bare}}
    c = client.chat.completions.create(tool_choice="auto", response_format=fmt, **ask).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert _valid_calls(c.message.tool_calls) == [("now", {})]
    # no call: a message, as without tools; none: the call's text stays text
    words = r"It is sunny in Paris\."
    c = client.chat.completions.create(tool_choice="auto", extra_body={"guided_regex": words}, **ask).choices[0]
    assert c.message.content == "It is sunny in Paris." and not c.message.tool_calls and c.finish_reason == "stop"
    c = client.chat.completions.create(tool_choice="none", extra_body={"guided_regex": hermes}, **ask).choices[0]
    assert c.message.content.startswith("Let me check.\n<tool_call>") and not c.message.tool_calls
    assert c.finish_reason == "stop"


RECORD = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16}, "population": {"type": "integer", "minimum": 0, "maximum": 10**8},
    "capital": {"type": "boolean"}, "rivers": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["city", "population", "capital", "rivers"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "role": {"enum": ["engineer", "doctor", "artist"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}


def test_structured_output_on_the_real_model_live_streamed_and_in_batch_files(real_stack):
    """response_format (json_schema, json_object) and vLLM's guided_regex / guided_choice on SmolLM2
    through the whole stack with the openai client: every answer parses and validates against its
    schema, greedy and sampled (n > 1); streamed, the deltas join into the plain greedy answer; a
    batch file's lines answer as live; a schema the grammar engine refuses is a 400 live and a failed
    line with invalid_grammar in a batch file."""
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=real_stack + "/v1", api_key=KEY, max_retries=0, timeout=180)
    asks = [("Describe Paris as a record.", RECORD), ("Invent a person who works in a hospital.", PERSON)]
    greedy: dict[str, str] = {}
    for q, schema in asks:
        messages = [{"role": "user", "content": q}]
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        r = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=120, temperature=0,
                                           response_format=fmt)
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), schema)
        greedy[q] = c.message.content
        sampled = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=120,
                                                 temperature=1.0, seed=3, n=3, response_format=fmt)
        for c in sampled.choices:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.message.content), schema)
        texts, finish = _streamed_choices(client.chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=120, temperature=0, response_format=fmt, stream=True))
        assert texts == {0: greedy[q]} and finish == {0: "stop"}
    # json_object: any JSON object
    obj = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Give a JSON object with a name and an id."}],
        max_tokens=160, temperature=0, response_format={"type": "json_object"}).choices[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content), dict), obj
    # vLLM's extensions, on text completions
    phone = client.completions.create(model="smollm2-135m", prompt="Call me at", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": r" \([0-9]{3}\) [0-9]{3}-[0-9]{4}"}).choices[0]
    assert re.fullmatch(r" \([0-9]{3}\) [0-9]{3}-[0-9]{4}", phone.text) and phone.finish_reason == "stop"
    mood = client.completions.create(model="smollm2-135m", prompt="The review 'I loved it' is", max_tokens=8,
                                     temperature=1.0, seed=1, n=4,
                                     extra_body={"guided_choice": ["positive", "negative", "mixed"]})
    assert all(c.text in ("positive", "negative", "mixed") and c.finish_reason == "stop" for c in mood.choices)
    # refused specs
    bad = {"type": "json_schema", "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=8, response_format=bad)
    assert e.value.body["type"] == "invalid_request_error"
    # a batch file: the same answers as live, and the refused schema's line fails alone
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "smollm2-135m", "messages": [{"role": "user", "content": q}], "max_tokens": 120,
                       "temperature": 0, "response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "a", "schema": schema}}}}
             for i, (q, schema) in enumerate(asks)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 8, "response_format": bad}})
    out = _batch_output(client, "/v1/chat/completions", lines)
    for i, (q, _) in enumerate(asks):
        assert out[f"q{i}"]["response"]["body"]["choices"][0]["message"]["content"] == greedy[q]
    err = out["bad"]["response"]["body"]["error"] if out["bad"].get("response") else out["bad"]["error"]
    assert err["code"] == "invalid_grammar", err
