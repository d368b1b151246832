"""The `firsttoken` command line."""

from __future__ import annotations

import argparse
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
    from workers.engine import EngineConfig, InvalidRequestError, LLMEngine

    cfg = EngineConfig(device=args.device, max_model_len=args.max_model_len, dtype=args.dtype)
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
            sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                **(obj.get("sampling") or {}))
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
                "usage": {"prompt_tokens": f.usage.prompt_tokens,
                          "cached_prompt_tokens": f.usage.cached_prompt_tokens,
                          "completion_tokens": f.usage.completion_tokens},
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="firsttoken", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate for a JSONL file of {id, prompt} lines, in this process")
    g.add_argument("file", help="JSONL file, one {\"id\": ..., \"prompt\": ...} per line")
    g.add_argument("--model", default="tiny", help="preset (tiny, llama3-8b) or Hugging Face checkpoint directory")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    g.set_defaults(func=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args, sys.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
