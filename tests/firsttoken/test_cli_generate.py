"""`firsttoken generate`: the engine alone over a JSONL file, a preset or a checkpoint directory,
one result line per input line (bad lines fail alone)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.workers.engine.conftest import llama_dir  # noqa: F401  (the fixture: a tiny random checkpoint)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "firsttoken.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_cli_with_preset_and_checkpoint(tmp_path, llama_dir):  # noqa: F811 (the imported fixture)
    src = tmp_path / "p.jsonl"
    src.write_text('{"id": "a", "prompt": "The quick brown fox"}\n'
                   '{"id": "b", "prompt": "Kafka partitions carry jobs"}\n'
                   "not json\n"
                   '{"id": "c", "prompt": "x", "sampling": {"top_p": 3}}\n'
                   '{"id": "d", "prompts": ["x", "y"]}\n'
                   '{"id": "e", "prompt": "x", "sampling": {"n": 2}}\n')
    for model in ("tiny", str(llama_dir)):
        r = _cli("generate", str(src), "--model", model, "--max-tokens", "6", "--device", "cpu")
        assert r.returncode == 3, r.stderr  # it ran; some lines failed
        rows = [json.loads(x) for x in r.stdout.splitlines()]
        assert [x["id"] for x in rows] == ["a", "b", None, "c", "d", "e"]
        assert [x["line"] for x in rows] == [1, 2, 3, 4, 5, 6]
        assert rows[0]["status"] == rows[1]["status"] == "succeeded"
        assert rows[0]["usage"]["completion_tokens"] == 6 or rows[0]["finish_reason"] == "stop"
        assert isinstance(rows[0]["text"], str)
        assert rows[2]["error_code"] == "invalid_request" and "not valid JSON" in rows[2]["error"]
        assert rows[3]["status"] == "failed" and rows[3]["error_code"] == "invalid_sampling"
        for row in rows[4:]:  # one sequence a line: refused, not answered with a first choice alone
            assert row["status"] == "failed" and "firsttoken run" in row["error"], row
    # with the trained tokenizer the text is real text pieces
    assert rows[0]["text"].strip() != ""


def test_generate_reads_tool_calls(tmp_path):
    """A line with tools and a named function (guided on tiny): its calls beside the raw text."""
    unit = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
            "additionalProperties": False}
    line = {"id": "t", "messages": [{"role": "user", "content": "Which unit?"}],
            "tools": [{"type": "function", "function": {"name": "pick_unit", "parameters": unit}}],
            "tool_choice": {"type": "function", "function": {"name": "pick_unit"}}, "sampling": {"max_tokens": 60}}
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps(line) + '\n{"id": "plain", "prompt": "x"}\n')
    r = _cli("generate", str(src), "--model", "tiny", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    (call,) = rows[0]["tool_calls"]
    assert call["function"] == {"name": "pick_unit", "arguments": rows[0]["text"]} and call["id"].startswith("call_")
    assert json.loads(rows[0]["text"])["unit"] in ("celsius", "fahrenheit")
    assert "tool_calls" not in rows[1]
