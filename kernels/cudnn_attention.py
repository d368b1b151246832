"""Dense causal attention on FP8 (e4m3) tensor cores through cuDNN's `sdpa_fp8` (the cudnn frontend).

A long uncached prompt's attention is the one part of an FP8 engine's prefill still on bf16 tensor
cores: PyTorch SDPA's cuDNN kernel runs it at ~560-590 TFLOP/s on the H100/H200 (bench/results), and
at 32768 tokens it is about half of TTFT. cuDNN's FP8 forward runs Q K^T and P V in e4m3.

What is quantized, and why it is safe:
- K and V: cast to e4m3 with scale 1, saturating: the values an fp8 KV cache stores (kernels/
  rope_cache.py writes them so), which decode attends over afterwards. This path is used only for an
  fp8 cache, so it adds no error the cache does not already carry.
- Q: the same cast, scale 1 (as K: the elements that fall below e4m3's normal range are the ones that
  matter least to a dot product).
- P (softmax probabilities, in [0, 1]): cuDNN scales them by `P_SCALE` into e4m3's range.
- O: e4m3 (Hopper's FP8 forward writes no 16-bit output), scaled so that max |V| maps under 448:
  each output row is a convex combination of V's rows, so |O| <= max |V| (times P's rounding,
  `O_MARGIN`). O is returned with its descale and feeds an FP8 o_proj as it is, already quantized.

The frontend (`nvidia-cudnn-frontend`, optional: `available()` says why not) builds one cuDNN graph
per shape; each is built once and kept (`_GRAPHS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels.fp8_quant import cast_e4m3_ref, cast_e4m3_triton, saturate_e4m3

__all__ = ["saturate_e4m3"]  # the cast this path applies to q/k/v, for its callers (the fp8 cache's)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
P_SCALE = 448.0  # softmax probabilities in [0, 1] -> [0, 448]
O_MARGIN = 1.125  # |O| <= max |V| * (1 + P's e4m3 rounding, at most 1/16): room over that

# head dims this path takes (others stay on bf16 attention): Llama-3's 128 and SmolLM2's 64, the two
# measured in the engine. cuDNN itself ran 16, 32 and 256 too (bench_fp8_attention.py --probe on an H100)
HEAD_DIMS = (64, 128)

_GRAPHS: dict[tuple, Any] = {}
_FAILED: dict[tuple, str] = {}  # graphs cuDNN refused to build: why


class Unsupported(RuntimeError):
    """cuDNN cannot build this attention graph here; the caller runs the attention in bf16 instead."""

_HANDLES: dict[int, Any] = {}
_CONSTS: dict[torch.device, torch.Tensor] = {}
_REASON: list[str | None] = []  # available()'s answer, once


def available(device: torch.device | str) -> str | None:
    """None when `dense_causal_attention_fp8` can run on this device, else why not."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "cuDNN FP8 attention needs a CUDA device"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "cuDNN FP8 attention needs sm90 or newer"
    if not _REASON:
        try:
            torch.backends.cudnn.version()  # torch's libcudnn loaded first: the frontend finds it by name
            import cudnn  # noqa: F401

            _REASON.append(None)
        except Exception as e:  # an optional package: any import failure means "not here"
            _REASON.append(f"the cudnn frontend does not import ({type(e).__name__}: {e})")
    return _REASON[0]


def _handle(device: torch.device) -> Any:
    import cudnn

    idx = device.index if device.index is not None else torch.cuda.current_device()
    h = _HANDLES.get(idx)
    if h is None:
        with torch.cuda.device(idx):
            h = _HANDLES[idx] = cudnn.create_handle()
    return h


