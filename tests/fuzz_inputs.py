"""Malformed inputs for the fuzz tests: batch-file lines and request bodies that must each fail
alone, with their own error, and never stop a run, a submission or the API."""

from __future__ import annotations

import json
import random

# Hand-written cases: each broke something once, or is a classic.
HANDWRITTEN: list[bytes] = [
    b"not json",
    b"{",
    b"}",
    b"[]",
    b"null",
    b"42",
    b'"a string"',
    b"[" * 1000 + b"]" * 1000,  # 2 KB nested 1000 deep
    b'{"a":' * 5000 + b"1" + b"}" * 5000,
    b'{"prompt": "x", "max_tokens": ' + b"9" * 4301 + b"}",  # over Python's int-string limit
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x", "top_p": -Infinity}',
    b'{"prompt": "\\ud800"}',  # a lone surrogate
    b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"prompt": "\xff\xfe"}',  # not UTF-8
    b"\xef\xbb\xbf{}",  # a BOM, then nothing valid
    b'{"prompt": ""}',
    b'{"prompt": null}',
    b'{"prompt": 5}',
    b'{"prompt": ["a"]}',
    b'{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}',
    b'{"messages": []}',
    b'{"messages": [{"role": "wizard", "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}',
    b'{"prompt": "x", "batch_id": "someone-elses"}',
    b'{"prompt": "x", "submitted_at": 1}',
    b'{"prompt": "x", "owner": "root"}',
    b'{"prompt": "x", "max_tokens": 0}',
    b'{"prompt": "x", "max_tokens": -5}',
    b'{"prompt": "x", "max_tokens": 1e309}',
    b'{"prompt": "x", "max_tokens": "ten"}',
    b'{"prompt": "x", "max_tokens": 99999999999}',
    b'{"prompt": "x", "temperature": 1000}',
    b'{"prompt": "x", "top_k": -2}',
    b'{"prompt": "x", "seed": -1}',
    b'{"prompt": "x", "seed": 18446744073709551616}',
    b'{"prompt": "x", "stop": [""]}',
    b'{"prompt": "x", "stop": ' + json.dumps(["s"] * 100).encode() + b"}",
    b'{"prompt": "x", "stop": ["' + b"s" * 5000 + b'"]}',
    b'{"prompt": "x", "stop_token_ids": [1e999]}',
    b'{"prompt": "x", "stop_token_ids": ' + json.dumps(list(range(5000))).encode() + b"}",
    b'{"prompt": "x", "priority": 1e100}',
    b'{"prompt": "x", "priority": 9223372036854775808}',
    b'{"prompt": "x", "metadata": "not an object"}',
    b'{"prompt": "x", "metadata": {"big": "' + b"m" * 20000 + b'"}}',
    b'{"prompt": "x", "prefix_key": ""}',
    b'{"prompt": "x", "sampling": [1]}',
    b'{"prompt": "x", "sampling": {"max_tokens": 1}, "max_tokens": 2}',
    b'{"id": "", "prompt": "x"}',
    b'{"id": " padded ", "prompt": "x"}',
    b'{"id": "tab\\there", "prompt": "x"}',
    b'{"id": 7, "prompt": "x"}',
    b'{"id": "' + b"i" * 500 + b'", "prompt": "x"}',
    b'{"prompt": "' + b"p" * 1_000_001 + b'"}',  # over the prompt-character limit
    b'{"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": []}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 0}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 2, "best_of": 1}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": [[]]}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": [1, [2]]}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": [-1]}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": [true]}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": []}}',
    b'{"prompts": [[1.5]]}',
    b'{"prompts": [""]}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "logit_bias": {"1": 500}}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "logit_bias": {"a": 1}}}',
    b'{"prompt": "x", "sampling": {"min_tokens": 9, "max_tokens": 4}}',
    b'{"prompt": "x", "sampling": {"presence_penalty": 2.5}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": "hi"}}',
    b'{"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}',
    b'{"custom_id": ["c"], "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}',
    b'{"custom_id": "c", "url": {"$gt": ""}, "body": {"prompt": "x"}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}, "extra": 1}',
    # issue 17: text no store can hold (each once stopped a whole Postgres submission)
    b'{"prompt": "a\\u0000b"}',
    b'{"messages": [{"role": "user", "content": "hi\\u0000"}]}',
    b'{"prompt": "x", "stop": ["\\u0000"]}',
    b'{"prompt": "x", "metadata": {"k": "v\\u0000"}}',
    b'{"prompt": "x", "metadata": {"k\\u0000": 1}}',
    b'{"prompt": "x", "metadata": {"a": [{"b": {"c": "\\u0000"}}]}}',
    b'{"prompt": "x", "prefix_key": "p\\u0000"}',
    b'{"id": "i\\u0000", "prompt": "x"}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "model": "m\\u0000"}}',
    b'{"custom_id": "c\\u0000", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}',
    b'{"prompt": "x", "metadata": {"\\ud800": 1}}',
    b'{"prompt": "x", "metadata": {"k": "\\udbff"}}',
    b'{"prompt": "x", "stop": ["\\ud800"]}',
    b'{"prompt": "x", "metadata": {"k": 1e400}}',
    b'{"prompt": "x", "metadata": {"k": [-1e400]}}',
    b'{"prompt": "x", "temperature": 1e400}',
    # issue 17: wrong types are errors, not coerced (OpenAI's API is strict)
    b'{"prompt": "x", "max_tokens": true}',
    b'{"prompt": "x", "max_tokens": "16"}',
    b'{"prompt": "x", "max_tokens": 16.0}',
    b'{"prompt": "x", "temperature": "0"}',
    b'{"prompt": "x", "temperature": false}',
    b'{"prompt": "x", "ignore_eos": "yes"}',
    b'{"prompt": "x", "ignore_eos": 1}',
    b'{"prompt": "x", "priority": "1"}',
    b'{"prompt": "x", "seed": 1.5}',
    b'{"prompt": "x", "stop_token_ids": [true]}',
    b'{"prompt": "x", "logprobs": true}',
    b'{"prompt": "x", "top_k": 1e30}',
    b'{"prompt": "x", "top_k": 1000000000000000000000000000000}',
    b'{"prompt": "x", "top_k": 5.0}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": true}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": "4"}}',
    # issue 20: tools that break OpenAI's rules
    b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a b"}}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", '
    b'"parameters": {"$schema": 5}}}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", '
    b'"parameters": {"type": "array"}}}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], '
    b'"tool_choice": {"type": "function", "function": {"name": "g"}}}',
    b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
    b'{"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}',
    b'{"messages": [{"role": "tool", "content": "x"}]}',
    b'{"messages": [{"role": "assistant", "content": null}]}',
    b'{"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": {"name": "f", '
    b'"arguments": "{}"}}]}]}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "tools": []}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": '
    b'[{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], '
    b'"tool_choice": "sometimes"}}',
    b'{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": '
    b'[{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], '
    b'"parallel_tool_calls": "no"}}',
]

