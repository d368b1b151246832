"""Dense causal prefill attention through PyTorch SDPA, one layer of Llama-3.1-8B heads (32 q, 8 kv, D 128,
bf16): the engine's call (`workers.engine.attention.dense_causal_attention`: [T, H, D] tensors seen as
[1, H, T, D] through strides, GQA left to the backend) against other layouts and backends, in one run.

    python3 bench/bench_sdpa_layouts.py [--lengths 8192,32768]

TTFT 8192 and 32768 spend ~28% and ~half of their time here (cuDNN's kernel at 465 and 563 TFLOP/s on
the H200); a faster way to call the same kernels is worth that share. Prints JSON lines and a markdown
table; writes them under $OUT when set.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_decode_tiles import time_ms
from bench.common import header, md_table, write_report
from workers.engine.attention import dense_causal_attention

HQ, HK, D = 32, 8, 128


def sdpa(q, k, v, backends, gqa: bool):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backends, set_priority=True):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=D**-0.5,
                                                                enable_gqa=gqa)


def one_length(t: int) -> list[dict]:
    """Every variant at T tokens: time, TFLOP/s, relative difference to the engine's output."""
    from torch.nn.attention import SDPBackend

    cudnn, flash = [SDPBackend.CUDNN_ATTENTION], [SDPBackend.FLASH_ATTENTION]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((t, HQ, D), device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn((t, HK, D), device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn((t, HK, D), device="cuda", dtype=torch.bfloat16, generator=g)
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, T, D] views (the engine's)
    qc, kc, vc = (x.contiguous() for x in (qh, kh, vh))  # [1, H, T, D] contiguous
    ke, ve = (x.repeat_interleave(HQ // HK, dim=1) for x in (kc, vc))  # 32 kv heads, contiguous
    ref = dense_causal_attention(q, k, v, D**-0.5)
    variants = {
        "engine (views, gqa)": lambda: dense_causal_attention(q, k, v, D**-0.5),
        "cudnn views, gqa": lambda: sdpa(qh, kh, vh, cudnn, True),
        "cudnn contiguous, gqa": lambda: sdpa(qc, kc, vc, cudnn, True),
        "cudnn contiguous + copies": lambda: sdpa(qh.contiguous(), kh.contiguous(), vh.contiguous(), cudnn, True),
        "cudnn kv expanded": lambda: sdpa(qc, ke, ve, cudnn, False),
        "cudnn views, kv expanded": lambda: sdpa(qh, ke, ve, cudnn, False),
        "flash views, gqa": lambda: sdpa(qh, kh, vh, flash, True),
        "flash contiguous, gqa": lambda: sdpa(qc, kc, vc, flash, True),
    }
    flops = 4 * D * HQ * t * (t + 1) / 2
    rows = []
    for name, fn in variants.items():
        row = {"T": t, "variant": name}
        try:
            out = fn()
            o = out[0].transpose(0, 1) if out.dim() == 4 else out
            row["rel_err"] = float((o.float() - ref.float()).norm() / ref.float().norm())
            ms = time_ms(fn, reps=10)
            row["ms"] = round(ms, 3)
            row["TFLOPs"] = round(flops / ms / 1e9, 1)
        except Exception as ex:  # a backend that refuses the layout: said, not fatal
            row["error"] = f"{type(ex).__name__}: {str(ex)[:160]}"
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="8192,32768")
    args = ap.parse_args()
    rows = []
    for t in (int(x) for x in args.lengths.split(",")):
        rows += one_length(t)
        torch.cuda.empty_cache()
    data = {"header": header(), "rows": rows}
    md = (f"### dense causal SDPA, one layer (32 q / 8 kv heads, D 128, bf16), {data['header']['machine']}, "
          f"commit {data['header']['commit']}\n\n" + md_table(rows, ["T", "variant", "ms", "TFLOPs", "rel_err", "error"]))
    write_report("sdpa_layouts", data, md)


if __name__ == "__main__":
    main()
