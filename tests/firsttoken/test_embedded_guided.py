"""Structured output in a batch file run by `firsttoken run` (the tiny random model): guided lines,
plain and OpenAI, answer in their language; a spec the grammar engine refuses fails its line alone
at submission with invalid_grammar (an OpenAI line: status 400, that code)."""

from __future__ import annotations

import json

from firsttoken.cli import EXIT_SOME_FAILED, main

CHOICES = ["red", "green", "blue"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}
LINES = [
    {"id": "choice", "prompt": "Pick a color:", "sampling": {"max_tokens": 16, "guided": {"kind": "choice", "choices": CHOICES}}},
    {"id": "bad-regex", "prompt": "x", "sampling": {"guided": {"kind": "regex", "regex": "secret(["}}},
    {"custom_id": "schema", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "a number"}], "max_tokens": 24, "temperature": 0,
              "response_format": {"type": "json_schema", "json_schema": {"name": "num", "schema": SCHEMA}}}},
    {"custom_id": "refused", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "x", "guided_json": {"type": "array", "uniqueItems": True}}},
    {"custom_id": "regex", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "code:", "max_tokens": 12, "guided_regex": "[A-Z]{2}-[0-9]{3}"}},
]


def test_guided_lines_in_a_run(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    argv = ["run", str(src), "--model", "tiny", "--db", f"sqlite:///{tmp_path / 'run.db'}", "-o", str(out)]
    assert main(argv) == EXIT_SOME_FAILED
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows[0]["status"] == "succeeded" and rows[0]["text"] in CHOICES, rows[0]
    assert rows[1]["error_code"] == "invalid_grammar" and rows[1]["error_message"].startswith("line 2: ")
    assert "secret" not in rows[1]["error_message"]
    body = rows[2]["response"]["body"]
    assert rows[2]["response"]["status_code"] == 200, body
    value = json.loads(body["choices"][0]["message"]["content"])
    assert set(value) == {"n"} and isinstance(value["n"], int) and 0 <= value["n"] <= 99
    assert rows[3]["response"]["status_code"] == 400
    assert rows[3]["response"]["body"]["error"]["code"] == "invalid_grammar"
    text = rows[4]["response"]["body"]["choices"][0]["text"]
    assert len(text) == 6 and text[:2].isupper() and text[2] == "-" and text[3:].isdigit(), text
