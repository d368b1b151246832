"""Attention of one new token per sequence over the paged KV cache (decode)."""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import cdiv, check, lazy_jit, next_pow2, num_sms
from kernels.prefill_attention import check_paged_inputs, paged_attention_ref


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D], one token per sequence at position seq_lens[b] - 1 -> [B, Hq, D]."""
    b = q.shape[0]
    qsl = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, qsl, seq_lens, scale, sliding_window)


# ---------------------------------------------------------------------------------------------
# Triton: flash-decoding in two launches (partials over context splits, then their combination)
# ---------------------------------------------------------------------------------------------

tl: Any = None  # triton.language, bound at the first launch by kernels._triton.lazy_jit


@lazy_jit
def _decode_partial_kernel(
    q_ptr,  # q: [B, Hq, D], last dim contiguous
    k_cache_ptr,  # k_cache: [num_blocks, block_size, Hk, D], last dim contiguous
    v_cache_ptr,  # v_cache: same shape and strides as k_cache
    bt_ptr,  # block_tables: [B, max_blocks] int32
    seq_lens_ptr,  # seq_lens: [B] int32; the query sits at position seq_lens[b] - 1
    m_ptr,  # partial row max: [B, Hq, NUM_SPLITS] fp32 (exp2 domain)
    l_ptr,  # partial row sum: [B, Hq, NUM_SPLITS] fp32
    acc_ptr,  # partial unnormalised output: [B, Hq, NUM_SPLITS, D] fp32, contiguous
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window W (read only when HAS_WINDOW)
    num_q_heads,  # Hq
    stride_qb,  # q batch stride (elements)
    stride_qh,  # q head stride
    stride_cb,  # cache block stride (k and v caches share strides)
    stride_cs,  # cache slot-in-block stride
    stride_ch,  # cache kv-head stride
    stride_bt,  # block_tables row stride
    GROUP: tl.constexpr,  # q heads per kv head
    G_PACK: tl.constexpr,  # q heads per program (rows of the score tile that are real)
    HEAD_CHUNKS: tl.constexpr,  # programs per kv head along axis 1 = cdiv(GROUP, G_PACK)
    BLOCK_H: tl.constexpr,  # rows of the score tile: power of two >= max(G_PACK, 16) (tl.dot minimum)
    BLOCK_N: tl.constexpr,  # keys per tile
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # power of two >= D
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    NUM_SPLITS: tl.constexpr,  # context partitions per (sequence, kv head)
    HAS_WINDOW: tl.constexpr,  # apply the sliding window
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs and the interpreter, None (default) for 16 bit
    DOT_FP32: tl.constexpr,  # upcast dot operands to fp32 (the CPU interpreter's 16-bit dot is wrong)
):
    b = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    kvh = pid_h // HEAD_CHUNKS
    chunk = pid_h % HEAD_CHUNKS

    # this split's key range, derived on the device from seq_lens (no host sync, graph-capturable)
    ctx = tl.load(seq_lens_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)  # the query at ctx - 1 sees keys > ctx - 1 - W
    per_split = tl.cdiv(tl.cdiv(ctx - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    k_start = lo + split * per_split
    k_stop = tl.minimum(k_start + per_split, ctx)

    r = tl.arange(0, BLOCK_H)
    g = chunk * G_PACK + r
    row_ok = (r < G_PACK) & (g < GROUP)
    qh = kvh * GROUP + g  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt
    kv_head_off = kvh.to(tl.int64) * stride_ch
    for start in range(k_start, k_stop, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < k_stop
        blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        c_off = blk * stride_cb + (kpos % BLOCK_SIZE).to(tl.int64) * stride_cs + kv_head_off  # [BLOCK_N]
        kv_mask = k_ok[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + c_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + c_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # an empty split (short context) stores m = -1e30, l = 0, acc = 0 and drops out of the combine
    part = (b * num_q_heads + qh) * NUM_SPLITS + split  # [BLOCK_H]
    tl.store(m_ptr + part, m_i, mask=row_ok)
    tl.store(l_ptr + part, l_i, mask=row_ok)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & dmask[None, :])


@lazy_jit
def _decode_combine_kernel(
    m_ptr,  # partial row max: [B, Hq, NUM_SPLITS] fp32
    l_ptr,  # partial row sum: [B, Hq, NUM_SPLITS] fp32
    acc_ptr,  # partial unnormalised output: [B, Hq, NUM_SPLITS, D] fp32
    out_ptr,  # out: [B, Hq, D], contiguous
    NUM_SPLITS: tl.constexpr,  # partitions to combine
    BLOCK_S: tl.constexpr,  # power of two >= NUM_SPLITS
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # power of two >= D
):
    row = tl.program_id(0).to(tl.int64)  # b * Hq + h
    s = tl.arange(0, BLOCK_S)
    smask = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    m = tl.load(m_ptr + row * NUM_SPLITS + s, mask=smask, other=-1.0e30)  # [BLOCK_S]
    lsum = tl.load(l_ptr + row * NUM_SPLITS + s, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + (row * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :],
                  mask=smask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - m_max)  # [BLOCK_S]
    total = tl.sum(w * lsum, 0)
    o = tl.sum(w[:, None] * acc, 0)  # [BLOCK_D]
    o = o / tl.where(total > 0.0, total, 1.0)  # an empty context (seq_len 0, padding) gives zeros
    tl.store(out_ptr + row * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty), mask=dmask)


def default_num_splits(batch: int, num_kv_programs: int, max_context: int, sms: int) -> int:
    """Context splits so that batch x kv programs x splits covers about eight programs per SM.

    Depends on shapes only (never on seq_lens), so a captured graph keeps its intermediates.
    No split is made shorter than 128 keys of the largest context the block table can hold.
    On an H200 (132 SMs, Llama-3.1-8B heads, context 1k-4k, graph replay) this beat the earlier
    two-waves / 256-key rule: B=1 7 -> 13 splits, B=8 5 -> 17 splits gave 670 -> ~890 GB/s and
    2280 -> ~2730 GB/s (bench/results/kernels-2026-11-30.md, sweep).
    """
    progs = max(1, batch * num_kv_programs)
    want = cdiv(8 * sms, progs)
    return max(1, min(want, cdiv(max_context, 128), 64))


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton `decode_attention_ref` (flash-decoding): q [B, Hq, D] -> [B, Hq, D].

    Grid (B, kv heads x head chunks, num_splits) computes partial (max, sum, acc) per split; a
    second launch combines them. Nothing is read on the host and every shape depends on
    (B, num_splits) only, so the call can be captured in a CUDA graph. num_splits defaults to
    `default_num_splits` (B, heads, SM count); block_n / num_warps / num_stages override tiles.
    """
    # q: [B, Hq, D]; partials: [B, Hq, S] and [B, Hq, S, D] fp32
    hq, hk, d, bs = check_paged_inputs("decode_attention", q, k_cache, v_cache, block_tables)
    b = q.shape[0]
    check(block_tables.shape[0] == b, f"decode_attention: block_tables has {block_tables.shape[0]} rows, q {b}")
    check(seq_lens.shape == (b,) and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(),
          f"decode_attention: seq_lens must be contiguous [{b}] int32")
    check(seq_lens.device == q.device, "decode_attention: seq_lens on another device than q")
    check(sliding_window is None or sliding_window >= 1, f"decode_attention: bad sliding_window {sliding_window}")
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    group = hq // hk
    g_pack = min(group, 64)
    head_chunks = cdiv(group, g_pack)
    if num_splits is None:
        num_splits = default_num_splits(b, hk * head_chunks, block_tables.shape[1] * bs, num_sms(q.device))
    check(1 <= num_splits <= 256, f"decode_attention: num_splits {num_splits} not in [1, 256]")
    on_gpu = q.device.type == "cuda"
    # 128-key tiles on the GPU: 3-10% over 64 at B=1..256 on H200 (kernels-2026-11-30.md, sweep)
    bn = block_n or (32 if q.dtype == torch.float32 else 128 if on_gpu else 64)
    check(bn >= 16 and bn & (bn - 1) == 0, "decode_attention: block_n must be a power of two >= 16")
    m_part = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    l_part = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    acc_part = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
    _decode_partial_kernel[(b, hk * head_chunks, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, m_part, l_part, acc_part,
        scale * 1.4426950408889634,
        sliding_window or 0,
        hq,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, G_PACK=g_pack, HEAD_CHUNKS=head_chunks, BLOCK_H=max(16, next_pow2(g_pack)),
        BLOCK_N=bn, HEAD_DIM=d, BLOCK_D=next_pow2(d), BLOCK_SIZE=bs, NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 or not on_gpu else None,
        DOT_FP32=not on_gpu,
        num_warps=num_warps or 4, num_stages=num_stages or 3,  # 3 stages: +3% over 2 at B=64 and 256 on H200
    )
    _decode_combine_kernel[(b * hq,)](
        m_part, l_part, acc_part, out,
        NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), HEAD_DIM=d, BLOCK_D=next_pow2(d),
        num_warps=4,
    )
    return out
