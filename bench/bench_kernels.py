"""Check and time the Triton kernels on a GPU beside eager PyTorch (the references) and SDPA.

One command (from the repo root, on a CUDA machine):

    python3 bench/bench_kernels.py [--out DIR] [--sweep] [--commit SHA]

(a) checks each Triton kernel against its reference on Llama-3.1-8B shapes (Hq=32, Hk=8, D=128,
block 16, bf16) and prints the max error; the long prefills (8192, 32768), whose fp32 reference
would not fit, are checked against SDPA instead; decode is also replayed from a CUDA graph after
seq_lens changed. (b) times each with triton.testing.do_bench (median, L2 flushed between runs),
measures a device copy bandwidth and a bf16 matmul rate in the same run, and reports TFLOP/s
(prefill attention) and GB/s (decode attention, norms, silu, rope). --sweep also times tile
variants of the two attention kernels. Writes kernels.json and kernels.md under --out.

--focus runs instead a short set for the split-KV prefill and the launch overhead (focus.json /
focus.md): GPU correctness of split / unsplit prefill and decode (also replayed from CUDA graphs
after seq_lens changed), CUDA-graph times of the cached-prefix prefill (2048 + 128) over tiles
and split counts, 2048 / 8192 prefill, decode B=1 / 64 (short contexts with one split vs the
default), and host microseconds per call with and without the direct launch path; with
--old DIR (a copy of the previous kernels as package `oldkernels`) also the previous launchers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
import traceback
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from kernels.decode_attention import decode_attention_ref, decode_attention_triton
from kernels.prefill_attention import paged_attention_ref, paged_attention_triton
from kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from kernels.rope_cache import rope_and_cache_ref, rope_and_cache_triton
from kernels.silu_mul import silu_and_mul_ref, silu_and_mul_triton

HQ, HK, D, BS, HIDDEN, INTER = 32, 8, 128, 16, 4096, 14336  # Llama-3.1-8B
DT = torch.bfloat16
DEV = "cuda"


def bench(fn, graph: bool = False) -> float:
    """Median milliseconds of fn (do_bench, or CUDA-graph replays when graph=True)."""
    import triton.testing as tt

    if graph:
        return tt.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def host_us(fn, n: int = 200) -> float:
    """Host microseconds per call (launcher + Triton dispatch), the GPU kept busy behind it."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def err(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o, r = out.float(), ref.float()
    return {
        "max_abs": (o - r).abs().max().item(),
        "rel_l2": ((o - r).norm() / r.norm().clamp_min(1e-30)).item(),
        "nan": bool(o.isnan().any().item()),
    }


def ceilings() -> dict:
    n = 1 << 30  # 1 GiB copied: bytes read + written
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = bench(partial(b.copy_, a))
    x = torch.randn(8192, 8192, device=DEV, dtype=DT)
    y = torch.randn(8192, 8192, device=DEV, dtype=DT)
    mm = bench(partial(torch.matmul, x, y))
    return {"copy_GBps": 2 * n / ms / 1e6, "bf16_matmul_TFLOPs": 2 * 8192**3 / mm / 1e9}


# --------------------------------------------------------------------------------------------- elementwise


def run_rms(rows: list) -> None:
    for t in (256, 16384):
        x = torch.randn(t, HIDDEN, device=DEV, dtype=DT)
        r = torch.randn_like(x)
        w = torch.randn(HIDDEN, device=DEV, dtype=DT)
        out, res = rms_norm_triton(x, w, 1e-5, r)
        ro, rr = rms_norm_ref(x, w, 1e-5, r)
        e = err(out, ro)
        e_res = err(res, rr)
        nbytes = 4 * t * HIDDEN * 2
        tt = bench(partial(rms_norm_triton, x, w, 1e-5, r))
        hu = host_us(partial(rms_norm_triton, x, w, 1e-5, r))
        te = bench(partial(rms_norm_ref, x, w, 1e-5, r))
        rows.append({"op": "rms_norm+residual", "shape": f"T={t} H={HIDDEN}", **_e(e), "res_max_abs": e_res["max_abs"],
                     "host_us": hu, "triton_ms": tt, "eager_ms": te, "GBps": nbytes / tt / 1e6})


def run_silu(rows: list) -> None:
    for t in (256, 8192):
        x = torch.randn(t, 2 * INTER, device=DEV, dtype=DT)
        e = err(silu_and_mul_triton(x), silu_and_mul_ref(x))
        nbytes = 3 * t * INTER * 2
        tt = bench(partial(silu_and_mul_triton, x))
        hu = host_us(partial(silu_and_mul_triton, x))
        te = bench(partial(silu_and_mul_ref, x))
        rows.append({"op": "silu_and_mul", "shape": f"T={t} I={INTER}", **_e(e),
                     "host_us": hu, "triton_ms": tt, "eager_ms": te, "GBps": nbytes / tt / 1e6})


def _cos_sin(max_pos: int) -> torch.Tensor:
    inv = 1.0 / 500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEV) / D)
    ang = torch.arange(max_pos, dtype=torch.float32, device=DEV)[:, None] * inv[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=1).contiguous()


