"""rope_and_cache's launches in prompt steps on the GPU, Llama-3.1-8B's heads, an fp8 cache of 64-token blocks
with V's keys innermost (the FP8 engine's default):

- `per-token`: rope_and_cache, one program a token;
- `tiles T`: rope_cache_cast's kernel rotating q and k in place, T tokens a program, a program per 4 q heads
  and per kv head (as rope_and_cache in tiles: tried in session 26 and dropped, slower);
- `rope + cast`: the dense FP8 path's two launches (rope_and_cache, then cast_e4m3 of q | k | v;
  FIRSTTOKEN_FP8_ATTENTION_ROPE=0);
- `rope_cache_cast T`: the two in one launch (the default since session 26: T = 32 tokens a program; 0: one
  program a token, rope_and_cache's kernel with the cast, not yet timed).

Slots as a prompt's (consecutive, through blocks that lie anywhere), and as a decode step's (each its own
block) for the per-token / tiles comparison. Each variant's cache and q, k are checked bit for bit against
the per-token kernel's (and the cast's rows against rope + cast), then timed (median of
triton.testing.do_bench); `floor` is the bytes each must move at the measured copy rate.

    python3 bench/bench_rope_tiles.py --tokens 128,2048,8192,32768
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header, md_table
from kernels.cudnn_attention import O_MARGIN
from kernels.fp8_linear import FP8
from kernels.fp8_quant import cast_e4m3_triton
from kernels.kv_layout import empty_kv_caches
from kernels.rope_cache import rope_and_cache_triton, rope_cache_cast_triton

HQ, HK, D, BS = 32, 8, 128, 64
C = (HQ + 2 * HK) * D


def _ms(fn) -> float:
    """Median ms of fn on the GPU; on the CPU (a smoke run, under the interpreter) one call's."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing as tt

    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_gbps(dev: str) -> float:
    a = torch.empty(1 << (30 if dev == "cuda" else 24), dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return 2 * a.numel() / _ms(partial(b.copy_, a)) / 1e6


def inputs(t: int, kind: str, dev: str, g: torch.Generator):
    """(qkv [T, C] bf16, positions, slots, k_cache, v_cache): a prompt's slots or a decode step's."""
    qkv = torch.randn((t, C), device=dev, dtype=torch.bfloat16, generator=g)
    nb = t + 8 if kind == "decode" else t // BS + 8
    kc, vc = empty_kv_caches(nb, BS, HK, D, FP8, dev, v_layout="keys_inner")
    blocks = torch.randperm(nb, device=dev, generator=g)
    if kind == "decode":  # each token the next slot of its own sequence's last block
        slots = blocks[:t] * BS + torch.randint(0, BS, (t,), device=dev, generator=g)
        positions = torch.randint(0, 4096, (t,), device=dev, generator=g)
    else:  # one prompt from position 0: consecutive slots through its blocks
        j = torch.arange(t, device=dev)
        slots = blocks[j // BS] * BS + j % BS
        positions = j
    return qkv, positions, slots.contiguous(), kc, vc


def views(qkv: torch.Tensor):
    t = qkv.shape[0]
    return (qkv[:, : HQ * D].view(t, HQ, D), qkv[:, HQ * D : (HQ + HK) * D].view(t, HK, D),
            qkv[:, (HQ + HK) * D :].view(t, HK, D))


def run(t: int, kind: str, tiles: list[int], cs: torch.Tensor, gbps: float, dev: str) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(t)
    qkv0, pos, slots, kc0, vc0 = inputs(t, kind, dev, g)
    rows = []

    def state():
        return qkv0.clone(), kc0.clone(), vc0.clone()

    # the per-token kernel's outputs: what every variant must give
    qkv, kc, vc = state()
    rope_and_cache_triton(*views(qkv), pos, cs, kc, vc, slots)
    want = (qkv, kc, vc)
    # bytes: q|k|v read (bf16), q and k written back, k and v into the cache (e4m3), cos/sin and metadata
    rope_bytes = t * (C * 2 + (HQ + HK) * D * 2 + 2 * HK * D + D * 4 + 16)
    cast_bytes = t * C * (2 + 1)  # q|k|v read again, e4m3 written
    fused_bytes = t * (C * 2 + 2 * HK * D + C + D * 4 + 16)  # read once; cache and e4m3 rows written

    def row(name, ms, nbytes, exact):
        floor = nbytes / gbps / 1e6
        rows.append({"tokens": t, "slots": kind, "variant": name, "ms": round(ms, 4), "floor_ms": round(floor, 4),
                     "x_floor": round(ms / floor, 2), "GBps": round(nbytes / ms / 1e6), "exact": exact})

    qkv, kc, vc = state()
    row("per-token", _ms(partial(rope_and_cache_triton, *views(qkv), pos, cs, kc, vc, slots)), rope_bytes, True)
    y = torch.empty((t, C), dtype=FP8, device=dev)
    for tile in tiles:  # (the rows written too: rope_and_cache's bytes and the cast's writes)
        qkv, kc, vc = state()
        rope_cache_cast_triton(*views(qkv), pos, cs, kc, vc, slots, O_MARGIN, out=y, tile=tile, write_qk=True)
        exact = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip((qkv, kc, vc), want))
        qkv, kc, vc = state()
        row(f"tiles {tile}", _ms(partial(rope_cache_cast_triton, *views(qkv), pos, cs, kc, vc, slots, O_MARGIN,
                                         out=y, tile=tile, write_qk=True)), rope_bytes + t * C, exact)
    if kind == "decode":
        return rows

    def rope_then_cast(qkv, kc, vc, y):
        q, k, v = views(qkv)
        rope_and_cache_triton(q, k, v, pos, cs, kc, vc, slots)
        return cast_e4m3_triton(qkv, (HQ + HK) * D, O_MARGIN, out=y)

    qkv, kc, vc = state()
    y_want, s_want = rope_then_cast(qkv, kc, vc, None)
    qkv, kc, vc = state()
    row("rope + cast", _ms(partial(rope_then_cast, qkv, kc, vc, y)), rope_bytes + cast_bytes, True)
    for tile in (0, *tiles):  # 0: one program a token (rope_and_cache's kernel with the cast)
        qkv, kc, vc = state()
        y8, s8 = rope_cache_cast_triton(*views(qkv), pos, cs, kc, vc, slots, O_MARGIN, tile=tile)
        exact = (torch.equal(y8.view(torch.uint8), y_want.view(torch.uint8)) and torch.equal(s8, s_want)
                 and torch.equal(kc.view(torch.uint8), want[1].view(torch.uint8))
                 and torch.equal(vc.view(torch.uint8), want[2].view(torch.uint8)) and torch.equal(qkv, qkv0))
        qkv, kc, vc = state()
        row(f"rope_cache_cast {tile}", _ms(partial(rope_cache_cast_triton, *views(qkv), pos, cs, kc, vc, slots,
                                                   O_MARGIN, out=y, tile=tile)), fused_bytes, exact)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,2048,8192,32768")
    ap.add_argument("--decode-tokens", default="512", help="decode steps' sizes for per-token against tiles")
    ap.add_argument("--tiles", default="16,32,64")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    inv = 1.0 / 500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=dev) / D)
    ang = torch.arange(131072, dtype=torch.float32, device=dev)[:, None] * inv[None, :]
    cs = torch.cat((ang.cos(), ang.sin()), dim=1).contiguous()
    gbps = copy_gbps(dev)
    tiles = [int(x) for x in args.tiles.split(",")]
    rows = []
    for t in (int(x) for x in args.tokens.split(",") if x):
        rows += run(t, "prompt", tiles, cs, gbps, dev)
    for t in (int(x) for x in args.decode_tokens.split(",") if x):
        rows += run(t, "decode", tiles, cs, gbps, dev)
    res = {**header(), "copy_GBps": round(gbps), "rows": rows}
    print(json.dumps(res))
    md = md_table(rows, ["tokens", "slots", "variant", "ms", "floor_ms", "x_floor", "GBps", "exact"])
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rope_tiles.json").write_text(json.dumps(res, indent=1))
    (out / "rope_tiles.md").write_text(md + "\n")
    if not all(r["exact"] for r in rows):
        sys.exit("a variant's outputs differ from the per-token kernel's")


if __name__ == "__main__":
    main()
