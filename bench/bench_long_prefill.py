"""Long causal prefill attention (one sequence, no cached prefix): our Triton paged kernel vs PyTorch SDPA backends.

    python3 bench/bench_long_prefill.py   # Llama-3.1-8B heads (32 q, 8 kv, D=128), bf16
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.prefill_attention import paged_attention_triton

HQ, HK, D, BS = 32, 8, 128, 16


def bench_len(n: int) -> list[tuple]:
    rows: list[tuple] = []
    q = torch.randn(n, HQ, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(n, HK, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(n, HK, D, dtype=torch.bfloat16, device="cuda")
    flops = 4 * HQ * D * n * (n + 1) / 2
    kc = k.view(n // BS, BS, HK, D)
    vc = v.view(n // BS, BS, HK, D)
    bt = torch.arange(n // BS, dtype=torch.int32, device="cuda")[None, :]
    qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    sl = torch.tensor([n], dtype=torch.int32, device="cuda")
    scale = D**-0.5

    def ours():
        return paged_attention_triton(q, kc, vc, bt, qsl, sl, scale, None, n)

    ref = ours()
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    cands = {"triton paged": ours}
    for name, be in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for gqa in (True, False):
            def f(be=be, gqa=gqa):
                with sdpa_kernel(be):
                    if gqa:
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                                              enable_gqa=True)
                    kk = kt.repeat_interleave(HQ // HK, dim=1)
                    vv = vt.repeat_interleave(HQ // HK, dim=1)
                    return F.scaled_dot_product_attention(qt, kk, vv, is_causal=True, scale=scale)
            cands[f"{name}{' gqa' if gqa else ' expand'}"] = f
    for name, f in cands.items():
        try:
            out = f()
            out = out if out.dim() == 3 else out[0].transpose(0, 1)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
            rows.append((n, name, ms, flops / ms / 1e9, err))
        except Exception as e:  # a backend that refuses this shape
            rows.append((n, name, float("nan"), float("nan"), f"{type(e).__name__}: {str(e)[:80]}"))
    return rows


def main() -> None:
    rows = bench_len(8192) + bench_len(32768)
    print("| tokens | kernel | ms | TFLOP/s | rel err vs triton |\n|---|---|---|---|---|")
    for n, name, ms, tf, err in rows:
        print(f"| {n} | {name} | {ms:.2f} | {tf:.0f} | {err if isinstance(err, str) else f'{err:.1e}'} |")


if __name__ == "__main__":
    main()