def run_rope(rows: list) -> None:
    cs = _cos_sin(131072)
    for t in (256, 16384):
        qkv = torch.randn(t, (HQ + 2 * HK) * D, device=DEV, dtype=DT)
        q = qkv[:, : HQ * D].view(t, HQ, D)
        k = qkv[:, HQ * D : (HQ + HK) * D].view(t, HK, D)
        v = qkv[:, (HQ + HK) * D :].view(t, HK, D)
        nb = t // BS + 8
        kc = torch.full((nb, BS, HK, D), float("nan"), device=DEV, dtype=DT)
        vc = torch.full_like(kc, float("nan"))
        pos = torch.randint(0, 131072, (t,), device=DEV)
        slots = torch.randperm(nb * BS, device=DEV)[:t]
        kc2, vc2 = kc.clone(), vc.clone()
        qr, _ = rope_and_cache_ref(q.clone(), k.clone(), v.clone(), pos, cs, kc2, vc2, slots)
        qkv0 = qkv.clone()
        rope_and_cache_triton(q, k, v, pos, cs, kc, vc, slots)
        e = err(q, qr)
        ek = err(kc.view(-1, HK, D)[slots], kc2.view(-1, HK, D)[slots])
        ev = err(vc.view(-1, HK, D)[slots], vc2.view(-1, HK, D)[slots])
        qkv.copy_(qkv0)
        nbytes = t * ((HQ + 2 * HK) * D * 2 + (HQ + HK) * D * 2 + 2 * HK * D * 2 + D * 4 + 16)
        # timing rotates the same buffer repeatedly: the values drift, the bytes moved do not
        tt = bench(partial(rope_and_cache_triton, q, k, v, pos, cs, kc, vc, slots))
        hu = host_us(partial(rope_and_cache_triton, q, k, v, pos, cs, kc, vc, slots))
        te = bench(partial(rope_and_cache_ref, q, k, v, pos, cs, kc, vc, slots))
        rows.append({"op": "rope_and_cache", "shape": f"T={t} Hq={HQ} Hk={HK}", **_e(e),
                     "k_cache_max_abs": ek["max_abs"], "v_cache_max_abs": ev["max_abs"],
                     "host_us": hu, "triton_ms": tt, "eager_ms": te, "GBps": nbytes / tt / 1e6})


def _e(e: dict) -> dict:
    return {"max_abs": e["max_abs"], "rel_l2": e["rel_l2"], "nan": e["nan"]}


# --------------------------------------------------------------------------------------------- FP8 GEMMs


FP8_SHAPES = (("qkv", HIDDEN, (HQ + 2 * HK) * D), ("o", HQ * D, HIDDEN), ("gate_up", HIDDEN, 2 * INTER),
              ("down", INTER, HIDDEN))


def run_fp8(out: list) -> None:
    """Each Llama-3.1-8B projection at several token counts: bf16 matmul and FP8 with per-channel
    weight scales (torch._scaled_mm); the FP8 time includes the activation quantization, as a layer
    runs it unfused. (The few-row kernel and the GEMV are timed by bench_fp8_decode.py and
    bench_fp8_gemv.py.)"""
    from kernels.fp8_linear import fp8_linear_scaled_mm, quantize_rowwise

    for t in (1, 64, 1024, 8192):
        for name, k, n in FP8_SHAPES:
            x = torch.randn(t, k, device=DEV, dtype=DT)
            w = torch.randn(n, k, device=DEV, dtype=DT) * 0.02
            ref = (x.float() @ w.float().t())
            wq, ws = quantize_rowwise(w)
            row = {"proj": name, "T": t, "K": k, "N": n}
            row["bf16_ms"] = bench(partial(torch.matmul, x, w.t()))
            row["quant_ms"] = bench(partial(quantize_rowwise, x))
            row["scaled_mm_ms"] = bench(partial(fp8_linear_scaled_mm, x, wq, ws))
            row["scaled_mm_rel_l2"] = err(fp8_linear_scaled_mm(x, wq, ws), ref)["rel_l2"]
            flop = 2 * t * k * n
            for key in ("bf16", "scaled_mm"):
                row[f"{key}_TFLOPs"] = flop / row[f"{key}_ms"] / 1e9
            out.append(row)
            print(row, flush=True)


# --------------------------------------------------------------------------------------------- attention


def paged_kv(ctx_lens: list[int]):
    """Random bf16 K/V for each sequence in a shuffled paged cache; also the dense copies for SDPA."""
    nblk = [math.ceil(c / BS) for c in ctx_lens]
    max_blocks = max(nblk)
    total = sum(nblk) + 4
    kc = torch.randn(total, BS, HK, D, device=DEV, dtype=DT)
    vc = torch.randn_like(kc)
    perm = torch.randperm(total, device=DEV)
    bt = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32, device=DEV)
    used = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[used : used + n].int()
        used += n
    return kc, vc, bt


