"""FP8 GEMM for few rows (decode and small mixed steps): C = (A * sa) @ (B * sb)^T with one scale
per row of A (per token) and one per row of B (per output channel), a weight-streaming Triton
kernel where cuBLASLt's FP8 GEMM (torch._scaled_mm) tiles M to 64 or more and launches too few
programs to stream the weight at the memory's rate.

A group-scaled GEMM (weight scales per group of input columns, and block-wise FP8 with activation
scales per token and group too) lived here and is gone: on the H200 at 231bf73 the block-wise
engine ran TTFT 2048 in 92.7 ms against 37.8 per channel and decode batch 1 in 6.33 ms against 5.23,
slower at every row (bench/results/2026-12-01-engine-h200.md), and it never got this kernel or the
W8A16 GEMV (kernels/fp8_gemv.py). Its better quality on SmolLM2 (weight-only KL 0.018 -> 0.010
nats with groups of 64) stays recorded in bench/results/2026-12-01-fp8-quality-cpu.md.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch

from kernels._triton import arrival_counters, cdiv, check, lazy_helper, lazy_jit
from kernels.fp8_linear import FP8

# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

tl: Any = None  # triton.language, bound at the first launch by kernels._triton.lazy_jit


@lazy_jit
def _fp8_gemm_rowwise_small_m_kernel(
    a_ptr,  # A: [M, K] e4m3, row-major
    a_scale_ptr,  # [M] fp32: one scale per row of A
    b_ptr,  # B: [N, K] e4m3, row-major (the weight)
    b_scale_ptr,  # [N] fp32: one scale per output channel
    bias_ptr,  # [N] or a dummy when HAS_BIAS is false
    c_ptr,  # C: [M, N], out dtype, row-major
    part_ptr,  # [SPLIT, M, N] fp32 partials (SPLIT > 1), else a dummy
    count_ptr,  # [tiles of M * tiles of N] int32 arrival counters, zero between launches (SPLIT > 1)
    M, N, K,  # sizes
    stride_am, stride_bn, stride_cm,  # row strides (elements)
    HAS_BIAS: tl.constexpr,  # add bias before the store
    BLOCK_M: tl.constexpr,  # rows of A per program (16, 32, 64 or 128)
    BLOCK_N: tl.constexpr,  # columns of C per program
    BLOCK_K: tl.constexpr,  # K step
    SPLIT: tl.constexpr,  # K parts (programs per output tile, grid axis 2)
    K_SPLIT: tl.constexpr,  # columns of K per part: a multiple of BLOCK_K, SPLIT * K_SPLIT >= K
):
    # one program per (BLOCK_M rows, BLOCK_N output channels): a few-row GEMM is a pass over the
    # weight, so each program streams its BLOCK_N rows of B once. Axis 0 runs over the row tiles,
    # so the programs of one weight tile start together and read it from DRAM once (then from L2)
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = tl.program_id(2) * K_SPLIT
    for k0 in range(0, K_SPLIT if SPLIT > 1 else K, BLOCK_K):
        k = k_lo + k0 + rk
        mask_k = k < K
        a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + rn[:, None] * stride_bn + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(b))
    _small_m_finish(acc, a_scale_ptr, b_scale_ptr, bias_ptr, c_ptr, part_ptr, count_ptr, M, N, stride_cm, pid_m, pid_n,
                    rm, rn, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT)


@lazy_jit
def _fp8_gemm_rowwise_tma_kernel(
    a_desc,  # A: [M, K] e4m3 as a TMA descriptor of [BLOCK_M, BLOCK_K] blocks (rows past M, columns past K read 0)
    b_desc,  # B: [N, K] e4m3 (the weight) as a TMA descriptor of [BLOCK_N, BLOCK_K] blocks
    a_scale_ptr,  # [M] fp32: one scale per row of A
    b_scale_ptr,  # [N] fp32: one scale per output channel
    bias_ptr,  # [N] or a dummy when HAS_BIAS is false
    c_ptr,  # C: [M, N], out dtype, row-major
    part_ptr,  # [SPLIT, M, N] fp32 partials (SPLIT > 1), else a dummy
    count_ptr,  # [tiles of M * tiles of N] int32 arrival counters, zero between launches (SPLIT > 1)
    M, N, K,  # sizes
    stride_cm,  # C's row stride (elements)
    HAS_BIAS: tl.constexpr,  # add bias before the store
    BLOCK_M: tl.constexpr,  # rows of A per program
    BLOCK_N: tl.constexpr,  # columns of C per program
    BLOCK_K: tl.constexpr,  # K step
    SPLIT: tl.constexpr,  # K parts (programs per output tile, grid axis 2)
    K_SPLIT: tl.constexpr,  # columns of K per part: a multiple of BLOCK_K, SPLIT * K_SPLIT >= K
):
    # `_fp8_gemm_rowwise_small_m_kernel`'s tiles with A and B brought in by the Tensor Memory
    # Accelerator (one bulk copy a tile, no per-thread address arithmetic), pipelined num_stages deep
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    off_m = tl.program_id(0) * BLOCK_M
    off_n = tl.program_id(1) * BLOCK_N
    k_lo = tl.program_id(2) * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K) if SPLIT > 1 else K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # parts are whole BLOCK_K steps: no step reads the next part's columns
        a = a_desc.load([off_m, k0])
        b = b_desc.load([off_n, k0])
        acc = tl.dot(a, b.T, acc)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _small_m_finish(acc, a_scale_ptr, b_scale_ptr, bias_ptr, c_ptr, part_ptr, count_ptr, M, N, stride_cm, pid_m, pid_n,
                    rm, rn, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT)


@lazy_helper
def _small_m_finish(acc, a_scale_ptr, b_scale_ptr, bias_ptr, c_ptr, part_ptr, count_ptr, M, N, stride_cm, pid_m, pid_n,
                    rm, rn, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SPLIT: tl.constexpr):
    """A program's output tile from its fp32 sums: scaled and stored, or (SPLIT) stored as this K part's
    partial, the last part to arrive adding them all in part order (deterministic) and storing C."""
    mask_m = rm < M
    mask_n = rn < N
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT > 1:  # store this part's sums; the last part to arrive adds them all, in part order
        tile = rm[:, None] * N + rn[None, :]
        tl.store(part_ptr + tl.program_id(2).to(tl.int64) * M * N + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the ticket releases them
        counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:  # the others' partials are visible
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for sp in range(SPLIT):  # the same sum whichever part arrives last
                acc += tl.load(part_ptr + sp * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            _small_m_epilogue(acc, a_scale_ptr, b_scale_ptr, bias_ptr, c_ptr, rm, rn, mask_m, mask_n, mask,
                              stride_cm, HAS_BIAS)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    else:
        _small_m_epilogue(acc, a_scale_ptr, b_scale_ptr, bias_ptr, c_ptr, rm, rn, mask_m, mask_n, mask, stride_cm,
                          HAS_BIAS)


@lazy_helper
def _small_m_epilogue(acc, a_scale_ptr, b_scale_ptr, bias_ptr, c_ptr, rm, rn, mask_m, mask_n, mask, stride_cm,
                      HAS_BIAS: tl.constexpr):
    """C tile = acc * (row scales x channel scales) (+ bias), stored in C's dtype."""
    sa = tl.load(a_scale_ptr + rm, mask=mask_m, other=0.0)
    sb = tl.load(b_scale_ptr + rn, mask=mask_n, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


# rows up to which an engine's FP8 projection takes fp8_gemm_rowwise_small_m instead of
# torch._scaled_mm: 64, and 128 for a weight of at most SMALL_M_WIDE_N output channels. Measured on
# the H200 in replayed graphs over distinct weights (bench/results/2026-12-02-fp8-decode-h200.md):
# up to 64 rows the kernel wins every Llama-3.1-8B projection (down_proj 23.8 us against 37.2 at 64
# rows); at 128 rows it wins o_proj and down_proj (N = 4096: 11.3 and 30.4 us against 13.9 and
# 37.4), where _scaled_mm's 128-wide tiles make 32 programs for 132 SMs, and loses gate_up (49.6
# against 37.3) and ties qkv; at 256 rows _scaled_mm wins all four
SMALL_M = 64
SMALL_M_WIDE = 128
SMALL_M_WIDE_N = 4096


_OVERRIDE: dict | None = None


def _override() -> dict:
    """FIRSTTOKEN_FP8_SMALL_M_CONFIG: a JSON file of {"K,N": {"128": cfg or null, "256": ...}} (a
    bench_fp8_decode sweep's picks above 64 rows: cfg is (block_m, block_n, block_k, warps, stages,
    split), null where torch._scaled_mm won), for an engine run in the same session."""
    global _OVERRIDE
    if _OVERRIDE is None:
        path = os.environ.get("FIRSTTOKEN_FP8_SMALL_M_CONFIG")
        _OVERRIDE = json.loads(Path(path).read_text()) if path else {}
    return _OVERRIDE


def small_m_rows(n: int, k: int) -> int:
    """Rows up to which the few-row kernel serves an [N, K] weight (see SMALL_M)."""
    o = _override().get(f"{k},{n}")
    if o is not None:
        rows = SMALL_M
        for bucket in sorted(o, key=int):
            if o[bucket] is None:
                break
            rows = int(bucket)
        return rows
    return SMALL_M_WIDE if n <= SMALL_M_WIDE_N else SMALL_M


def _rowwise_operands(name: str, a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor,
                      b_scale: torch.Tensor) -> tuple[int, int, int]:
    """(M, K, N) of a row-wise GEMM's operands: e4m3 A [M, K] and B [N, K], contiguous rows, one
    scale per row of each. Raises ValueError naming `name`."""
    check(a_q.dtype == FP8 and b_q.dtype == FP8, "{}: A and B must be float8_e4m3fn", name)
    m, k = a_q.shape
    n, kb = b_q.shape
    check(k == kb, "{}: A is [M, {}] but B is [N, {}]", name, k, kb)
    check(a_scale.numel() == m and b_scale.numel() == n, "{}: scales must be per row ([M, 1], [N, 1])", name)
    check(a_q.stride(1) == 1 and b_q.stride(1) == 1, "{}: A's and B's last dims must be contiguous", name)
    return m, k, n


# fp8_gemm_rowwise_tma's tiles (block_m, block_n, block_k, warps, stages, split) for 65-128 and 129-256
# rows of a Llama-3.1-8B-shaped weight, None where torch._scaled_mm stays faster: the
# `bench_fp8_decode.py --tma` sweep on the H100 at 47d791b (fifteen tiles; bench/results/2026-12-06-session15-h100.md),
# us, TMA against the best of _scaled_mm and the pointer kernel: 128 rows qkv 12.8 / 14.4, o 9.6 / 12.0,
# down 27.2 / 35.0, gate_up 49.3 / 48.0 (not taken); 256 rows o 10.8 / 13.8, down 29.8 / 37.9, qkv 15.3 /
# 15.1 and gate_up 66.3 / 61.9 (not taken). Against session 14's seven-tile picks (f8a6a19): down 128 rows
# 28.6 -> 27.2, 256 rows 33.5 -> 29.8, o 256 rows 11.2 -> 10.8; TTFT 2048 cached + 128 (fp8+kv8) 5.99 ms with
# those, 5.91 with these, 7.07 with no TMA (three processes, one call).
_TMA_QKV = ((128, 64, 128, 4, 8, 1), None)
_TMA_O = ((64, 32, 256, 4, 4, 1), (128, 64, 128, 4, 8, 1))
_TMA_DOWN = ((64, 64, 128, 4, 8, 1), (128, 64, 128, 4, 8, 1))


def tma_default(n: int, k: int) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None] | None:
    """The built-in TMA tiles of an [N, K] weight (see _TMA_QKV): None for gate_up-wide weights."""
    if n >= 16384:  # gate_up_proj: _scaled_mm's 128-wide tiles fill the SMs
        return None
    if k >= 8192:  # down_proj
        return _TMA_DOWN
    return _TMA_QKV if n > k else _TMA_O


