"""FP8 weights, 16-bit activations (W8A16) for a few rows: decode's GEMV, with the op before it fused.

At one to a few rows a projection is a pass over its weight, and the activation is a few KB: the
W8A8 path spends a kernel on quantizing it (the fused RMSNorm or SiLU-and-mul writes e4m3 and a
scale, o_proj's input takes its own launch) for a GEMM that saves nothing by it, since the weight
read sets its time. Here the activation stays in the model's dtype, each e4m3 weight widens to
fp32 in registers, and the op that would have produced the activation runs inside the GEMV:

- `PROLOGUE_NONE`: x as it is (o_proj's attention output);
- `PROLOGUE_RMS`: RMSNorm(x + residual) (qkv and gate_up), each program reading its row at once
  for the sum of squares; the programs of the first column tile write x + residual, the residual
  stream's next value;
- `PROLOGUE_SILU`: silu(gate) * up of a [M, 2K] input (down_proj).

Each prologue rounds where its unfused reference (`rms_norm_ref`, `silu_and_mul_ref`) rounds to the
model's dtype, so the activation the weight multiplies is that op's output, bit for bit up to the
order of fp32 sums; the product is exact fp32 of (activation x e4m3 weight) with the per-channel
scale applied once.

The K loop can run in SPLIT parts (more programs than output tiles, for weights with few output
columns): each part stores an fp32 partial, takes a ticket from a per-tile counter, and the last to
arrive adds the partials in part order (deterministic) and writes the output, then zeroes its
counter for the next launch (`kernels._triton.arrival_counters`).

On the H200, one row, the Llama-3.1-8B projections each with its op, in replayed graphs (bench/
bench_fp8_gemv.py, bench/results/2026-12-02-fp8-gemv-h200.md): 70.7 us a layer against 86.6 for the
W8A8 path (the quantizing op, then the few-row GEMM), 131 for bf16; engine decode at batch 1 2.77 ms
against 3.30. From two rows it loses (each row re-reads the weight: 110.7 against 86.1 us a layer),
hence GEMV_ROWS = 1. Tried and dropped, slower or within run-to-run noise: programmatic dependent
launches (the first weight tile read before `gdc_wait`: 3-8 us slower per call, every shape), the
weight's next tile loaded an iteration ahead and its first before the prologue (b3eebdf: no shape's
best needed it, engine decode b1 2.97 ms with the sweep's picks against 2.96; 2026-12-03-fp8-gemv-prefetch-h200-b3eebdf.md),
multiplying 1 / rms after the loop instead of a first look at the row (10.8 against 11.3 us on qkv in
one run, 11.3 against 11.0 in the next), and [BLOCK_N, BLOCK_K] partial products summed once after
the loop (within noise).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from kernels._triton import arrival_counters, cdiv, check, lazy_jit, next_pow2
from kernels.fp8_linear import FP8, dequantize

PROLOGUE_NONE, PROLOGUE_RMS, PROLOGUE_SILU = 0, 1, 2


def fp8_gemv_ref(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
    prologue: int = PROLOGUE_NONE, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6, res_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [M, N] in x's dtype, x + residual or None): the prologue's reference op, then its output
    (upcast) times the dequantized weight in fp32. x: [M, K] ([M, 2K] gate | up for PROLOGUE_SILU).
    res_out: where x + residual goes (as the Triton GEMV writes it), else a new tensor."""
    from kernels.rmsnorm import rms_norm_ref
    from kernels.silu_mul import silu_and_mul_ref

    new_res = None
    if prologue == PROLOGUE_RMS:
        assert norm_weight is not None
        a, new_res = rms_norm_ref(x, norm_weight, eps, residual)
        if residual is None:
            new_res = None
        elif res_out is not None:
            new_res = res_out.copy_(new_res)
    elif prologue == PROLOGUE_SILU:
        a = silu_and_mul_ref(x)
    else:
        a = x
    out = a.float() @ dequantize(w_q, w_scale.reshape(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype), new_res


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

tl: Any = None  # triton.language, bound at the first launch by kernels._triton.lazy_jit


@lazy_jit(do_not_specialize=("M",))
def _fp8_gemv_kernel(
    x_ptr,  # x: [M, K] (or [M, 2K] gate | up for PROLOGUE_SILU), model dtype, last dim contiguous
    res_ptr,  # residual [M, K] (HAS_RESIDUAL), else a dummy
    nw_ptr,  # RMSNorm weight [K] (PROLOGUE_RMS), else a dummy
    res_out_ptr,  # [M, K] out: x + residual, written by the first column tile's programs (HAS_RESIDUAL)
    b_ptr,  # weight [N, K] e4m3, row-major
    b_scale_ptr,  # [N] fp32: one scale per output channel
    bias_ptr,  # [N] (HAS_BIAS), else a dummy
    c_ptr,  # out [M, N], row-major
    part_ptr,  # [SPLIT, M, N] fp32 partials (SPLIT > 1), else a dummy
    count_ptr,  # [M * tiles of N] int32 arrival counters, zero between launches (SPLIT > 1)
    M, N, K,  # sizes
    stride_x, stride_r, stride_bn, stride_c,  # row strides (elements)
    eps,  # RMSNorm epsilon
    PROLOGUE: tl.constexpr,  # 0: x; 1: RMSNorm(x [+ residual]); 2: silu(gate) * up
    HAS_RESIDUAL: tl.constexpr,  # PROLOGUE 1 adds the residual first
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # output channels per program
    BLOCK_K: tl.constexpr,  # K step
    SPLIT: tl.constexpr,  # K parts (programs per output tile)
    K_SPLIT: tl.constexpr,  # columns of K per part: a multiple of BLOCK_K, SPLIT * K_SPLIT >= K
    ROW: tl.constexpr,  # PROLOGUE 1: a power of two >= K to load the row at once, or 0 (a loop)
):
    # axis 0 over rows, so the programs of one weight tile start together and read it from DRAM once
    m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    part = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    rk = tl.arange(0, BLOCK_K)
    x_row = x_ptr + m * stride_x
    inv = 1.0
    if PROLOGUE == 1:
        first = (pid_n == 0) & (part == 0)
        if ROW > 0:  # the whole row in one load (K <= ROW): no loop of dependent steps before the weight
            kr = tl.arange(0, ROW)
            mr = kr < K
            xr = tl.load(x_row + kr, mask=mr, other=0.0)
            if HAS_RESIDUAL:
                rr = tl.load(res_ptr + m * stride_r + kr, mask=mr, other=0.0)
                xr = (xr.to(tl.float32) + rr.to(tl.float32)).to(xr.dtype)  # rounded as the reference
                if first:
                    tl.store(res_out_ptr + m * K + kr, xr, mask=mr)
            xrf = xr.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(xrf * xrf, axis=0) / K + eps)
        else:
            ss = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + rk
                mk = k < K
                xv = tl.load(x_row + k, mask=mk, other=0.0)
                if HAS_RESIDUAL:
                    rv = tl.load(res_ptr + m * stride_r + k, mask=mk, other=0.0)
                    xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(xv.dtype)
                    if first:
                        tl.store(res_out_ptr + m * K + k, xv, mask=mk)
                xf = xv.to(tl.float32)
                ss += xf * xf
            inv = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_rows = b_ptr + rn.to(tl.int64)[:, None] * stride_bn
    k_lo = part * K_SPLIT
    for k0 in range(0, K_SPLIT, BLOCK_K):
        k = k_lo + k0 + rk
        mk = k < K
        if PROLOGUE == 2:
            gate = tl.load(x_row + k, mask=mk, other=0.0)
            up = tl.load(x_row + K + k, mask=mk, other=0.0)
            gf = gate.to(tl.float32)
            # silu in fp32 rounded to x.dtype, times up rounded again: torch's two 16-bit ops
            silu = (gf / (1.0 + tl.exp(-gf))).to(up.dtype).to(tl.float32)
            a = (silu * up.to(tl.float32)).to(up.dtype).to(tl.float32)
        elif PROLOGUE == 1:
            xv = tl.load(x_row + k, mask=mk, other=0.0)
            if HAS_RESIDUAL:
                rv = tl.load(res_ptr + m * stride_r + k, mask=mk, other=0.0)
                xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(xv.dtype)
            normed = (xv.to(tl.float32) * inv).to(xv.dtype)
            w = tl.load(nw_ptr + k, mask=mk, other=0.0)
            a = (w.to(tl.float32) * normed.to(tl.float32)).to(xv.dtype).to(tl.float32)
        else:
            a = tl.load(x_row + k, mask=mk, other=0.0).to(tl.float32)
        wt = tl.load(b_rows + k[None, :], mask=mask_n[:, None] & mk[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc += tl.sum(wt.to(tl.float32) * a[None, :], axis=1)
    acc = acc * tl.load(b_scale_ptr + rn, mask=mask_n, other=0.0)
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(c_ptr + m * stride_c + rn, acc.to(c_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(part_ptr + (part * M + m) * N + rn, acc, mask=mask_n)
        tl.debug_barrier()  # every thread's partial stored before the ticket releases them
        counter = count_ptr + m * tl.num_programs(1) + pid_n
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:  # the last part to arrive: the others' partials are visible
            tot = tl.zeros([BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT):  # in part order: the same sum whichever part arrives last
                tot += tl.load(part_ptr + (s * M + m) * N + rn, mask=mask_n, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(c_ptr + m * stride_c + rn, tot.to(c_ptr.dtype.element_ty), mask=mask_n)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


# rows up to which an FP8 engine's projections take this GEMV (workers/engine/quantization.py)
GEMV_ROWS = 1

ROW_MAX = 8192  # the RMSNorm prologue loads rows up to this long at once


def gemv_config(n: int, k: int) -> tuple[int, ...]:
    """(block_n, block_k, split, num_warps, num_stages) for an [N, K] weight; see GEMV_CONFIGS.
    FIRSTTOKEN_FP8_GEMV_CONFIG names a JSON file of {"K,N": [block_n, ...]} that comes first (a sweep's
    picks, for an engine run in the same session: bench/bench_fp8_gemv.py writes one)."""
    global _OVERRIDE
    if _OVERRIDE is None:
        path = os.environ.get("FIRSTTOKEN_FP8_GEMV_CONFIG")
        _OVERRIDE = {}
        if path:
            with open(path) as f:
                _OVERRIDE = {tuple(int(v) for v in key.split(",")): tuple(cfg) for key, cfg in json.load(f).items()}
    hit = _OVERRIDE.get((k, n))
    if hit is not None:
        return hit
    for (kmin, nmin), cfg in GEMV_CONFIGS:
        if k >= kmin and n >= nmin:
            return cfg
    return 32, 256, 1, 4, 3


_OVERRIDE: dict | None = None

# per weight shape (first match of K >= kmin and N >= nmin): the fastest on the H200 at one row for the
# Llama-3.1-8B projections with their ops, in replayed graphs (bench/bench_fp8_gemv.py at 6802f18,
# bench/results/2026-12-02-fp8-gemv-h200.md); the engine's 2.77 ms decode at batch 1 ran these
GEMV_CONFIGS: list[tuple[tuple[int, int], tuple[int, ...]]] = [
    ((8192, 0), (16, 512, 4, 4, 3)),  # down_proj (K = 14336): 19.2 us
    ((0, 16384), (32, 256, 1, 4, 3)),  # gate_up_proj: 32.7
    ((0, 4097), (32, 512, 2, 8, 3)),  # qkv_proj (N = 6144): 11.0
    ((0, 0), (16, 512, 4, 4, 3)),  # o_proj: 7.76
]


def fp8_gemv_triton(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
    prologue: int = PROLOGUE_NONE, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6, res_out: torch.Tensor | None = None,
    block_n: int | None = None, block_k: int | None = None, split: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton `fp8_gemv_ref`: (out [M, N], x + residual written into res_out (allocated when None),
    or None without a residual). Tiles default to `gemv_config`."""
    check(w_q.dtype == FP8 and w_q.dim() == 2 and w_q.stride(1) == 1, "fp8_gemv: the weight must be [N, K] e4m3")
    n, k = w_q.shape
    check(w_scale.numel() == n, "fp8_gemv: one weight scale per output channel ({}), got {}", n, w_scale.numel())
    check(x.dim() == 2 and x.stride(1) == 1, "fp8_gemv: x must be [M, K] with a contiguous last dim")
    m = x.shape[0]
    check(x.shape[1] == (2 * k if prologue == PROLOGUE_SILU else k), "fp8_gemv: x is {} for K={} (prologue {})",
          tuple(x.shape), k, prologue)
    has_res = prologue == PROLOGUE_RMS and residual is not None
    if prologue == PROLOGUE_RMS:
        check(norm_weight is not None and norm_weight.shape == (k,) and norm_weight.is_contiguous(),
              "fp8_gemv: RMSNorm needs a contiguous [{}] weight", k)
    if has_res:
        check(residual.shape == (m, k) and residual.stride(1) == 1 and residual.dtype == x.dtype,
              "fp8_gemv: residual must be [{}, {}] in x's dtype", m, k)
        if res_out is None:
            res_out = torch.empty((m, k), dtype=x.dtype, device=x.device)
        check(res_out.shape == (m, k) and res_out.is_contiguous(), "fp8_gemv: res_out must be contiguous [{}, {}]",
              m, k)
    c = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return c, res_out if has_res else None
    cfg = gemv_config(n, k)
    bn, bk = block_n or cfg[0], block_k or cfg[1]
    sp = split if split is not None else cfg[2]
    warps, stages = num_warps or cfg[3], num_stages or cfg[4]
    row = next_pow2(k) if prologue == PROLOGUE_RMS and k <= ROW_MAX else 0
    k_split = cdiv(cdiv(k, sp), bk) * bk
    sp = cdiv(k, k_split)  # no empty part
    tiles_n = cdiv(n, bn)
    w_s = w_scale.reshape(n).float().contiguous()
    if sp > 1:
        part = torch.empty((sp, m, n), dtype=torch.float32, device=x.device)
        count = arrival_counters(x.device, m * tiles_n)
    else:
        part = count = w_s
    has_bias = bias is not None
    args = (x, residual if has_res else x, norm_weight if norm_weight is not None else x,
            res_out if has_res else x, w_q, w_s, bias if has_bias else w_s, c, part, count,
            m, n, k, x.stride(0), residual.stride(0) if has_res else 0, w_q.stride(0), c.stride(0), float(eps))
    consts = {"PROLOGUE": prologue, "HAS_RESIDUAL": has_res, "HAS_BIAS": has_bias, "BLOCK_N": bn, "BLOCK_K": bk,
              "SPLIT": sp, "K_SPLIT": k_split, "ROW": row}
    _fp8_gemv_kernel.launch((m, tiles_n, sp), args, consts, warps, stages, x.device.type == "cuda")
    return c, res_out if has_res else None
