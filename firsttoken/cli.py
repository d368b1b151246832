"""The `firsttoken` command line.

Exit codes: 0 when every line (job) succeeded; 3 when the command ran but some lines failed or
were cancelled (each has its error in the output); 1 when it could not run (a missing file, an
unknown model, a batch id holding another input: one line on stderr); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

EXIT_OK = 0  # every line (job) succeeded
EXIT_ERROR = 1  # the command could not run: a missing file, an unknown model, a batch id conflict, ...
EXIT_USAGE = 2  # bad arguments (argparse's own code)
EXIT_SOME_FAILED = 3  # it ran, but some lines failed or were cancelled: their errors are in the output


class CliError(Exception):
    """An error the user can fix, printed as one line (no traceback) with EXIT_ERROR."""


def _input_file(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise CliError(f"{path}: no such file")
    if p.is_dir():
        raise CliError(f"{path}: is a directory, not a JSONL file")
    try:
        with p.open("rb"):
            pass
    except OSError as exc:
        raise CliError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    return p


def _output_file(path: str | None, *inputs: Path) -> Path | None:
    if path is None:
        return None
    from pipeline.batch_io import output_problem, same_file

    out = Path(path)
    problem = output_problem(out)  # a regular file or a character device (/dev/null) only
    if problem is not None:
        raise CliError(f"--output {path}: {problem}")
    for p in inputs:
        if same_file(p, out):
            raise CliError(f"--output {path} is the input file: it would be overwritten; choose another path")
    return out


def cmd_generate(args: argparse.Namespace, out: TextIO) -> int:
    """Generate for every prompt of a JSONL file with the engine in this process."""
    from schemas.batchfile import BatchLineError, parse_lines
    from schemas.openai.tool_calls import parse_tool_calls
    from schemas.tools import ToolUse, template_tools
    from workers.engine import InvalidRequestError, LLMEngine
    from workers.engine.llm import LLM
    from workers.engine.prompts import prompt_token_ids

    path = _input_file(args.file)
    es = _engine_settings(args)
    t0 = time.perf_counter()
    engine = LLMEngine(es.model, es.engine_config())
    load_s = time.perf_counter() - t0
    order: list[str] = []
    results: dict[str, dict[str, Any]] = {}
    uses: dict[str, ToolUse] = {}  # the lines with tools
    todo: list[tuple[str, list[int], Any]] = []  # (line key, prompt token ids, sampling) of the valid lines
    with path.open("rb") as f:
        for item in parse_lines(f):
            key = f"line-{item.line_no}"
            order.append(key)
            if isinstance(item, BatchLineError):
                results[key] = {"id": item.job_id, "line": item.line_no, "status": "failed",
                                "error_code": item.code.value, "error": item.message}
                continue
            job = item.job
            results[key] = {"id": job.id, "line": item.line_no}
            if job.tool_use is not None:
                uses[key] = job.tool_use
            if job.has_choices:  # one sequence a line here: never a silent first choice
                results[key].update({"status": "failed", "error_code": "invalid_request",
                                     "error": "prompt lists, n and best_of: run the file with `firsttoken run` "
                                              "(generate runs one sequence a line)"})
                continue
            sp = job.sampling
            if args.max_tokens is not None and "max_tokens" not in sp.model_fields_set:
                sp = sp.model_copy(update={"max_tokens": args.max_tokens})
            if "temperature" not in sp.model_fields_set:
                sp = sp.model_copy(update={"temperature": args.temperature})
            turns = None if job.messages is None else [m.turn() for m in job.messages]
            try:
                todo.append((key, prompt_token_ids(engine.tokenizer, job.prompt, turns, template_tools(job.tools)), sp))
            except InvalidRequestError as e:
                results[key].update({"status": "failed", "error_code": e.code, "error": e.message})
    t1 = time.perf_counter()
    n_tokens = 0
    outs = LLM(engine=engine).generate([ids for _, ids, _ in todo], [sp for _, _, sp in todo], errors="return")
    for (key, _ids, _sp), o in zip(todo, outs):
        if isinstance(o, InvalidRequestError):  # the engine refused it (too long for the model, ...)
            results[key].update({"status": "failed", "error_code": o.code, "error": o.message})
            continue
        n_tokens += o.usage.completion_tokens
        results[key].update({
            "status": "succeeded",
            "text": o.text,
            "finish_reason": o.finish_reason,
            "usage": {
                "prompt_tokens": o.usage.prompt_tokens,
                "cached_prompt_tokens": o.usage.cached_prompt_tokens,
                "completion_tokens": o.usage.completion_tokens,
            },
            "engine_ttft_ms": round(o.timings.engine_ttft_ms or 0.0, 3),
            "tpot_ms": None if o.tpot_ms is None else round(o.tpot_ms, 3),
        })
        if key in uses:  # a line with tools: the calls read out of its text, as firsttoken run's plain lines
            calls = parse_tool_calls(uses[key], o.text, results[key]["id"] or key)[1]
            if calls:
                results[key]["tool_calls"] = calls
    gen_s = time.perf_counter() - t1
    failed = 0
    for key in order:
        failed += results[key].get("status") != "succeeded"
        out.write(json.dumps(results[key], ensure_ascii=False) + "\n")
    st = engine.stats()
    print(
        f"# {len(order)} prompts, {n_tokens} tokens in {gen_s:.2f}s ({n_tokens / max(gen_s, 1e-9):.0f} tok/s), "
        f"model load {load_s:.2f}s, prefix hit rate {st.prefix_hit_rate:.2f}, kernels {st.kernel_backend}, "
        f"device {engine.runner.device}",
        file=sys.stderr,
    )
    return EXIT_SOME_FAILED if failed else EXIT_OK


def _engine_settings(args: argparse.Namespace) -> Any:
    """The engine's options: the flags given, then FIRSTTOKEN_* variables, then the defaults."""
    from workers.settings import EngineSettings

    return EngineSettings.from_args(args)


