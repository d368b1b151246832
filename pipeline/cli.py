"""The `firsttoken` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO


def _read_prompts(path: Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """Yield (line number, parsed line or None, error or None) for each non-blank line."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield n, None, "undecodable: line is not UTF-8"
                continue
            except json.JSONDecodeError as e:
                yield n, None, f"invalid_json: {e.msg}"
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                yield n, None, 'invalid_request: each line needs {"id": ..., "prompt": "..."}'
                continue
            yield n, obj, None


def cmd_generate(args: argparse.Namespace, out: TextIO) -> int:
    """Generate for every prompt of a JSONL file with the engine in this process."""
    from schemas.sampling import SamplingParams
    from workers.engine import InvalidRequestError, LLMEngine

    cfg = _engine_config(args)
    t0 = time.perf_counter()
    engine = LLMEngine(args.model, cfg)
    load_s = time.perf_counter() - t0
    order: list[str] = []
    results: dict[str, dict[str, Any]] = {}
    for n, obj, err in _read_prompts(Path(args.file)):
        if obj is None:
            rid = f"line-{n}"
            order.append(rid)
            code, _, msg = (err or "").partition(": ")
            results[rid] = {"id": rid, "status": "failed", "error_code": code, "error": msg}
            continue
        rid = str(obj.get("id", f"line-{n}"))
        order.append(rid)
        try:
            sp = SamplingParams(
                max_tokens=args.max_tokens, temperature=args.temperature, **(obj.get("sampling") or {})
            )
            engine.add_request(rid, prompt=obj["prompt"], sampling=sp)
        except InvalidRequestError as e:
            results[rid] = {"id": rid, "status": "failed", "error_code": e.code, "error": e.message}
        except (TypeError, ValueError) as e:
            results[rid] = {"id": rid, "status": "failed", "error_code": "invalid_sampling", "error": str(e)}
    t1 = time.perf_counter()
    n_tokens = 0
    while engine.has_unfinished():
        for f in engine.step().finished:
            n_tokens += f.usage.completion_tokens
            results[f.request_id] = {
                "id": f.request_id,
                "status": "succeeded",
                "text": f.text,
                "finish_reason": f.finish_reason,
                "usage": {
                    "prompt_tokens": f.usage.prompt_tokens,
                    "cached_prompt_tokens": f.usage.cached_prompt_tokens,
                    "completion_tokens": f.usage.completion_tokens,
                },
                "engine_ttft_ms": round(f.timings.engine_ttft_ms or 0.0, 3),
                "tpot_ms": None if f.tpot_ms is None else round(f.tpot_ms, 3),
            }
    gen_s = time.perf_counter() - t1
    for rid in order:
        out.write(json.dumps(results[rid], ensure_ascii=False) + "\n")
    st = engine.stats()
    print(
        f"# {len(order)} prompts, {n_tokens} tokens in {gen_s:.2f}s ({n_tokens / max(gen_s, 1e-9):.0f} tok/s), "
        f"model load {load_s:.2f}s, prefix hit rate {st.prefix_hit_rate:.2f}, kernels {st.kernel_backend}, "
        f"device {engine.runner.device}",
        file=sys.stderr,
    )
    return 0


def _engine_config(args: argparse.Namespace) -> Any:
    from workers.engine import EngineConfig

    return EngineConfig(device=args.device, max_model_len=args.max_model_len, dtype=args.dtype,
                        kv_cache_dtype=args.kv_cache_dtype)


def _db_url(args: argparse.Namespace) -> str:
    from pipeline.settings import get_settings, normalize_database_url

    return normalize_database_url(args.db) if getattr(args, "db", None) else get_settings().database_url


def cmd_run(args: argparse.Namespace, out: TextIO) -> int:
    """The whole pipeline in this process: local queue, SQLite, the engine; resumable."""
    from pipeline.embedded import run_file
    from pipeline.settings import normalize_database_url

    db = normalize_database_url(args.db) if args.db else "sqlite:///firsttoken.db"
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(open(args.output, "w", encoding="utf-8")) if args.output else out
        s = run_file(
            args.file,
            model=args.model,
            db_url=db,
            output=f,
            batch_id=args.batch_id,
            default_max_tokens=args.max_tokens,
            engine_config=_engine_config(args),
        )
    counts = ", ".join(f"{n} {k}" for k, n in sorted(s.counts.items()))
    print(
        f"# batch {s.batch_id}: {s.lines} lines ({s.invalid} invalid), ran {s.ran}, skipped {s.skipped} "
        f"already done; {counts}; {time.perf_counter() - t0:.2f}s; db {db}"
        + (f"; output {args.output}" if args.output else ""),
        file=sys.stderr,
    )
    return 0


def cmd_submit(args: argparse.Namespace, out: TextIO) -> int:
    """Submit a batch file to Kafka (and record its jobs as queued unless --no-db)."""
    from pipeline.producer import Producer
    from pipeline.queue.kafka import KafkaQueue
    from pipeline.settings import get_settings
    from pipeline.store import ResultStore

    settings = get_settings()
    store = None if args.no_db else ResultStore.from_url(_db_url(args))
    queue = KafkaQueue(settings)
    try:
        s = Producer(queue, store).submit_file(
            args.file, batch_id=args.batch_id, default_max_tokens=args.max_tokens
        )
    finally:
        queue.close()
        if store is not None:
            store.close()
    out.write(json.dumps({"batch_id": s.batch_id, "submitted": s.submitted, "invalid": s.invalid}) + "\n")
    print(f"# {s.submitted} jobs in {s.seconds:.2f}s ({s.jobs_per_s:.0f} jobs/s)", file=sys.stderr)
    return 0


