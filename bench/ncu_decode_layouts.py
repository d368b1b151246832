"""One decode-attention launch per V layout (fp8 cache, B = 1000, context 1500, shuffled blocks), for ncu:

    ncu --clock-control none -k regex:_decode_partial --launch-skip 2 python3 bench/ncu_decode_layouts.py

Each layout is launched twice (a compile and a warm launch) before the one that ncu profiles, rows first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.decode_attention import decode_attention_triton
from kernels.kv_layout import to_v_layout


def main(b: int = 1000, ctx: int = 1500, hq: int = 32, hk: int = 8, d: int = 128, bs: int = 16) -> None:
    per_seq = -(-ctx // bs)
    n = b * per_seq + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn((n, bs, hk, d), device="cuda", generator=g, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    vc = torch.randn((n, bs, hk, d), device="cuda", generator=g, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    ids = torch.arange(1, n, device="cuda", dtype=torch.int32)[torch.randperm(n - 1, device="cuda", generator=g)]
    bt = ids.view(b, per_seq).contiguous()
    sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn((b, hq, d), device="cuda", generator=g, dtype=torch.bfloat16)
    for v in (vc, to_v_layout(vc, "keys_inner")):
        for _ in range(3):
            decode_attention_triton(q, kc, v, bt, sl, d**-0.5)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
