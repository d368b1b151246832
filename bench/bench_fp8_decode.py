"""The GEMMs of a decode step, FP8 against bf16, on the Llama-3.1-8B projections: bf16 F.linear,
torch._scaled_mm (cuBLASLt, per-token x per-channel scales), and kernels/fp8_gemm.py's few-row
weight-streaming kernel (its default tiles and the best of a few), at 1 to 512 rows; and the quantization of
an unfused input (o_proj's): torch's composition against the Triton kernel. Each time is a median
per call over a CUDA graph of calls on distinct weight copies (several times the L2), replayed:
what a decode step's graph sees, with no host launch in it (do_bench's launch-per-call timing
measured the host on small kernels), and the bytes each GEMM must read over that time.

    python3 bench/bench_fp8_decode.py [--rows 1,16,64,128,256,512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header, md_table, write_report

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
CONFIGS = [(16, 256, 4, 4), (32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 4), (16, 512, 4, 4), (64, 128, 4, 5),
           (32, 128, 4, 6), (128, 128, 8, 4)]  # (block_n, block_k, warps, stages)
# above 64 rows: (block_m, block_n, block_k, warps, stages), row tiles of 64 or 128
# and a sixth, the K parts (split-K; 1 when absent)
CONFIGS_M = [(64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (128, 64, 128, 8, 3), (128, 32, 128, 4, 4),
             (64, 32, 256, 4, 4), (128, 128, 128, 8, 3), (64, 64, 256, 4, 3), (128, 64, 64, 4, 4),
             (128, 64, 128, 8, 3, 2), (128, 64, 128, 8, 3, 4), (128, 128, 128, 8, 3, 2), (128, 128, 128, 8, 3, 4),
             (128, 32, 128, 4, 4, 2), (128, 32, 128, 4, 4, 4), (64, 64, 128, 4, 4, 2), (64, 64, 128, 4, 4, 4),
             (128, 64, 256, 8, 3, 3)]
# --tma: the same kernel with TMA loads (kernels.fp8_gemm.fp8_gemm_rowwise_tma), above 64 rows; the
# pipeline is num_stages deep in shared memory (no per-thread addresses), so deeper stages fit
CONFIGS_TMA = [(128, 64, 128, 4, 4), (128, 64, 128, 4, 6), (128, 32, 128, 4, 6), (128, 32, 256, 4, 4),
               (128, 128, 128, 8, 4), (128, 64, 256, 4, 3), (64, 64, 128, 4, 6), (64, 32, 256, 4, 4),
               (128, 64, 128, 4, 4, 2), (128, 32, 128, 4, 6, 2), (128, 64, 128, 4, 6, 3), (128, 128, 128, 8, 4, 2),
               # after the H100 sweep at f8a6a19 (64-row tiles won 128 rows: two row tiles, twice the programs):
               # deeper and wider 64-row tiles for gate_up (51.3 against _scaled_mm's 49.9 us) and qkv at 256 rows
               (64, 64, 128, 4, 8), (64, 64, 256, 4, 4), (64, 128, 128, 4, 4), (64, 128, 128, 8, 4),
               (64, 32, 128, 4, 8), (128, 128, 128, 8, 5), (128, 64, 128, 4, 8)]


def chain_us(fn, calls: list[tuple], reps: int = 20) -> float:
    """Median us per call of fn(*args) over `calls` (each on its own weight copy), replayed back to
    back in one CUDA graph: as a decode step runs its layers, no host launch in the timing, and
    every weight read from DRAM (the copies together are several times the L2)."""
    for args in calls:  # compile and warm up outside the capture
        fn(*args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for args in calls:
            fn(*args)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        g.replay()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1))
    return 1e3 * statistics.median(times) / len(calls)


def scaled_mm_swapped(x_q, x_s, w_q, w_s, out_dtype=torch.bfloat16, fast_accum=False, contiguous=True):
    """C = X W^T computed as (W X^T)^T: the weight as _scaled_mm's first operand, so cuBLASLt tiles
    the output channels (thousands) and not the few rows (its M tiles are 64 or more), then the
    [N, M] result transposed back (a copy of M x N values when `contiguous`)."""
    c_t = torch._scaled_mm(w_q, x_q.t(), scale_a=w_s.reshape(-1, 1).contiguous(),
                           scale_b=x_s.reshape(1, -1).contiguous(), out_dtype=out_dtype, use_fast_accum=fast_accum)
    return c_t.t().contiguous() if contiguous else c_t.t()


def main() -> None:
    from kernels.fp8_gemm import fp8_gemm_rowwise_small_m, fp8_gemm_rowwise_tma
    from kernels.fp8_linear import fp8_gemm_ref, fp8_gemm_scaled_mm, quantize
    from kernels.fp8_quant import quantize_triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64,128,256,512")
    ap.add_argument("--weights-mib", type=int, default=384, help="FP8 weight copies per shape, MiB in all")
    ap.add_argument("--no-sweep", action="store_true", help="the few-row kernel at its default tiles only "
                    "(no configuration sweep); with the swapped _scaled_mm (weight first) and fast accumulation")
    ap.add_argument("--configs-m", default="", help="JSON list of (block_m, block_n, block_k, warps, stages[, split]) "
                    "replacing the sweep's configurations above 64 rows")
    ap.add_argument("--tma", action="store_true", help="above 64 rows, also sweep the TMA kernel (CONFIGS_TMA)")
    args = ap.parse_args()
    configs_m = [tuple(c) for c in json.loads(args.configs_m)] if args.configs_m else CONFIGS_M
    torch.manual_seed(0)
    rows_out = []
    best_cfg: dict[str, list] = {}
    picks: dict[str, dict] = {}  # "K,N" -> {"128": cfg + [split] or None, "256": ...}
    tma_picks: dict[str, dict] = {}  # the same for the TMA kernel (--tma)
    lin = torch.nn.functional.linear
    for name, (k, n) in SHAPES.items():
        copies = max(4, -(-args.weights_mib * 2**20 // (n * k)))
        ws_bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        ws_fp8 = [quantize(w) for w in ws_bf16]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize(x)
            row = {"proj": name, "K": k, "N": n, "M": m, "copies": copies}
            row["bf16_us"] = chain_us(lin, [(x, w) for w in ws_bf16])
            row["scaled_mm_us"] = chain_us(fp8_gemm_scaled_mm, [(xq, xs, q, sc, None, torch.bfloat16) for q, sc in ws_fp8])
            ref = fp8_gemm_ref(xq, xs, *ws_fp8[0], None, torch.float32)
            if args.no_sweep:
                mm = fp8_gemm_scaled_mm
                row["scaled_mm_fast_us"] = chain_us(partial(mm, fast_accum=True),
                                                    [(xq, xs, q, sc, None, torch.bfloat16) for q, sc in ws_fp8])
                for fast in (False, True):
                    for contig in (True, False):
                        f = partial(scaled_mm_swapped, out_dtype=torch.bfloat16, fast_accum=fast, contiguous=contig)
                        err = ((f(xq, xs, *ws_fp8[0]).float() - ref).norm() / ref.norm()).item()
                        if err > 1e-2:
                            raise SystemExit(f"swapped _scaled_mm {name} M={m}: rel err {err}")
                        key = "swap" + ("_fast" if fast else "") + ("" if contig else "_nocopy") + "_us"
                        row[key] = chain_us(f, [(xq, xs, q, sc) for q, sc in ws_fp8])
                if m <= 256:
                    row["small_m_default_us"] = chain_us(
                        partial(fp8_gemm_rowwise_small_m, xq, xs, out_dtype=torch.bfloat16), ws_fp8)
                row["floor_us"] = max(n * k / 4.29e6, 2 * m * n * k / 1.25e9)  # copy 4.29 TB/s, FP8 1250 TFLOP/s
                rows_out.append(row)
                print(row, flush=True)
                continue
            timed = []
            for cfg in CONFIGS if m <= 64 else configs_m:
                bm, (bn, bk, nw, ns), sp = (None, cfg, 1) if m <= 64 else (cfg[0], cfg[1:5], (*cfg[5:], 1)[0])
                f = partial(fp8_gemm_rowwise_small_m, xq, xs, out_dtype=torch.bfloat16, block_n=bn, block_k=bk,
                            num_warps=nw, num_stages=ns, block_m=bm, split=sp)
                try:
                    err = ((f(*ws_fp8[0]).float() - ref).norm() / ref.norm()).item()
                except Exception as ex:  # a tile that does not fit (shared memory, registers): skipped, said
                    print(f"# {name} M={m} {cfg}: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
                    continue
                if err > 1e-2:
                    raise SystemExit(f"few-row kernel {name} M={m} {cfg}: rel err {err}")
                timed.append((chain_us(f, ws_fp8), cfg))
            t, cfg = min(timed)
            row["small_m_us"], row["small_m_cfg"] = t, str(cfg)
            row["small_m_all"] = {str(c): round(tc, 2) for tc, c in timed}
            if m in (128, 256):  # above 64 rows: the few-row kernel's pick where it beat _scaled_mm, else null
                picks.setdefault(f"{k},{n}", {})[str(m)] = [*cfg, *(() if len(cfg) > 5 else (1,))] if (
                    t < row["scaled_mm_us"]) else None
            row["small_m_default_us"] = chain_us(partial(fp8_gemm_rowwise_small_m, xq, xs, out_dtype=torch.bfloat16),
                                                 ws_fp8)
            if args.tma and m > 64:
                tma = []
                for tcfg in CONFIGS_TMA:
                    bm, bn, bk, nw, ns = tcfg[:5]
                    f = partial(fp8_gemm_rowwise_tma, xq, xs, out_dtype=torch.bfloat16, block_m=bm, block_n=bn,
                                block_k=bk, num_warps=nw, num_stages=ns, split=(*tcfg[5:], 1)[0])
                    try:
                        err = ((f(*ws_fp8[0]).float() - ref).norm() / ref.norm()).item()
                    except Exception as ex:  # shared memory, registers: skipped, said
                        print(f"# tma {name} M={m} {tcfg}: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
                        continue
                    if err > 1e-2:
                        raise SystemExit(f"TMA kernel {name} M={m} {tcfg}: rel err {err}")
                    tma.append((chain_us(f, ws_fp8), tcfg))
                if tma:
                    tt, tc_best = min(tma)
                    row["tma_us"], row["tma_cfg"] = tt, str(tc_best)
                    row["tma_all"] = {str(c): round(tc, 2) for tc, c in tma}
                    row["tma_GBps"] = n * k / (tt * 1e3)
                    if m in (128, 256):  # the engine's FIRSTTOKEN_FP8_TMA_CONFIG: where TMA beat both others
                        tma_picks.setdefault(f"{k},{n}", {})[str(m)] = [*tc_best, *(() if len(tc_best) > 5 else (1,))] if (
                            tt < min(row["scaled_mm_us"], row["small_m_us"])) else None
            best_cfg.setdefault(name, []).append((m, cfg, t))
            wbytes = n * k
            row["bf16_GBps"] = 2 * wbytes / (row["bf16_us"] * 1e3)
            row["fp8_best_GBps"] = wbytes / (min(row["scaled_mm_us"], row["small_m_us"]) * 1e3)
            rows_out.append(row)
            print(row, flush=True)
        del ws_bf16, ws_fp8
        torch.cuda.empty_cache()
    quant = []
    for m in (1, 16, 256, 2048):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        quant.append({"M": m, "torch_us": chain_us(quantize, [(x,)] * 16),
                      "triton_us": chain_us(quantize_triton, [(x,)] * 16)})
        print(quant[-1], flush=True)
    data = {**header(), "bench": "fp8_decode_gemms", "rows": rows_out, "quantize": quant, "best_small_m": best_cfg}
    # kernels.fp8_gemm reads this file from FIRSTTOKEN_FP8_SMALL_M_CONFIG
    if os.environ.get("OUT") and picks:
        Path(os.environ["OUT"], "small_m_config.json").write_text(json.dumps(picks, indent=1))
    if os.environ.get("OUT") and tma_picks:  # kernels.fp8_gemm.tma_tiles reads this from FIRSTTOKEN_FP8_TMA_CONFIG
        Path(os.environ["OUT"], "tma_config.json").write_text(json.dumps(tma_picks, indent=1))
    cols = (["proj", "M", "floor_us", "bf16_us", "scaled_mm_us", "scaled_mm_fast_us", "swap_us", "swap_nocopy_us",
             "swap_fast_us", "swap_fast_nocopy_us", "small_m_default_us"] if args.no_sweep else
            ["proj", "M", "bf16_us", "scaled_mm_us", "small_m_us", "small_m_default_us", "small_m_cfg", "bf16_GBps",
             "fp8_best_GBps", *(["tma_us", "tma_cfg", "tma_GBps"] if args.tma else [])])
    md = md_table(rows_out, cols)
    md += "\n\nquantization of a [M, 4096] bf16 input, us\n\n" + md_table(quant, ["M", "torch_us", "triton_us"])
    write_report("bench_fp8_decode", data, f"decode GEMMs, Llama-3.1-8B projections, us (do_bench medians)\n\n{md}")


if __name__ == "__main__":
    main()
