"""Can a decode step's attention (bound by the KV cache's bytes) and its FP8 GEMMs (bound by FLOPs) run at
once on one GPU? One layer's worth of each, repeated 32 times (a Llama-3.1-8B decode step for M sequences
at context C), timed alone, one after the other on one stream, and on two streams at once under each
stream-priority order:

    python3 bench/bench_overlap.py                      # M = 256, 512; C = 1500
    python3 bench/bench_overlap.py --rows 512 --context 1100

If "concurrent" is near max(attention, gemms), the two can share the GPU, and a decode step split in two
halves (FIRSTTOKEN_DECODE_OVERLAP) has room; if it is near their sum, the block scheduler runs them one
after the other whatever the streams. Prints JSON and a markdown table; writes them under $OUT when set.

Measured on an H100 (bench/results/2026-12-07-session22-overlap-micro-h100-9aff7ef.md), M = 512: attention
18.6 ms (2705 GB/s), GEMMs 5.59 ms (1279 TFLOP/s), one after the other 24.5, on two streams 24.3-25.0
under every priority order: no overlap at all (at M = 256 the GEMMs alone are bound by Triton's host
dispatch, which the serial run hides). The engine path this tested, a decode step's two halves on two
streams, each half's attention beside the other's GEMMs (session 22, ffbd670: exact tokens, GPU tests
passing), lowered offline throughput on the H100: 12,255 tok/s, and 12,378 with the halves' attentions
free, against 12,643 without (decode graphs 54.1 / 53.4 against 51.6 s;
bench/results/2026-12-07-session22-overlap-throughput-*); removed. The attention's programs fill every SM,
so a GEMM gets SMs only as they drain.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header, md_table, write_report
from kernels.decode_attention import decode_attention_triton
from kernels.fp8_quant import quantize_triton
from workers.engine.presets import get_preset
from workers.engine.quantization import Fp8Linear

FP8 = torch.float8_e4m3fn
CFG = get_preset("llama3-8b")
LAYERS, HQ, HK, D, BS = CFG.num_layers, CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, 16


def timed(fn, reps: int = 7) -> float:
    """Median ms of `reps` calls of fn (each issues its own work, streams joined back to the current one)."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]


def case(m: int, ctx: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    per_seq = -(-ctx // BS)
    n_blocks = m * per_seq + 1
    kc = torch.randn((n_blocks, BS, HK, D), device="cuda", generator=g, dtype=torch.bfloat16).to(FP8)
    vc = torch.randn((n_blocks, BS, HK, D), device="cuda", generator=g, dtype=torch.bfloat16).to(FP8)
    ids = torch.arange(1, n_blocks, device="cuda", dtype=torch.int32)
    bt = ids[torch.randperm(n_blocks - 1, device="cuda", generator=g)].view(m, per_seq).contiguous()
    sl = torch.full((m,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn((m, HQ, D), device="cuda", generator=g, dtype=torch.bfloat16)
    projs = [Fp8Linear(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16), scale_search=False)
             for n, k in ((CFG.q_size + 2 * CFG.kv_size, CFG.hidden_size), (CFG.hidden_size, CFG.q_size),
                          (2 * CFG.intermediate_size, CFG.hidden_size), (CFG.hidden_size, CFG.intermediate_size))]
    xs = [quantize_triton(torch.randn((m, p.in_features), device="cuda", dtype=torch.bfloat16)) for p in projs]

    def attention() -> None:
        for _ in range(LAYERS):
            decode_attention_triton(q, kc, vc, bt, sl, D**-0.5)

    def gemms() -> None:
        for _ in range(LAYERS):
            for p, (xq, xs_) in zip(projs, xs):
                p((xq, xs_))

    lo, hi = torch.cuda.Stream.priority_range()  # (lowest, greatest): greater priority is the lower number

    def concurrent(attn_prio: int, gemm_prio: int):
        sa = torch.cuda.Stream(priority=attn_prio)
        sg = torch.cuda.Stream(priority=gemm_prio)

        def run() -> None:
            main = torch.cuda.current_stream()
            sa.wait_stream(main)
            sg.wait_stream(main)
            with torch.cuda.stream(sa):
                attention()
            with torch.cuda.stream(sg):
                gemms()
            main.wait_stream(sa)
            main.wait_stream(sg)
        return run

    def serial() -> None:
        attention()
        gemms()

    row: dict = {"M": m, "context": ctx}
    row["attention ms"] = a = timed(attention)
    row["gemms ms"] = gm = timed(gemms)
    row["serial ms"] = timed(serial)
    row["concurrent ms"] = timed(concurrent(lo, lo))
    row["gemms first ms"] = timed(concurrent(lo, hi))
    row["attention first ms"] = timed(concurrent(hi, lo))
    best = min(row["concurrent ms"], row["gemms first ms"], row["attention first ms"])
    row["best / max"] = best / max(a, gm)  # 1.0: perfect overlap
    row["best / sum"] = best / (a + gm)  # 1.0: none
    row["attention GB/s"] = 2 * m * ctx * HK * D * LAYERS / a / 1e6
    flops = 2 * m * sum(p.in_features * p.out_features for p in projs) * LAYERS
    row["gemms TFLOP/s"] = flops / gm / 1e9
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,512")
    ap.add_argument("--context", type=int, default=1500)
    args = ap.parse_args()
    rows = []
    for m in (int(x) for x in args.rows.split(",")):
        rows.append(case(m, args.context))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    cols = list(rows[0])
    data = {"header": header(), "layers": LAYERS, "rows": rows}
    md = (f"### attention beside FP8 GEMMs, {data['header']['machine']}, {data['header']['commit']}\n\n"
          + md_table(rows, cols))
    write_report(f"bench_overlap_ctx{args.context}", data, md)


if __name__ == "__main__":
    main()
