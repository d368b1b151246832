"""Decode attention over an fp8 cache at large batches: its tile variants and the cache's layout
against the device's copy rate, in one run.

    python3 bench/bench_decode_tiles.py            # Llama-3.1-8B heads (32 q, 8 kv, D 128), block 16
    python3 bench/bench_decode_tiles.py --variants '{"s2": {"num_stages": 2}}'

At batch 1000 and context ~1100 a decode step's attention ran at ~3.0 TB/s on the H200 (the profile
in bench/results/2026-12-04-profile-fp8-decode-b1000-ctx1100-h200-32f8889.txt), 64% of the step.
Measured there (bench/results/2026-12-04-session7-h200.md): the grid's order (the kv heads of one
sequence side by side instead of one head of many sequences; an option of the kernel then, removed
as no faster), a head-major cache layout and a dozen tile variants all within a few percent of the
defaults at batch 1000.

Block tables: "prefill" gives each sequence consecutive blocks (a prompt prefilled in one chunk),
"shuffled" a random permutation of the pool (decode blocks allocated one at a time across many
sequences); "hnd" is shuffled over a cache laid out [blocks, Hk, block_size, D] in memory (the
kernels see it through strides as [blocks, block_size, Hk, D]): one head's rows of a block are
one run of block_size x D bytes instead of block_size rows Hk x D bytes apart.
Prints JSON and a markdown table; writes them under $OUT when set. --hog-sms N times everything with N
SMs held by spinning programs (bench/sm_hog.py): on an H100, N = 40 leaves an H200's bandwidth per SM.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header, md_table, write_report
from bench.sm_hog import SmHog
from kernels.decode_attention import decode_attention_triton
from kernels.kv_layout import to_v_layout

FP8 = torch.float8_e4m3fn


def copy_gbps(nbytes: int = 1 << 30) -> float:
    """The copy rate the timed SMs reach (with --hog-sms, the SMs left)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    time_ms(lambda: b.copy_(a), reps=2)
    torch.cuda.synchronize()
    with SmHog(HOG_SMS):
        return 2 * nbytes / time_ms(lambda: b.copy_(a)) / 1e6