def _db_url(args: argparse.Namespace) -> str:
    from pipeline.settings import get_settings

    return _normalized_db(args.db) if getattr(args, "db", None) else get_settings().database_url


def _normalized_db(url: str) -> str:
    from pipeline.settings import normalize_database_url

    try:
        return normalize_database_url(url)
    except ValueError as exc:
        raise CliError(f"--db: {exc}") from None


def cmd_run(args: argparse.Namespace, out: TextIO) -> int:
    """The whole pipeline in this process: local queue, SQLite, the engine; resumable."""
    from firsttoken.embedded import run_file
    from pipeline.batch_io import atomic_output

    path = _input_file(args.file)
    output = _output_file(args.output, path)
    db = _normalized_db(args.db) if args.db else "sqlite:///firsttoken.db"
    t0 = time.perf_counter()
    es = _engine_settings(args)
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(atomic_output(output)) if output is not None else out
        s = run_file(
            path,
            model=es.model,
            db_url=db,
            output=f,
            batch_id=args.batch_id,
            default_max_tokens=args.max_tokens,
            engine_config=es.engine_config(),
            progress=False if args.no_progress else None,
        )
    counts = ", ".join(f"{n} {k}" for k, n in sorted(s.counts.items())) or "no jobs"
    print(
        f"# batch {s.batch_id} {s.batch_status}: {s.lines} lines ({s.invalid} invalid), ran {s.ran}, "
        f"skipped {s.skipped} already done; {counts}; {time.perf_counter() - t0:.2f}s; db {db}"
        + (f"; output {output}" if output else ""),
        file=sys.stderr,
    )
    return EXIT_OK if s.all_succeeded else EXIT_SOME_FAILED


