"""Decode attention over an fp8 cache at large batches: the grid's order (sequences first, as
before, or kv heads first) against the device's copy rate, in one run.

    python3 bench/bench_decode_order.py            # Llama-3.1-8B heads (32 q, 8 kv, D 128), block 16

At batch 1000 and context ~1100 the H200 profile of a decode step (bench/profile_engine.py) had
the decode kernel at ~3.0 TB/s against 4.2 at batch 640 / context 1530. With sequences on grid axis
0, the programs running together read one kv head's 128-byte rows of many blocks (a block's token
rows are Hk x D bytes apart), and the other heads' rows of those blocks come waves later; with the
heads first, the programs of one sequence run side by side and read its blocks' rows whole.

Block tables: "prefill" gives each sequence consecutive blocks (a prompt prefilled in one chunk),
"shuffled" a random permutation of the pool (decode blocks allocated one at a time across many
sequences). Prints JSON and a markdown table; writes them under $OUT when set.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header, md_table, write_report
from kernels.decode_attention import decode_attention_triton

FP8 = torch.float8_e4m3fn


def copy_gbps(nbytes: int = 1 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * nbytes / time_ms(lambda: b.copy_(a)) / 1e6


def time_ms(fn, reps: int = 20) -> float:
    """Median of reps CUDA-event timings, after two warm calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]


# the grid orders, and two tile variants with the heads first (the fp8 defaults are 64 keys, 2 warps,
# 3 stages, tuned at B = 224)
VARIANTS = {
    "seqs_first": {"heads_first": False},
    "heads_first": {"heads_first": True},
    "hf_n128_w4": {"heads_first": True, "block_n": 128, "num_warps": 4},
    "hf_stages4": {"heads_first": True, "num_stages": 4},
}


def case(b: int, ctx: int, layout: str, hq: int = 32, hk: int = 8, d: int = 128, bs: int = 16) -> dict:
    per_seq = -(-ctx // bs)
    n_blocks = b * per_seq + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn((n_blocks, bs, hk, d), device="cuda", generator=g, dtype=torch.bfloat16).to(FP8)
    vc = torch.randn((n_blocks, bs, hk, d), device="cuda", generator=g, dtype=torch.bfloat16).to(FP8)
    ids = torch.arange(1, n_blocks, device="cuda", dtype=torch.int32)
    if layout == "shuffled":
        ids = ids[torch.randperm(n_blocks - 1, device="cuda", generator=g)]
    bt = ids.view(b, per_seq).contiguous()
    sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn((b, hq, d), device="cuda", generator=g, dtype=torch.bfloat16)
    scale = d ** -0.5
    outs, row = {}, {"B": b, "context": ctx, "blocks": layout}
    kv_bytes = 2 * b * ctx * hk * d  # K and V, one byte each
    for name, kw in VARIANTS.items():
        outs[name] = decode_attention_triton(q, kc, vc, bt, sl, scale, **kw)
        ms = time_ms(lambda kw=kw: decode_attention_triton(q, kc, vc, bt, sl, scale, **kw))
        row[f"{name} us"] = ms * 1e3
        row[f"{name} GB/s"] = kv_bytes / ms / 1e6
    row["same output"] = bool(torch.equal(outs["seqs_first"], outs["heads_first"]))
    row["tiles max diff"] = max(float((outs[n].float() - outs["seqs_first"].float()).abs().max()) for n in outs)
    row["heads_first x"] = row["seqs_first us"] / row["heads_first us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="1x2048,64x1500,256x1100,640x1530,1000x1100,1000x1500,1000x1900",
                    help="comma-separated BxCONTEXT")
    args = ap.parse_args()
    bw = copy_gbps()
    rows = []
    for c in args.cases.split(","):
        b, ctx = (int(x) for x in c.split("x"))
        for layout in ("prefill", "shuffled"):
            rows.append(case(b, ctx, layout))
            torch.cuda.empty_cache()
            print(f"# {rows[-1]}", flush=True)
    data = {"header": header(), "copy_gbps": bw, "rows": rows}
    cols = ["B", "context", "blocks", *(f"{n} GB/s" for n in VARIANTS), "seqs_first us", "heads_first x",
            "same output", "tiles max diff"]
    md = (f"### decode attention grid order, fp8 cache, {data['header']['machine']}, commit "
          f"{data['header']['commit']}; copy {bw:.0f} GB/s\n\n" + md_table(rows, cols))
    write_report("decode_order", data, md)


if __name__ == "__main__":
    main()