def time_ms(fn, reps: int = 20, inner: int = 4) -> float:
    """Median of reps CUDA-event timings of `inner` calls back to back (a call's host launch then overlaps the
    one before it, so the GPU time holds no host gap: Triton's own dispatch, which descriptor arguments take,
    costs tens of us), per call, after two warm calls (stream syncs only: see bench/sm_hog.py)."""
    for _ in range(2):
        fn()
    torch.cuda.current_stream().synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(inner):
            fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / inner)
    return sorted(ts)[len(ts) // 2]


# tile variants beside the defaults (fp8: 64 keys, 2 warps, 3 stages, tuned at B = 224); "v_layout":
# "keys_inner" runs the variant over a copy of the V cache with each block's keys innermost
# (kernels/kv_layout.py: V then loads as K does, not a byte at a time from shared memory; over it the block ids are
# prefetched by default on the GPU, "prefetch": false turns that off)
VARIANTS: dict[str, dict] = {
    "default": {},
    "vt": {"v_layout": "keys_inner", "prefetch": False},
    "vtpf": {"v_layout": "keys_inner"},
    "vt_s2": {"v_layout": "keys_inner", "num_stages": 2},
    "vt_w4": {"v_layout": "keys_inner", "num_warps": 4},
    "vt_n128_w4": {"v_layout": "keys_inner", "block_n": 128, "num_warps": 4},
}


OLD = None  # --old's module
HOG_SMS = 0  # --hog-sms: SMs held by spinning programs while the variants are timed


def case(b: int, ctx: int, layout: str, hq: int = 32, hk: int = 8, d: int = 128, bs: int = 16) -> dict:
    per_seq = -(-ctx // bs)
    n_blocks = b * per_seq + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    if layout == "hnd":  # [blocks, Hk, block_size, D] in memory: one head's block is one run of bytes
        kc = torch.randn((n_blocks, hk, bs, d), device="cuda", generator=g, dtype=torch.bfloat16).to(FP8)
        vc = torch.randn((n_blocks, hk, bs, d), device="cuda", generator=g, dtype=torch.bfloat16).to(FP8)
        kc, vc = kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3)  # seen as [blocks, block_size, Hk, D]
    else:
        kc = torch.randn((n_blocks, bs, hk, d), device="cuda", generator=g, dtype=torch.bfloat16).to(FP8)
        vc = torch.randn((n_blocks, bs, hk, d), device="cuda", generator=g, dtype=torch.bfloat16).to(FP8)
    ids = torch.arange(1, n_blocks, device="cuda", dtype=torch.int32)
    if layout in ("shuffled", "hnd"):
        ids = ids[torch.randperm(n_blocks - 1, device="cuda", generator=g)]
    bt = ids.view(b, per_seq).contiguous()
    sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn((b, hq, d), device="cuda", generator=g, dtype=torch.bfloat16)
    scale = d ** -0.5
    outs, row = {}, {"B": b, "context": ctx, "blocks": layout, "block size": bs}
    kv_bytes = 2 * b * ctx * hk * d  # K and V, one byte each
    vc_inner = None
    calls = {}
    for name, kw in VARIANTS.items():  # compiled and run once each before any SMs are held
        fn = OLD.decode_attention_triton if name == "old" else decode_attention_triton
        kw = dict(kw)
        v = vc
        if kw.pop("v_layout", "rows") == "keys_inner":
            vc_inner = to_v_layout(vc, "keys_inner") if vc_inner is None else vc_inner
            v = vc_inner
        calls[name] = lambda kw=kw, fn=fn, v=v: fn(q, kc, v, bt, sl, scale, **kw)
        outs[name] = calls[name]()
        time_ms(calls[name], reps=2)  # the allocator's blocks for these shapes, cached
    torch.cuda.synchronize()
    with SmHog(HOG_SMS):
        for name, call in calls.items():
            ms = time_ms(call)
            row[f"{name} us"] = ms * 1e3
            row[f"{name} GB/s"] = kv_bytes / ms / 1e6
    row["max diff"] = max(float((outs[n].float() - outs["default"].float()).abs().max()) for n in outs)
    ref = outs["default"].float()
    for n in outs:  # each variant's relative error against the default (fp16 dots over the exact e4m3 values)
        row[f"{n} rel"] = float((outs[n].float() - ref).norm() / ref.norm())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="1x2048,64x1500,256x1100,640x1530,1000x1100,1000x1500,1000x1900",
                    help="comma-separated BxCONTEXT")
    ap.add_argument("--layouts", default="shuffled",
                    help="block tables and cache layout: prefill, shuffled, hnd (shuffled, head-major blocks)")
    ap.add_argument("--variants", default="",
                    help="JSON {name: decode_attention_triton keywords} replacing the variants beside the default")
    ap.add_argument("--block-sizes", default="16",
                    help="comma-separated KV block sizes (tokens): 16 is the engine's default; TensorRT-LLM's "
                         "head-major blocks of 32-64 tokens are 'hnd' at 32 / 64 (one head's block: 4-8 KB in one run)")
    ap.add_argument("--old", default="", help="a previous kernels/decode_attention.py: timed too, as variant 'old'")
    ap.add_argument("--hog-sms", type=int, default=0,
                    help="hold this many SMs while timing (bench/sm_hog.py): an H100 with 40 of 132 held has an "
                         "H200's memory bandwidth per SM")
    args = ap.parse_args()
    global HOG_SMS
    HOG_SMS = args.hog_sms
    if args.variants:
        extra = json.loads(args.variants)
        for k in [k for k in VARIANTS if k != "default"]:
            del VARIANTS[k]
        VARIANTS.update(extra)
    if args.old:
        import importlib.util

        global OLD
        spec = importlib.util.spec_from_file_location("old_decode_attention", args.old)
        OLD = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(OLD)
        VARIANTS["old"] = {}
    # a non-blocking stream of its own: the legacy default stream would wait for the spinners (--hog-sms)
    with torch.cuda.stream(torch.cuda.Stream()):
        bw = copy_gbps()
        rows = []
        for c in args.cases.split(","):
            b, ctx = (int(x) for x in c.split("x"))
            for bs in (int(x) for x in args.block_sizes.split(",")):
                for layout in args.layouts.split(","):
                    rows.append(case(b, ctx, layout, bs=bs))
                    torch.cuda.empty_cache()
                    print(f"# {rows[-1]}", flush=True)
    data = {"header": header(), "copy_gbps": bw, "rows": rows}
    cols = ["B", "context", "blocks", "block size", *(f"{n} GB/s" for n in VARIANTS), "default us", "max diff",
            *(f"{n} rel" for n in VARIANTS if n != "default")]
    md = (f"### decode attention tiles, fp8 cache, {data['header']['machine']}, commit "
          f"{data['header']['commit']}; copy {bw:.0f} GB/s\n\n" + md_table(rows, cols))
    write_report("decode_tiles", data, md)


if __name__ == "__main__":
    main()