def _graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, o: torch.Tensor, padded: bool) -> tuple:
    """The built graph for these shapes and strides (built once), its tensors and workspace. padded: the
    sequence is shorter than the tensors (its length a device tensor: one graph serves a bucket of lengths).
    Raises Unsupported where cuDNN refuses it (remembered: not tried again)."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), o.stride(), float(scale), q.device, padded)
    hit = _GRAPHS.get(key)
    if hit is not None:
        return hit
    failed = _FAILED.get(key)
    if failed is not None:  # refused before: not built again (a build costs tens of ms)
        raise Unsupported(failed)
    try:
        hit = _GRAPHS[key] = _build(q, k, v, scale, o, padded)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # cuDNN refusing the graph (its version, the device, the shape)
        _FAILED[key] = f"cuDNN's FP8 attention graph for q {tuple(q.shape)}, k {tuple(k.shape)}: {type(e).__name__}: {e}"
        raise Unsupported(_FAILED[key]) from e
    return hit


def _build(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, o: torch.Tensor, padded: bool) -> tuple:
    import cudnn

    handle = _handle(q.device)
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def bhsd(name: str, x: torch.Tensor):  # [T, H, D] seen as [1, H, T, D]
        t, h, d = x.shape
        return graph.tensor(name=name, dim=[1, h, t, d], stride=[t * x.stride(0), x.stride(1), x.stride(0), 1],
                            data_type=e4m3)

    tq, tk, tv = bhsd("q", q), bhsd("k", k), bhsd("v", v)
    scalars = [graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
               for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")]
    lens = {}
    if padded:  # the real length, for q and kv alike ([1, 1, 1, 1] int32)
        seq = graph.tensor(name="seq_len", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        lens = {"use_padding_mask": True, "seq_len_q": seq, "seq_len_kv": seq}
    out, _stats, amax_s, amax_o = graph.sdpa_fp8(
        q=tq, k=tk, v=tv, descale_q=scalars[0], descale_k=scalars[1], descale_v=scalars[2],
        descale_s=scalars[3], scale_s=scalars[4], scale_o=scalars[5], is_inference=True,
        attn_scale=float(scale), use_causal_mask=True, name="sdpa_fp8", **lens)
    t, h, d = o.shape
    out.set_output(True).set_dim([1, h, t, d]).set_stride([t * o.stride(0), o.stride(1), o.stride(0), 1]) \
        .set_data_type(e4m3)
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    ws = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device=q.device)
    return graph, handle, (tq, tk, tv), scalars, out, (amax_s, amax_o), ws, lens.get("seq_len_q")


def release(device: torch.device | str) -> None:
    """Drop the built graphs (their workspaces) and constants of a device: an engine closing gives its
    memory back. The next call builds again."""
    device = torch.device(device)

    def on(d: torch.device) -> bool:
        return d.type == device.type and (device.index is None or d.index == device.index)

    for key in [k for k in _GRAPHS if on(k[7])]:
        del _GRAPHS[key]
    for key in [k for k in _FAILED if on(k[7])]:
        del _FAILED[key]
    for d in [d for d in _CONSTS if on(d)]:
        del _CONSTS[d]


def dense_causal_attention_fp8(
    q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scale: float, o_scale: torch.Tensor,
    out: torch.Tensor | None = None, seq_len: torch.Tensor | None = None, built: tuple | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence over itself, all e4m3 with Q/K/V scale 1: q8 [T, Hq, D],
    k8/v8 [T, Hk, D] (last dims contiguous); o_scale: a one-element fp32 device tensor, O's scale
    (kernels.fp8_quant.cast_e4m3_triton's). Returns out, e4m3 [T, Hq, D]: the attention output times o_scale.
    seq_len: a one-element int32 device tensor, the sequence's length when it is shorter than T (rows
    past it must hold finite values; their outputs are not the sequence's). built: `_graph`'s answer for
    these tensors, when the caller has it."""
    import cudnn

    t, hq, d = q8.shape
    if out is None:
        out = torch.empty((t, hq, d), dtype=FP8, device=q8.device)
    if built is None:
        built = _graph(q8, k8, v8, scale, out, seq_len is not None)
    graph, handle, (tq, tk, tv), sc, to, (tas, tao), ws, tlen = built
    c = _CONSTS.get(q8.device)
    if c is None:  # descale q, k, v; descale and scale of P; then room for the two amax outputs
        c = _CONSTS[q8.device] = torch.tensor([1.0, 1.0, 1.0, 1.0 / P_SCALE, P_SCALE, 0.0, 0.0],
                                               dtype=torch.float32, device=q8.device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
    graph.execute({tq: q8, tk: k8, tv: v8, sc[0]: c[0:1], sc[1]: c[1:2], sc[2]: c[2:3], sc[3]: c[3:4],
                   sc[4]: c[4:5], sc[5]: o_scale, to: out, tas: c[5:6], tao: c[6:7], tlen: seq_len}, ws, handle=handle)
    return out


def causal_attention_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          round_p: bool = False) -> torch.Tensor:
    """Causal attention in fp32 of q [T, Hq, D] over k/v [T, Hk, D] (any float dtypes) -> [T, Hq, D] fp32;
    round_p: the probabilities rounded to e4m3 at P_SCALE before P V (as cuDNN's FP8 forward), the row sum
    taken before that rounding."""
    t, hq, _d = q.shape
    g = hq // k.shape[1]
    qf = q.float().transpose(0, 1)  # [Hq, T, D]
    kf = k.float().repeat_interleave(g, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
    s = (qf @ kf.transpose(1, 2)) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    row_sum = p.sum(dim=-1, keepdim=True)
    if round_p:
        p = (p * P_SCALE).to(FP8).float() / P_SCALE
    return ((p @ vf) / row_sum).transpose(0, 1)


def causal_attention_fp8_ref(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scale: float,
                             o_scale: torch.Tensor) -> torch.Tensor:
    """What cuDNN's FP8 forward computes, in fp32: softmax of the e4m3 q8 k8^T (times scale), the
    probabilities rounded to e4m3 at P_SCALE, times v8 over the row sum, times o_scale, cast to e4m3
    (saturating). q8: [T, Hq, D], k8/v8: [T, Hk, D] -> [T, Hq, D] e4m3."""
    o = causal_attention_fp32(q8, k8, v8, scale, round_p=True) * o_scale.float()
    return o.clamp(-FP8_MAX, FP8_MAX).contiguous().to(FP8)


def qkv_views(rows: torch.Tensor, hq: int, hk: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused projection's [T, (Hq + 2 Hk) * D] rows seen as q [T, Hq, D], k and v [T, Hk, D]."""
    t = rows.shape[0]
    return (rows[:, : hq * d].view(t, hq, d), rows[:, hq * d : (hq + hk) * d].view(t, hk, d),
            rows[:, (hq + hk) * d :].view(t, hk, d))


def _split_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The [T, (Hq + 2 Hk) * D] rows q, k and v are views of (a fused projection's output, q | k | v
    side by side), else None."""
    t, hq, d = q.shape
    hk, e = k.shape[1], q.element_size()
    rows = q.stride(0)
    if not (k.stride(0) == v.stride(0) == rows and q.stride(1) == k.stride(1) == v.stride(1) == d
            and k.data_ptr() == q.data_ptr() + hq * d * e and v.data_ptr() == k.data_ptr() + hk * d * e
            and rows >= (hq + 2 * hk) * d):
        return None
    return q.as_strided((t, (hq + 2 * hk) * d), (rows, 1))


def dense_attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        reference: bool = False, bucket: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one uncached prompt on FP8 tensor cores, for an FP8 o_proj: q [T, Hq, D],
    k/v [T, Hk, D] in the model's dtype (rotated; views of one fused projection's rows or not) ->
    (e4m3 [T, Hq * D], its per-row descale [T, 1] fp32), the input an Fp8Linear takes as it is.

    One launch casts q | k | v to e4m3 and takes O's scale from V (kernels.fp8_quant.cast_e4m3_triton),
    then cuDNN's sdpa_fp8. reference: the same in PyTorch (`causal_attention_fp8_ref`, any device).
    bucket: the padded length to run at (>= T; None: `bucket_tokens`)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    rows = _split_qkv(q, k, v)
    if rows is None:  # not side by side: one copy puts them so
        rows = torch.cat([x.reshape(t, -1) for x in (q, k, v)], dim=1)
    if reference:
        y, o_scale = cast_e4m3_ref(rows, (hq + hk) * d, O_MARGIN)
        return _attend_ref(y, hq, hk, d, scale, o_scale)
    return _attend(t, hq, hk, d, scale, q.device, bucket,
                   lambda y: cast_e4m3_triton(rows, (hq + hk) * d, O_MARGIN, out=y)[1])


def dense_attention_fp8_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, positions: torch.Tensor,
                             cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slot_mapping: torch.Tensor, reference: bool = False,
                             bucket: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`dense_attention_fp8` from q and k not yet rotated: one launch rotates them, writes k and v to the
    cache (rope_and_cache's work) and casts q | k | v to e4m3 (kernels.rope_cache.rope_cache_cast_triton),
    where rope_and_cache would write the rotated q and k back for the cast to read them again. q and k are
    left unrotated. Raises Unsupported before anything is written where cuDNN refuses the shape (the
    caller then runs rope_and_cache and its own attention). reference: the same in PyTorch."""
    from kernels.rope_cache import rope_cache_cast_ref, rope_cache_cast_triton

    t, hq, d = q.shape
    hk = k.shape[1]
    args = (q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    if reference:
        y, o_scale = rope_cache_cast_ref(*args, O_MARGIN)
        return _attend_ref(y, hq, hk, d, scale, o_scale)
    return _attend(t, hq, hk, d, scale, q.device, bucket,
                   lambda y: rope_cache_cast_triton(*args, O_MARGIN, out=y)[1])


def _attend_ref(y: torch.Tensor, hq: int, hk: int, d: int, scale: float,
                o_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_attention_fp8_ref` of the cast rows y [T, (Hq + 2 Hk) * D], as dense_attention_fp8 returns it."""
    t = y.shape[0]
    o8 = causal_attention_fp8_ref(*qkv_views(y, hq, hk, d), scale, o_scale)
    return o8.view(t, hq * d), torch.reciprocal(o_scale).expand(t, 1).contiguous()


def _attend(t: int, hq: int, hk: int, d: int, scale: float, device: torch.device,
            bucket: int | None, cast: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's attention of one prompt of t tokens at its bucket: the graph first (Unsupported before `cast`
    runs), then cast(y) writes the first t rows of y [bucket, (Hq + 2 Hk) * D] e4m3 and returns O's scale."""
    tb = bucket_tokens(t) if bucket is None else max(bucket, t)
    # (a bucket over EXACT_MAX is always run padded, below; at or under it the length's own graph)
    y = torch.empty((tb, (hq + 2 * hk) * d), dtype=FP8, device=device)
    out = torch.empty((tb, hq, d), dtype=FP8, device=device)
    padded = tb > EXACT_MAX
    built = _graph(*qkv_views(y, hq, hk, d), scale, out, padded)  # (or refused) before the cast writes the cache
    if tb > t:
        y[t:].zero_()  # the padding's rows: finite, masked out of the sequence's attention
    o_scale = cast(y)
    # past EXACT_MAX always the bucket's padded graph (a length on the bucket too: one graph a bucket)
    seq_len = torch.full((1,), t, dtype=torch.int32, device=device) if padded else None
    o8 = dense_causal_attention_fp8(*qkv_views(y, hq, hk, d), scale, o_scale, out=out, seq_len=seq_len, built=built)
    return o8[:t].view(t, hq * d), torch.reciprocal(o_scale).expand(t, 1).contiguous()


# prompts longer than EXACT_MAX run padded to a bucket, so that cuDNN builds one graph per bucket, not per
# length: ~50 ms a graph, ~0.9 s for the process's first padded one (an H100, bench_fp8_attention.py
# --buckets). cuDNN's padding mask does not skip the padding's work (8192 tokens in a 32768 bucket: 3.93 ms
# against 0.72 in their own), so the buckets are an eighth of an octave apart (at least 256 tokens): at most
# 1/8 more rows. Up to EXACT_MAX (the dense CUDA graphs' range, captured per 128-token bucket) each length
# has its own graph.
EXACT_MAX = 2048


def bucket_tokens(t: int) -> int:
    """The padded length a prompt of t tokens runs at."""
    if t <= EXACT_MAX:
        return t
    step = max(256, 1 << (t.bit_length() - 4))  # 2^(floor(log2 t) - 3)
    return -(-t // step) * step


def buckets_up_to(max_tokens: int) -> list[int]:
    """Every bucket a prompt of EXACT_MAX + 1 .. max_tokens tokens runs at."""
    out: list[int] = []
    t = EXACT_MAX + 1
    while t <= max_tokens:
        out.append(bucket_tokens(t))
        t = out[-1] + 1
    return out


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: torch.dtype,
            device: torch.device, max_tokens: int) -> int:
    """Build the graph of every bucket up to max_tokens now (a prompt's first token should not wait for
    it), each run once on zeros, smallest first. Returns the largest bucket built: where the device runs
    out of memory for a bucket's buffers (or cuDNN refuses its graph) the rest are left to their first prompt."""
    built = 0
    for b in buckets_up_to(max_tokens):
        try:
            qkv = torch.zeros((b, (num_heads + 2 * num_kv_heads) * head_dim), dtype=dtype, device=device)
            dense_attention_fp8(*qkv_views(qkv, num_heads, num_kv_heads, head_dim), scale)
        except (torch.cuda.OutOfMemoryError, Unsupported):
            break
        built = b
    return built