def cmd_submit(args: argparse.Namespace, out: TextIO) -> int:
    """Submit a batch file to Kafka (and record its jobs as queued unless --no-db)."""
    from pipeline.producer import Producer
    from pipeline.queue.kafka import KafkaQueue
    from pipeline.settings import get_settings
    from pipeline.store import ResultStore

    path = _input_file(args.file)
    if args.model:  # the workers' model: prompts that cannot fit its context fail now
        from workers.engine.prompts import SubmitCheck

        check = SubmitCheck.for_model(args.model, args.max_model_len)
    else:  # no model to check against: a guided-decoding spec the grammar engine refuses still fails now
        from schemas.grammar import job_grammar_problem

        def check(job):  # type: ignore[no-untyped-def]
            return job_grammar_problem(job.sampling)
    settings = get_settings()
    store = None if args.no_db else ResultStore.from_url(_db_url(args))
    queue = KafkaQueue(settings)
    try:
        s = Producer(queue, store).submit_file(
            path, batch_id=args.batch_id, default_max_tokens=args.max_tokens, check=check
        )
    finally:
        queue.close()
        if store is not None:
            store.close()
    out.write(
        json.dumps(
            {
                "batch_id": s.batch_id,
                "lines": s.lines,
                "submitted": s.submitted,
                "invalid": s.invalid,
                "duplicates": s.duplicates,
                "already_done": s.already_done,
                "resumed": s.resumed,
            }
        )
        + "\n"
    )
    for e in s.errors[:20]:
        print(f"# {e.error_code}: {e.error_message}", file=sys.stderr)
    print(f"# {s.submitted} jobs in {s.seconds:.2f}s ({s.jobs_per_s:.0f} jobs/s)", file=sys.stderr)
    if args.wait:
        if args.no_db:
            raise CliError("--wait follows the batch in the database: it cannot be used with --no-db")
        if s.lines == 0:  # an empty input: nothing to wait for
            return EXIT_OK
        return _watch_until_done(_db_url(args), s.batch_id, progress=not args.no_progress)
    return EXIT_SOME_FAILED if s.invalid else EXIT_OK


def _watch_until_done(db: str, batch_id: str, *, progress: bool = True, timeout_s: float | None = None) -> int:
    """Follow a batch to its end with a progress bar; the exit code of its outcome."""
    from firsttoken.report import status_line, watch
    from pipeline.store import ResultStore

    store = ResultStore.from_url(db)
    try:
        b = watch(store, batch_id, progress=progress, timeout_s=timeout_s)
    finally:
        store.close()
    if b is None:
        raise CliError(f"no batch {batch_id!r}")
    print(f"# {status_line(b)}", file=sys.stderr)
    return _outcome_code(b)


def _outcome_code(b: Any) -> int:
    from pipeline.store import BatchStatus
    from schemas.job import JobStatus

    p = b.progress
    total = p.total if p.total is not None else p.recorded
    return EXIT_OK if b.status is BatchStatus.COMPLETED and p.count(JobStatus.SUCCEEDED) == total else EXIT_SOME_FAILED


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    """A batch's status and counts; --watch follows it to its end with a progress bar."""
    from firsttoken.report import status_line
    from pipeline.store import BatchStatus, ResultStore

    db = _db_url(args)
    if args.watch:
        return _watch_until_done(db, args.batch_id)
    store = ResultStore.from_url(db)
    try:
        store.finalize_batch(args.batch_id)
        b = store.get_batch(args.batch_id)
    finally:
        store.close()
    if b is None:
        raise CliError(f"no batch {args.batch_id!r}")
    out.write(status_line(b) + "\n")
    return _outcome_code(b) if b.status in (BatchStatus.COMPLETED, BatchStatus.CANCELLED) else EXIT_OK


def cmd_report(args: argparse.Namespace, out: TextIO) -> int:
    """A batch's latency percentiles, and a PNG and an HTML report."""
    from firsttoken.report import write_report
    from pipeline.store import ResultStore

    store = ResultStore.from_url(_db_url(args))
    try:
        try:
            table, png, page = write_report(store, args.batch_id, Path(args.out or f"report-{args.batch_id[:60]}"))
        except LookupError:
            raise CliError(f"no batch {args.batch_id!r}") from None
    finally:
        store.close()
    out.write(table + "\n")
    print(f"# wrote {png} and {page}", file=sys.stderr)
    return EXIT_OK


def cmd_worker(args: argparse.Namespace, out: TextIO) -> int:
    """A GPU worker without Celery: Kafka intake, engine loop, result sink; SIGTERM drains."""
    import logging

    from workers.settings import WorkerSettings
    from workers.wiring import build_worker, run_until_signalled

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ws = WorkerSettings.from_args(args)  # every engine flag given, then FIRSTTOKEN_*, then the defaults
    from workers.engine.prompts import model_context

    model_context(ws.model, ws.max_model_len)  # an unknown model or a bad checkpoint: one line, before any process starts
    return run_until_signalled(build_worker(worker_settings=ws))