@functools.lru_cache(maxsize=4)
def _tma_picks(path: str) -> dict:
    return json.loads(Path(path).read_text())


def tma_tiles(n: int, k: int) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None] | None:
    """The [N, K] weight's fp8_gemm_rowwise_tma tiles for 65-128 and for 129-256 rows, or None where
    _scaled_mm serves both; read when a projection is built, for a Hopper GPU. Built in (tma_default)
    unless FIRSTTOKEN_FP8_TMA_CONFIG says otherwise: "off" (never; an A/B switch), or a JSON file of
    {"K,N": {"128": cfg or null, "256": ...}}, `bench_fp8_decode.py --tma`'s picks (cfg: block_m,
    block_n, block_k, warps, stages, split) where the TMA kernel beat the others."""
    env = os.environ.get("FIRSTTOKEN_FP8_TMA_CONFIG")
    if env == "off":
        return None
    if k % 16:
        return None  # TMA rows are 16-byte aligned
    if not env:
        return tma_default(n, k)
    picks = _tma_picks(env).get(f"{k},{n}", {})
    tiles = tuple(tuple(c) if c else None for c in (picks.get("128"), picks.get("256")))
    for c in tiles:
        check(c is None or (len(c) == 6 and all(type(x) is int and x > 0 for x in c)),
              "FIRSTTOKEN_FP8_TMA_CONFIG: a pick is [block_m, block_n, block_k, warps, stages, split], not {!r}", c)
    return tiles if any(tiles) else None