def cmd_worker(args: argparse.Namespace, out: TextIO) -> int:
    """A GPU worker without Celery: Kafka intake, engine loop, result sink; SIGTERM drains."""
    import logging

    from workers.worker import WorkerSettings, build_worker, run_until_signalled

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {
        k: v
        for k, v in (
            ("model", args.model),
            ("device", args.device),
            ("dtype", args.dtype),
            ("max_model_len", args.max_model_len),
        )
        if v is not None
    }
    ws = WorkerSettings(**overrides)
    return run_until_signalled(build_worker(worker_settings=ws))


def cmd_api(args: argparse.Namespace, out: TextIO) -> int:
    """Serve the HTTP API."""
    import uvicorn

    uvicorn.run("pipeline.api:create_app", factory=True, host=args.host, port=args.port, log_level="info")
    return 0


def cmd_migrate(args: argparse.Namespace, out: TextIO) -> int:
    """alembic upgrade head on the database."""
    from pipeline.store import migrate

    url = _db_url(args)
    migrate(url)
    print(f"# migrated {url.split('@')[-1]}", file=sys.stderr)
    return 0


def cmd_results(args: argparse.Namespace, out: TextIO) -> int:
    """A batch's terminal results as JSONL (OpenAI lines for an OpenAI batch)."""
    from pipeline.store import ResultStore
    from schemas.batchfile import LineFormat, format_output_line

    store = ResultStore.from_url(_db_url(args))
    try:
        batch = store.get_batch(args.batch_id)
        if batch is None:
            print(f"no batch {args.batch_id!r}", file=sys.stderr)
            return 1
        fmt = LineFormat(batch.input_format) if batch.input_format in set(LineFormat) else LineFormat.PLAIN
        after = None
        while True:
            page = store.list_jobs(batch_id=args.batch_id, limit=1000, after=after)
            if not page:
                break
            for rec in page:
                result = rec.result()
                if result is not None:
                    out.write(format_output_line(result, fmt))
            after = page[-1].id
        p = batch.progress
        print(f"# batch {batch.id} {batch.status}: {p.done}/{p.total or p.recorded} done", file=sys.stderr)
    finally:
        store.close()
    return 0


def _engine_args(a: argparse.ArgumentParser, model_default: str | None = "tiny") -> None:
    a.add_argument(
        "--model", default=model_default, help="preset (tiny, llama3-8b) or Hugging Face checkpoint directory"
    )
    a.add_argument("--max-model-len", type=int, default=None)
    a.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    a.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    a.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="KV cache: the model's dtype (auto) or fp8 e4m3 (twice the tokens; outputs may differ slightly)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="firsttoken", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate for a JSONL file of {id, prompt} lines, in this process")
    g.add_argument("file", help='JSONL file, one {"id": ..., "prompt": ...} per line')
    _engine_args(g)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.set_defaults(func=cmd_generate)

    r = sub.add_parser(
        "run", help="the whole pipeline in this process (no services): results to SQLite and JSONL"
    )
    r.add_argument(
        "file", help="JSONL batch file: plain {id, prompt|messages, ...} or OpenAI Batch API lines"
    )
    _engine_args(r)
    r.add_argument("--output", "-o", default=None, help="output JSONL, in input order (default: stdout)")
    r.add_argument("--db", default=None, help="database URL (default: sqlite:///firsttoken.db)")
    r.add_argument("--batch-id", default=None, help="default: derived from the file's path (re-runs resume)")
    r.add_argument("--max-tokens", type=int, default=None, help="for lines that do not set max_tokens")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("submit", help="submit a JSONL batch file to Kafka")
    s.add_argument("file")
    s.add_argument("--batch-id", default=None)
    s.add_argument("--max-tokens", type=int, default=None, help="for lines that do not set max_tokens")
    s.add_argument("--db", default=None, help="database URL (default: FIRSTTOKEN_DATABASE_URL)")
    s.add_argument("--no-db", action="store_true", help="do not record queued rows")
    s.set_defaults(func=cmd_submit)

    w = sub.add_parser("worker", help="a GPU worker without Celery (Kafka -> engine -> database)")
    _engine_args(w, model_default=None)
    w.set_defaults(func=cmd_worker)

    a = sub.add_parser("api", help="serve the HTTP API")
    a.add_argument("--host", default="127.0.0.1")
    a.add_argument("--port", type=int, default=8000)
    a.set_defaults(func=cmd_api)

    m = sub.add_parser("migrate", help="alembic upgrade head")
    m.add_argument("--db", default=None, help="database URL (default: FIRSTTOKEN_DATABASE_URL)")
    m.set_defaults(func=cmd_migrate)

    res = sub.add_parser("results", help="a batch's results as JSONL")
    res.add_argument("batch_id")
    res.add_argument("--db", default=None, help="database URL (default: FIRSTTOKEN_DATABASE_URL)")
    res.set_defaults(func=cmd_results)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args, sys.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