def cmd_api(args: argparse.Namespace, out: TextIO) -> int:
    """Serve the HTTP API."""
    from firsttoken.api import ConfigError, create_app
    from pipeline.settings import get_settings

    settings = get_settings()
    if args.no_auth:
        settings = settings.model_copy(update={"api_no_auth": True})
    try:
        app = create_app(settings)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    if settings.api_no_auth:
        print(
            f"firsttoken api: WARNING: authentication is OFF (--no-auth / FIRSTTOKEN_API_NO_AUTH): anyone who "
            f"can reach {args.host}:{args.port} can submit, read and cancel every job. For local use only.",
            file=sys.stderr,
        )
    else:
        owners = sorted(set(settings.api_key_owners.values()))
        print(f"# API keys for {len(owners)} owner(s): {', '.join(owners)}", file=sys.stderr)
    from firsttoken.api.server import serve  # limits and read deadlines (FIRSTTOKEN_API_MAX_CONNECTIONS, ...)

    serve(app, settings, host=args.host, port=args.port)
    return 0


def cmd_migrate(args: argparse.Namespace, out: TextIO) -> int:
    """alembic upgrade head on the database."""
    from pipeline.store import migrate

    url = _db_url(args)
    migrate(url)
    print(f"# migrated {url.split('@')[-1]}", file=sys.stderr)
    return 0


def cmd_results(args: argparse.Namespace, out: TextIO) -> int:
    """A batch's terminal results as JSONL, in input order, each line in its input line's format."""
    from pipeline.batch_io import atomic_output, batch_format, write_results
    from pipeline.store import ResultStore
    from schemas.job import JobStatus

    output = _output_file(args.output)
    store = ResultStore.from_url(_db_url(args))
    try:
        batch = store.get_batch(args.batch_id)
        if batch is None:
            raise CliError(f"no batch {args.batch_id!r}")
        with contextlib.ExitStack() as stack:
            f = stack.enter_context(atomic_output(output)) if output is not None else out
            write_results(store, batch.id, f, batch_format(batch.input_format))
        p = batch.progress
        total = p.total if p.total is not None else p.recorded
        print(
            f"# batch {batch.id} {batch.status}: {p.done}/{total} done, "
            f"{p.count(JobStatus.SUCCEEDED)} succeeded, {p.count(JobStatus.FAILED)} failed, "
            f"{p.count(JobStatus.CANCELLED)} cancelled",
            file=sys.stderr,
        )
    finally:
        store.close()
    return EXIT_OK if p.count(JobStatus.SUCCEEDED) == total else EXIT_SOME_FAILED