# Valid lines that only the model can refuse (their prompt, or top_k past its vocabulary): with
# the model known at submission they fail there, else at the engine; each fails alone.
MODEL_REFUSED: list[bytes] = [
    # ~2.1 MB of 3-byte UTF-8: past kafka-python's default max_request_size (1 MiB), within the line limit
    b'{"id": "huge-multibyte", "prompt": "' + ("\u4e2d" * 700_000).encode() + b'"}',
    b'{"id": "topk-past-vocab", "prompt": "x", "top_k": 1000000}',
]


def random_bad_lines(n: int, seed: int = 0) -> list[bytes]:
    """`n` random lines that are not valid jobs: good lines mutated, and JSON-ish noise."""
    rng = random.Random(seed)
    good = [
        {"id": "g", "prompt": "hello there", "max_tokens": 4},
        {"custom_id": "g", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 2}},
    ]
    out: list[bytes] = []
    while len(out) < n:
        kind = rng.randrange(4)
        if kind == 0:  # a good line with one value replaced by something of the wrong kind
            obj = json.loads(json.dumps(rng.choice(good)))
            target = obj["body"] if "body" in obj and rng.random() < 0.5 else obj
            key = rng.choice(list(target))
            target[key] = rng.choice([None, -1, 0, 1e308, [], {}, "", "x" * 300, [None], {"k": []}, True])
            line = json.dumps(obj).encode()
        elif kind == 1:  # a good line cut short
            text = json.dumps(rng.choice(good)).encode()
            line = text[: rng.randrange(1, len(text) - 1)]
        elif kind == 2:  # a byte flipped
            text = bytearray(json.dumps(rng.choice(good)).encode())
            text[rng.randrange(len(text))] = rng.randrange(256)
            line = bytes(text)
        else:  # noise
            line = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 60)))
        line = line.replace(b"\n", b" ").replace(b"\r", b" ")
        if line.strip() and _is_bad(line):
            out.append(line)
    return out


def _is_bad(line: bytes) -> bool:
    from schemas.batchfile import BatchLineError, parse_line

    return isinstance(parse_line(line, 1), BatchLineError)


def bad_lines(n_random: int = 300, seed: int = 0) -> list[bytes]:
    """Every handwritten case and `n_random` random ones."""
    return HANDWRITTEN + random_bad_lines(n_random, seed)
