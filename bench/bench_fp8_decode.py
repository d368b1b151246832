"""The GEMMs of a decode step, FP8 against bf16, on the Llama-3.1-8B projections: bf16 F.linear,
torch._scaled_mm (cuBLASLt, per-token x per-channel scales), and kernels/fp8_gemm.py's small-M
weight-streaming kernel over a few tile configurations, at 1 to 256 rows; and the quantization of
an unfused input (o_proj's): torch's composition against the Triton kernel. Times are medians of
triton.testing.do_bench (L2 flushed before each run: a decode step finds no weight in L2), with the
bytes each GEMM must read over that time.

    python3 bench/bench_fp8_decode.py [--rows 1,4,16,64,256]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header, md_table, write_report

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
CONFIGS = [(16, 256, 4, 4), (32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 4), (16, 512, 4, 4), (64, 128, 4, 5),
           (32, 128, 4, 6), (128, 128, 8, 4)]  # (block_n, block_k, warps, stages)
# the split-K kernel's (block_n, block_k, splits; None: splitk_splits' choice)
SPLITK = [(32, 256, None), (16, 256, None), (32, 128, None), (64, 256, None), (32, 256, 2), (32, 256, 4), (16, 512, 4)]


def ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    from kernels.fp8_gemm import SMALL_M, fp8_gemm_rowwise_small_m, fp8_gemm_rowwise_splitk
    from kernels.fp8_linear import fp8_gemm_ref, fp8_gemm_scaled_mm, quantize
    from kernels.fp8_quant import quantize_triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows_out = []
    best_cfg: dict[str, list] = {}
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize(w)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize(x)
            row = {"proj": name, "K": k, "N": n, "M": m}
            row["bf16_us"] = 1e3 * ms(partial(torch.nn.functional.linear, x, w))
            row["scaled_mm_us"] = 1e3 * ms(partial(fp8_gemm_scaled_mm, xq, xs, wq, ws, None, torch.bfloat16))
            if m <= SMALL_M:
                ref = fp8_gemm_ref(xq, xs, wq, ws, None, torch.float32)
                timed = []
                for bn, bk, nw, ns in CONFIGS:
                    f = partial(fp8_gemm_rowwise_small_m, xq, xs, wq, ws, None, torch.bfloat16, bn, bk, nw, ns)
                    err = ((f().float() - ref).norm() / ref.norm()).item()
                    if err > 1e-2:
                        raise SystemExit(f"small-M kernel {name} M={m} {(bn, bk, nw, ns)}: rel err {err}")
                    timed.append((1e3 * ms(f), (bn, bk, nw, ns)))
                t, cfg = min(timed)
                row["small_m_us"], row["small_m_cfg"] = t, str(cfg)
                row["small_m_default_us"] = next(tt for tt, c in timed if c == (32, 256, 4, 4))
                best_cfg.setdefault(name, []).append((m, cfg, t))
                split_t = []
                for bn, bk, sp in SPLITK:
                    f = partial(fp8_gemm_rowwise_splitk, xq, xs, wq, ws, None, torch.bfloat16, bn, bk, sp)
                    err = ((f().float() - ref).norm() / ref.norm()).item()
                    if err > 1e-2:
                        raise SystemExit(f"split-K kernel {name} M={m} {(bn, bk, sp)}: rel err {err}")
                    split_t.append((1e3 * ms(f), (bn, bk, sp)))
                t, cfg = min(split_t)
                row["splitk_us"], row["splitk_cfg"] = t, str(cfg)
            wbytes = n * k
            row["bf16_GBps"] = 2 * wbytes / (row["bf16_us"] * 1e3)
            row["fp8_best_GBps"] = wbytes / (min(row["scaled_mm_us"], row.get("small_m_us", 1e9),
                                                 row.get("splitk_us", 1e9)) * 1e3)
            rows_out.append(row)
            print(row, flush=True)
    quant = []
    for m in (1, 16, 256, 2048):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        quant.append({"M": m, "torch_us": 1e3 * ms(partial(quantize, x)), "triton_us": 1e3 * ms(partial(quantize_triton, x))})
        print(quant[-1], flush=True)
    data = {**header(), "bench": "fp8_decode_gemms", "rows": rows_out, "quantize": quant, "best_small_m": best_cfg}
    md = md_table(rows_out, ["proj", "M", "bf16_us", "scaled_mm_us", "small_m_us", "small_m_default_us", "small_m_cfg",
                             "splitk_us", "splitk_cfg", "bf16_GBps", "fp8_best_GBps"])
    md += "\n\nquantization of a [M, 4096] bf16 input, us\n\n" + md_table(quant, ["M", "torch_us", "triton_us"])
    write_report("bench_fp8_decode", data, f"decode GEMMs, Llama-3.1-8B projections, us (do_bench medians)\n\n{md}")


if __name__ == "__main__":
    main()
