"""Chat templates render in a sandbox and give the token ids transformers' apply_chat_template
gives, on the real templates of Llama 3, Mistral and ChatML (SmolLM2, Qwen): one BOS, never two."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.job import ErrorCode, JobRequest
from workers.engine.chat_template import ChatTemplateError, render_chat
from workers.engine.errors import InvalidRequestError
from workers.engine.prompts import SubmitCheck, prompt_token_ids
from workers.engine.tokenizer import Tokenizer

# Meta-Llama-3-8B-Instruct's template (its BOS comes from the template; the tokenizer adds one too)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Mistral-7B-Instruct-v0.1's template
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token + ' ' }}{% else %}{{ raise_exception('Only user and "
    "assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# SmolLM2-Instruct's ChatML template (no BOS in it)
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The helpers transformers gives templates: tojson without ASCII escaping, loop controls, strftime_now
HELPERS = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{{ m | tojson }}{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}"
    "{{ {'k': 'é<&>'} | tojson(indent=1) }}{{ strftime_now('%Y') | length }}"
)

SPECIALS = ["<s>", "</s>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "[INST]", "[/INST]"]
CORPUS = ["Hello there, how are you today?", "Kafka partitions carry jobs to the GPU workers.",
          "résumé naïve café: non-ASCII text", "system user assistant"] * 30

MESSAGES = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  What is Kafka?  "}],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "second, with café and 中文"},
    ],
]


def make_checkpoint(path: Path, template: str, bos: str) -> Path:
    """A tokenizer directory like a Hub checkpoint's: a BPE whose post-processor adds `bos` (as
    Llama's and Mistral's do) and the chat template in tokenizer_config.json."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(path / "tokenizer.json"))
    added = {"__type": "AddedToken", "content": bos, "lstrip": False, "normalized": False, "rstrip": False,
             "single_word": False, "special": True}  # as older checkpoints serialize it
    cfg = {"bos_token": added, "eos_token": "</s>", "chat_template": template,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def hf_ids(path: Path, messages: list[dict[str, str]]) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize(
    ("name", "template", "bos"),
    [("llama3", LLAMA3, "<|begin_of_text|>"), ("mistral", MISTRAL, "<s>"), ("chatml", CHATML, "<s>"),
     ("helpers", HELPERS, "<s>")],
)
def test_token_ids_equal_transformers(tmp_path, name, template, bos):
    ckpt = make_checkpoint(tmp_path / name, template, bos)
    tok = Tokenizer.from_dir(ckpt)
    bos_id = tok.encode(bos, add_special_tokens=False)[0]
    for messages in MESSAGES:
        if name == "mistral" and messages[0]["role"] == "system":
            with pytest.raises(InvalidRequestError, match="roles must alternate"):
                prompt_token_ids(tok, None, [(m["role"], m["content"]) for m in messages])
            continue
        ours = prompt_token_ids(tok, None, [(m["role"], m["content"]) for m in messages])
        assert ours == hf_ids(ckpt, messages), (name, messages)
        # exactly the template's BOS: one for Llama 3 and Mistral, none for ChatML
        assert ours.count(bos_id) == (0 if name == "chatml" else 1)
    # a plain prompt still gets the tokenizer's BOS
    assert prompt_token_ids(tok, "Hello there", None)[0] == bos_id


def test_helpers_render_like_transformers():
    text = render_chat(HELPERS, [{"role": "system", "content": "x"}, {"role": "user", "content": "é"}],
                       special_tokens={"bos_token": "<s>"})
    assert text.startswith('<s>{"role": "user", "content": "é"}')  # tojson keeps non-ASCII as it is
    assert '"k": "é<&>"' in text and text.endswith("4")  # no HTML escaping; strftime_now works


@pytest.mark.parametrize(
    "evil",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set x = messages.append({'role': 'user', 'content': 'injected'}) %}{{ x }}",
        "{{ raise_exception.__globals__['__builtins__']['__import__']('os').system('true') }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    ],
)
def test_a_template_cannot_run_code(evil):
    with pytest.raises(ChatTemplateError):
        render_chat(evil, [{"role": "user", "content": "hi"}])


def test_template_failures_are_that_jobs_error(tmp_path):
    ckpt = make_checkpoint(tmp_path / "evil", "{{ ''.__class__.__mro__ }}", "<s>")
    check = SubmitCheck(Tokenizer.from_dir(ckpt), max_model_len=512)
    job = JobRequest(messages=[{"role": "user", "content": "hi"}])
    code, message = check(job)
    assert code is ErrorCode.INVALID_REQUEST and "unsafe" in message
    broken = make_checkpoint(tmp_path / "broken", "{% for %}", "<s>")
    code, message = SubmitCheck(Tokenizer.from_dir(broken), 512)(job)
    assert code is ErrorCode.INVALID_REQUEST and "does not parse" in message
    ok = make_checkpoint(tmp_path / "ok", CHATML, "<s>")
    check = SubmitCheck(Tokenizer.from_dir(ok), max_model_len=256)
    assert check(JobRequest(messages=[{"role": "user", "content": "hi"}], sampling={"max_tokens": 8})) is None
    code, message = check(JobRequest(messages=[{"role": "user", "content": "hi " * 300}], sampling={"max_tokens": 8}))
    assert code is ErrorCode.PROMPT_TOO_LONG and "the model's context is 256" in message
    n = len(prompt_token_ids(check.tokenizer, None, [("user", "hi")]))
    code, message = check(JobRequest(messages=[{"role": "user", "content": "hi"}], sampling={"max_tokens": 257 - n}))
    assert code is ErrorCode.PROMPT_TOO_LONG and "exceeds the context (256)" in message
    code, message = check(JobRequest(prompt="x", sampling={"max_tokens": 256}))
    # max_tokens alone past the context: the engine's code too (one admission check, one set of codes)
    assert code is ErrorCode.PROMPT_TOO_LONG and "max_tokens (256) must be below the model's context" in message
