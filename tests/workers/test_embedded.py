"""`firsttoken run`: the whole pipeline in one process; bad lines become failed rows; output in
input order and in each line's format; a re-run resumes."""

from __future__ import annotations

import json

from sqlalchemy import text

from pipeline.cli import main
from pipeline.store import ResultStore

LINES = [
    {"id": "a", "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0},
    "this is not json",
    {"id": "bad-sampling", "prompt": "x", "sampling": {"max_tokens": 0}},
    {
        "custom_id": "oa",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3,
            "temperature": 0,
        },
    },
    {"prompt": "no id here", "temperature": 0},
    {"id": "long", "prompt": "y" * 3000},
    {
        "custom_id": "oc",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "abc", "max_tokens": 2},
    },
]


def write_input(path):
    with path.open("w") as f:
        for line in LINES:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
        f.write("\n")  # blank lines are skipped


def run(tmp_path, db):
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "run",
                str(tmp_path / "in.jsonl"),
                "--model",
                "tiny",
                "--db",
                db,
                "-o",
                str(out),
                "--batch-id",
                "B1",
                "--max-tokens",
                "4",
            ]
        )
        == 0
    )
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_run_good_and_bad_lines_in_order_then_resume(tmp_path, capsys):
    write_input(tmp_path / "in.jsonl")
    db = f"sqlite:///{tmp_path / 'run.db'}"
    out = run(tmp_path, db)
    assert len(out) == 7
    assert (
        out[0]["id"] == "a" and out[0]["status"] == "succeeded" and out[0]["usage"]["completion_tokens"] == 5
    )
    assert out[1]["id"] == "B1-L2" and out[1]["error_code"] == "invalid_request"
    assert out[2]["id"] == "bad-sampling" and out[2]["error_code"] == "invalid_sampling"
    assert out[3]["custom_id"] == "oa" and out[3]["response"]["status_code"] == 200
    assert out[3]["response"]["body"]["object"] == "chat.completion"
    assert (
        out[4]["id"] == "B1-L5"
        and out[4]["status"] == "succeeded"
        and out[4]["usage"]["completion_tokens"] <= 4
    )
    assert out[5]["id"] == "long" and out[5]["error_code"] == "prompt_too_long"
    assert out[6]["custom_id"] == "oc" and out[6]["response"]["body"]["object"] == "text_completion"
    assert "ran 5" in capsys.readouterr().err

    # resume: everything is terminal, nothing runs again, same output
    assert run(tmp_path, db) == out
    assert "ran 0, skipped 5" in capsys.readouterr().err

    # a half-done batch: only the missing jobs run
    store = ResultStore.from_url(db)
    with store.engine.begin() as conn:
        conn.execute(text("DELETE FROM jobs WHERE id IN ('a', 'oc')"))
    store.close()
    again = run(tmp_path, db)
    assert "ran 2, skipped 3" in capsys.readouterr().err
    assert [x.get("id") for x in again] == [x.get("id") for x in out]
    assert again[0]["text"] == out[0]["text"]  # greedy: the same output
