"""RMSNorm and SiLU-and-mul fused with the FP8 quantization of their output: the input of an FP8
projection is written once, as e4m3 with its scales, instead of written in bf16, read back, and
written again as e4m3 by a separate quantization.

Scales are per token ([T, 1]). The references compose the unfused ops (`rms_norm_ref` /
`silu_and_mul_ref`, then `quantize`), so a fused kernel must give what the unfused path gives: the
same rounding to the activation dtype before the scale is taken.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kernels._triton import check, lazy_helper, lazy_jit, next_pow2
from kernels.fp8_linear import FP8, FP8_MAX, quantize
from kernels.rmsnorm import rms_norm_ref
from kernels.silu_mul import silu_and_mul_ref

Quantized = tuple[torch.Tensor, torch.Tensor]  # (q: [T, C] e4m3, scale: [T, 1] fp32)


def rms_norm_quant_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[Quantized, torch.Tensor]:
    """((q, scale), new_residual): rms_norm_ref's output quantized per token."""
    normed, new_res = rms_norm_ref(x, weight, eps, residual)
    return quantize(normed), new_res


def silu_and_mul_quant_ref(x: torch.Tensor) -> Quantized:
    """(q, scale): silu_and_mul_ref's output quantized per token."""
    return quantize(silu_and_mul_ref(x))


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

tl: Any = None  # triton.language, bound at the first launch by kernels._triton.lazy_jit


@lazy_helper
def _round_e4m3(q, HW_CAST: tl.constexpr):
    """q: fp32 in [-448, 448] -> q on the e4m3 grid (fp32), or q as is where the caller's cast to
    e4m3 rounds it (HW_CAST: the GPU's cvt, round to nearest even). Otherwise rounded here, to
    nearest with ties to even as the GPU does (16-bit inputs make exact ties common: 0.75 * 448 = 336
    is one), so that the cast is exact and does not hang on a backend's fp8 rounding (Triton's
    interpreter rounds values just under a power of two down a whole binade); below 2^-6 the grid is
    e4m3's subnormal step, 2^-9. kernels/prefill_attention.py's k8 path rounds q with it too. The log2/exp2 per element cost the
    prefill's silu_and_mul_quant more than half its time on the H200: 117 -> 48.7 us at T = 2048,
    I = 14336 with the cast (bench/results/2026-12-02-fp8-quant-h200.md)."""
    if HW_CAST:
        return q
    step = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(q), 0.015625))) - 3.0)
    r = tl.abs(q) / step
    n = tl.floor(r + 0.5)
    n = tl.where((n - r == 0.5) & (n % 2.0 == 1.0), n - 1.0, n)  # a tie: to the even step
    return tl.where(q < 0, -1.0, 1.0) * n * step


