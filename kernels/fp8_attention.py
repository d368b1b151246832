"""Causal attention of one long prompt over itself with FP8 (e4m3) tensor-core dots: the dense
prefill of an FP8 engine with an fp8 KV cache.

Both dots run in e4m3 with fp32 accumulation: S = Q K^T, then O = P V. K and V are rounded to
e4m3 unscaled, exactly as the fp8 KV cache stores them (config `kv_cache_dtype="fp8"`), so the
prompt's own attention sees the keys and values its later decode steps read from the cache. Q is
rounded unscaled too. P (the online softmax's exp2(s - m) in [0, 1]) is scaled by 2^8 before its
rounding and the accumulator by 2^-8 after, so that probabilities down to ~1e-5 keep a normal e4m3
exponent (unscaled, e4m3's subnormals start at 2^-6 and end at 2^-9: a long context's many small
probabilities would round to zero while the fp32 row sum keeps them). The row sum is fp32 over the
unrounded P.

Layout: q [T, Hq, D] (a strided view of the fused qkv output); k, v [T, Hk, D]. The launcher
rounds k to e4m3 in [Hk, T, D] and v to e4m3 transposed, [Hk, D, T]: the second dot's B operand
(V, reduced over keys) must have its keys contiguous for Hopper's FP8 MMA, as the first dot's B
(K^T, reduced over D) has D contiguous.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import cdiv, check, lazy_helper, lazy_jit
from kernels.fp8_quant import _round_e4m3

FP8 = torch.float8_e4m3fn
P_SCALE = 256.0  # P is rounded as P * P_SCALE (see the module docstring)

# (BLOCK_M, BLOCK_N, num_warps, num_stages): the default tiles (bench/bench_fp8_attention.py sweeps them)
DEFAULT_CONFIG = (128, 128, 8, 3)


def fp8_causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The op's semantics: q, k and v rounded to e4m3, then causal softmax attention in fp32 (P
    unrounded). q: [T, Hq, D], k, v: [T, Hk, D] (Hq a multiple of Hk) -> [T, Hq, D] in q's dtype."""
    t, hq, _ = q.shape
    hk = k.shape[1]
    qf = q.to(FP8).float().transpose(0, 1)  # [Hq, T, D]
    kf = k.to(FP8).float().transpose(0, 1).repeat_interleave(hq // hk, dim=0)
    vf = v.to(FP8).float().transpose(0, 1).repeat_interleave(hq // hk, dim=0)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    out = torch.matmul(torch.softmax(s, dim=-1), vf)  # [Hq, T, D]
    return out.transpose(0, 1).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

tl: Any = None  # triton.language, bound at the first launch by kernels._triton.lazy_jit


@lazy_helper
def _attend_tile(acc, l_i, m_i, q8, k_base, v_base, start, qpos, rn, d, T, stride_kt, stride_vd, qk_scale,
                 MASK: tl.constexpr, HW_CAST: tl.constexpr, DOT_FP32: tl.constexpr, P_SCALE_: tl.constexpr):
    """One key tile [start, start + BLOCK_N) of the online softmax; MASK: the causal diagonal (and
    the keys past T). k_base: this kv head's [T, D] e4m3 keys; v_base: its [D, T] e4m3 values."""
    kpos = start + rn  # [BLOCK_N]
    k_ptrs = k_base + kpos[None, :].to(tl.int64) * stride_kt + d[:, None]  # [D, BLOCK_N]: K^T
    v_ptrs = v_base + d[:, None].to(tl.int64) * stride_vd + kpos[None, :]  # [D, BLOCK_N]: V^T
    if MASK:
        kv_ok = kpos[None, :] < T
        k = tl.load(k_ptrs, mask=kv_ok, other=0.0)
        v = tl.load(v_ptrs, mask=kv_ok, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if DOT_FP32:  # the interpreter: the same products, exact in fp32
        s = tl.dot(q8.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q8, k)
    s = s * qk_scale
    if MASK:
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p8 = _round_e4m3(p * P_SCALE_, HW_CAST).to(tl.float8e4nv)
    if DOT_FP32:
        pv = tl.dot(p8.to(tl.float32), tl.trans(v.to(tl.float32)), input_precision="ieee")
    else:
        pv = tl.dot(p8, tl.trans(v))
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_new


@lazy_jit(do_not_specialize=("T",))
def _fp8_causal_attention_kernel(
    q_ptr,  # q: [T, Hq, D] (bf16/fp16), last dim contiguous
    k_ptr,  # k: [Hk, T, D] e4m3, contiguous
    vt_ptr,  # v transposed: [Hk, D, stride_vd] e4m3 (keys contiguous)
    out_ptr,  # out: [T, Hq, D], last dim contiguous
    T,  # tokens
    qk_scale,  # softmax scale * log2(e): scores in the exp2 domain
    stride_qt, stride_qh,  # q strides (elements)
    stride_kh, stride_kt,  # k strides
    stride_vh, stride_vd,  # v^T strides
    stride_ot, stride_oh,  # out strides
    GROUP: tl.constexpr,  # q heads per kv head
    BLOCK_M: tl.constexpr,  # queries per program (a multiple of BLOCK_N)
    BLOCK_N: tl.constexpr,  # keys per tile
    HEAD_DIM: tl.constexpr,  # D (a power of two)
    HW_CAST: tl.constexpr,  # the GPU's e4m3 cast rounds (else kernels.fp8_quant._round_e4m3 does)
    DOT_FP32: tl.constexpr,  # dots on fp32 copies of the e4m3 operands (the interpreter)
    P_SCALE_: tl.constexpr,  # P is rounded as P * P_SCALE_
):
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) query tiles start first
    h = tl.program_id(1)
    kvh = h // GROUP
    rm = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    row_ok = rm < T
    q = tl.load(q_ptr + rm[:, None].to(tl.int64) * stride_qt + h * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    q8 = _round_e4m3(tl.minimum(tl.maximum(q.to(tl.float32), -448.0), 448.0), HW_CAST).to(tl.float8e4nv)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = vt_ptr + kvh.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo = m_tile * BLOCK_M  # keys below lo are before every query of the tile: no mask
    for start in range(0, lo, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q8, k_base, v_base, start, rm, rn, d, T, stride_kt,
                                     stride_vd, qk_scale, False, HW_CAST, DOT_FP32, P_SCALE_)
    hi = tl.minimum(lo + BLOCK_M, T)
    for start in range(lo, hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q8, k_base, v_base, start, rm, rn, d, T, stride_kt,
                                     stride_vd, qk_scale, True, HW_CAST, DOT_FP32, P_SCALE_)
    o = acc / (l_i[:, None] * P_SCALE_)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_ot + h * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def fp8_kv_operands(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k [Hk, T, D] e4m3, v^T [Hk, D, T16] e4m3): the kernel's key and value operands, rounded
    as the fp8 KV cache rounds them (T16: T up to a multiple of 16, 16-byte rows)."""
    t, hk, d = k.shape
    k8 = torch.empty((hk, t, d), dtype=FP8, device=k.device)
    k8.copy_(k.transpose(0, 1))
    vt8 = torch.empty((hk, d, cdiv(t, 16) * 16), dtype=FP8, device=v.device)
    vt8[:, :, :t].copy_(v.permute(1, 2, 0))
    return k8, vt8


def fp8_causal_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
    config: tuple[int, int, int, int] | None = None, hw_cast: bool | None = None,
) -> torch.Tensor:
    """Triton `fp8_causal_attention_ref` (P rounded to e4m3 too: see the module docstring).
    config: (BLOCK_M, BLOCK_N, num_warps, num_stages), DEFAULT_CONFIG when None."""
    import os

    check(q.dim() == 3 and k.dim() == 3 and v.shape == k.shape, "fp8_attention: q [T, Hq, D], k and v [T, Hk, D]")
    t, hq, d = q.shape
    hk = k.shape[1]
    check(k.shape[0] == t and k.shape[2] == d, "fp8_attention: k is {}, q {}", tuple(k.shape), tuple(q.shape))
    check(hq % hk == 0, "fp8_attention: {} q heads are not a multiple of {} kv heads", hq, hk)
    check(d >= 16 and d & (d - 1) == 0, "fp8_attention: head dim {} is not a power of two >= 16", d)
    check(q.stride(2) == 1, "fp8_attention: q's last dim must be contiguous")
    check(q.dtype in (torch.bfloat16, torch.float16), "fp8_attention: q must be bf16 or fp16, got {}", q.dtype)
    block_m, block_n, warps, stages = config or DEFAULT_CONFIG
    check(block_m % block_n == 0, "fp8_attention: BLOCK_M {} is not a multiple of BLOCK_N {}", block_m, block_n)
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    k8, vt8 = fp8_kv_operands(k, v)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    hw = (q.device.type == "cuda" and not interp) if hw_cast is None else hw_cast
    _fp8_causal_attention_kernel.launch(
        (cdiv(t, block_m), hq), (
            q, k8, vt8, out, t, scale * 1.4426950408889634,
            q.stride(0), q.stride(1), k8.stride(0), k8.stride(1), vt8.stride(0), vt8.stride(1),
            out.stride(0), out.stride(1),
        ), {"GROUP": hq // hk, "BLOCK_M": block_m, "BLOCK_N": block_n, "HEAD_DIM": d, "HW_CAST": hw,
            "DOT_FP32": q.device.type != "cuda" or interp, "P_SCALE_": P_SCALE},
        warps, stages, q.device.type == "cuda" and not interp)
    return out