def small_m_config(n: int, k: int, m: int = 1) -> tuple[int, ...]:
    """(block_m, block_n, block_k, num_warps, num_stages[, split]) for M rows of an [N, K] weight
    (split, K's parts, only from a sweep's override above 64 rows).

    The fastest of eight configurations per Llama-3.1-8B projection at 1, 16 and 64 rows (up to 64
    rows A is one tile of 16, 32 or 64 rows) and at 128 rows, on the H200 in replayed graphs
    (bench/results/2026-12-02-fp8-decode-h200.md): at 1 row qkv 10.7 us, o 9.1, gate_up 32.6,
    down 24.6 (23.4 at 16 rows)."""
    if m > 64:
        picked = _override().get(f"{k},{n}", {}).get("128" if m <= 128 else "256")
        return tuple(picked) if picked else (64, 32, 256, 4, 4)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    if k >= 8192:  # down_proj
        return block_m, 32, 512, 4, 3
    if n >= 16384:  # gate_up_proj
        return block_m, 128, 128, 8, 4
    if n > k:  # qkv_proj
        return block_m, 64, 256, 4, 4
    return block_m, 32, 256, 4, 4  # o_proj


def fp8_gemm_rowwise_small_m(
    a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
    block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, block_m: int | None = None, split: int | None = None,
) -> torch.Tensor:
    """`kernels.fp8_linear.fp8_gemm_ref` with per-token ([M, 1]) and per-channel ([N, 1]) scales
    for few rows: a weight-streaming kernel for decode and small mixed steps, where cuBLASLt's FP8
    GEMM (torch._scaled_mm) tiles M to 64 or more and launches too few programs to stream the
    weight at the memory's rate. Tile sizes default to `small_m_config`. `split`: K in this many
    parts, each a program per output tile, the last to finish adding the parts' fp32 sums in part
    order (deterministic); for weights of few output tiles at 65-256 rows (default 1)."""
    m, k, n = _rowwise_operands("fp8_gemm_small_m", a_q, a_scale, b_q, b_scale)
    c = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0 or n == 0:
        return c
    cfg = small_m_config(n, k, m)
    block_m, block_n, block_k = block_m or cfg[0], block_n or cfg[1], block_k or cfg[2]
    num_warps, num_stages = num_warps or cfg[3], num_stages or cfg[4]
    grid, tail, consts = _rowwise_launch(a_q, a_scale, b_scale, bias, c, block_m, block_n, block_k,
                                         split or (cfg[5] if len(cfg) > 5 else 1))
    args = (a_q, tail[0], b_q, *tail[1:], m, n, k, a_q.stride(0), b_q.stride(0), c.stride(0))
    _fp8_gemm_rowwise_small_m_kernel.launch(grid, args, consts, num_warps, num_stages, a_q.device.type == "cuda")
    return c


