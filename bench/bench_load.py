"""Time to first token under load: Poisson arrivals into the engine at fixed rates, for a while,
with prompts of 256-2048 tokens (half of them opening with one of a few 512-token shared
prefixes) and 64-256 output tokens. Reports TTFT p50/p90/p99, time per output token p50/p99,
throughput, and goodput (requests per second that met both SLOs: TTFT and TPOT targets).

Each request's arrival is its scheduled Poisson time (on the monotonic clock), so a step that
keeps a new request waiting counts in its TTFT, as a client would see it.

    python3 bench/bench_load.py --preset llama3-8b --rates 8,16,32 --duration 30       # a GPU
    python3 bench/bench_load.py --preset llama3-8b --rates 32 --quantization fp8
    python3 bench/bench_load.py --preset llama3-8b --rates 32 --tpot-targets none,15,20,30   # the trade-off
    python3 bench/bench_load.py --preset tiny --rates 4 --duration 3 --device cpu       # a smoke run
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header, md_table, write_report
from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def workload(rate: float, duration_s: float, vocab: int, seed: int, *, prefixes: int = 4,
             prefix_len: int = 512, prompt_range: tuple[int, int] = (256, 2048),
             out_range: tuple[int, int] = (64, 256)) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt token ids, output tokens) of each request, in arrival order."""
    rng = random.Random(seed)
    shared = [[rng.randrange(2, vocab) for _ in range(prefix_len)] for _ in range(prefixes)]
    reqs, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return reqs
        n = rng.randint(*prompt_range)
        if rng.random() < 0.5 and n > prefix_len:
            ids = rng.choice(shared) + [rng.randrange(2, vocab) for _ in range(n - prefix_len)]
        else:
            ids = [rng.randrange(2, vocab) for _ in range(n)]
        reqs.append((t, ids, rng.randint(*out_range)))


def warm_up(engine: LLMEngine, vocab: int, max_prompt: int) -> None:
    """A few requests run through before any is timed: the first steps of an engine pay for
    allocations, compiles and caches that no later request does. The cost model's fit carries over."""
    rng = random.Random(12345)
    for i, n in enumerate((max_prompt // 2, max_prompt, 64, 64)):
        engine.add_request(f"warm{i}", prompt_token_ids=[rng.randrange(2, vocab) for _ in range(n)],
                           sampling=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def run_rate(engine: LLMEngine, reqs: list[tuple[float, list[int], int]], duration_s: float) -> dict[str, Any]:
    start = time.monotonic() + 0.05
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    i = 0
    while i < len(reqs) or engine.has_unfinished():
        now = time.monotonic()
        while i < len(reqs) and start + reqs[i][0] <= now:
            at, ids, out = reqs[i]
            rid = f"r{i}"
            arrival[rid] = start + at
            engine.add_request(rid, prompt_token_ids=ids, arrival_time=start + at,
                               sampling=SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(0.01, start + reqs[i][0] - time.monotonic())))
            continue
        step = engine.step()
        for ev in step.first_tokens:
            first[ev.request_id] = ev.time
        for f in step.finished:
            done[f.request_id] = (f.timings.finished or time.monotonic(), len(f.output_token_ids))
    wall = time.monotonic() - start
    ttft = [(first[r] - arrival[r]) * 1e3 for r in first]
    tpot = [(done[r][0] - first[r]) * 1e3 / (done[r][1] - 1) for r in done if r in first and done[r][1] > 1]
    slo = getattr(engine, "slo", None)
    return {"requests": len(reqs), "wall_s": wall,
            "cost_model": None if slo is None else {
                "fixed_ms": slo.model.fixed_s * 1e3, "per_token_us": slo.model.per_token_s * 1e6,
                "per_decode_us": slo.model.per_decode_s * 1e6,
                "mean_rel_error": slo.model.mean_rel_error, "steps": slo.model.observed}, "ttft_ms": ttft, "tpot_ms": tpot, "per_request": {
        r: ((first[r] - arrival[r]) * 1e3, (done[r][0] - first[r]) * 1e3 / max(1, done[r][1] - 1)) for r in done if r in first},
        "output_tokens": sum(n for _, n in done.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--rates", default="8,16,32")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--ttft-slo-ms", type=float, default=200.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=20.0)
    ap.add_argument("--tpot-targets", default="none",
                    help="comma-separated engine TPOT targets (ms) to run in turn, 'none' for no target: the trade-off curve")
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lo = min(256, args.max_prompt // 2)
    rows, data = [], {**header(), "bench": "load", "preset": args.preset, "quantization": args.quantization,
                      "kv_cache_dtype": args.kv_cache_dtype, "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms},
                      "rates": []}
    for target in args.tpot_targets.split(","):
        tpot_target = None if target == "none" else float(target)
        cfg = EngineConfig(device=args.device, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                           max_model_len=args.max_prompt + 512, tpot_target_ms=tpot_target)
        engine = LLMEngine(args.preset, cfg)
        vocab = engine.model_config.vocab_size
        warm_up(engine, vocab, args.max_prompt)
        for rate in (float(r) for r in args.rates.split(",")):
            reqs = workload(rate, args.duration, vocab, args.seed, prefix_len=min(512, lo),
                            prompt_range=(lo, args.max_prompt), out_range=(64, 256))
            r = run_rate(engine, reqs, args.duration)
            good = sum(1 for t, p in r["per_request"].values() if t <= args.ttft_slo_ms and p <= args.tpot_slo_ms)
            row = {
                "tpot_target": target,
                "rate": rate,
                "requests": r["requests"],
                "ttft_p50": pct(r["ttft_ms"], 0.5),
                "ttft_p90": pct(r["ttft_ms"], 0.9),
                "ttft_p99": pct(r["ttft_ms"], 0.99),
                "tpot_p50": pct(r["tpot_ms"], 0.5),
                "tpot_p99": pct(r["tpot_ms"], 0.99),
                "out_tok_s": r["output_tokens"] / r["wall_s"],
                "goodput_rps": good / r["wall_s"],
                "slo_met": good / max(1, r["requests"]),
                "mean_ttft": statistics.fmean(r["ttft_ms"]) if r["ttft_ms"] else None,
                "cost_model": r["cost_model"],
                "model_err": (r["cost_model"] or {}).get("mean_rel_error"),
            }
            rows.append(row)
            data["rates"].append(row)
        del engine
    md = md_table(rows, ["tpot_target", "rate", "requests", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p99",
                         "out_tok_s", "goodput_rps", "slo_met", "model_err"])
    write_report(f"bench_load_{args.preset}{'_' + args.quantization if args.quantization else ''}", data,
                 f"TTFT under load, {args.preset}, quantization {args.quantization}, times in ms\n\n{md}")


if __name__ == "__main__":
    main()
