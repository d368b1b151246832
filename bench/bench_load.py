"""Time to first token under load: Poisson arrivals into the engine at fixed rates, for a while,
with prompts of 256-2048 tokens (half of them opening with one of 8 shared 512-token prefixes)
and 64-256 output tokens. Reports TTFT p50/p90/p99, time per output token p50/p99, throughput,
goodput (requests per second that met both SLOs), and the step-cost model's prediction error.

Each request's arrival is its scheduled Poisson time (on the monotonic clock), so a step that
keeps a new request waiting counts in its TTFT, as a client would see it. One engine serves every
row: the TPOT target is switched between rows (none: no budget function).

--goodput searches for the highest rate that meets MLPerf's Llama-3.1-8B limits, interactive
(TTFT p99 <= 500 ms, TPOT p99 <= 30 ms) and server (2000 ms / 100 ms): a ladder of rates up to
the first miss, then bisection; a probe stops early (and fails) once more than 1% of its
requests have waited past the TTFT limit. Prints and records max_rate_interactive and
max_rate_server (req/s).

Step timing: the engine's cost model learns from each step's CUDA-event time on a GPU
(SampledTokens.device_seconds; the host's read-back time, which async scheduling distorts,
mispredicted steps by 54-680% on the H200), from the host's clock on a CPU. With $OUT set, every
step the model saw (shape, device time, prediction) goes to bench_load_*_steps.json.

--core process drives the engine the worker runs: one engine core in a process of its own
(workers.engine_core.ProcessCore), requests submitted and outputs read over its pipe, as the
worker's intake and results threads do (the cost model lives in that process: no model_err).

    python3 bench/bench_load.py --preset llama3-8b --rates 8,16,24,32 --duration 15 --tpot-targets none,15,20,30
    python3 bench/bench_load.py --preset llama3-8b --goodput --duration 20
    python3 bench/bench_load.py --preset llama3-8b --goodput --duration 12 --core process
    python3 bench/bench_load.py --preset tiny --rates 4 --duration 3 --device cpu       # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header, load_floor_s, md_table, measure_ceilings, write_report
from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine
from workers.engine.presets import PRESETS
from workers.engine.slo import StepShape
from workers.engine_core import AddRequest, ProcessCore


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def workload(rate: float, duration_s: float, vocab: int, seed: int, *, draw: int = 0, prefixes: int = 8,
             prefix_len: int = 512, prompt_range: tuple[int, int] = (256, 2048),
             out_range: tuple[int, int] = (64, 256)) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt token ids, output tokens) of each request, in arrival order.

    The shared prefixes come from `seed` alone; everything else from (seed, draw): probes of
    one engine with distinct draws share the prefixes (a system prompt stays cached) and nothing
    else. (Until 2026-12-02 every probe drew the same prompts: after the first probe of a run,
    the engine's prefix cache held all but the last partial block of most prompts, so later rows
    computed a few prompt tokens a request; the H200 results of 2026-12-01 are flattered so.)"""
    rng = random.Random(seed)
    shared = [[rng.randrange(2, vocab) for _ in range(prefix_len)] for _ in range(prefixes)]
    rng = random.Random(seed * 1_000_003 + draw)
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


INTERACTIVE = (500.0, 30.0)  # MLPerf Llama-3.1-8B interactive: TTFT p99, TPOT p99 (ms)
SERVER = (2000.0, 100.0)