@lazy_helper
def _quantize_row(y, FP8_MAX_: tl.constexpr, HW_CAST: tl.constexpr):
    """y: [BLOCK] fp32, one row (masked columns 0) -> (q on the e4m3 grid, fp32; the row's scale):
    the row scaled so that its largest magnitude maps to FP8_MAX_."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / FP8_MAX_
    q = tl.minimum(tl.maximum(y / scale, -FP8_MAX_), FP8_MAX_)
    return _round_e4m3(q, HW_CAST), scale


@lazy_jit
def _rms_norm_quant_kernel(
    x_ptr,  # x: [T, H], last dim contiguous
    res_ptr,  # residual: [T, H] (read only when HAS_RESIDUAL)
    w_ptr,  # weight: [H], contiguous
    q_ptr,  # out: [T, H] e4m3, contiguous
    scale_ptr,  # out: [T] fp32, one scale per row
    new_res_ptr,  # new residual out: [T, H], contiguous (written only when HAS_RESIDUAL)
    stride_x,  # row stride of x (elements)
    stride_res,  # row stride of residual (elements)
    H,  # hidden size
    eps,  # variance epsilon
    FP8_MAX_: tl.constexpr,  # 448: e4m3's largest value
    HW_CAST: tl.constexpr,  # the store's cast to e4m3 rounds (a GPU), else _round_e4m3 does
    HAS_RESIDUAL: tl.constexpr,  # fuse new_residual = x + residual
    BLOCK_H: tl.constexpr,  # power of two >= H: one program handles one whole row
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + row * H + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    normed = (xf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # the unfused path rounds the weighted output to the activation dtype before quantizing it
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype).to(tl.float32)
    q, scale = _quantize_row(y, FP8_MAX_, HW_CAST)
    tl.store(q_ptr + row * H + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def rms_norm_quant_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    hw_cast: bool | None = None, num_warps: int | None = None,
) -> tuple[Quantized, torch.Tensor]:
    """Triton `rms_norm_quant_ref`: one pass per row; residual add, norm and quantization fused.
    `hw_cast`: round to e4m3 with the GPU's cast (None: on a GPU, not under the interpreter).
    `num_warps`: per program (None: a warp per 256 columns, at most 16; bench/bench_fp8_quant.py sweeps it)."""
    check(x.dim() == 2, "rms_norm_quant: x must be [T, H], got {}", tuple(x.shape))
    t, h = x.shape
    check(weight.shape == (h,) and weight.is_contiguous(), "rms_norm_quant: weight must be a contiguous [{}]", h)
    check(weight.dtype == x.dtype, "rms_norm_quant: weight dtype {} != x dtype {}", weight.dtype, x.dtype)
    check(x.stride(1) == 1 or h == 1, "rms_norm_quant: x's last dim must be contiguous")
    check(h <= 65536, "rms_norm_quant: hidden size {} > 65536 is not supported (one row per program)", h)
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype, "rms_norm_quant: residual must match x")
        check(residual.stride(1) == 1 or h == 1, "rms_norm_quant: residual's last dim must be contiguous")
    block_h = next_pow2(h)
    q = torch.empty((t, h), dtype=FP8, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    new_res = torch.empty((t, h), dtype=x.dtype, device=x.device) if residual is not None else x
    if t == 0:
        return (q, scale), new_res
    _rms_norm_quant_kernel.launch((t,), (
        x, residual if residual is not None else x, weight, q, scale, new_res,
        x.stride(0), residual.stride(0) if residual is not None else 0, h, eps,
    ), {"FP8_MAX_": FP8_MAX, "HW_CAST": _hw_cast(x, hw_cast), "HAS_RESIDUAL": residual is not None,
        "BLOCK_H": block_h},
        num_warps or _warps(block_h), 3, x.device.type == "cuda")
    return (q, scale), new_res


@lazy_jit
def _silu_and_mul_quant_kernel(
    x_ptr,  # x: [T, 2 * I] (gate | up), last dim contiguous
    q_ptr,  # out: [T, I] e4m3, contiguous
    scale_ptr,  # out: [T] fp32, one scale per row
    stride_x,  # row stride of x (elements)
    inter,  # I: the intermediate size
    FP8_MAX_: tl.constexpr,  # 448
    HW_CAST: tl.constexpr,  # the store's cast to e4m3 rounds (a GPU), else _round_e4m3 does
    BLOCK: tl.constexpr,  # power of two >= I: one program handles one whole row
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    # rounded to the activation dtype, as the unfused silu_and_mul writes it
    y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    q, scale = _quantize_row(y, FP8_MAX_, HW_CAST)
    tl.store(q_ptr + row * inter + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@lazy_jit
def _silu_and_mul_quant_chunked_kernel(
    x_ptr,  # x: [T, 2 * I] (gate | up), last dim contiguous
    q_ptr,  # out: [T, I] e4m3, contiguous
    scale_ptr,  # out: [T, 1] fp32
    stride_x,  # row stride of x (elements)
    inter,  # I: the intermediate size
    FP8_MAX_: tl.constexpr,  # 448
    HW_CAST: tl.constexpr,  # the store's cast to e4m3 rounds (a GPU), else _round_e4m3 does
    CHUNK: tl.constexpr,  # columns per iteration (power of two)
):
    """One scale per row, the row in chunks: a pass for its largest magnitude, then a pass that
    computes the activation again and writes it quantized. Not the default: on the H200 at
    T = 2048, I = 14336 it took 72 us against the whole-row kernel's 48.7 (both with the GPU's
    cast; bench/results/2026-12-02-fp8-quant-h200.md); kept for rows past the whole-row kernel's
    registers."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for c0 in range(0, inter, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        mask = cols < inter
        gate = tl.load(base + cols, mask=mask, other=0.0)
        up = tl.load(base + inter + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(y))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX_
    for c0 in range(0, inter, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        mask = cols < inter
        gate = tl.load(base + cols, mask=mask, other=0.0)
        up = tl.load(base + inter + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
        q = _round_e4m3(tl.minimum(tl.maximum(y / scale, -FP8_MAX_), FP8_MAX_), HW_CAST)
        tl.store(q_ptr + row * inter + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def _warps(block: int) -> int:
    """Warps of a one-row program over `block` columns: one per 256, at most 16."""
    return min(16, max(1, block // 256))


def _hw_cast(x: torch.Tensor, hw_cast: bool | None) -> bool:
    """Round with the GPU's e4m3 cast: asked, or (None) on a GPU and not under the interpreter.
    FIRSTTOKEN_FP8_QUANT_LEGACY=1 keeps the in-kernel rounding everywhere (an A/B switch)."""
    if hw_cast is not None:
        return hw_cast
    if os.environ.get("FIRSTTOKEN_FP8_QUANT_LEGACY") == "1":
        return False
    return x.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def silu_maxnreg(block: int, warps: int) -> int:
    """The whole-row silu_and_mul_quant's register cap: 40 when a thread holds at most 32 of the
    row's values, else none (0). Llama-3.1-8B's row (I = 14336, 16 warps, 32 values a thread) takes
    64 registers uncapped, two rows resident per SM; capped at 40, three (spilling 48 bytes a
    thread): on the H200 at 642cfb5 (bench_fp8_quant) 49.2 -> 45.7 us at T = 2048, 164 -> 148 at
    8192 (3.2 / 4.0 TB/s). At 128 rows every variant's timing moved 9-20 us within the run (noise
    larger than any difference); one variant for every T, so the engine's warm-up compiles it.
    Holding the product in bf16 across the row's reduction (to free registers) measured 48.3 / 161
    us and 45.5 / 151 with the cap: not kept."""
    return 40 if block // (32 * warps) <= 32 else 0


def silu_and_mul_quant_triton(x: torch.Tensor, hw_cast: bool | None = None, chunk: int | None = None,
                              num_warps: int | None = None, maxnreg: int | None = None) -> Quantized:
    """Triton `silu_and_mul_quant_ref`: x [T, 2 * I] -> (q [T, I] e4m3, scale [T, 1]). `hw_cast`,
    `num_warps`: as in rms_norm_quant_triton. `chunk`: the row in chunks of this many columns (two
    passes); None or 0: the whole row in one program (faster on the H200). `maxnreg`: the
    whole-row kernel's register cap per thread on a GPU (None: `silu_maxnreg`; 0: none)."""
    check(x.dim() == 2 and x.shape[1] % 2 == 0, "silu_and_mul_quant: x must be [T, 2 * I], got {}", tuple(x.shape))
    check(x.stride(1) == 1, "silu_and_mul_quant: x's last dim must be contiguous")
    t, two_i = x.shape
    inter = two_i // 2
    check(inter <= 65536, "silu_and_mul_quant: I={} > 65536 is not supported (one row per program)", inter)
    block = next_pow2(inter)
    q = torch.empty((t, inter), dtype=FP8, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t == 0 or inter == 0:
        return q, scale
    hw = _hw_cast(x, hw_cast)
    if chunk is None:
        chunk = 0
    if chunk:
        check(chunk >= 16 and chunk & (chunk - 1) == 0, "silu_and_mul_quant: chunk {} is not a power of two >= 16", chunk)
        _silu_and_mul_quant_chunked_kernel.launch((t,), (x, q, scale, x.stride(0), inter),
                                                  {"FP8_MAX_": FP8_MAX, "HW_CAST": hw, "CHUNK": chunk},
                                                  min(8, max(1, chunk // 256)), 3, x.device.type == "cuda")
        return q, scale
    gpu = x.device.type == "cuda"
    warps = num_warps or _warps(block)
    if maxnreg is None:
        maxnreg = silu_maxnreg(block, warps)
    _silu_and_mul_quant_kernel.launch((t,), (x, q, scale, x.stride(0), inter),
                                      {"FP8_MAX_": FP8_MAX, "HW_CAST": hw, "BLOCK": block},
                                      warps, 3, gpu, (maxnreg or None) if gpu else None)
    return q, scale


@lazy_jit
def _quantize_kernel(
    x_ptr,  # x: [T, C], last dim contiguous
    q_ptr,  # out: [T, C] e4m3, contiguous
    scale_ptr,  # out: [T] fp32, one scale per row
    stride_x,  # row stride of x (elements)
    C,  # columns
    FP8_MAX_: tl.constexpr,  # 448
    HW_CAST: tl.constexpr,  # the store's cast to e4m3 rounds (a GPU), else _round_e4m3 does
    BLOCK: tl.constexpr,  # power of two >= C: one program handles one whole row
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    y = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_row(y, FP8_MAX_, HW_CAST)
    tl.store(q_ptr + row * C + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_triton(x: torch.Tensor, hw_cast: bool | None = None) -> Quantized:
    """Triton `kernels.fp8_linear.quantize`: x [T, C] -> (q [T, C] e4m3, scale [T, 1]) in one
    launch (the torch composition is ~8 kernels: o_proj's input took that in every layer)."""
    check(x.dim() == 2, "quantize: x must be [T, C], got {}", tuple(x.shape))
    check(x.stride(1) == 1 or x.shape[1] == 1, "quantize: x's last dim must be contiguous")
    t, c = x.shape
    check(c <= 65536, "quantize: {} columns > 65536 are not supported (one row per program)", c)
    block = next_pow2(c)
    q = torch.empty((t, c), dtype=FP8, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t == 0 or c == 0:
        return q, scale
    _quantize_kernel.launch((t,), (x, q, scale, x.stride(0), c),
                            {"FP8_MAX_": FP8_MAX, "HW_CAST": _hw_cast(x, hw_cast), "BLOCK": block},
                            _warps(block), 3, x.device.type == "cuda")
    return q, scale


@lazy_jit(do_not_specialize=("T", "stride_x", "V_COL"))
def _cast_e4m3_kernel(
    x_ptr,  # x: [T, C], last dim contiguous (q | k | v of a fused projection, or one of them)
    y_ptr,  # out: [T, C] e4m3, contiguous
    scale_ptr,  # [1] fp32: min over the V columns of FP8_MAX_ / (MARGIN * |v|), atomically
    T,  # rows
    stride_x,  # row stride of x (elements)
    C,  # columns
    V_COL,  # the first V column (C: none)
    FP8_MAX_: tl.constexpr,
    MARGIN: tl.constexpr,
    HW_CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per program: one atomic per BLOCK_R rows (thousands on one address were ~0.1 ms)
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c0 = tl.program_id(1) * BLOCK_C
    cols = c0 + tl.arange(0, BLOCK_C)
    mask = (r < T)[:, None] & (cols < C)[None, :]
    r64 = r.to(tl.int64)[:, None]
    y = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # clamped as the fp8 cache's store saturates; NaN stays NaN (as it would through bf16 attention)
    q = _round_e4m3(tl.minimum(tl.maximum(y, -FP8_MAX_, propagate_nan=tl.PropagateNan.ALL), FP8_MAX_,
                               propagate_nan=tl.PropagateNan.ALL), HW_CAST)
    tl.store(y_ptr + r64 * C + cols[None, :], q.to(y_ptr.dtype.element_ty), mask=mask)
    if c0 + BLOCK_C > V_COL:  # O's scale from V's finite values (a NaN row stays NaN whatever the scale)
        amax = tl.max(tl.max(tl.where(mask & (cols >= V_COL)[None, :] & (q == q), tl.abs(q), 0.0), axis=1), axis=0)
        tl.atomic_min(scale_ptr, FP8_MAX_ / (MARGIN * tl.maximum(amax, 0.001953125)))


def saturate_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x cast to e4m3 as the fp8 cache stores it: scale 1, beyond +-448 clamped (not NaN), NaN kept."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def cast_e4m3_ref(x: torch.Tensor, v_col: int, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x cast to e4m3 with scale 1, beyond +-448 clamped, NaN kept, [T, C] contiguous; [1] fp32: FP8_MAX
    over margin times the largest finite |cast value| of columns v_col.. (at most 2^-9 below: e4m3's
    smallest step), or FP8_MAX / (margin * 2^-9) without such columns)."""
    y = saturate_e4m3(x)
    vals = torch.nan_to_num(y[:, v_col:].float().abs(), nan=0.0)
    amax = vals.amax() if x.shape[0] > 0 and v_col < x.shape[1] else torch.zeros(())
    return y, (FP8_MAX / (margin * amax.clamp_min(2.0**-9))).reshape(1).to(torch.float32).to(x.device)


def cast_outputs(name: str, t: int, c: int, margin: float, device: torch.device, out: torch.Tensor | None,
                 scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A cast to e4m3's outputs (`cast_e4m3_triton`'s, and kernels.rope_cache.rope_cache_cast_triton's): out, checked
    to be a contiguous e4m3 [>= t, c], or a new [t, c]; scale, or a new [1] fp32 at what no V column gives
    (FP8_MAX / (margin * 2^-9)), for the kernel to take the minimum into."""
    y = torch.empty((t, c), dtype=FP8, device=device) if out is None else out
    check(y.dtype == FP8 and y.is_contiguous() and y.shape[0] >= t and y.shape[1] == c,
          "{}: out must be a contiguous e4m3 [>= {}, {}]", name, t, c)
    if scale is None:
        scale = torch.full((1,), FP8_MAX / (margin * 2.0**-9), dtype=torch.float32, device=device)
    return y, scale


def cast_e4m3_triton(x: torch.Tensor, v_col: int, margin: float, scale: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, hw_cast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `cast_e4m3_ref` in one launch. scale: a [1] fp32 tensor to take the minimum into (several
    casts sharing one V scale), else a new one. out: a [>= T, C] contiguous e4m3 buffer for the first T rows."""
    check(x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] == 1), "cast_e4m3: x must be [T, C], last dim contiguous")
    t, c = x.shape
    y, scale = cast_outputs("cast_e4m3", t, c, margin, x.device, out, scale)
    if t and c:
        bc = min(512, next_pow2(c))
        br = max(1, min(32, 8192 // bc, next_pow2(t)))
        _cast_e4m3_kernel.launch((-(-t // br), -(-c // bc)), (x, y, scale, t, x.stride(0), c, v_col),
                                 {"FP8_MAX_": FP8_MAX, "MARGIN": float(margin), "HW_CAST": _hw_cast(x, hw_cast),
                                  "BLOCK_R": br, "BLOCK_C": bc}, max(1, min(8, br * bc // 1024)), 1,
                                 x.device.type == "cuda")
    return y, scale
