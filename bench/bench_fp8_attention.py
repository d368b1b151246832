"""The dense causal prefill attention on the GPU: cuDNN's bf16 kernel (what an engine runs today,
through PyTorch SDPA) against kernels/fp8_attention.py's FP8 kernel at each tile configuration,
Llama-3.1-8B's heads (32 q heads, 8 kv heads, D = 128). Times are medians of do_bench; the FP8
kernel's are with and without its operand pass (k rounded to e4m3, v rounded and transposed). Error
against fp32 attention over the same bf16 inputs, for both kernels, on a few heads.

    python3 bench/bench_fp8_attention.py                       # T = 2048, 8192, 32768
    python3 bench/bench_fp8_attention.py --tokens 2048 --configs 128,128,8,3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header, md_table
from kernels.fp8_attention import DEFAULT_CONFIG, fp8_causal_attention_triton, fp8_kv_operands
from workers.engine.attention import dense_causal_attention

CONFIGS = [(128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3),
           (128, 64, 4, 4), (64, 64, 4, 3), (256, 128, 8, 2)]
HEADS = (32, 8, 128)  # Llama-3.1-8B: q heads, kv heads, head dim


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: list[int], scale: float) -> torch.Tensor:
    """fp32 causal attention of the listed q heads: [T, len(heads), D]."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for h in heads:
        qh, kh, vh = q[:, h].float(), k[:, h // group].float(), v[:, h // group].float()
        outs.append(torch.nn.functional.scaled_dot_product_attention(qh[None], kh[None], vh[None], is_causal=True,
                                                                     scale=scale)[0])
    return torch.stack(outs, dim=1)


def measure(t: int, configs: list[tuple[int, ...]], rows: list[dict]) -> None:
    """Rows for T tokens: cuDNN, the operand pass, the FP8 kernel at each config."""
    import triton.testing

    hq, hk, d = HEADS
    scale = d**-0.5
    g = torch.Generator(device="cuda").manual_seed(t)
    qkv = torch.randn(t, hq + 2 * hk, d, device="cuda", generator=g).bfloat16()
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    flops = 4.0 * t * (t + 1) / 2 * d * hq
    heads = [0, 5, 17, 31]
    ref = exact(q, k, v, heads, scale)

    def err(out: torch.Tensor) -> dict[str, float]:
        e = (out[:, heads].float() - ref).abs()
        return {"max_err": e.max().item(), "mean_err": e.mean().item()}

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=10, rep=60 if t <= 8192 else 300, return_mode="median")

    ms = bench(lambda: dense_causal_attention(q, k, v, scale))
    rows.append({"T": t, "kernel": "cuDNN bf16 (SDPA)", "ms": ms, "TFLOP/s": flops / ms / 1e9,
                 **err(dense_causal_attention(q, k, v, scale))})
    ms_ops = bench(lambda: fp8_kv_operands(k, v))
    rows.append({"T": t, "kernel": "fp8 operand pass alone", "ms": ms_ops})
    for cfg in configs:
        try:
            out = fp8_causal_attention_triton(q, k, v, scale, config=cfg)
            ms = bench(lambda c=cfg: fp8_causal_attention_triton(q, k, v, scale, config=c))
        except Exception as e:  # a config past the shared memory or the registers: the row says so
            rows.append({"T": t, "kernel": f"fp8 {cfg}", "note": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        rows.append({"T": t, "kernel": f"fp8 {cfg}" + (" (default)" if cfg == DEFAULT_CONFIG else ""),
                     "ms": ms, "ms_kernel": ms - ms_ops, "TFLOP/s": flops / ms / 1e9,
                     "TFLOP/s_kernel": flops / (ms - ms_ops) / 1e9, **err(out)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="2048,8192,32768")
    ap.add_argument("--configs", default=None, help="BLOCK_M,BLOCK_N,warps,stages;... (default: the sweep)")
    args = ap.parse_args()
    configs = ([tuple(int(x) for x in c.split(",")) for c in args.configs.split(";")] if args.configs
               else CONFIGS)
    rows: list[dict] = []
    for t in (int(x) for x in args.tokens.split(",")):
        measure(t, configs, rows)
        torch.cuda.empty_cache()
    hq, hk, d = HEADS
    data = {"bench": "fp8_attention", **header(), "heads": [hq, hk, d], "rows": rows}
    md = (f"# Dense causal prefill attention, FP8 against cuDNN bf16 ({data['date']}, {data['commit']}, "
          f"{data['machine']})\n\n" + md_table(rows, ["T", "kernel", "ms", "ms_kernel", "TFLOP/s", "TFLOP/s_kernel",
                                                    "max_err", "mean_err", "note"]))
    from bench.common import write_report

    write_report("fp8_attention", data, md)


if __name__ == "__main__":
    main()