def warm_up(engine: LLMEngine, vocab: int, max_prompt: int) -> None:
    """A few requests run through before any is timed: the first steps of an engine pay for
    allocations, compiles and caches that no later request does. The cost model's fit carries over."""
    rng = random.Random(12345)
    for i, n in enumerate((max_prompt // 2, max_prompt, 64, 64)):
        engine.add_request(f"warm{i}", prompt_token_ids=[rng.randrange(2, vocab) for _ in range(n)],
                           sampling=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


class StepTrace:
    """Every step the engine's cost model observes: its shape, its device time (CUDA events; the
    engine feeds the model those) and what the model predicted for it just before, so a model can
    be judged again offline (bench/fit_cost_model.py) on the steps the H200 ran."""

    PATHS: ClassVar[dict[str, int]] = {"decode_graph": 0, "prefill_graph": 1, "eager": 2, "mixed_graph": 3}

    def __init__(self, engine: LLMEngine) -> None:
        self.rows: list[list] = []  # per step: probe, path, prompt tokens, decodes, context, pairs, us, predicted us
        self.probe = 0
        model = engine.slo.model  # type: ignore[union-attr]
        observe = model.observe_shape

        def traced(shape: StepShape, seconds: float) -> None:
            if shape.prefill_tokens + shape.decodes > 0 and seconds > 0:
                self.rows.append([self.probe, self.PATHS.get(shape.path, 2), shape.prefill_tokens, shape.decodes,
                                  shape.decode_context, shape.prefill_pairs, round(seconds * 1e6, 1),
                                  round(model.predict_shape(shape) * 1e6, 1)])
            observe(shape, seconds)

        model.observe_shape = traced  # type: ignore[method-assign]


def set_target(engine: LLMEngine, target_ms: float | None) -> None:
    """Switch the TPOT target between rows: None serves with the fixed budget (the cost model
    keeps learning, so its error is measured in every row)."""
    slo = engine.slo
    assert slo is not None
    if target_ms is None:
        engine.scheduler.budget_fn = None
    else:
        slo.tpot_target_s = target_ms / 1e3
        slo.reset()
        engine.scheduler.budget_fn = slo


def run_rate(engine: LLMEngine, reqs: list[tuple[float, list[int], int]], give_up_ttft_ms: float | None = None,
             tag: str = "r") -> dict[str, Any]:
    """Serve one workload; with give_up_ttft_ms, stop (gave_up: True) once more than 1% of the
    requests have waited longer than that for their first token."""
    start = time.monotonic() + 0.05
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    model = engine.slo.model if engine.slo is not None else None
    err0 = (model._rel_err_sum, model._rel_err_n) if model is not None else None
    i, gave_up, late_allowed = 0, False, len(reqs) // 100
    while i < len(reqs) or engine.has_unfinished():
        now = time.monotonic()
        while i < len(reqs) and start + reqs[i][0] <= now:
            at, ids, out = reqs[i]
            rid = f"{tag}{i}"
            arrival[rid] = start + at
            engine.add_request(rid, prompt_token_ids=ids, arrival_time=start + at,
                               sampling=SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
            i += 1
        if give_up_ttft_ms is not None and not gave_up:
            limit = give_up_ttft_ms / 1e3
            late = sum(1 for r, t in arrival.items() if (first.get(r, now) - t) > limit)
            if late > late_allowed:
                gave_up = True
                i = len(reqs)
                for r in list(arrival):
                    if r not in done:
                        engine.abort(r)
        if not engine.has_unfinished():
            if i < len(reqs):
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
    cost = None
    if model is not None:
        n = model._rel_err_n - err0[1]  # type: ignore[index]
        cost = {**model.coefficients(), "steps": n,
                "mean_rel_error": (model._rel_err_sum - err0[0]) / n if n else None}  # type: ignore[index]
    return {"requests": len(reqs), "wall_s": wall, "gave_up": gave_up, "cost_model": cost, "ttft_ms": ttft,
            "tpot_ms": tpot, "output_tokens": sum(n for _, n in done.values()),
            "per_request": {r: ((first[r] - arrival[r]) * 1e3, (done[r][0] - first[r]) * 1e3 / max(1, done[r][1] - 1))
                            for r in done if r in first}}


def _text(ids: list[int]) -> str:
    """A preset's byte-level tokenizer reads a printable byte as its one token."""
    return bytes(32 + i % 95 for i in ids).decode("ascii")


def core_warm_up(core: ProcessCore, max_prompt: int) -> None:
    rng = random.Random(12345)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = {f"warm{i}" for i in range(4)}
    core.submit([AddRequest(f"warm{i}", _text([rng.randrange(95) for _ in range(n)]), None, sp)
                 for i, n in enumerate((max_prompt // 2, max_prompt, 64, 64))])
    while want:
        out = core.get(1.0)
        if out is not None:
            want -= {f.request_id for f in out.finished}


def run_rate_core(core: ProcessCore, reqs: list[tuple[float, list[int], int]], give_up_ttft_ms: float | None = None,
                  tag: str = "r") -> dict[str, Any]:
    """run_rate through an engine core in its own process: each request is submitted at its
    arrival (with that arrival time), first tokens and finished requests are read off its pipe."""
    texts = [_text(ids) for _, ids, _ in reqs]  # before the clock starts
    start = time.monotonic() + 0.05
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    i, gave_up, late_allowed = 0, False, len(reqs) // 100
    while i < len(reqs) or len(done) < len(arrival):
        now = time.monotonic()
        batch = []
        while i < len(reqs) and start + reqs[i][0] <= now:
            at, _, out = reqs[i]
            rid = f"{tag}{i}"
            arrival[rid] = start + at
            batch.append(AddRequest(rid, texts[i], None, SamplingParams(max_tokens=out, temperature=0.0,
                                                                        ignore_eos=True), arrival_time=start + at))
            i += 1
        if batch:
            core.submit(batch)
        if give_up_ttft_ms is not None and not gave_up:
            limit = give_up_ttft_ms / 1e3
            late = sum(1 for r, t in arrival.items() if (first.get(r, now) - t) > limit)
            if late > late_allowed:
                gave_up = True
                i = len(reqs)
                core.abort([r for r in arrival if r not in done])
        wait = 0.002 if i >= len(reqs) else max(0.0, min(0.002, start + reqs[i][0] - time.monotonic()))
        out = core.get(wait)
        if out is None:
            continue
        for rid, t in out.first_tokens:
            first[rid] = t
        for f in out.finished:
            done[f.request_id] = (f.timings.finished or time.monotonic(), len(f.output_token_ids))
        for rid, _, _ in out.rejected:
            done[rid] = (time.monotonic(), 0)
    wall = time.monotonic() - start
    ttft = [(first[r] - arrival[r]) * 1e3 for r in first]
    tpot = [(done[r][0] - first[r]) * 1e3 / (done[r][1] - 1) for r in done if r in first and done[r][1] > 1]
    return {"requests": len(reqs), "wall_s": wall, "gave_up": gave_up, "cost_model": None, "ttft_ms": ttft,
            "tpot_ms": tpot, "output_tokens": sum(n for _, n in done.values()),
            "per_request": {r: ((first[r] - arrival[r]) * 1e3, (done[r][0] - first[r]) * 1e3 / max(1, done[r][1] - 1))
                            for r in done if r in first}}


def summarize(r: dict[str, Any], target: str, rate: float, slo: tuple[float, float]) -> dict[str, Any]:
    good = sum(1 for t, p in r["per_request"].values() if t <= slo[0] and p <= slo[1])
    return {
        "tpot_target": target, "rate": rate, "requests": r["requests"], "gave_up": r["gave_up"],
        "ttft_p50": pct(r["ttft_ms"], 0.5), "ttft_p90": pct(r["ttft_ms"], 0.9), "ttft_p99": pct(r["ttft_ms"], 0.99),
        "tpot_p50": pct(r["tpot_ms"], 0.5), "tpot_p99": pct(r["tpot_ms"], 0.99),
        "out_tok_s": r["output_tokens"] / r["wall_s"], "goodput_rps": good / r["wall_s"],
        "slo_met": good / max(1, r["requests"]),
        "mean_ttft": statistics.fmean(r["ttft_ms"]) if r["ttft_ms"] else None,
        "cost_model": r["cost_model"], "model_err": (r["cost_model"] or {}).get("mean_rel_error"),
    }


def meets(row: dict[str, Any], limits: tuple[float, float]) -> bool:
    return (not row["gave_up"] and row["ttft_p99"] is not None and row["tpot_p99"] is not None
            and row["ttft_p99"] <= limits[0] and row["tpot_p99"] <= limits[1])


def search(probe, limits: tuple[float, float], ladder: list[float], steps: int) -> tuple[float, list[dict]]:
    """The highest rate of the ladder (then bisected `steps` times toward the first miss) whose
    probe meets `limits`; 0.0 if none does."""
    rows, best, miss = [], 0.0, None
    for rate in ladder:
        row = probe(rate, limits)
        rows.append(row)
        if not meets(row, limits):
            miss = rate
            break
        best = rate
    for _ in range(steps if miss is not None else 0):
        rate = round((best + miss) / 2, 1)
        row = probe(rate, limits)
        rows.append(row)
        if meets(row, limits):
            best = rate
        else:
            miss = rate
    return best, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--rates", default="8,16,32")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--ttft-slo-ms", type=float, default=INTERACTIVE[0])
    ap.add_argument("--tpot-slo-ms", type=float, default=INTERACTIVE[1])
    ap.add_argument("--tpot-targets", default="none",
                    help="comma-separated engine TPOT targets (ms) to run in turn, 'none' for no target: the trade-off curve")
    ap.add_argument("--goodput", action="store_true", help="search max_rate_interactive and max_rate_server instead")
    ap.add_argument("--goodput-targets", default="none,none",
                    help="the engine's TPOT target (ms or none) for the interactive search, then the server search "
                         "(skip: no server search)")
    ap.add_argument("--search-rates", default=None, help="the ladder (req/s); default 16,24,...,64 / 24,32,...,96")
    ap.add_argument("--search-steps", type=int, default=2, help="bisections after the ladder's first miss")
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--prefill-graph-max-tokens", type=int, default=None, help="EngineConfig's (mixed steps replayed)")
    ap.add_argument("--prefill-graph-max-seqs", type=int, default=None, help="EngineConfig's")
    ap.add_argument("--mixed-graph-max-tokens", type=int, default=None, help="EngineConfig's (0: mixed steps eager)")
    ap.add_argument("--core", default="inline", choices=["inline", "process"],
                    help="process: through the worker's engine core in its own process (one TPOT target only)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lo = min(256, args.max_prompt // 2)
    extra = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                               ("max_num_seqs", args.max_num_seqs),
                               ("prefill_graph_max_tokens", args.prefill_graph_max_tokens),
                               ("prefill_graph_max_seqs", args.prefill_graph_max_seqs),
                               ("mixed_graph_max_tokens", args.mixed_graph_max_tokens)) if v is not None}
    targets = [t for t in (args.goodput_targets if args.goodput else args.tpot_targets).split(",") if t != "skip"]
    core_target = None if targets[0] == "none" else float(targets[0])
    if args.core == "process" and len(set(targets)) > 1:
        ap.error("--core process serves one TPOT target (its engine is built with it)")
    cfg = EngineConfig(device=args.device, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                       max_model_len=args.max_prompt + 512,
                       tpot_target_ms=30.0 if args.core == "inline" else core_target, **extra)
    # the GPU's ceilings, measured before the engine takes its memory: each probe's floor (what a
    # perfect engine would need of the device for that workload) is counted at them
    ceil = measure_ceilings(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"# ceilings {ceil}", flush=True)
    engine: LLMEngine | None = None
    core: ProcessCore | None = None
    trace: StepTrace | None = None
    if args.core == "process":
        if args.preset not in PRESETS:
            ap.error("--core process takes a preset (random weights, byte-level prompts)")
        core = ProcessCore(args.preset, cfg)
        vocab = PRESETS[args.preset].vocab_size  # the same workload as inline; each id sent as one printable byte
        device = core.info.get("device", "?")
    else:
        t_build = time.perf_counter()
        engine = LLMEngine(args.preset, cfg)
        print(f"# engine built in {time.perf_counter() - t_build:.1f} s (weights, KV cache, graph captures: "
              f"{ {k: len(g.graphs) for k, g in (('decode', engine.runner.graphs), ('prefill', engine.runner.prefill_graphs), ('mixed', engine.runner.mixed_graphs)) if g is not None} })", flush=True)
        vocab = engine.model_config.vocab_size
        device = str(engine.runner.device)
        trace = StepTrace(engine)
    cuda = device.startswith("cuda")
    mc = PRESETS[args.preset] if core is not None else engine.model_config  # type: ignore[union-attr]
    fp8 = args.quantization == "fp8"
    floor_rates = (ceil["bf16_matmul_tflops"] * 1e12, ceil["copy_gbps"] * 1e9, 1 if args.kv_cache_dtype == "fp8" else 2,
                   ceil.get("fp8_matmul_tflops", ceil["bf16_matmul_tflops"]) * 1e12 if fp8 else None)
    data: dict[str, Any] = {**header(), "bench": "load", "ceilings": ceil, "preset": args.preset, "quantization": args.quantization,
                            "kv_cache_dtype": args.kv_cache_dtype, "core": args.core,
                            "step_timing": "device (CUDA events)" if cuda else "host", "engine_config": {
                                "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs,
                                "prefill_graph_max_tokens": cfg.prefill_graph_max_tokens,
                                "prefill_graph_max_seqs": cfg.prefill_graph_max_seqs,
                                "mixed_graph_max_tokens": cfg.mixed_graph_max_tokens,
                                "mixed_graph_max_prefills": cfg.mixed_graph_max_prefills},
                            "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms}, "rates": []}
    if core is not None:
        core_warm_up(core, args.max_prompt)
    else:
        warm_up(engine, vocab, args.max_prompt)  # type: ignore[arg-type]
    n_probe = [0]

    def probe(rate: float, slo: tuple[float, float], target: str, give_up: float | None = None) -> dict[str, Any]:
        n_probe[0] += 1
        reqs = workload(rate, args.duration, vocab, args.seed, draw=n_probe[0], prefix_len=min(512, lo),
                        prompt_range=(lo, args.max_prompt), out_range=(64, 256))
        tag = f"p{n_probe[0]}-"
        if core is not None:
            r = run_rate_core(core, reqs, give_up, tag=tag)
        else:
            set_target(engine, None if target == "none" else float(target))  # type: ignore[arg-type]
            trace.probe = n_probe[0]  # type: ignore[union-attr]
            r = run_rate(engine, reqs, give_up, tag=tag)  # type: ignore[arg-type]
        row = summarize(r, target, rate, slo)
        row["probe"] = n_probe[0]
        # the share of the probe's duration a perfect engine would keep the device busy: at 1 or more
        # no schedule keeps the queues bounded; rate / floor_util is the rate at which it reaches 1
        util = load_floor_s(mc, reqs, floor_rates[0], floor_rates[1], floor_rates[2], floor_rates[3],
                            cfg.block_size) / args.duration
        row["floor_util"], row["capacity_rps"] = util, rate / util if util > 0 else None
        print(f"# {row['tpot_target']} @ {rate} req/s: ttft p50/p99 {row['ttft_p50']}/{row['ttft_p99']} ms, "
              f"tpot p50/p99 {row['tpot_p50']}/{row['tpot_p99']} ms, gave_up {row['gave_up']}, "
              f"model err {row['model_err']}, floor utilisation {util:.2f}", flush=True)
        return row

    rows: list[dict[str, Any]] = []
    if args.goodput:
        t_int, t_srv = args.goodput_targets.split(",")
        ladders = ([float(r) for r in args.search_rates.split(",")],) * 2 if args.search_rates else (
            [16.0, 24.0, 32.0, 40.0, 48.0, 56.0, 64.0], [24.0, 32.0, 40.0, 48.0, 64.0, 80.0, 96.0])
        best_i, rows_i = search(lambda r, lim: probe(r, lim, t_int, lim[0]), INTERACTIVE, ladders[0], args.search_steps)
        best_s, rows_s = (None, []) if t_srv == "skip" else search(
            lambda r, lim: probe(r, lim, t_srv, lim[0]), SERVER, ladders[1], args.search_steps)
        for r in rows_i:
            r["limits"] = "interactive"
        for r in rows_s:
            r["limits"] = "server"
        rows = rows_i + rows_s
        data.update({"max_rate_interactive": best_i, "max_rate_server": best_s,
                     "goodput_targets": {"interactive": t_int, "server": t_srv},
                     "limits": {"interactive": INTERACTIVE, "server": SERVER}})
        print(f"max_rate_interactive {best_i} req/s (TTFT p99 <= {INTERACTIVE[0]:.0f} ms, TPOT p99 <= "
              f"{INTERACTIVE[1]:.0f} ms; target {t_int}); max_rate_server {best_s} req/s (target {t_srv})", flush=True)
    else:
        for target in args.tpot_targets.split(","):
            for rate in (float(r) for r in args.rates.split(",")):
                rows.append(probe(rate, (args.ttft_slo_ms, args.tpot_slo_ms), target))
    data["rates"] = rows
    if engine is not None:
        data["path_steps"] = dict(engine.runner.path_steps)  # steps per path over the whole run
    if core is not None:
        core.stop()
    else:
        engine.close()  # type: ignore[union-attr]
    cols = ["tpot_target", "rate", "requests", "gave_up", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p99",
            "out_tok_s", "goodput_rps", "slo_met", "model_err", "floor_util", "capacity_rps"]
    if args.goodput:
        cols.insert(0, "limits")
    md = md_table(rows, cols)
    if args.goodput:
        md = (f"max_rate_interactive {data['max_rate_interactive']} req/s, max_rate_server "
              f"{data['max_rate_server']} req/s\n\n") + md
    name = (f"bench_load_{args.preset}{'_' + args.quantization if args.quantization else ''}"
            f"{'_core' if core is not None else ''}{'_goodput' if args.goodput else ''}"
            f"{'_t' + targets[0] if args.goodput and targets and targets[0] != 'none' else ''}"
            f"{f'_pg{cfg.prefill_graph_max_seqs}x{cfg.prefill_graph_max_tokens}' if 'prefill_graph_max_seqs' in extra else ''}"
            f"{f'_mg{cfg.mixed_graph_max_tokens}' if 'mixed_graph_max_tokens' in extra else ''}"
            f"{f'_bt{cfg.max_num_batched_tokens}' if 'max_num_batched_tokens' in extra else ''}")
    if trace is not None and os.environ.get("OUT"):
        cols_t = ["probe", "path (0 decode graph, 1 prefill graph, 2 eager, 3 mixed graph)", "prefill_tokens", "decodes",
                  "decode_context", "prefill_pairs", "device_us", "predicted_us"]
        Path(os.environ["OUT"], f"{name}_steps.json").write_text(
            json.dumps({"commit": data.get("commit"), "columns": cols_t, "steps": trace.rows}))
    write_report(name, data,
                 f"TTFT under load, {args.preset}, quantization {args.quantization}, core {args.core}, "
                 f"step timing {data['step_timing']}, "
                 f"times in ms\n\n{md}")


if __name__ == "__main__":
    main()
