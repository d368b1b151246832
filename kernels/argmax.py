"""Row argmax of logits (greedy sampling) in two short launches instead of one long one.

At one to a few rows torch's `argmax(dim=-1)` reduces each row in one thread block: a decode step of
the Llama-3.1-8B shape (128256 logits) spent 27.9 us in it on the H200, ~1% of the step, for 0.5 MB
(bench/results/2026-12-03-profile-fp8-h200-b9352b7.txt). Here the row is cut into chunks: the first
launch (rows x chunks programs) finds each chunk's maximum and its first index, the second (one
program per row) picks the first chunk holding the row's maximum. The result is torch's: the index
of the first maximal value, NaN counting as larger than any number (the first NaN wins), and a row of
-inf alone gives index 0.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import cdiv, check, lazy_jit, next_pow2

tl: Any = None  # triton.language, bound at the first launch by kernels._triton.lazy_jit

CHUNK = 2048  # logits per program of the first launch: 63 programs a row at V = 128256


@lazy_jit(do_not_specialize=("n_rows",))
def _chunk_argmax_kernel(
    x_ptr,  # logits [R, V], last dim contiguous
    val_ptr,  # out [R, C] fp32: each chunk's maximum (+inf where it holds a NaN)
    idx_ptr,  # out [R, C] int32: the first index of that maximum (of its first NaN)
    nan_ptr,  # out [R, C] int32: 1 where the chunk holds a NaN
    n_rows,  # R
    V,  # row length
    stride_x,  # row stride (elements)
    C,  # chunks per row
    CHUNK_: tl.constexpr,  # logits per program
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK_ + tl.arange(0, CHUNK_)
    ok = offs < V
    x = tl.load(x_ptr + r * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
    big = 2147483647
    is_nan = (x != x) & ok
    first_nan = tl.min(tl.where(is_nan, offs, big), axis=0)
    m = tl.max(tl.where(is_nan, float("-inf"), x), axis=0)
    first_max = tl.min(tl.where((x == m) & ok, offs, big), axis=0)
    has_nan = first_nan < big
    idx = tl.where(has_nan, first_nan, first_max)
    tl.store(val_ptr + r * C + c, tl.where(has_nan, float("inf"), m))
    tl.store(idx_ptr + r * C + c, idx)
    tl.store(nan_ptr + r * C + c, has_nan.to(tl.int32))


@lazy_jit(do_not_specialize=("n_rows",))
def _rows_argmax_kernel(
    val_ptr,  # [R, C] fp32 chunk maxima
    idx_ptr,  # [R, C] int32 their first indices
    nan_ptr,  # [R, C] int32 NaN flags
    out_ptr,  # out [R] int64
    n_rows,  # R
    C,  # chunks per row
    BLOCK_C: tl.constexpr,  # power of two >= C
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < C
    v = tl.load(val_ptr + r * C + c, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + r * C + c, mask=ok, other=0)
    nan = tl.load(nan_ptr + r * C + c, mask=ok, other=0)
    big = 2147483647
    first_nan = tl.min(tl.where(nan != 0, c, big), axis=0)
    m = tl.max(v, axis=0)
    first_max = tl.min(tl.where((v == m) & ok, c, big), axis=0)  # chunks in order: the first wins
    pick = tl.where(first_nan < big, first_nan, first_max)
    best = tl.sum(tl.where(c == pick, i, 0), axis=0)
    tl.store(out_ptr + r, best.to(tl.int64))


def argmax_triton(x: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of logits x [R, V] (fp32 or 16-bit) -> [R] int64, in two launches.
    Rows may have any stride; a last dim that is not contiguous is copied first."""
    check(x.dim() == 2, "argmax: x must be [R, V], got {}", tuple(x.shape))
    if x.stride(1) != 1 and x.shape[1] > 1:
        x = x.contiguous()
    check(x.is_floating_point(), "argmax: logits must be floating point, got {}", x.dtype)
    check(chunk >= 16 and chunk & (chunk - 1) == 0, "argmax: chunk {} is not a power of two >= 16", chunk)
    rows, v = x.shape
    check(v > 0 or rows == 0, "argmax: an empty row has no argmax")
    check(v < 2**31, "argmax: {} columns do not fit int32 indices", v)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    c = cdiv(v, chunk)
    check(c <= 8192, "argmax: {} chunks of {} (raise chunk)", c, chunk)
    val = torch.empty((rows, c), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, c), dtype=torch.int32, device=x.device)
    nan = torch.empty((rows, c), dtype=torch.int32, device=x.device)
    gpu = x.device.type == "cuda"
    _chunk_argmax_kernel.launch((rows, c), (x, val, idx, nan, rows, v, x.stride(0), c), {"CHUNK_": chunk},
                                4 if chunk >= 1024 else 1, 1, gpu)
    _rows_argmax_kernel.launch((rows,), (val, idx, nan, out, rows, c), {"BLOCK_C": max(16, next_pow2(c))},
                               1 if c <= 256 else 4, 1, gpu)
    return out
