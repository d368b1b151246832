"""Row argmax over a vocabulary in one launch: greedy sampling's last step.

torch's argmax reduces a row of 128k logits in one block: 27 us on an H200 for one row to 64
(bench/results/2026-12-02-fp8-gemv-h200.md), 1% of a decode step at batch 1, and splitting it
into torch ops (max over chunks, then over their maxima) took 49 us, four launches. Here the row
is read by many programs at once, each keeping the largest value of its chunk and the first index
holding it; each takes a ticket, and the last one of a row picks among the chunks' winners (the
largest, the first chunk on a tie) and writes the index, then zeroes its counter. The result is
torch.argmax's: the first index of the maximum. A NaN counts as larger than any number (torch
returns the first NaN as well), so a row with NaN gives its first NaN's index.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import arrival_counters, cdiv, check, lazy_jit, next_pow2


def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [B, V] -> [B] int64, the first index of each row's maximum."""
    return x.argmax(dim=-1)


tl: Any = None  # triton.language, bound at the first launch by kernels._triton.lazy_jit


@lazy_jit(do_not_specialize=("V",))
def _argmax_kernel(
    x_ptr,  # [B, V] floats, last dim contiguous
    part_v_ptr,  # [B, PARTS] fp32: each chunk's largest value
    part_i_ptr,  # [B, PARTS] int32: the first index holding it
    count_ptr,  # [B] int32 arrival counters, zero between launches
    out_ptr,  # [B] int64
    V, stride_x,
    CHUNK: tl.constexpr,  # values per program
    PARTS: tl.constexpr,  # programs per row
    BLOCK_P: tl.constexpr,  # power of two >= PARTS
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs = part * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    nan = x != x
    x = tl.where(nan, float("inf"), x)  # NaN as the largest (inf's rank, but found first below)
    best = tl.max(x, axis=0)
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    hit = tl.where(has_nan, nan, x == best) & (offs < V)
    first = tl.min(tl.where(hit, offs, V), axis=0)
    best = tl.where(has_nan, float("nan"), best)
    tl.store(part_v_ptr + row * PARTS + part, best)
    tl.store(part_i_ptr + row * PARTS + part, first)
    tl.debug_barrier()  # the partials stored before the ticket releases them
    ticket = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
    if ticket == PARTS - 1:  # the last chunk of the row to arrive: the others' winners are visible
        p = tl.arange(0, BLOCK_P)
        pv = tl.load(part_v_ptr + row * PARTS + p, mask=p < PARTS, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(part_i_ptr + row * PARTS + p, mask=p < PARTS, other=V, cache_modifier=".cg")
        pnan = pv != pv
        any_nan = tl.max(pnan.to(tl.int32), axis=0) > 0
        top = tl.max(tl.where(pnan, float("inf"), pv), axis=0)
        win = tl.where(any_nan, pnan, pv == top) & (p < PARTS)
        tl.store(out_ptr + row, tl.min(tl.where(win, pi, V), axis=0).to(tl.int64))
        tl.atomic_xchg(count_ptr + row, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def argmax_rows_triton(x: torch.Tensor, chunk: int = 4096, num_warps: int = 4) -> torch.Tensor:
    """Triton `argmax_rows_ref` for a [B, V] float tensor with a contiguous last dim."""
    check(x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] == 1), "argmax_rows: x must be [B, V], last dim contiguous")
    check(chunk >= 16 and chunk & (chunk - 1) == 0, "argmax_rows: chunk must be a power of two >= 16")
    b, v = x.shape
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b == 0:
        return out
    check(0 < v < 2**31, "argmax_rows: V={} must be in [1, 2^31)", v)
    parts = cdiv(v, chunk)
    part_v = torch.empty((b, parts), dtype=torch.float32, device=x.device)
    part_i = torch.empty((b, parts), dtype=torch.int32, device=x.device)
    count = arrival_counters(x.device, b)
    _argmax_kernel.launch((b, parts), (x, part_v, part_i, count, out, v, x.stride(0)),
                          {"CHUNK": chunk, "PARTS": parts, "BLOCK_P": max(16, next_pow2(parts))}, num_warps, 3,
                          x.device.type == "cuda")
    return out
