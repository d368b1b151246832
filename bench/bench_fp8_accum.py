"""torch._scaled_mm with and without cuBLASLt's fast accumulation, on the Llama-3.1-8B projections:
time, TFLOP/s, and the error each adds to FP8's own (both against the exact product of the same e4m3
inputs, in fp64 on the CPU for a slice of rows, so the rounding of the inputs is not counted).

    python3 bench/bench_fp8_accum.py            # M = 128, 2048, 8192; OUT=dir writes JSON + markdown

Fast accumulation keeps the tensor cores' own accumulator over the whole K loop; the default
promotes it to fp32 CUDA-core registers every few steps. vLLM's CUTLASS FP8 kernels and torchao's
float8 inference run the fast mode; the question here is what it costs on these shapes.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header, md_table, write_report
from kernels.fp8_linear import fp8_gemm_scaled_mm, quantize

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="128,2048,8192")
    ap.add_argument("--check-rows", type=int, default=64, help="rows compared in fp64 on the CPU")
    args = ap.parse_args()
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for name, (k, n) in SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(k + n)
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        w_q, w_s = quantize(w)  # [N, K] e4m3, [N, 1]
        w_exact = (w_q.double().cpu() * w_s.double().cpu()).t()  # [K, N]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, generator=g)
            x[:, :: 97] *= 20.0  # a few outlier channels, as real activations have
            x_q, x_s = quantize(x.bfloat16())
            c = min(args.check_rows, m)
            exact = (x_q[:c].double().cpu() * x_s[:c].double().cpu()) @ w_exact  # [c, N]
            out = {}
            for fast in (False, True):
                y = fp8_gemm_scaled_mm(x_q, x_s, w_q, w_s, None, torch.bfloat16, fast_accum=fast)
                yf = fp8_gemm_scaled_mm(x_q, x_s, w_q, w_s, None, torch.float32, fast_accum=fast)
                ms = triton.testing.do_bench(
                    partial(fp8_gemm_scaled_mm, x_q, x_s, w_q, w_s, None, torch.bfloat16, fast_accum=fast),
                    warmup=25, rep=100, return_mode="median")
                d = yf[:c].double().cpu() - exact
                out[fast] = y
                rows.append({
                    "proj": name, "M": m, "K": k, "N": n, "fast_accum": fast, "us": ms * 1e3,
                    "tflops": 2 * m * k * n / ms / 1e9,
                    # fp32 output against the exact product: what the accumulation itself adds
                    "rel_rms_fp32_out": (d.norm() / exact.norm()).item(),
                    "max_abs_fp32_out": d.abs().max().item(),
                    # the bf16 output's own rounding, for scale
                    "rel_rms_bf16_out": ((y[:c].double().cpu() - exact).norm() / exact.norm()).item(),
                })
            rows[-1]["bf16_out_differ"] = (out[True] != out[False]).float().mean().item()
            print(rows[-2], rows[-1], flush=True)
    base = {(r["proj"], r["M"]): r["us"] for r in rows if not r["fast_accum"]}
    for r in rows:
        r["speedup"] = base[(r["proj"], r["M"])] / r["us"]
    data = {**header(), "bench": "fp8_accum", "rows": rows}
    md = md_table(rows, ["proj", "M", "fast_accum", "us", "tflops", "speedup", "rel_rms_fp32_out", "max_abs_fp32_out",
                         "rel_rms_bf16_out", "bf16_out_differ"])
    write_report("bench_fp8_accum", data, md)


if __name__ == "__main__":
    main()
