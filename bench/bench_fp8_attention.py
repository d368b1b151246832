"""Dense causal prefill attention, one layer of Llama-3.1-8B heads (32 q, 8 kv, D 128): the engine's bf16
call (cuDNN through PyTorch SDPA) against cuDNN's FP8 forward (`kernels/cudnn_attention.py`), in one run.

    python3 bench/bench_fp8_attention.py [--lengths 2048,8192,32768]

For each length: time (median of CUDA-event timings), TFLOP/s (causal: half the square), and the error of
each output against an fp32 reference on a sample of query rows (the last and middle 256), relative RMS:
`vs_exact` against attention of the bf16 q/k/v, `vs_cache` against attention over k/v as an fp8 cache
holds them (e4m3, scale 1): the error FP8 attention adds beyond the cache's own. Variants:
- `bf16`: the engine's `dense_causal_attention` (bf16 q/k/v, cuDNN);
- `fp8 kernel`: cuDNN sdpa_fp8 alone, inputs already e4m3;
- `fp8 layer op`: what the engine's layer runs (`dense_attention_fp8`: one launch casting the fused
  projection's q | k | v rows and taking O's scale, cuDNN, O's per-row descale), and the same 100 tokens
  shorter (padded to its bucket: the sequence's length a device tensor);
- `fp8 kv expanded`: the kernel with k/v repeated to 32 heads (is GQA costing the kernel anything?).
Prints JSON lines and a markdown table; writes them under $OUT when set.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_decode_tiles import time_ms
from bench.common import header, md_table, write_report
from kernels import cudnn_attention as ca
from kernels.fp8_quant import cast_e4m3_ref
from workers.engine.attention import dense_causal_attention

HQ, HK, D = 32, 8, 128
SCALE = D**-0.5


def reference_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """fp32 causal attention of the query rows `rows` ([R] int64) over all keys: [R, HQ, D]."""
    qf = q[rows].float()  # [R, HQ, D]
    kf = k.float().repeat_interleave(HQ // HK, dim=1)  # [T, HQ, D]
    vf = v.float().repeat_interleave(HQ // HK, dim=1)
    s = torch.einsum("rhd,thd->hrt", qf, kf) * SCALE
    keys = torch.arange(k.shape[0], device=q.device)
    s = s.masked_fill(keys[None, None, :] > rows[None, :, None], float("-inf"))
    return torch.einsum("hrt,thd->rhd", torch.softmax(s, dim=-1), vf)


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def one_length(t: int, reps: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn((t, (HQ + 2 * HK) * D), device="cuda", generator=g).to(torch.bfloat16)  # the fused rows
    qkv[:, : HQ * D] *= 2.0  # a peakier softmax
    qkv[:, (HQ + HK) * D :] *= 0.5
    q, k, v = ca.qkv_views(qkv, HQ, HK, D)
    rows = torch.cat([torch.arange(t // 2 - 128, t // 2 + 128), torch.arange(t - 256, t)]).cuda()
    exact = reference_rows(q, k, v, rows)
    y, o_scale = cast_e4m3_ref(qkv, (HQ + HK) * D, ca.O_MARGIN)  # as the layer op casts them, O's scale
    q8, k8, v8 = ca.qkv_views(y, HQ, HK, D)
    cache = reference_rows(q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), rows)
    flops = 4 * D * HQ * t * (t + 1) / 2
    short = t - 100  # a length that runs padded to its bucket (kernels.cudnn_attention.bucket_tokens)
    mid = rows < short

    def layer_op(n: int):  # (e4m3 [n, HQ * D], descale [n, 1]): what o_proj takes
        return ca.dense_attention_fp8(q[:n], k[:n], v[:n], SCALE)

    k8e, v8e = (x.repeat_interleave(HQ // HK, dim=1) for x in (k8, v8))
    variants = {
        "bf16": (lambda: dense_causal_attention(q, k, v, SCALE), None),
        "fp8 kernel": (lambda: ca.dense_causal_attention_fp8(q8, k8, v8, SCALE, o_scale), o_scale),
        "fp8 layer op": (lambda: layer_op(t), None),  # the cast's launch, cuDNN, O's descale rows
        f"fp8 layer op, {short} tokens": (lambda: layer_op(short), None),
        "fp8 kv expanded": (lambda: ca.dense_causal_attention_fp8(q8, k8e, v8e, SCALE, o_scale), o_scale),
    }
    out = []
    for name, (fn, osc) in variants.items():
        row = {"tokens": t, "variant": name}
        try:
            t0 = time.perf_counter()
            o = fn()
            torch.cuda.synchronize()
            row["first_call_ms"] = round((time.perf_counter() - t0) * 1e3, 1)  # cuDNN's graph build in it
            if isinstance(o, tuple):
                of = (o[0].float() * o[1]).view(o[0].shape[0], HQ, D)
            else:
                of = o.float() if osc is None else o.float() / osc
            row["ms"] = round(time_ms(fn, reps), 4)
            row["tflops"] = round(flops / (row["ms"] * 1e-3) / 1e12, 1)
            sel = mid if of.shape[0] < t else torch.ones_like(mid)
            row["vs_exact"] = round(rel_rms(of[rows[sel]], exact[sel]), 5)
            row["vs_cache"] = round(rel_rms(of[rows[sel]], cache[sel]), 5)
            row["finite"] = bool(torch.isfinite(of).all())
        except Exception as e:  # a variant the frontend refuses is a result, not a crash
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(row, flush=True)
        out.append(row)
    return out


def _run(t: int, reps: int) -> list[dict]:
    rows = one_length(t, reps)
    torch.cuda.empty_cache()  # the length's tensors are gone with its closures
    return rows


def probe_one(d: int, t: int) -> None:
    """One shape through `dense_attention_fp8` (8 q heads, 2 kv heads): its error against the emulation
    and exact attention over the same e4m3 inputs, printed as one JSON line. Run in its own process: a
    shape cuDNN mishandles can fault the CUDA context."""
    import json

    hq, hk = 8, 2
    g = torch.Generator(device="cuda").manual_seed(d + t)
    qkv = torch.randn((t, (hq + 2 * hk) * d), device="cuda", generator=g).to(torch.bfloat16)
    o8, descale = ca.dense_attention_fp8(*ca.qkv_views(qkv, hq, hk, d), d**-0.5)
    got = o8.float() * descale
    torch.cuda.synchronize()
    y, o_scale = cast_e4m3_ref(qkv, (hq + hk) * d, ca.O_MARGIN)
    e8 = ca.qkv_views(y, hq, hk, d)
    emu = ca.causal_attention_fp8_ref(*e8, d**-0.5, o_scale).float().view(t, -1) / o_scale
    ex = torch.nn.functional.scaled_dot_product_attention(*(x.float().transpose(0, 1)[None] for x in e8),
                                                          is_causal=True, enable_gqa=True)[0].transpose(0, 1).reshape(t, -1)
    print(json.dumps({"head_dim": d, "tokens": t, "vs_exact": rel_rms(got, ex), "emulation_vs_exact": rel_rms(emu, ex),
                      "finite": bool(torch.isfinite(got).all())}), flush=True)


def probe(dims: list[int], lengths: list[int]) -> list[dict]:
    """probe_one for every shape, each in a subprocess; a crash is recorded as the shape's result."""
    import json
    import subprocess

    rows = []
    for d in dims:
        for t in lengths:
            p = subprocess.run([sys.executable, __file__, "--probe-one", f"{d},{t}"], capture_output=True, text=True,
                               timeout=120)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(line[-1]) if p.returncode == 0 and line else {
                "head_dim": d, "tokens": t, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
            print(row, flush=True)
            rows.append(row)
    return rows


def buckets(pairs: list[tuple[int, int]], reps: int) -> list[dict]:
    """The layer op at `tokens` run padded to `bucket`: does cuDNN's padding mask skip the padding's work
    (then a few coarse buckets serve every length), or pay for it?"""
    n = max(b for _, b in pairs)
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn((n, (HQ + 2 * HK) * D), device="cuda", generator=g).to(torch.bfloat16)
    rows = []
    for t, b in pairs:
        views = ca.qkv_views(qkv[:t], HQ, HK, D)
        t0 = time.perf_counter()
        ca.dense_attention_fp8(*views, SCALE, bucket=b)
        torch.cuda.synchronize()
        first = (time.perf_counter() - t0) * 1e3
        ms = time_ms(lambda views=views, b=b: ca.dense_attention_fp8(*views, SCALE, bucket=b), reps)
        row = {"tokens": t, "bucket": b, "ms": round(ms, 4), "first_call_ms": round(first, 1),
               "tflops_real": round(4 * D * HQ * t * (t + 1) / 2 / (ms * 1e-3) / 1e12, 1)}
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--probe", default=None, help="DIMS/LENGTHS, e.g. 16,32,64,128/37,128,1000: which head dims and "
                    "lengths the FP8 path runs (each shape in its own process), instead of the timings")
    ap.add_argument("--probe-one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--buckets", default=None, help="TOKENS:BUCKET,... (e.g. 8192:8192,8192:16384): the layer op "
                    "padded to each bucket, instead of the timings")
    args = ap.parse_args()
    if args.buckets:
        pairs = [tuple(int(x) for x in p.split(":")) for p in args.buckets.split(",")]
        rows = buckets(pairs, args.reps)
        write_report("fp8_attention_buckets", {**header(), "rows": rows},
                     md_table(rows, ["tokens", "bucket", "ms", "tflops_real", "first_call_ms"]))
        return
    if args.probe_one:
        probe_one(*(int(x) for x in args.probe_one.split(",")))
        return
    if args.probe:
        dims, lengths = ([int(x) for x in part.split(",")] for part in args.probe.split("/"))
        rows = probe(dims, lengths)
        md = md_table(rows, ["head_dim", "tokens", "vs_exact", "emulation_vs_exact", "finite", "error"])
        write_report("fp8_attention_probe", {**header(), "rows": rows}, md)
        return
    why = ca.available("cuda")
    info = header()
    if why is None:
        import cudnn

        info["cudnn_backend"] = cudnn.backend_version()
        info["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
    info["fp8_attention_unavailable"] = why
    print(info, flush=True)
    rows = [r for t in (int(x) for x in args.lengths.split(",")) for r in _run(t, args.reps)]
    md = md_table(rows, ["tokens", "variant", "ms", "tflops", "vs_exact", "vs_cache", "finite", "first_call_ms",
                        "error"])
    print(md)
    write_report("fp8_attention", {**info, "rows": rows}, md)


if __name__ == "__main__":
    main()
