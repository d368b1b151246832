"""The fused FP8 activation quantizations of a prefill (kernels/fp8_quant.py) on the GPU: each
variant against the unfused torch reference (scales, e4m3 values) and timed, with the bandwidth it
reaches (bytes read + written once). Variants: the in-kernel rounding to the e4m3 grid (log2/exp2
per element: the interpreter's path, 'legacy') or the GPU's cast; silu_and_mul_quant over the whole
row in registers or in chunks (two passes), its warps and register cap.

    python3 bench/bench_fp8_quant.py            # Llama-3.1-8B's H = 4096, I = 14336, T = 1, 128, 2048, 8192
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header, md_table
from kernels.fp8_linear import quantize
from kernels.fp8_quant import (
    quantize_triton,
    rms_norm_quant_ref,
    rms_norm_quant_triton,
    silu_and_mul_quant_ref,
    silu_and_mul_quant_triton,
)


def agree(q, s, qr, sr) -> dict[str, float]:
    """Scale rel. difference (max) and the share of e4m3 values that differ from the reference's."""
    return {"scale_rel": ((s - sr).abs() / sr.abs()).max().item(),
            "q_differ": (q.view(torch.uint8) != qr.view(torch.uint8)).float().mean().item(),
            "deq_rel": ((q.float() * s - qr.float() * sr).norm() / (qr.float() * sr).norm()).item()}


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,128,2048,8192")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    args = ap.parse_args()
    dev = "cuda"
    rows = []

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    for t in (int(x) for x in args.tokens.split(",")):
        g = torch.Generator(device=dev).manual_seed(t)
        x = (torch.randn(t, 2 * args.inter, device=dev, generator=g) * 2).bfloat16()
        qr, sr = silu_and_mul_quant_ref(x)
        nbytes = x.numel() * 2 + t * args.inter + t * 4
        for name, kw in (("legacy whole row", {"hw_cast": False, "chunk": 0}),
                         ("hw cast whole row (default: at most 40 registers)", {"hw_cast": True, "chunk": 0}),
                         ("legacy chunks 2048", {"hw_cast": False, "chunk": 2048}),
                         ("hw cast chunks 1024", {"hw_cast": True, "chunk": 1024}),
                         ("hw cast chunks 2048", {"hw_cast": True, "chunk": 2048}),
                         ("hw cast chunks 4096", {"hw_cast": True, "chunk": 4096}),
                         *((f"hw cast whole row, {w} warps", {"hw_cast": True, "chunk": 0, "num_warps": w})
                           for w in (4, 8, 32)),
                         ("whole row, no register cap (before 9dbdc81)", {"hw_cast": True, "maxnreg": 0}),
                         ("whole row, at most 48 registers", {"hw_cast": True, "maxnreg": 48})):
            q, s = silu_and_mul_quant_triton(x, **kw)
            ms = bench(lambda kw=kw, x=x: silu_and_mul_quant_triton(x, **kw))
            rows.append({"op": "silu_and_mul_quant", "T": t, "variant": name, "us": ms * 1e3,
                         "GB_s": nbytes / ms / 1e6, **agree(q, s, qr, sr)})
        h = args.hidden
        xh = torch.randn(t, h, device=dev, generator=g).bfloat16()
        res = torch.randn(t, h, device=dev, generator=g).bfloat16()
        w = (torch.rand(h, device=dev, generator=g) + 0.5).bfloat16()
        (qr, sr), _ = rms_norm_quant_ref(xh, w, 1e-5, res)
        nbytes = t * h * (2 + 2 + 2 + 1) + t * 4
        for name, hw, nw in (("legacy", False, None), ("hw cast (default)", True, None), ("hw cast, 4 warps", True, 4),
                             ("hw cast, 8 warps", True, 8), ("hw cast, 32 warps", True, 32)):
            (q, s), _ = rms_norm_quant_triton(xh, w, 1e-5, res, hw_cast=hw, num_warps=nw)
            ms = bench(lambda hw=hw, nw=nw, xh=xh, w=w, res=res: rms_norm_quant_triton(xh, w, 1e-5, res, hw_cast=hw,
                                                                                       num_warps=nw))
            rows.append({"op": "rms_norm_quant", "T": t, "variant": name, "us": ms * 1e3,
                         "GB_s": nbytes / ms / 1e6, **agree(q, s, qr, sr)})
        qr, sr = quantize(xh)
        nbytes = t * h * 3 + t * 4
        for name, hw in (("legacy", False), ("hw cast (default)", True)):
            q, s = quantize_triton(xh, hw_cast=hw)
            ms = bench(lambda hw=hw, xh=xh: quantize_triton(xh, hw_cast=hw))
            rows.append({"op": "quantize", "T": t, "variant": name, "us": ms * 1e3,
                         "GB_s": nbytes / ms / 1e6, **agree(q, s, qr, sr)})
    data = {**header(), "bench": "fp8_quant", "rows": rows}
    md = md_table(rows, ["op", "T", "variant", "us", "GB_s", "scale_rel", "q_differ", "deq_rel"])
    print(md, flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_fp8_quant.json").write_text(json.dumps(data, indent=1))
        Path(out, "bench_fp8_quant.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
