"""The engine's real scheduler driven on the CPU through an offline run, each step priced by a cost model: a
prediction of what a scheduling option (kv_reserve) does to throughput where the KV cache cannot hold every
request at its end, before a GPU measures it. It is a model, not a measurement.

A step costs `overhead + max(weight_read, per_token * tokens) + per_row * sampled + per_ctx * decode context
tokens`: the projections' FLOPs at the FP8 rate (or their weight bytes when few tokens run), the bf16 head on
every sampled row, and each decode's KV bytes at the copy rate. The default constants are Llama-3.1-8B FP8 with an
fp8 cache on an H100: copy 2950 GB/s, and the projections at an effective 900 TFLOP/s (their GEMMs at a decode
step's ~500 rows and a mixed step's 8192, with their quantizing ops; the peak is ~1250). That rate fits the H100's
measured runs of session 24 (tree 675e8f1) step kind by step kind: kv_reserve 0, measured 13,023 tok/s, 1886
decode steps in 49.5 s of device time and 201 mixed ones in 26.8 s, modelled 12,986, 1884 in 48.7 s and 201 in
28.3; kv_reserve 0.85, 14,448 (1939 in 51.0 s, 136 in 17.7), modelled 14,445 (1935 in 50.4, 136 in 18.8). At the
peak rate the model was 14-17% optimistic, mixed steps 26% and decode steps 10% short of their real time.

    python3 bench/sim_schedule.py [--kv-tokens 969728] [--reserve 0,1,auto] [--prompts 1000] [--stop uniform:20]

--stop uniform:LO gives each answer a length uniform in [LO, output-len] (an EOS) under max_tokens --max-tokens
(default output-len): what kv_reserve "auto" learns from (workers.engine.scheduler.AdaptiveReserve).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARAMS = 6.98e9  # Llama-3.1-8B's projection weights (the decoder layers)
HEAD = 4096 * 128256  # its lm_head


def step_seconds(tokens: int, sampled: int, decode_ctx: int, a: argparse.Namespace) -> float:
    gemm = max(PARAMS / (a.copy_gbps * 1e9), 2 * PARAMS * tokens / (a.fp8_tflops * 1e12))
    head = 2 * HEAD * sampled / (a.bf16_tflops * 1e12)
    attention = decode_ctx * a.kv_bytes_per_token / ((a.attention_gbps or a.copy_gbps) * 1e9)
    return a.overhead_ms / 1e3 + gemm + head + attention


def output_lengths(a: argparse.Namespace) -> list[int]:
    """Each request's output length: max_tokens (`--stop max`, ignore_eos), or uniform in [LO, output_len]
    (`--stop uniform:LO`, an answer that ends at EOS), seeded."""
    if a.stop == "max":
        return [a.output_len] * a.prompts
    kind, _, lo_text = a.stop.partition(":")
    if kind != "uniform" or not lo_text.isdigit() or not 1 <= int(lo_text) <= a.output_len:
        raise SystemExit(f"--stop takes max or uniform:LO with 1 <= LO <= --output-len, not {a.stop!r}")
    lo = int(lo_text)
    rng = random.Random(0)
    return [rng.randint(lo, a.output_len) for _ in range(a.prompts)]


def reserve_value(text: str) -> float | str:
    """One --reserve value: "auto", or a share in [0, 1] (as EngineConfig.kv_reserve takes)."""
    if text == "auto":
        return text
    try:
        share = float(text)
    except ValueError:
        share = float("nan")
    if not 0.0 <= share <= 1.0:
        raise SystemExit(f"--reserve takes auto or shares in [0, 1], not {text!r}")
    return share


def simulate(reserve: float | str, a: argparse.Namespace) -> dict:
    # the engine's modules import torch (~3 s): only once the arguments are known to be good
    from schemas.sampling import SamplingParams
    from workers.engine.kv_cache_manager import KVCacheManager
    from workers.engine.scheduler import Scheduler
    from workers.engine.sequence import Request, RequestTimes

    max_tokens = a.max_tokens or a.output_len
    kv = KVCacheManager(a.kv_tokens // a.block_size, a.block_size, enable_prefix_caching=False)
    sched = Scheduler(kv, a.max_num_batched_tokens, a.max_num_seqs, a.input_len + max_tokens + 1,
                      admission_batch=max(1, a.max_num_seqs // 8), kv_reserve=reserve)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    lengths = output_lengths(a)
    reqs = [Request(f"s{i}", [7 + i % 50] * a.input_len, a.input_len, sp, 0, i, RequestTimes(0.0))
            for i in range(a.prompts)]
    want = {r.request_id: n for r, n in zip(reqs, lengths)}
    for r in reqs:
        sched.add(r)
    seconds = steps = computed = 0
    by_kind = {"decode": [0, 0.0], "mixed": [0, 0.0]}  # steps of decodes only / with prompt tokens: [steps, seconds]
    peak_running = 0
    while sched.has_work():
        out = sched.schedule()
        if not out.scheduled:
            raise RuntimeError("a step with nothing scheduled: the pool cannot hold one request")
        steps += 1
        tokens = sampled = decode_ctx = 0
        for e in out.scheduled:
            r = e.request
            tokens += e.num_new_tokens
            if e.num_new_tokens == 1 and r.num_computed_tokens >= r.num_prompt_tokens:
                decode_ctx += r.num_computed_tokens + 1
            r.num_computed_tokens += e.num_new_tokens
            if r.num_computed_tokens == r.num_tokens:
                sampled += 1
                r.token_ids.append(11)
                if r.num_output_tokens >= want[r.request_id]:
                    sched.finish(r, "length")
        computed += tokens
        peak_running = max(peak_running, len(sched.running))
        sec = step_seconds(tokens, sampled, decode_ctx, a)
        seconds += sec
        kind = by_kind["decode" if all(e.num_new_tokens == 1 for e in out.scheduled) else "mixed"]
        kind[0] += 1
        kind[1] += sec
    output = sum(lengths)
    return {"kv_reserve": reserve, "modelled_tok_s": output / seconds, "modelled_s": seconds, "steps": steps,
            "preemptions": sched.num_preemptions, "tokens_computed": computed,
            "recomputed_tokens": computed - sum(a.input_len + n - 1 for n in lengths),
            "peak_running": peak_running,
            **{f"{k}_steps": v[0] for k, v in by_kind.items()}, **{f"{k}_s": v[1] for k, v in by_kind.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-tokens", type=int, default=15152 * 64, help="KV cache room in tokens (the H100 run's)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--reserve", default="0,1", help="comma-separated kv_reserve values (a share, or auto)")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=None, help="each request's max_tokens (default: output-len)")
    ap.add_argument("--stop", default="max", help="max: every answer runs to output-len; uniform:LO: its length is "
                    "uniform in [LO, output-len] (EOS)")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--fp8-tflops", type=float, default=900.0,
                    help="the projections' effective FP8 rate (H100, fitted: see above; ~1000 fits the H200's run of "
                    "session 19 with attention at 3234 GB/s)")
    ap.add_argument("--bf16-tflops", type=float, default=690.0)
    ap.add_argument("--copy-gbps", type=float, default=2950.0)
    ap.add_argument("--attention-gbps", type=float, default=None,
                    help="the decode attention's read rate (default: the copy rate), a kernel's measured GB/s")
    ap.add_argument("--kv-bytes-per-token", type=int, default=32 * 2 * 8 * 128, help="K and V of every layer, fp8")
    ap.add_argument("--overhead-ms", type=float, default=1.2, help="a step's launches and small kernels")
    a = ap.parse_args()
    if a.max_tokens is not None and a.max_tokens < a.output_len:  # answers would outgrow max_model_len
        raise SystemExit(f"--max-tokens ({a.max_tokens}) must be at least --output-len ({a.output_len})")
    reserves = [reserve_value(r) for r in a.reserve.split(",")]
    output_lengths(a)  # --stop checked before the first run
    t0 = time.perf_counter()
    rows = [simulate(r, a) for r in reserves]
    print(json.dumps({"args": vars(a), "rows": rows, "wall_s": time.perf_counter() - t0}, indent=1))
    print("\n| kv_reserve | modelled tok/s | modelled s | steps | preemptions | recomputed tokens | peak running | "
          "decode steps, s | mixed steps, s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv_reserve']} | {r['modelled_tok_s']:,.0f} | {r['modelled_s']:.1f} | {r['steps']} | "
              f"{r['preemptions']} | {r['recomputed_tokens']:,} | {r['peak_running']} | "
              f"{r['decode_steps']}, {r['decode_s']:.1f} | {r['mixed_steps']}, {r['mixed_s']:.1f} |")


if __name__ == "__main__":
    main()