def _rowwise_launch(a_q: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, bias: torch.Tensor | None,
                    c: torch.Tensor, block_m: int, block_n: int, block_k: int, split: int) -> tuple:
    """A row-wise GEMM launch's grid, its (a_scale, b_scale, bias, c, partials, counters) arguments and
    constexprs: K in `split` parts of whole BLOCK_K steps (fewer where K is short: no empty part)."""
    (m, k), n = a_q.shape, c.shape[1]
    a_s = a_scale.reshape(m).float().contiguous()
    b_s = b_scale.reshape(n).float().contiguous()
    k_split = cdiv(cdiv(k, split), block_k) * block_k
    sp = cdiv(k, k_split)
    tiles = (cdiv(m, block_m), cdiv(n, block_n))
    if sp > 1:
        part = torch.empty((sp, m, n), dtype=torch.float32, device=a_q.device)
        count = arrival_counters(a_q.device, tiles[0] * tiles[1])
    else:
        part = count = b_s
    consts = {"HAS_BIAS": bias is not None, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT": sp,
              "K_SPLIT": k_split}
    return (*tiles, sp), (a_s, b_s, b_s if bias is None else bias, c, part, count), consts


def fp8_gemm_rowwise_tma(
    a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32, block_m: int = 128,
    block_n: int = 64, block_k: int = 128, num_warps: int = 4, num_stages: int = 4, split: int = 1,
) -> torch.Tensor:
    """`fp8_gemm_rowwise_small_m` with A and B read by TMA (Hopper's bulk tensor copies) instead of
    per-thread pointer loads: the candidate for 65-256 rows (a cached prefix's new tokens), where
    the pointer kernel and cuBLASLt both stream the weight at about half the memory's rate. K must be
    a multiple of 16 (a TMA row stride is 16-byte aligned). The engine's 65-256-row projections on
    Hopper where tma_tiles names tiles; `bench/bench_fp8_decode.py --tma` sweeps them."""
    m, k, n = _rowwise_operands("fp8_gemm_tma", a_q, a_scale, b_q, b_scale)
    check(k % 16 == 0, "fp8_gemm_tma: K {} must be a multiple of 16 (TMA rows are 16-byte aligned)", k)
    c = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0 or n == 0:
        return c
    from triton.tools.tensor_descriptor import TensorDescriptor

    a_desc = TensorDescriptor.from_tensor(a_q, [block_m, block_k])
    b_desc = TensorDescriptor.from_tensor(b_q, [block_n, block_k])
    grid, tail, consts = _rowwise_launch(a_q, a_scale, b_scale, bias, c, block_m, block_n, block_k, split)
    args = (a_desc, b_desc, *tail, m, n, k, c.stride(0))
    # Triton's own dispatch: the direct launch passes tensors, not descriptors
    _fp8_gemm_rowwise_tma_kernel.launch(grid, args, consts, num_warps, num_stages, False)
    return c
