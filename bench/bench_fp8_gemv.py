"""Decode's projections at 1-8 rows, each with the op before it, on the Llama-3.1-8B shapes: the W8A8
path (the fused norm / activation writing e4m3, or o_proj's quantize, then the few-row GEMM), the
W8A16 GEMV with that op fused (kernels/fp8_gemv.py: its default tiles and a sweep), and bf16 (the
unquantized op, then F.linear). Times are medians per call over a replayed CUDA graph of calls on
distinct weight copies (bench_fp8_decode.chain_us): what a decode step's graph sees. Every swept
configuration is checked against the reference and for run-to-run equality (the split-K reduction
adds its parts in a fixed order). The fastest configuration per shape goes to $OUT/gemv_best.json,
which FIRSTTOKEN_FP8_GEMV_CONFIG hands to an engine run in the same session.

    python3 bench/bench_fp8_gemv.py [--rows 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_fp8_decode import SHAPES, chain_us
from bench.common import header, md_table, write_report

# (block_n, block_k, split, num_warps, num_stages): the earlier sweeps' best per shape
# (bench/results/2026-12-02-fp8-gemv-h200.md) and their neighbours
SWEEP = [(8, 512, 1, 4, 3), (8, 1024, 2, 4, 3), (16, 256, 4, 4, 3), (16, 512, 2, 4, 3), (16, 512, 4, 4, 3),
         (16, 1024, 4, 4, 2), (32, 256, 1, 4, 3), (32, 256, 2, 4, 3), (32, 256, 4, 4, 3), (32, 512, 2, 8, 3),
         (64, 256, 1, 8, 3), (32, 128, 1, 4, 4), (16, 256, 2, 4, 4), (8, 256, 1, 4, 4), (32, 256, 1, 4, 4),
         (64, 128, 2, 4, 3)]
PROLOGUES = {"qkv": "rms", "o": "none", "gate_up": "rms", "down": "silu"}


def main() -> None:
    from kernels.fp8_gemm import fp8_gemm_rowwise_small_m
    from kernels.fp8_gemv import (
        PROLOGUE_NONE,
        PROLOGUE_RMS,
        PROLOGUE_SILU,
        fp8_gemv_ref,
        fp8_gemv_triton,
        gemv_config,
    )
    from kernels.fp8_linear import quantize
    from kernels.fp8_quant import quantize_triton, rms_norm_quant_triton, silu_and_mul_quant_triton
    from kernels.rmsnorm import rms_norm_triton
    from kernels.silu_mul import silu_and_mul_triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--weights-mib", type=int, default=384, help="FP8 weight copies per shape, MiB in all")
    ap.add_argument("--top", type=int, default=3, help="configurations of the 1-row sweep timed at more rows")
    args = ap.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    lin = torch.nn.functional.linear
    rows_out, best = [], {}
    for name, (k, n) in SHAPES.items():
        kind = PROLOGUES[name]
        prologue = {"rms": PROLOGUE_RMS, "none": PROLOGUE_NONE, "silu": PROLOGUE_SILU}[kind]
        copies = max(4, -(-args.weights_mib * 2**20 // (n * k)))
        ws = [quantize(torch.randn(n, k, device="cuda", dtype=dt) * 0.02) for _ in range(copies)]
        w16 = [(q.to(dt) * 1).contiguous() for q, _ in ws[: max(4, copies // 2)]]  # bf16 weights (values only)
        nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(dt)
        ranked: list[tuple] = []
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, 2 * k if kind == "silu" else k, device="cuda", dtype=dt)
            res = torch.randn(m, k, device="cuda", dtype=dt)
            kw = {"prologue": prologue, "residual": res if kind == "rms" else None,
                  "norm_weight": nw if kind == "rms" else None, "eps": 1e-5}

            def w8a8(wq, wsc, x=x, res=res, kind=kind, nw=nw):
                if kind == "rms":
                    (xq, xs), _ = rms_norm_quant_triton(x, nw, 1e-5, res)
                elif kind == "silu":
                    xq, xs = silu_and_mul_quant_triton(x)
                else:
                    xq, xs = quantize_triton(x)
                return fp8_gemm_rowwise_small_m(xq, xs, wq, wsc, None, dt)

            def bf16(w, x=x, res=res, kind=kind, nw=nw):
                if kind == "rms":
                    h, _ = rms_norm_triton(x, nw, 1e-5, res)
                elif kind == "silu":
                    h = silu_and_mul_triton(x)
                else:
                    h = x
                return lin(h, w)

            want, want_res = fp8_gemv_ref(x, *ws[0], None, **kw)
            row = {"proj": name, "K": k, "N": n, "M": m, "prologue": kind,
                   "bf16_us": chain_us(bf16, [(w,) for w in w16]), "w8a8_us": chain_us(w8a8, ws)}
            cands = SWEEP if m == 1 or not ranked else [c for _, c in ranked[: args.top]]
            timed = []
            for cfg in cands:
                f = partial(fp8_gemv_triton, x, **kw, block_n=cfg[0], block_k=cfg[1], split=cfg[2],
                            num_warps=cfg[3], num_stages=cfg[4])
                try:
                    a, ra = f(*ws[0])
                    b, _ = f(*ws[0])
                except Exception as e:
                    print(f"# {name} M={m} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                err = ((a.float() - want.float()).norm() / want.float().norm()).item()
                if err > 1e-2 or not torch.equal(a, b) or (ra is not None and not torch.equal(ra, want_res)):
                    raise SystemExit(f"gemv {name} M={m} {cfg}: rel err {err}, repeat equal {torch.equal(a, b)}")
                timed.append((chain_us(f, ws), cfg))
            timed.sort()
            if m == 1:
                ranked = timed
            row["gemv_best_us"], row["gemv_best_cfg"] = timed[0][0], str(timed[0][1])
            row["gemv_default_us"] = chain_us(partial(fp8_gemv_triton, x, **kw), ws)
            row["default_cfg"] = str(gemv_config(n, k))
            row["gemv_GBps"] = n * k / (row["gemv_best_us"] * 1e3)
            row["w8a8_over_gemv"] = row["w8a8_us"] / row["gemv_best_us"]
            if m == 1:
                best[f"{k},{n}"] = list(timed[0][1])
                row["top5"] = [(round(t, 2), str(c)) for t, c in timed[:5]]
            rows_out.append(row)
            print({kk: v for kk, v in row.items() if kk != "top5"}, flush=True)
        del ws, w16
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        Path(out, "gemv_best.json").write_text(json.dumps(best))
    data = {**header(), "bench": "fp8_gemv", "rows": rows_out, "best_1row": best}
    md = md_table(rows_out, ["proj", "M", "prologue", "bf16_us", "w8a8_us", "gemv_default_us", "gemv_best_us",
                             "gemv_best_cfg", "gemv_GBps", "w8a8_over_gemv"])
    layer = {m: sum(r["gemv_best_us"] for r in rows_out if r["M"] == m) for m in {r["M"] for r in rows_out}}
    layer8 = {m: sum(r["w8a8_us"] for r in rows_out if r["M"] == m) for m in layer}
    md += "\n\nper layer (4 projections with their ops), us: " + ", ".join(
        f"M={m}: W8A8 {layer8[m]:.1f} -> GEMV {layer[m]:.1f}" for m in sorted(layer))
    write_report("bench_fp8_gemv", data, f"decode projections with their ops, Llama-3.1-8B, us per call\n\n{md}")


if __name__ == "__main__":
    main()