def _engine_args(a: argparse.ArgumentParser, wanted: bool) -> None:
    """The engine's flags (workers.settings.EngineSettings), on the command being run: the other
    commands import nothing of the engine's settings (a quicker start)."""
    if not wanted:
        return
    from workers.settings import EngineSettings

    EngineSettings.add_arguments(a)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; `command`: the command about to run (None: every command's flags)."""
    p = argparse.ArgumentParser(prog="firsttoken", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate for a JSONL file of {id, prompt} lines, in this process")
    g.add_argument("file", help='JSONL file, one {"id": ..., "prompt": ...} per line')
    _engine_args(g, command in (None, "generate"))
    g.add_argument("--max-tokens", type=int, default=None,
                   help="for lines that do not set max_tokens (default: SamplingParams', 256, as run and submit)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.set_defaults(func=cmd_generate)

    r = sub.add_parser(
        "run", help="the whole pipeline in this process (no services): results to SQLite and JSONL"
    )
    r.add_argument(
        "file", help="JSONL batch file: plain {id, prompt|messages, ...} or OpenAI Batch API lines"
    )
    _engine_args(r, command in (None, "run"))
    r.add_argument("--output", "-o", default=None, help="output JSONL, in input order (default: stdout)")
    r.add_argument("--db", default=None, help="database URL (default: sqlite:///firsttoken.db)")
    r.add_argument("--batch-id", default=None, help="default: derived from the file's path (re-runs resume)")
    r.add_argument("--max-tokens", type=int, default=None, help="for lines that do not set max_tokens")
    r.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("submit", help="submit a JSONL batch file to Kafka")
    s.add_argument("file")
    s.add_argument("--batch-id", default=None)
    s.add_argument("--max-tokens", type=int, default=None, help="for lines that do not set max_tokens")
    s.add_argument("--db", default=None, help="database URL (default: FIRSTTOKEN_DATABASE_URL)")
    s.add_argument("--no-db", action="store_true", help="do not record queued rows")
    s.add_argument("--model", default=None,
                   help="the workers' model (preset or checkpoint directory): check prompts against its context now")
    s.add_argument("--max-model-len", type=int, default=None, help="the workers' --max-model-len, with --model")
    s.add_argument("--wait", action="store_true", help="follow the batch to its end (progress bar); exit code by outcome")
    s.add_argument("--no-progress", action="store_true", help="with --wait: no progress bar")
    s.set_defaults(func=cmd_submit)

    w = sub.add_parser("worker", help="a GPU worker without Celery (Kafka -> engine -> database)")
    _engine_args(w, command in (None, "worker"))
    w.set_defaults(func=cmd_worker)

    a = sub.add_parser("api", help="serve the HTTP API")
    a.add_argument("--host", default="127.0.0.1")
    a.add_argument("--port", type=int, default=8000)
    a.add_argument("--no-auth", action="store_true",
                   help="serve without API keys (local use only; otherwise FIRSTTOKEN_API_KEYS is required)")
    a.set_defaults(func=cmd_api)

    m = sub.add_parser("migrate", help="alembic upgrade head")
    m.add_argument("--db", default=None, help="database URL (default: FIRSTTOKEN_DATABASE_URL)")
    m.set_defaults(func=cmd_migrate)

    res = sub.add_parser("results", help="a batch's results as JSONL")
    res.add_argument("batch_id")
    res.add_argument("--output", "-o", default=None, help="output JSONL (default: stdout)")
    res.add_argument("--db", default=None, help="database URL (default: FIRSTTOKEN_DATABASE_URL)")
    res.set_defaults(func=cmd_results)

    st = sub.add_parser("status", help="a batch's status and counts (--watch: follow it to its end)")
    st.add_argument("batch_id")
    st.add_argument("--watch", action="store_true", help="a progress bar until the batch ends")
    st.add_argument("--db", default=None, help="database URL (default: FIRSTTOKEN_DATABASE_URL)")
    st.set_defaults(func=cmd_status)

    rp = sub.add_parser("report", help="a batch's latency percentiles, plus a PNG and an HTML report")
    rp.add_argument("batch_id")
    rp.add_argument("--out", default=None, help="directory for report.png and report.html (default: report-BATCH)")
    rp.add_argument("--db", default=None, help="database URL (default: FIRSTTOKEN_DATABASE_URL)")
    rp.set_defaults(func=cmd_report)
    return p


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's to fix: one line on stderr, no traceback."""
    from pipeline.batch_io import OutputError
    from pipeline.producer import BatchConflict
    from workers.engine.errors import CheckpointError

    return (CliError, BatchConflict, CheckpointError, OutputError)


def _service_error(exc: BaseException) -> str | None:
    """One line for a setting or a service the command could not use, else None."""
    from kafka.errors import KafkaError
    from pydantic import ValidationError
    from sqlalchemy.exc import ArgumentError, OperationalError

    if isinstance(exc, ValidationError):  # FIRSTTOKEN_* settings (their values are never shown)
        return "invalid settings: " + "; ".join(
            f"FIRSTTOKEN_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']}" for e in exc.errors()
        )
    if isinstance(exc, OperationalError | ArgumentError):
        first = str(exc.orig if isinstance(exc, OperationalError) else exc).strip().splitlines()
        return f"cannot use the database: {first[0] if first else type(exc).__name__}"
    if isinstance(exc, KafkaError):
        return f"cannot use Kafka: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    first = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(first if first is not None else "").parse_args(argv)
    try:
        return args.func(args, sys.stdout)
    except _user_errors() as exc:
        print(f"firsttoken {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        line = _service_error(exc)
        if line is None:
            raise
        print(f"firsttoken {args.command}: error: {line}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"firsttoken {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
