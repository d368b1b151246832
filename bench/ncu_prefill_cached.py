"""The paged prefill attention of TTFT 2048 cached + 128 as the engine's prefill graph launches it, for ncu
and a timing: 128 new tokens over a 2048-token cached prefix, an fp8 cache in the engine's layout (blocks of
64, V keys inner, since session 23; `--block-size 16 --v-layout rows` is the layout of the results before
session 27), 16 block-table rows (15 of them padding) as wide as max_model_len 33024, Llama-3.1-8B heads.
Prints the median graph-replayed time of each variant (the default split and tiles, then those of
--variants, e.g. '{"pf": {"prefetch": true}}'); with --ncu it only launches the default three times, for a
profiler:

    ncu --clock-control none -k regex:_paged_attention --launch-skip 2 --launch-count 1 \\
        python3 bench/ncu_prefill_cached.py --ncu
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_fp8_decode import chain_us
from kernels.kv_layout import to_v_layout
from kernels.prefill_attention import paged_attention_ref, paged_attention_triton

HQ, HK, D = 32, 8, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--variants", default="{}", help="JSON {name: paged_attention_triton keywords}")
    ap.add_argument("--ncu", action="store_true", help="three launches of the default, no timing")
    ap.add_argument("--rows", type=int, default=16, help="block-table rows (the prefill graph's 16: 15 of them padding)")
    ap.add_argument("--block-size", type=int, default=64, help="KV block size (the fp8 cache's default: 64)")
    ap.add_argument("--v-layout", default="keys_inner", choices=["keys_inner", "rows"],
                    help="the V cache's layout (an fp8 cache's default: keys inner)")
    args = ap.parse_args()
    bs = args.block_size
    ctx = args.prefix + args.new
    g = torch.Generator(device="cuda").manual_seed(0)
    nblk = -(-ctx // bs)
    total = nblk + 8
    kc = torch.randn((total, bs, HK, D), device="cuda", generator=g).to(torch.float8_e4m3fn)
    vc = torch.randn((total, bs, HK, D), device="cuda", generator=g).to(torch.float8_e4m3fn)
    if args.v_layout == "keys_inner":
        vc = to_v_layout(vc, "keys_inner")
    rows, width = args.rows, 33024 // bs
    bt = torch.full((rows, width), total - 1, dtype=torch.int32, device="cuda")
    bt[0, :nblk] = torch.randperm(total - 1, device="cuda", generator=g)[:nblk].int()
    q = torch.randn((args.new, HQ, D), device="cuda", generator=g, dtype=torch.bfloat16)
    qsl = torch.full((rows + 1,), args.new, dtype=torch.int32, device="cuda")
    qsl[0] = 0
    sl = torch.zeros(rows, dtype=torch.int32, device="cuda")
    sl[0] = ctx
    scale = D**-0.5
    ref = paged_attention_ref(q, kc, vc, bt[:1].clone(), qsl[:2].clone(), sl[:1].clone(), scale)
    flops = 4 * D * HQ * sum(args.prefix + i + 1 for i in range(args.new))
    if args.ncu:
        for _ in range(3):
            paged_attention_triton(q, kc, vc, bt, qsl, sl, scale, None, max_query_len=args.new)
        torch.cuda.synchronize()
        return
    variants = {"default": {}, **json.loads(args.variants)}
    out = []
    for name, kw in variants.items():
        f = partial(paged_attention_triton, q, kc, vc, bt, qsl, sl, scale, None, max_query_len=args.new, **kw)
        err = float((f().float() - ref.float()).norm() / ref.float().norm())
        us = chain_us(f, [()] * 20, reps=30)  # 20 calls replayed in one graph, us a call
        out.append({"variant": name, "us": round(us, 2), "TFLOPs": round(flops / us / 1e6, 1), "rel_err": err, **kw})
        print(json.dumps(out[-1]), flush=True)


if __name__ == "__main__":
    main()