def dense_kv(kc, vc, bt, i: int, ctx: int):
    """Sequence i's K/V gathered from the cache: [1, Hq, ctx, D] each (kv heads repeated)."""
    blocks = bt[i, : math.ceil(ctx / BS)].long()
    k = kc[blocks].reshape(-1, HK, D)[:ctx].transpose(0, 1).repeat_interleave(HQ // HK, 0)[None]
    v = vc[blocks].reshape(-1, HK, D)[:ctx].transpose(0, 1).repeat_interleave(HQ // HK, 0)[None]
    return k.contiguous(), v.contiguous()


PREFILL_SHAPES = [(0, 512), (0, 2048), (0, 8192), (0, 32768), (2048, 128)]  # (cached prefix, new tokens)


def run_prefill(rows: list, sweep: list | None) -> None:
    scale = D**-0.5
    for prefix, new in PREFILL_SHAPES:
        ctx = prefix + new
        kc, vc, bt = paged_kv([ctx])
        q = torch.randn(new, HQ, D, device=DEV, dtype=DT)
        qsl = torch.tensor([0, new], dtype=torch.int32, device=DEV)
        sl = torch.tensor([ctx], dtype=torch.int32, device=DEV)
        pairs = sum(prefix + i + 1 for i in range(new))
        flops = 4 * D * HQ * pairs
        k, v = dense_kv(kc, vc, bt, 0, ctx)
        qd = q.transpose(0, 1)[None]  # [1, Hq, n, D]
        if prefix == 0:
            sdpa = partial(F.scaled_dot_product_attention, qd, k, v, is_causal=True, scale=scale)
        else:
            mask = (torch.arange(ctx, device=DEV)[None, :] <= (prefix + torch.arange(new, device=DEV))[:, None])
            sdpa = partial(F.scaled_dot_product_attention, qd, k, v, attn_mask=mask, scale=scale)
        tri = partial(paged_attention_triton, q, kc, vc, bt, qsl, sl, scale, None, max_query_len=new)
        out = tri()
        if ctx <= 8192:
            ref = paged_attention_ref(q, kc, vc, bt, qsl, sl, scale)
            check_against = "reference"
        else:
            ref = sdpa()[0].transpose(0, 1)
            check_against = "sdpa"
        e = err(out, ref)
        del ref
        tt = bench(tri)
        hu = host_us(tri, 50)
        ts = bench(sdpa)
        te = bench(partial(paged_attention_ref, q, kc, vc, bt, qsl, sl, scale)) if ctx <= 2176 else None
        rows.append({"op": "prefill_attention", "shape": f"prefix={prefix} new={new}", **_e(e), "checked_vs": check_against,
                     "host_us": hu, "triton_ms": tt, "sdpa_ms": ts, "eager_ms": te,
                     "TFLOPs": flops / tt / 1e9, "sdpa_TFLOPs": flops / ts / 1e9})
        if sweep is not None and new in (2048, 8192, 32768, 128):
            for bm, bn, w, st in [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 3),
                                  (64, 128, 4, 2), (64, 128, 4, 3)]:
                f = partial(paged_attention_triton, q, kc, vc, bt, qsl, sl, scale, None, max_query_len=new,
                            block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                try:
                    ev = err(f(), out)["max_abs"]
                    ms = bench(f)
                    sweep.append({"op": "prefill", "shape": f"prefix={prefix} new={new}",
                                  "cfg": f"M{bm} N{bn} w{w} s{st}", "ms": ms, "TFLOPs": flops / ms / 1e9, "diff": ev})
                except Exception as ex:  # a variant that does not compile (shared memory) is reported, not fatal
                    sweep.append({"op": "prefill", "shape": f"prefix={prefix} new={new}",
                                  "cfg": f"M{bm} N{bn} w{w} s{st}", "error": repr(ex)[:200]})
        del kc, vc, k, v, q
        torch.cuda.empty_cache()


def time_variant(f, ref: torch.Tensor, rate: str, work: float, **row) -> dict:
    """One sweep row: f's max difference from ref and its graph-replayed median ms, with
    `rate` = work / ms; a variant that fails (compile, shared memory) is reported, not fatal."""
    try:
        diff = (f().float() - ref.float()).abs().max().item()
        ms = bench(f, graph=True)
        row.update({"ms": ms, rate: work / ms, "diff": diff})
    except Exception as ex:
        row["error"] = repr(ex)[:200]
    print(row, flush=True)
    return row


def run_prefill_graph_shape(sweep: list, cache_dtypes: tuple[str, ...] = ("bf16",)) -> None:
    """The cached-prefix TTFT case as the engine's prefill graph runs it: 16 table rows (15 padded,
    no tokens), tables as wide as max_model_len (33024), 128 new tokens over a 2048 prefix (and
    over none); tiles x split counts, graph-replayed with the combine. cache_dtypes: "bf16" and/or
    "fp8" (the engine's fp8 KV cache: the same values rounded to e4m3)."""
    for cache in cache_dtypes:
        _prefill_graph_shape(sweep, cache)


def _prefill_graph_shape(sweep: list, cache: str) -> None:
    scale = D**-0.5
    rows_, width = 16, 33024 // BS
    for prefix, new in ((2048, 128), (0, 128), (0, 512)):
        ctx = prefix + new
        kc, vc, bt1 = paged_kv([ctx])
        if cache == "fp8":
            kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        bt = torch.full((rows_, width), kc.shape[0] - 1, dtype=torch.int32, device=DEV)
        bt[0, : bt1.shape[1]] = bt1[0]
        q = torch.randn(new, HQ, D, device=DEV, dtype=DT)
        qsl = torch.full((rows_ + 1,), new, dtype=torch.int32, device=DEV)
        qsl[0] = 0
        sl = torch.zeros(rows_, dtype=torch.int32, device=DEV)
        sl[0] = ctx
        flops = 4 * D * HQ * sum(prefix + i + 1 for i in range(new))
        ref = paged_attention_ref(q, kc, vc, bt1, qsl[:2].clone(), sl[:1].clone(), scale)
        # an fp8 cache: its widening to q's dtype ("q") against fp16 (the default), on fewer tiles
        tile_set = [(None, None, None, None), (64, 128, 4, 2), (64, 64, 4, 2), (64, 128, 4, 3), (32, 128, 4, 2),
                    (64, 64, 2, 2), (128, 128, 8, 3), (128, 64, 8, 3), (16, 128, 4, 2)]
        widens = (None,)
        if cache == "fp8":
            tile_set = [(None, None, None, None), (64, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 3)]
            widens = ("q", "fp16")
        for tiles, widen, splits in itertools.product(tile_set, widens, (None, 1, 2, 4, 8, 16)):
            bm, bn, w, st = tiles
            f = partial(paged_attention_triton, q, kc, vc, bt, qsl, sl, scale, None, max_query_len=new,
                        num_splits=splits, block_m=bm, block_n=bn, num_warps=w, num_stages=st, widen=widen)
            sweep.append(time_variant(f, ref, "TFLOPs", flops / 1e9, op="prefill_graph_shape",
                                      shape=f"prefix={prefix} new={new} rows=16 cache={cache}",
                                      cfg=f"M{bm} N{bn} w{w} s{st} splits={splits or 'auto'}"
                                          + (f" widen={widen}" if widen else "")))
        del kc, vc
        torch.cuda.empty_cache()


def run_decode(rows: list, sweep: list | None) -> None:
    scale = D**-0.5
    gen = torch.Generator().manual_seed(0)
    for b in (1, 8, 64, 256):
        ctx = torch.randint(1024, 4097, (b,), generator=gen).tolist()
        kc, vc, bt = paged_kv(ctx)
        q = torch.randn(b, HQ, D, device=DEV, dtype=DT)
        sl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
        nbytes = sum(ctx) * HK * D * 2 * 2 + 2 * b * HQ * D * 2 + bt.numel() * 4
        tri = partial(decode_attention_triton, q, kc, vc, bt, sl, scale)
        out = tri()
        e = err(out, decode_attention_ref(q, kc, vc, bt, sl, scale))
        # SDPA over K/V gathered to a dense, padded [B, Hq, max_ctx, D] (the gather is not timed)
        mx = max(ctx)
        kd = torch.zeros(b, HQ, mx, D, device=DEV, dtype=DT)
        vd = torch.zeros_like(kd)
        for i, c in enumerate(ctx):
            k, v = dense_kv(kc, vc, bt, i, c)
            kd[i, :, :c], vd[i, :, :c] = k[0], v[0]
        mask = (torch.arange(mx, device=DEV)[None, :] < sl[:, None])[:, None, None, :]  # [B, 1, 1, max_ctx]
        sdpa = partial(F.scaled_dot_product_attention, q[:, :, None], kd, vd, attn_mask=mask, scale=scale)
        e_sdpa = err(out, sdpa()[:, :, 0])
        tt = bench(tri)
        hu = host_us(tri)
        tg = bench(tri, graph=True)
        ts = bench(sdpa)
        te = bench(partial(decode_attention_ref, q, kc, vc, bt, sl, scale))
        rows.append({"op": "decode_attention", "shape": f"B={b} ctx={min(ctx)}..{max(ctx)}", **_e(e),
                     "vs_sdpa_max_abs": e_sdpa["max_abs"], "host_us": hu, "triton_ms": tt, "triton_graph_ms": tg, "sdpa_ms": ts,
                     "eager_ms": te, "GBps": nbytes / tt / 1e6, "graph_GBps": nbytes / tg / 1e6})
        if sweep is not None:
            for bn, w, st, ns in [(64, 4, 3, None), (64, 4, 2, None), (128, 4, 2, None), (128, 4, 3, None),
                                  (64, 4, 3, 32)]:
                f = partial(decode_attention_triton, q, kc, vc, bt, sl, scale, num_splits=ns, block_n=bn, num_warps=w,
                            num_stages=st)
                try:
                    ev = err(f(), out)["max_abs"]
                    ms = bench(f, graph=True)
                    sweep.append({"op": "decode", "shape": f"B={b}", "cfg": f"N{bn} w{w} s{st} splits={ns or 'auto'}",
                                  "ms": ms, "GBps": nbytes / ms / 1e6, "diff": ev})
                except Exception as ex:
                    sweep.append({"op": "decode", "shape": f"B={b}", "cfg": f"N{bn} w{w} s{st} splits={ns}",
                                  "error": repr(ex)[:200]})
        del kc, vc, kd, vd
        torch.cuda.empty_cache()


def run_decode_kv_dtype(sweep: list, batches: tuple[int, ...] = (64, 224, 640)) -> None:
    """Decode attention over a bf16 and an fp8 (e4m3) cache, at the throughput run's steady state
    (B=64 and 224, context ~1000), across tiles: does half the bytes give half the time? And the
    fp8 cache at TensorRT-LLM's throughput shape's decode steps (B=640, context ~1500)."""
    scale = D**-0.5
    gen = torch.Generator().manual_seed(1)
    for b, lo, hi in ((64, 800, 1201), (224, 800, 1201), (640, 1000, 2001)):
        if b not in batches:
            continue
        ctx = torch.randint(lo, hi, (b,), generator=gen).tolist()
        kc, vc, bt = paged_kv(ctx)
        q = torch.randn(b, HQ, D, device=DEV, dtype=DT)
        sl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
        ref = decode_attention_triton(q, kc, vc, bt, sl, scale)
        tiles = [(128, 4, 3), (64, 4, 3), (128, 8, 3), (128, 4, 2), (64, 2, 3), (32, 2, 3), (64, 1, 3),
                 (64, 2, 4), (128, 2, 3), (32, 1, 3), (64, 2, 2)]
        caches = (("bf16", kc, vc), ("fp8", kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)))
        if b == 640:
            caches = caches[1:]
            tiles += [(128, 4, 4), (64, 4, 4), (64, 2, 5), (128, 2, 4), (256, 4, 3), (256, 8, 3), (32, 2, 4)]
        shape = f"B={b} ctx~{(lo + hi) // 2}"
        for name, k, v in caches:
            nbytes = sum(ctx) * HK * D * 2 * k.element_size()
            if name == "fp8":  # the block ids of the next tile loaded an iteration ahead
                for bn, w, st in ((64, 2, 3), (64, 2, 4), (128, 4, 3), (64, 4, 3), (128, 4, 4), (32, 2, 4)):
                    f = partial(decode_attention_triton, q, k, v, bt, sl, scale, block_n=bn, num_warps=w,
                                num_stages=st, widen="fp16", prefetch=True)
                    sweep.append(time_variant(f, ref, "GBps", nbytes / 1e6, op="decode_fp8_cache", shape=shape,
                                              cfg=f"N{bn} w{w} s{st} widen=fp16 prefetch"))
            for (bn, w, st), widen, splits in [(t, wd, None) for t in tiles for wd in
                                               (("q", "fp16") if name == "fp8" else ("q",))] + [
                    ((128, 4, 3), "q", 1), ((128, 4, 3), "fp16" if name == "fp8" else "q", 2)]:
                f = partial(decode_attention_triton, q, k, v, bt, sl, scale, num_splits=splits, block_n=bn,
                            num_warps=w, num_stages=st, widen=widen)
                sweep.append(time_variant(f, ref, "GBps", nbytes / 1e6, op=f"decode_{name}_cache",
                                          shape=shape,
                                          cfg=f"N{bn} w{w} s{st} widen={widen} splits={splits or 'auto'}"))
        del kc, vc
        torch.cuda.empty_cache()


def check_decode_graph() -> dict:
    """Capture decode in a CUDA graph, change seq_lens (and the block table) in place, replay, compare."""
    scale = D**-0.5
    b = 16
    kc, vc, bt = paged_kv([4096] * b)
    q = torch.randn(b, HQ, D, device=DEV, dtype=DT)
    sl = torch.full((b,), 100, dtype=torch.int32, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        decode_attention_triton(q, kc, vc, bt, sl, scale)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = decode_attention_triton(q, kc, vc, bt, sl, scale)
    res = {}
    for name, lens in (("short", [100] * b), ("mixed", torch.randint(1, 4097, (b,)).tolist())):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        res[name] = err(out, decode_attention_ref(q, kc, vc, bt, sl, scale))["max_abs"]
    return res


# --------------------------------------------------------------------------------------------- report


def markdown(result: dict) -> str:
    lines = [f"# Kernel benchmark: {result['device']}", "",
             f"- date {result['date']}, commit {result['commit']}, torch {result['torch']}, triton {result['triton']}",
             f"- measured ceilings: copy {result['ceilings']['copy_GBps']:.0f} GB/s (read+write), "
             f"bf16 matmul 8192^3 {result['ceilings']['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
             f"- decode captured in a CUDA graph, seq_lens changed, replayed: max abs error {result['graph_check']}",
             "- times: do_bench median (L2 flushed), ms; 'graph' = do_bench_cudagraph median", "",
             "- host us: host time of one Triton call (checks + dispatch); small shapes are bound by it", "",
             "| op | shape | max abs err | rel L2 | triton ms | triton (graph) ms | host us | eager ms | SDPA ms | rate |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, p=3):
        return "-" if x is None else f"{x:.{p}f}"

    for r in result["rows"]:
        rate = f"{r['TFLOPs']:.0f} TFLOP/s (SDPA {r['sdpa_TFLOPs']:.0f})" if "TFLOPs" in r else f"{r['GBps']:.0f} GB/s"
        if "graph_GBps" in r:
            rate += f", graph {r['graph_GBps']:.0f} GB/s"
        lines.append(f"| {r['op']} | {r['shape']} | {r['max_abs']:.2e} | {r['rel_l2']:.1e} | {f(r['triton_ms'])} | "
                     f"{f(r.get('triton_graph_ms'))} | {f(r.get('host_us'), 0)} | {f(r.get('eager_ms'))} | {f(r.get('sdpa_ms'))} | {rate} |")
    if result.get("fp8"):
        lines += ["", "## FP8 GEMMs (Llama-3.1-8B projections; FP8 times include quantizing the activations)", "",
                  "| proj | T | bf16 ms | FP8 per-channel (_scaled_mm) ms | quantize ms | TFLOP/s bf16 / scaled_mm | "
                  "rel L2 scaled_mm |", "|---|---|---|---|---|---|---|"]
        for r in result["fp8"]:
            lines.append(f"| {r['proj']} | {r['T']} | {r['bf16_ms']:.4f} | {r['scaled_mm_ms']:.4f} | {r['quant_ms']:.4f} | "
                         f"{r['bf16_TFLOPs']:.0f} / {r['scaled_mm_TFLOPs']:.0f} | {r['scaled_mm_rel_l2']:.1e} |")
    if result.get("sweep"):
        lines += ["", "## Tile sweep", "", "| op | shape | config | ms | rate | max diff vs default |", "|---|---|---|---|---|---|"]
        for s in result["sweep"]:
            if "error" in s:
                lines.append(f"| {s['op']} | {s['shape']} | {s['cfg']} | error | {s['error']} | |")
            else:
                rate = f"{s['TFLOPs']:.0f} TFLOP/s" if "TFLOPs" in s else f"{s['GBps']:.0f} GB/s"
                lines.append(f"| {s['op']} | {s['shape']} | {s['cfg']} | {s['ms']:.4f} | {rate} | {s['diff']:.1e} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- focus


def _graph_ms(fn) -> float:
    """Median ms of fn replayed from a CUDA graph (its launches captured once)."""
    fn()
    torch.cuda.synchronize()
    return bench(fn, graph=True)


def _host(fn, n: int = 300) -> float:
    """Median-of-3 host microseconds per call (no sync inside)."""
    return sorted(host_us(fn, n) for _ in range(3))[1]


FOCUS_PREFILL = [(2048, 128), (0, 2048), (0, 8192)]  # (cached prefix, new tokens); the first is swept
FOCUS_DECODE = [(1, 1637, 1637), (64, 1024, 4096), (1, 256, 256), (1, 512, 512), (64, 256, 512)]  # (B, ctx range)


def focus_prefill(res: dict, old) -> None:
    scale = D**-0.5
    rows, sweep = res.setdefault("prefill", []), res.setdefault("prefill_sweep", [])
    for prefix, new in FOCUS_PREFILL:
        ctx = prefix + new
        kc, vc, bt = paged_kv([ctx])
        q = torch.randn(new, HQ, D, device=DEV, dtype=DT)
        qsl = torch.tensor([0, new], dtype=torch.int32, device=DEV)
        sl = torch.tensor([ctx], dtype=torch.int32, device=DEV)
        flops = 4 * D * HQ * sum(prefix + i + 1 for i in range(new))
        ref = paged_attention_ref(q, kc, vc, bt, qsl, sl, scale)
        base = partial(paged_attention_triton, q, kc, vc, bt, qsl, sl, scale, None, max_query_len=new)
        variants = {"default": base, "splits=1": partial(base, num_splits=1)}
        if old is not None:
            variants["previous"] = partial(old.prefill_attention.paged_attention_triton, q, kc, vc, bt, qsl, sl, scale,
                                           None, max_query_len=new)
        for name, fn in variants.items():
            fn()
            e = err(fn(), ref)  # the second call goes through the direct launch path
            ms = bench(fn)
            gms = _graph_ms(fn)
            rows.append({"shape": f"prefix={prefix} new={new}", "variant": name, **_e(e), "ms": ms, "graph_ms": gms,
                         "TFLOPs_graph": flops / gms / 1e9})
            print(rows[-1], flush=True)
        if (prefix, new) == FOCUS_PREFILL[0]:
            res["host_us_prefill_2048+128"] = host_table(base, old and partial(
                old.prefill_attention.paged_attention_triton, q, kc, vc, bt, qsl, sl, scale, None, max_query_len=new))
            for bm, bn, w, st in [(64, 128, 4, 2), (64, 64, 4, 2), (128, 128, 8, 3)]:
                for ns in (1, 2, 4, 6, 8):
                    f = partial(base, block_m=bm, block_n=bn, num_warps=w, num_stages=st, num_splits=ns)
                    try:
                        d = err(f(), ref)["max_abs"]
                        gms = _graph_ms(f)
                        sweep.append({"cfg": f"M{bm} N{bn} w{w} s{st} splits={ns}", "graph_ms": gms,
                                      "TFLOPs": flops / gms / 1e9, "max_abs": d})
                    except Exception as ex:
                        sweep.append({"cfg": f"M{bm} N{bn} w{w} s{st} splits={ns}", "error": repr(ex)[:200]})
                    print(sweep[-1], flush=True)
            try:
                # the engine's captured step: B = 16 sequence slots, 15 of them padding (no tokens)
                b = 16
                bt16 = torch.zeros(b, 8192 // BS, dtype=torch.int32, device=DEV)
                bt16[0, : bt.shape[1]] = bt[0]
                qsl16 = torch.full((b + 1,), new, dtype=torch.int32, device=DEV)
                qsl16[0] = 0
                sl16 = torch.zeros(b, dtype=torch.int32, device=DEV)
                sl16[0] = ctx
                g = partial(paged_attention_triton, q, kc, vc, bt16, qsl16, sl16, scale, None, max_query_len=new)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    g()
                torch.cuda.current_stream().wait_stream(s)
                sl16[0] = 200  # captured with a short context, replayed with the real one
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = g()
                sl16[0] = ctx
                graph.replay()
                torch.cuda.synchronize()
                res["prefill_graph_b16"] = {**_e(err(out, ref)), "graph_ms": _graph_ms(g),
                                            "graph_ms_splits1": _graph_ms(partial(g, num_splits=1))}
                print(res["prefill_graph_b16"], flush=True)
            except Exception:
                res["errors"].append(f"prefill graph b16: {traceback.format_exc()}")
                print(res["errors"][-1], flush=True)
        _save(res)
        del kc, vc, q, ref
        torch.cuda.empty_cache()


def _save(res: dict) -> None:
    """Write what is measured so far (a run stopped at its time limit keeps it)."""
    out = Path(res["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "focus.json").write_text(json.dumps(res, indent=1, default=str))


def host_table(fn, old_fn) -> dict:
    import kernels._triton as kt

    out = {"direct_launch": _host(fn)}
    kt.FAST_LAUNCH = False
    out["triton_dispatch"] = _host(fn)
    kt.FAST_LAUNCH = True
    if old_fn is not None:
        out["previous"] = _host(old_fn)
    print(out, flush=True)
    return out


def focus_decode(res: dict, old) -> None:
    scale = D**-0.5
    rows = res.setdefault("decode", [])
    for b, lo, hi in FOCUS_DECODE:
        ctx = torch.randint(lo, hi + 1, (b,)).tolist()
        kc, vc, bt = paged_kv(ctx)
        q = torch.randn(b, HQ, D, device=DEV, dtype=DT)
        sl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
        ref = decode_attention_ref(q, kc, vc, bt, sl, scale)
        nbytes = sum(ctx) * HK * D * 2 * 2
        for ns in (None, 1, 2, 4):
            fn = partial(decode_attention_triton, q, kc, vc, bt, sl, scale, num_splits=ns)
            fn()
            e = err(fn(), ref)
            gms = _graph_ms(fn)
            rows.append({"shape": f"B={b} ctx={lo}..{hi}", "splits": ns or "auto", **_e(e), "graph_ms": gms,
                         "GBps": nbytes / gms / 1e6})
            print(rows[-1], flush=True)
        if b == 1 and lo == 1637:
            _save(res)
            res["host_us_decode_b1"] = host_table(partial(decode_attention_triton, q, kc, vc, bt, sl, scale),
                                                  old and partial(old.decode_attention.decode_attention_triton,
                                                                  q, kc, vc, bt, sl, scale))
        del kc, vc
        torch.cuda.empty_cache()
    x = torch.randn(256, HIDDEN, device=DEV, dtype=DT)
    w = torch.randn(HIDDEN, device=DEV, dtype=DT)
    res["host_us_rms_norm_256"] = host_table(partial(rms_norm_triton, x, w, 1e-5, x),
                                             old and partial(old.rmsnorm.rms_norm_triton, x, w, 1e-5, x))


def focus_markdown(res: dict) -> str:
    lines = [f"- {res['device']}, commit {res['commit']}, torch {res['torch']}, triton {res['triton']}, "
             f"decode graph check {res.get('graph_check')}", "",
             "| prefill | variant | max abs err | NaN | do_bench ms | graph ms | TFLOP/s (graph) |", "|---|---|---|---|---|---|---|"]
    for r in res.get("prefill", []):
        lines.append(f"| {r['shape']} | {r['variant']} | {r['max_abs']:.2e} | {r['nan']} | {r['ms']:.4f} | "
                     f"{r['graph_ms']:.4f} | {r['TFLOPs_graph']:.0f} |")
    lines += ["", "| prefill 2048+128 config | graph ms | TFLOP/s | max abs err |", "|---|---|---|---|"]
    for r in res.get("prefill_sweep", []):
        if "error" in r:
            lines.append(f"| {r['cfg']} | error | {r['error']} | |")
        else:
            lines.append(f"| {r['cfg']} | {r['graph_ms']:.4f} | {r['TFLOPs']:.0f} | {r['max_abs']:.1e} |")
    lines += ["", f"- prefill 2048+128 captured with B=16 slots (15 padding): {res.get('prefill_graph_b16')}", "",
              "| decode | splits | max abs err | graph ms | GB/s |", "|---|---|---|---|---|"]
    for r in res.get("decode", []):
        lines.append(f"| {r['shape']} | {r['splits']} | {r['max_abs']:.2e} | {r['graph_ms']:.4f} | {r['GBps']:.0f} |")
    lines += ["", "| host us per call | direct launch | Triton dispatch | previous launcher |", "|---|---|---|---|"]
    for k in ("host_us_prefill_2048+128", "host_us_decode_b1", "host_us_rms_norm_256"):
        h = res.get(k) or {}
        lines.append(f"| {k[8:]} | {h.get('direct_launch', 0):.1f} | {h.get('triton_dispatch', 0):.1f} | "
                     f"{h.get('previous', float('nan')):.1f} |")
    if res.get("errors"):
        lines += ["", "errors:", *[f"    {e}" for e in res["errors"]]]
    return "\n".join(lines) + "\n"


def run_focus(args) -> None:
    import importlib

    import triton

    old = None
    if args.old:
        sys.path.insert(0, args.old)
        old = importlib.import_module("oldkernels")
        for m in ("prefill_attention", "decode_attention", "rmsnorm"):
            importlib.import_module(f"oldkernels.{m}")
    torch.manual_seed(0)
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "commit": args.commit, "torch": torch.__version__,
           "triton": triton.__version__, "errors": [], "out": args.out}
    for name, fn in (("prefill", lambda: focus_prefill(res, old)), ("decode", lambda: focus_decode(res, old)),
                     ("graph", lambda: res.__setitem__("graph_check", check_decode_graph()))):
        try:
            fn()
        except Exception:
            res["errors"].append(f"{name}: {traceback.format_exc()}")
            print(res["errors"][-1], flush=True)
        print(name, "done", f"{time.time() - t0:.0f}s", flush=True)
        _save(res)
    md = focus_markdown(res)
    (Path(args.out) / "focus.md").write_text(md)
    print(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true", help="also time tile variants of the attention kernels")
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--kv-batches", default="64,224,640", help="decode_kv_dtype: batch sizes (of 64, 224, 640)")
    ap.add_argument("--focus", action="store_true", help="only the split-KV / launch-overhead set (see above)")
    ap.add_argument("--old", default=None, help="folder holding the previous kernels as package `oldkernels`")
    ap.add_argument("--prefill-caches", default="bf16",
                    help="prefill_graph_shape: KV cache dtypes to sweep (bf16, fp8; comma list)")
    ap.add_argument("--sections", default=None,
                    help="comma list of sections to run (rms,silu,rope,prefill,decode,decode_kv_dtype,prefill_graph_shape,graph,fp8); default all")
    args = ap.parse_args()
    if args.focus:
        run_focus(args)
        return
    import triton

    torch.manual_seed(0)
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "commit": args.commit,
              "torch": torch.__version__, "triton": triton.__version__,
              "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    result["ceilings"] = ceilings()
    print("ceilings", result["ceilings"], flush=True)
    rows: list = []
    sweep: list | None = [] if args.sweep else None
    errors = []
    sections = (("rms", lambda: run_rms(rows)), ("silu", lambda: run_silu(rows)), ("rope", lambda: run_rope(rows)),
                ("prefill", lambda: run_prefill(rows, sweep)), ("decode", lambda: run_decode(rows, sweep)),
                ("decode_kv_dtype", lambda: sweep is not None and run_decode_kv_dtype(
                    sweep, tuple(int(x) for x in args.kv_batches.split(",")))),
                ("prefill_graph_shape", lambda: sweep is not None and run_prefill_graph_shape(
                    sweep, tuple(args.prefill_caches.split(",")))),
                ("graph", lambda: result.__setitem__("graph_check", check_decode_graph())),
                ("fp8", lambda: run_fp8(result.setdefault("fp8", []))))
    only = set(args.sections.split(",")) if args.sections else None
    for name, fn in sections:
        if only is not None and name not in only:
            continue
        try:  # one broken section is reported and does not lose the others' numbers
            fn()
        except Exception:
            errors.append(f"{name}: {traceback.format_exc()}")
            print(errors[-1], flush=True)
        print(name, "done", f"{time.time() - t0:.0f}s", flush=True)
    result.setdefault("graph_check", None)
    result["errors"] = errors
    result["rows"] = rows
    result["sweep"] = sweep
    result["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out / "kernels.md").write_text(md)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "sweep")}))
    print(md)


if __name__ == "__main__":
    main()
