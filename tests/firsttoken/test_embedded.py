"""`firsttoken run`: the whole pipeline in one process; bad lines become failed rows; output in
input order and in each line's format; a re-run resumes."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import text

from firsttoken.cli import EXIT_ERROR, EXIT_OK, EXIT_SOME_FAILED, main
from pipeline.store import ResultStore
from schemas.job import ErrorCode, JobStatus, job_id_in_batch, job_id_of_line
from tests.fuzz_inputs import bad_lines

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


def run(tmp_path, db, *extra, expect=EXIT_SOME_FAILED, batch="B1", src="in.jsonl"):
    out = tmp_path / "out.jsonl"
    argv = ["run", str(tmp_path / src), "--model", "tiny", "--db", db, "-o", str(out), "--max-tokens", "4"]
    if batch is not None:
        argv += ["--batch-id", batch]
    assert main([*argv, *extra]) == expect
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_run_good_and_bad_lines_in_order_then_resume(tmp_path, capsys):
    write_input(tmp_path / "in.jsonl")
    db = f"sqlite:///{tmp_path / 'run.db'}"
    out = run(tmp_path, db)
    assert len(out) == 7
    assert (
        out[0]["id"] == "a" and out[0]["status"] == "succeeded" and out[0]["usage"]["completion_tokens"] == 5
    )
    assert out[1]["id"] is None and out[1]["error_code"] == "invalid_request"
    assert out[1]["error_message"].startswith("line 2: not valid JSON")
    assert out[2]["id"] == "bad-sampling" and out[2]["error_code"] == "invalid_sampling"
    assert out[3]["custom_id"] == "oa" and out[3]["response"]["status_code"] == 200
    assert out[3]["response"]["body"]["object"] == "chat.completion"
    assert (
        out[4]["id"] is None
        and out[4]["job_id"] == job_id_of_line("B1", 5)
        and out[4]["status"] == "succeeded"
        and out[4]["usage"]["completion_tokens"] <= 4
    )
    # refused at submission (3000 bytes > the tiny model's 2048 tokens), before any engine saw it
    assert out[5]["id"] == "long" and out[5]["error_code"] == "prompt_too_long"
    assert out[5]["error_message"] == "line 6: prompt has 3000 tokens; the model's context is 2048"
    assert out[6]["custom_id"] == "oc" and out[6]["response"]["body"]["object"] == "text_completion"
    err = capsys.readouterr().err
    assert "ran 4" in err and "batch B1 completed" in err

    # resume: everything is terminal, nothing runs again, same output
    assert run(tmp_path, db) == out
    assert "ran 0, skipped 4" in capsys.readouterr().err

    # a half-done batch: only the missing jobs run
    store = ResultStore.from_url(db)
    with store.engine.begin() as conn:
        conn.execute(
            text("DELETE FROM jobs WHERE id IN (:a, :b)"),
            {"a": job_id_in_batch("B1", "a"), "b": job_id_in_batch("B1", "oc")},
        )
    store.close()
    again = run(tmp_path, db)
    assert "ran 2, skipped 2" in capsys.readouterr().err
    assert [x.get("id") for x in again] == [x.get("id") for x in out]
    assert again[0]["text"] == out[0]["text"]  # greedy: the same output


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def test_ids_belong_to_their_batch_and_duplicates_fail_alone(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'run.db'}"
    first = [{"id": f"q{i}", "prompt": f"prompt {i}", "temperature": 0} for i in range(3)]
    _write(tmp_path / "in.jsonl", first)
    out1 = run(tmp_path, db, batch="one", expect=EXIT_OK)
    assert [x["status"] for x in out1] == ["succeeded"] * 3

    # the same custom ids in another batch are other jobs: they run, with their own prompts
    second = [
        {"id": "q0", "prompt": "another prompt", "temperature": 0},
        {"id": "q1", "prompt": "first q1", "temperature": 0},
        {"id": "q1", "prompt": "second q1 (duplicate)", "temperature": 0},  # a duplicate: its own error
        {"id": "q2", "prompt": "bad", "max_tokens": 0},  # invalid, then a valid line with the same id
        {"id": "q2", "prompt": "good q2", "temperature": 0},
        {"id": "q3", "prompt": "p", "batch_id": "one"},  # a line may not write into another batch
    ]
    _write(tmp_path / "in.jsonl", second)
    out2 = run(tmp_path, db, batch="two")
    assert [(x["id"], x["status"], x.get("error_code")) for x in out2] == [
        ("q0", "succeeded", None),
        ("q1", "succeeded", None),
        ("q1", "failed", "duplicate_id"),
        ("q2", "failed", "invalid_sampling"),
        ("q2", "succeeded", None),
        ("q3", "failed", "invalid_request"),
    ]
    assert "line 2" in out2[2]["error_message"] and "batch_id: set by the server" in out2[5]["error_message"]
    assert out2[0]["job_id"] != out1[0]["job_id"] and out2[0]["text"] != out1[0]["text"]
    # the duplicate ran nothing: one job for q1
    store = ResultStore.from_url(db)
    try:
        assert store.batch_progress("one").counts == {JobStatus.SUCCEEDED: 3}  # untouched
        b = store.get_batch("two")
        assert b is not None and b.status == "completed" and b.finished_at is not None
        assert b.progress.counts == {JobStatus.SUCCEEDED: 3, JobStatus.FAILED: 3}
    finally:
        store.close()


def test_lines_that_used_to_kill_the_run_fail_alone(tmp_path):
    db = f"sqlite:///{tmp_path / 'run.db'}"
    lines = [
        {"id": "ok1", "prompt": "fine", "temperature": 0},
        "[" * 1000 + "]" * 1000,  # 2 KB nested 1000 deep
        '{"id": "big", "prompt": "x", "max_tokens": ' + "7" * 4301 + "}",  # 4301 digits
        '{"id": "nan", "prompt": "x", "temperature": NaN}',
        {"id": "ok2", "prompt": "also fine", "temperature": 0},
    ]
    _write(tmp_path / "in.jsonl", lines)
    out = run(tmp_path, db)
    assert [(x["id"], x["status"]) for x in out] == [
        ("ok1", "succeeded"),
        (None, "failed"),
        (None, "failed"),
        (None, "failed"),
        ("ok2", "succeeded"),
    ]
    assert out[1]["error_code"] == "too_large"


def test_output_file_is_whole_or_absent_and_never_the_input(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'run.db'}"
    src = tmp_path / "in.jsonl"
    _write(src, [{"id": "a", "prompt": "x", "temperature": 0}])
    before = src.read_bytes()
    assert main(["run", str(src), "--db", db, "-o", str(src)]) == EXIT_ERROR
    assert "is the input file" in capsys.readouterr().err and src.read_bytes() == before
    # an error while running leaves no output file behind, not a truncated one
    out = tmp_path / "out.jsonl"
    out.write_text("previous results\n")
    assert main(["run", str(src), "--db", db, "-o", str(out), "--model", "no-such-model"]) == EXIT_ERROR
    assert out.read_text() == "previous results\n"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]


def test_user_errors_are_one_line_not_a_traceback(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'run.db'}"
    assert main(["run", str(tmp_path / "missing.jsonl"), "--db", db]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.strip().endswith("missing.jsonl: no such file") and "Traceback" not in err
    assert main(["run", str(tmp_path), "--db", db]) == EXIT_ERROR
    assert "is a directory" in capsys.readouterr().err
    src = tmp_path / "in.jsonl"
    _write(src, [{"id": "a", "prompt": "x"}])
    assert main(["run", str(src), "--db", db, "--model", "nope"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "neither a known model" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    bad_ckpt = tmp_path / "ckpt"
    bad_ckpt.mkdir()
    (bad_ckpt / "config.json").write_text("{not json")
    assert main(["run", str(src), "--db", db, "--model", str(bad_ckpt)]) == EXIT_ERROR
    assert "cannot read config.json" in capsys.readouterr().err
    # a batch id that already holds another input is refused, not mixed
    assert main(["run", str(src), "--db", db, "--batch-id", "X", "--max-tokens", "2", "--model", "tiny"]) == EXIT_OK
    _write(src, [{"id": "a", "prompt": "something else"}])
    assert main(["run", str(src), "--db", db, "--batch-id", "X", "--model", "tiny"]) == EXIT_ERROR
    assert "already exists with a different input" in capsys.readouterr().err


def test_default_batch_id_follows_the_content(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'run.db'}"
    src = tmp_path / "in.jsonl"
    _write(src, [{"id": "a", "prompt": "x", "temperature": 0}])
    run(tmp_path, db, batch=None, expect=EXIT_OK)
    first = capsys.readouterr().err
    run(tmp_path, db, batch=None, expect=EXIT_OK)
    assert "ran 0, skipped 1" in capsys.readouterr().err  # the same file resumes its batch
    _write(src, [{"id": "a", "prompt": "edited", "temperature": 0}])
    run(tmp_path, db, batch=None, expect=EXIT_OK)
    edited = capsys.readouterr().err
    assert "ran 1" in edited and first.split()[2] != edited.split()[2]  # an edited file is a new batch


def test_fuzz_run_every_good_line_succeeds_every_bad_one_fails_alone(tmp_path, capsys):
    bad = bad_lines(n_random=250, seed=11)
    good = [json.dumps({"id": f"g{i}", "prompt": f"good line {i}", "max_tokens": 2, "temperature": 0}).encode()
            for i in range(60)]
    lines: list[bytes] = []
    for i, b in enumerate(bad):  # the good lines spread between the bad ones
        if i % 6 == 0 and good[i // 6 :]:
            lines.append(good[i // 6])
        lines.append(b)
    lines.extend(good[len(bad) // 6 + 1 :])
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    out = run(tmp_path, f"sqlite:///{tmp_path / 'run.db'}")
    assert len(out) == len(good) + len(bad)
    ok = [x for x in out if x.get("status") == "succeeded" or x.get("response", {}).get("status_code") == 200]
    assert sorted(x["id"] for x in ok) == sorted(f"g{i}" for i in range(60))
    for x in out:
        if x not in ok:
            code = x.get("error_code") or x["response"]["body"]["error"]["code"]
            assert code in {c.value for c in ErrorCode}
    assert f"{len(bad)} invalid" in capsys.readouterr().err


def test_service_and_setting_errors_are_one_line(tmp_path, capsys, monkeypatch):
    from pipeline.settings import get_settings

    assert main(["results", "nope", "--db", "postgresql://nobody@127.0.0.1:1/none"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("firsttoken results: error: cannot use the database") and "Traceback" not in err
    assert main(["results", "nope", "--db", "mysql://x/y"]) == EXIT_ERROR
    assert "unsupported database" in capsys.readouterr().err
    monkeypatch.setenv("FIRSTTOKEN_API_KEYS", "alice:tooshort")
    get_settings.cache_clear()
    try:
        assert main(["api", "--port", "1"]) == EXIT_ERROR
        err = capsys.readouterr().err
        assert "FIRSTTOKEN_API_KEYS" in err and "at least 16" in err and "tooshort" not in err
    finally:
        get_settings.cache_clear()


def test_a_killed_run_leaves_the_previous_output(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    src = tmp_path / "in.jsonl"
    _write(src, [{"id": f"k{i}", "prompt": f"prompt number {i} " * 8, "max_tokens": 64, "ignore_eos": True}
                 for i in range(400)])
    out = tmp_path / "out.jsonl"
    out.write_text("previous results\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "firsttoken.cli", "run", str(src), "-o", str(out), "--model", "tiny",
         "--db", f"sqlite:///{tmp_path / 'k.db'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "k.db").exists() and time.monotonic() < deadline:  # it is running
        time.sleep(0.05)
    time.sleep(1.0)
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert out.read_text() == "previous results\n"
    assert (tmp_path / ".out.jsonl.part").exists()  # the killed run's
    # the next run of the same output takes its .part file over: nothing is left beside the output
    _write(src, [{"id": "next", "prompt": "x", "max_tokens": 2}])
    assert main(["run", str(src), "-o", str(out), "--model", "tiny", "--db", f"sqlite:///{tmp_path / 'n.db'}"]) == EXIT_OK
    assert json.loads(out.read_text())["id"] == "next"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")]


def test_output_is_a_regular_file_with_the_umask_or_a_device_written_through(tmp_path, capsys):
    import os
    import stat

    db = f"sqlite:///{tmp_path / 'run.db'}"
    src = tmp_path / "in.jsonl"
    _write(src, [{"id": "a", "prompt": "x", "max_tokens": 2, "temperature": 0}])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for bad, why in ((tmp_path, "is a directory"), (fifo, "is a FIFO")):  # refused before anything runs
        assert main(["run", str(src), "--db", db, "--model", "tiny", "-o", str(bad)]) == EXIT_ERROR
        err = capsys.readouterr().err
        assert err.startswith(f"firsttoken run: error: --output {bad}: {why}") and len(err.splitlines()) == 1
    assert stat.S_ISFIFO(fifo.stat().st_mode) and not (tmp_path / "run.db").exists()

    old = os.umask(0o027)
    try:
        out = tmp_path / "out.jsonl"
        assert main(["run", str(src), "--db", db, "--model", "tiny", "-o", str(out)]) == EXIT_OK
        assert stat.S_IMODE(out.stat().st_mode) == 0o640  # the umask's, not always 0600
        assert main(["results", "in-x", "--db", db, "-o", str(out)]) == EXIT_ERROR  # no such batch: untouched
        assert stat.S_IMODE(out.stat().st_mode) == 0o640 and json.loads(out.read_text())["id"] == "a"
    finally:
        os.umask(old)

    master, slave = os.openpty()  # a terminal (as /dev/stdout is on one): written through, not replaced
    try:
        tty = os.ttyname(slave)
        assert main(["run", str(src), "--db", db, "--model", "tiny", "-o", tty]) == EXIT_OK
        assert stat.S_ISCHR(os.stat(tty).st_mode)
        assert json.loads(os.read(master, 65536).decode())["id"] == "a"
    finally:
        os.close(master)
        os.close(slave)


def test_status_and_report_of_a_batch(tmp_path, capsys):
    import base64
    import re

    db = f"sqlite:///{tmp_path / 'run.db'}"
    _write(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "x" * (5 + 40 * i), "max_tokens": 3, "temperature": 0}
                                   for i in range(12)] + [{"id": "bad", "prompt": "x", "max_tokens": 0}])
    run(tmp_path, db, batch="REP")
    capsys.readouterr()
    assert main(["status", "REP", "--db", db]) == EXIT_SOME_FAILED
    assert capsys.readouterr().out.strip() == "batch REP completed: 13/13 done (12 succeeded, 1 failed)"
    assert main(["status", "REP", "--db", db, "--watch"]) == EXIT_SOME_FAILED  # ended: returns at once
    assert main(["status", "nope", "--db", db]) == EXIT_ERROR
    capsys.readouterr()
    out = tmp_path / "rep"
    assert main(["report", "REP", "--db", db, "--out", str(out)]) == EXIT_OK
    table = capsys.readouterr().out
    ttft_row = next(line for line in table.splitlines() if line.startswith("ttft_ms"))
    assert ttft_row.split()[1] == "12"  # the succeeded jobs
    store = ResultStore.from_url(db)
    try:
        p50 = store.latency_stats(metrics=("ttft_ms",), by=(), batch_id="REP")[0].p50
    finally:
        store.close()
    assert float(ttft_row.split()[2]) == pytest.approx(p50, abs=0.01)  # the same percentile as SQL's
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    page = (out / "report.html").read_text()
    embedded = re.search(r'src="data:image/png;base64,([^"]+)"', page)
    assert embedded and base64.b64decode(embedded.group(1)) == png  # self-contained
    assert "batch REP completed" in page and "<td>ttft_ms</td><td>12</td>" in page


@pytest.mark.slow
def test_run_without_model_answers_with_the_real_model(tmp_path, capsys):
    """No --model: SmolLM2-135M-Instruct answers (not the random-weight `tiny` preset's garbage)."""
    from pipeline.settings import DEFAULT_MODEL, Settings
    from workers.settings import EngineSettings

    assert EngineSettings.model_fields["model"].default == DEFAULT_MODEL == Settings.model_fields["model"].default
    assert DEFAULT_MODEL == "smollm2-135m"
    src = tmp_path / "q.jsonl"
    _write(src, [{"id": "fr", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                  "max_tokens": 12, "temperature": 0}])
    out = tmp_path / "out.jsonl"
    assert main(["run", str(src), "--db", f"sqlite:///{tmp_path / 'r.db'}", "-o", str(out)]) == EXIT_OK
    (row,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert row["status"] == "succeeded" and row["model"] == "smollm2-135m"
    assert "Paris" in row["text"]


@pytest.mark.parametrize(("argv", "env", "expect"), [
    ([], None, "smollm2-135m"),  # the real model unless told otherwise
    ([], "tiny", "tiny"),  # FIRSTTOKEN_MODEL names the preset
    (["--model", "tiny"], "smollm2-135m", "tiny"),  # --model over the environment
])
def test_worker_model_is_the_real_one_unless_named(monkeypatch, argv, env, expect):
    import workers.wiring
    from pipeline.settings import get_settings

    built = []
    monkeypatch.setattr(workers.wiring, "build_worker", lambda worker_settings: built.append(worker_settings))
    monkeypatch.setattr(workers.wiring, "run_until_signalled", lambda worker: 0)
    if env is None:
        monkeypatch.delenv("FIRSTTOKEN_MODEL", raising=False)
    else:
        monkeypatch.setenv("FIRSTTOKEN_MODEL", env)
    get_settings.cache_clear()
    try:
        assert main(["worker", *argv]) == EXIT_OK
    finally:
        get_settings.cache_clear()
    assert [ws.model for ws in built] == [expect]


@pytest.mark.parametrize("content", [b"", b"\n  \n\r\n"])
def test_an_empty_input_is_a_batch_of_no_lines_that_exits_0(tmp_path, capsys, content):
    src = tmp_path / "empty.jsonl"
    src.write_bytes(content)
    out = tmp_path / "out.jsonl"
    db = f"sqlite:///{tmp_path / 'run.db'}"
    # no engine is needed for it: an unknown model is still an error, the default one is never loaded
    assert main(["run", str(src), "--db", db, "-o", str(out), "--model", "nope"]) == EXIT_ERROR
    capsys.readouterr()
    assert main(["run", str(src), "--db", db, "-o", str(out), "--batch-id", "E", "--model", "tiny"]) == EXIT_OK
    assert out.read_bytes() == b""
    err = capsys.readouterr().err
    assert "0 lines (0 invalid), ran 0" in err and "no jobs" in err
    assert main(["run", str(src), "--db", db, "--batch-id", "E", "--model", "tiny"]) == EXIT_OK  # again: the same


def test_an_empty_input_is_a_completed_batch(tmp_path, capsys):
    src = tmp_path / "empty.jsonl"
    src.write_bytes(b"\n")
    db = f"sqlite:///{tmp_path / 'run.db'}"
    assert main(["run", str(src), "--db", db, "--batch-id", "E", "--model", "tiny"]) == EXIT_OK
    assert "# batch E completed: 0 lines" in capsys.readouterr().err
    assert main(["status", "E", "--db", db]) == EXIT_OK
    assert capsys.readouterr().out.strip() == "batch E completed: 0/0 done (no jobs yet)"


def test_the_progress_bar_counts_results_as_they_are_written(monkeypatch):
    """Offsets are committed in order, up to the lowest job still running: the bar follows the
    results written instead (it once showed 0/48 with 5 results stored)."""
    from types import SimpleNamespace

    import tqdm as tqdm_module

    from firsttoken import embedded

    shown: list[int] = []

    class Bar:
        def __init__(self, total: int, **kw: object) -> None:
            self.total, self.n = total, 0

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def refresh(self) -> None:
            shown.append(self.n)

    monkeypatch.setattr(tqdm_module, "tqdm", Bar)
    monkeypatch.setattr(embedded.time, "sleep", lambda s: None)
    polls = iter([{0: 0}, {0: 0}, {0: 0}, {0: 4}])  # the first job runs longest: nothing committed until the end
    queue = SimpleNamespace(end_offsets=lambda: {0: 4})

    class Worker:
        sink = SimpleNamespace(results_durable=0)
        failed_with = None

    worker = Worker()

    def committed() -> dict[int, int]:
        out = next(polls)
        worker.sink.results_durable += 1  # a result written per poll
        return out

    queue.committed = committed
    embedded._wait_until_done(queue, worker, progress=True)  # type: ignore[arg-type]
    assert shown == [1, 2, 3, 4]  # by the offsets: 0, 0, 0, 4


def test_tools_in_a_run_plain_and_openai_lines(tmp_path, capsys):
    """Lines with tools in `firsttoken run` (tiny model, guided): a named function and required
    (one call) answer with calls whose arguments validate, finish_reason tool_calls, in each line's
    format; an unknown function fails its line alone; a re-run gives the same calls (same ids)."""
    import jsonschema

    unit = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "pick_unit", "parameters": unit}},
             {"type": "function", "function": {"name": "now"}}]
    named = {"type": "function", "function": {"name": "pick_unit"}}
    ask = [{"role": "user", "content": "Which unit?"}]
    body = {"messages": ask, "tools": tools, "max_tokens": 100, "temperature": 0}
    _write(tmp_path / "in.jsonl", [
        {"custom_id": "named", "method": "POST", "url": "/v1/chat/completions", "body": body | {"tool_choice": named}},
        {"custom_id": "required", "method": "POST", "url": "/v1/chat/completions",
         "body": body | {"tool_choice": "required", "parallel_tool_calls": False}},
        {"id": "plain", "messages": ask, "tools": tools, "tool_choice": named, "sampling": {"max_tokens": 100}},
        {"custom_id": "unknown", "method": "POST", "url": "/v1/chat/completions",
         "body": body | {"tool_choice": {"type": "function", "function": {"name": "fly"}}}},
    ])
    db = f"sqlite:///{tmp_path / 'run.db'}"
    out = run(tmp_path, db, src="in.jsonl")
    for line in out[:2]:
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, line
        (call,) = choice["message"]["tool_calls"]
        assert call["id"].startswith("call_") and call["type"] == "function"
        schema = unit if call["function"]["name"] == "pick_unit" else {"type": "object", "maxProperties": 0}
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    assert out[0]["response"]["body"]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "pick_unit"
    plain = out[2]
    assert plain["status"] == "succeeded" and json.loads(plain["text"])["unit"] in ("celsius", "fahrenheit")
    assert plain["tool_calls"][0]["function"] == {"name": "pick_unit", "arguments": plain["text"]}
    assert out[3]["response"]["status_code"] == 400
    assert "fly" in out[3]["response"]["body"]["error"]["message"]
    assert run(tmp_path, db, src="in.jsonl") == out  # resumed: nothing runs, the same calls and ids
