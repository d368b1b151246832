"""Tools in the prompt: the functions and the conversation's tool calls and tool turns reach the
chat template as transformers' apply_chat_template passes them (the same token ids, on a
Qwen2.5-style tool template), a template that knows nothing of tool calls still shows the model
what it called, the submission's length check counts the tools, and the engine core renders a
worker's turns and tools."""

from __future__ import annotations

import json

import pytest
from test_chat_template import make_checkpoint

from schemas.job import ErrorCode, JobInput, JobRequest
from schemas.sampling import SamplingParams
from schemas.tools import template_tools
from workers.engine.prompts import SubmitCheck, prompt_token_ids, template_turns
from workers.engine.tokenizer import Tokenizer
from workers.engine_core import AddRequest, _add

# Qwen2.5-Instruct's tool template, in substance: the tools in the system turn, calls as
# <tool_call> blocks with the arguments through tojson, tool turns as <tool_response> in a user turn
QWEN_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' }}{{- message.content }}"
    "{{- '\\n</tool_response>' }}{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "ville, 城市"}},
                   "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
CONVERSATION = [
    {"role": "user", "content": "What is the weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def _job() -> JobInput:
    return JobInput.model_validate({"messages": CONVERSATION, "tools": TOOLS})


def _hf(ckpt, messages, tools) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_tools_and_tool_turns_render_as_transformers_renders_them(tmp_path):
    ckpt = make_checkpoint(tmp_path / "qwen", QWEN_TOOLS, "<s>")
    tok = Tokenizer.from_dir(ckpt)
    job = _job()
    ours = prompt_token_ids(tok, None, [m.turn() for m in job.messages], template_tools(job.tools))
    # transformers' documented form: the call's arguments as an object
    hf_messages = [dict(m) for m in CONVERSATION]
    hf_messages[1] = {**hf_messages[1], "tool_calls": [{**CALL, "function": {
        "name": "get_weather", "arguments": json.loads(CALL["function"]["arguments"])}}]}
    assert ours == _hf(ckpt, hf_messages, TOOLS)
    text = tok.decode(ours, skip_special_tokens=False)
    assert '"description": "ville, 城市"' in text  # the tools, as JSON with non-ASCII kept
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in text  # not a JSON string in a string
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text
    # no tools: the template's own branch, as transformers with tools=None
    plain = [CONVERSATION[0]]
    assert prompt_token_ids(tok, None, [("user", plain[0]["content"])]) == _hf(ckpt, plain, None)


def test_a_template_without_tool_calls_still_shows_the_call():
    turns = template_turns([m.turn() for m in _job().messages], CHATML)
    assert turns[1] == {"role": "assistant", "content":
                        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'}
    assert turns[2] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}
    with_text = template_turns([{"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}], CHATML)
    assert with_text[0]["content"].startswith("Checking.\n<tool_call>")
    # arguments that are no JSON object stay text
    odd = {**CALL, "function": {"name": "f", "arguments": "not json"}}
    assert template_turns([{"role": "assistant", "content": None, "tool_calls": [odd]}], QWEN_TOOLS)[0][
        "tool_calls"][0]["function"]["arguments"] == "not json"


def test_the_submission_check_counts_the_tools(tmp_path):
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path / "qwen", QWEN_TOOLS, "<s>"))
    bare = JobRequest(messages=[CONVERSATION[0]], sampling=SamplingParams(max_tokens=1))
    n_bare = len(prompt_token_ids(tok, None, [("user", CONVERSATION[0]["content"])]))
    with_tools = JobRequest(messages=[CONVERSATION[0]], tools=TOOLS, sampling=SamplingParams(max_tokens=1))
    n_tools = len(prompt_token_ids(tok, None, [("user", CONVERSATION[0]["content"])], TOOLS))
    assert n_tools > n_bare + 20
    check = SubmitCheck(tok, max_model_len=n_bare + 2)
    assert check(bare) is None
    code, msg = check(with_tools)
    assert code is ErrorCode.PROMPT_TOO_LONG and f"prompt has {n_tools} tokens" in msg


class _Engine:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.added = tokenizer, []

    def add_request(self, request_id, prompt_token_ids, **kw):
        self.added.append(prompt_token_ids)


@pytest.mark.parametrize("template", [QWEN_TOOLS, None])
def test_the_engine_core_renders_the_workers_turns_and_tools(tmp_path, template):
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path / "t", QWEN_TOOLS, "<s>"))
    tok.chat_template = template  # None: the transcript of a model with no template (the random presets)
    job = _job()
    engine, rejected = _Engine(tok), []
    req = AddRequest("r", None, tuple(m.turn() for m in job.messages), job.sampling, tools=template_tools(job.tools))
    _add(engine, None, req, rejected)
    assert not rejected
    assert engine.added == [prompt_token_ids(tok, None, [m.turn() for m in job.messages], TOOLS)]
    text = tok.decode(engine.added[0], skip_special_tokens=False)
    assert "get_weather" in text.split("Zürich?")[0]  # the tools come before the conversation
    assert "Zürich" in text.split("Zürich?")[1] and '{"temp": 21}' in text
