"""Attention of one new token per sequence over the paged KV cache (decode)."""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import bounded_put, cdiv, check, lazy_jit, next_pow2, num_sms
from kernels.kv_layout import v_keys_inner, v_max
from kernels.prefill_attention import check_paged_inputs, combine_splits, paged_attention_ref, split_partials


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


# block tables are as wide as the step's longest sequence: their row stride changes every step
@lazy_jit(do_not_specialize=("window", "num_splits", "stride_bt"),
          do_not_specialize_on_alignment=("bt_ptr", "seq_lens_ptr", "kn_ptr", "vn_ptr", "pos_ptr", "slot_ptr"))
def _decode_partial_kernel(
    q_ptr,  # q: [B, Hq, D], last dim contiguous
    k_cache_ptr,  # k_cache: [num_blocks, block_size, Hk, D], last dim contiguous; q's dtype or fp8 e4m3
    v_cache_ptr,  # v_cache: k_cache's shape and dtype; k_cache's strides, or V_T's (keys innermost)
    bt_ptr,  # block_tables: [B, max_blocks] int32
    seq_lens_ptr,  # seq_lens: [B] int32; the query sits at position seq_lens[b] - 1
    m_ptr,  # partial row max: [B * Hq, num_splits] fp32 (exp2 domain); unused unless SPLIT
    l_ptr,  # partial row sum: [B * Hq, num_splits] fp32
    acc_ptr,  # partial unnormalised output: [B * Hq, num_splits, D] fp32 (rows with l = 0 unwritten)
    out_ptr,  # out: [B, Hq, D] contiguous, written directly unless SPLIT
    kn_ptr,  # ROPE: the step's new k, not rotated: [B, Hk, D], last dim contiguous (else a dummy)
    vn_ptr,  # ROPE: the step's new v: [B, Hk, D], last dim contiguous
    pos_ptr,  # ROPE: positions [B] int64
    cs_ptr,  # ROPE: cos_sin [max_pos, D] fp32 = cat(cos[:, :D/2], sin[:, :D/2])
    slot_ptr,  # ROPE: slot_mapping [B] int64; a negative slot writes nothing
    stride_kt,  # ROPE: new k token stride (elements)
    stride_kh,  # ROPE: new k head stride
    stride_vt,  # ROPE: new v token stride
    stride_vh,  # ROPE: new v head stride
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window W (read only when HAS_WINDOW)
    num_splits,  # context partitions per (sequence, kv head) = grid axis 2
    num_q_heads,  # Hq
    stride_qb,  # q batch stride (elements)
    stride_qh,  # q head stride
    stride_cb,  # cache block stride (k and v caches share strides)
    stride_cs,  # cache slot-in-block stride
    stride_ch,  # cache kv-head stride
    stride_vcb,  # v_cache block stride (stride_cb unless V_T)
    stride_vch,  # v_cache kv-head stride (stride_ch unless V_T)
    stride_bt,  # block_tables row stride
    GROUP: tl.constexpr,  # q heads per kv head
    G_PACK: tl.constexpr,  # q heads per program (rows of the score tile that are real)
    HEAD_CHUNKS: tl.constexpr,  # programs per kv head along axis 1 = cdiv(GROUP, G_PACK)
    BLOCK_H: tl.constexpr,  # rows of the score tile: power of two >= max(G_PACK, 16) (tl.dot minimum)
    BLOCK_N: tl.constexpr,  # keys per tile
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # power of two >= D
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for the combine; else normalise and write out
    HAS_WINDOW: tl.constexpr,  # apply the sliding window
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs and the interpreter, None (default) for 16 bit
    DOT_FP32: tl.constexpr,  # upcast dot operands to fp32 (the CPU interpreter's 16-bit dot is wrong)
    WIDEN_F16: tl.constexpr,  # an fp8 cache: widen K/V (and q, P) to fp16 (one cvt per pair) instead of q's dtype
    PREFETCH: tl.constexpr,  # load the next key tile's block-table entries one iteration ahead
    ROPE: tl.constexpr,  # q (and the new k) arrive unrotated: rotate them here and write k, v to the cache
    V_T: tl.constexpr,  # v_cache holds each block's keys innermost ([blocks, Hk, D, block_size]): tiles of whole blocks
    V_MAX: tl.constexpr,  # V_T and ROPE: the new v is written finite, clamped to +-V_MAX (kernels/kv_layout.py)
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
    lo_t = lo
    if V_T:  # tiles of whole blocks start on a block: keys before lo (a window's) are masked
        lo_t = (lo // BLOCK_SIZE) * BLOCK_SIZE
    per_split = tl.cdiv(tl.cdiv(ctx - lo_t, num_splits), BLOCK_N) * BLOCK_N
    k_start = lo_t + split * per_split
    k_stop = tl.minimum(k_start + per_split, ctx)

    r = tl.arange(0, BLOCK_H)
    g = chunk * G_PACK + r
    row_ok = (r < G_PACK) & (g < GROUP)
    qh = kvh * GROUP + g  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if ROPE:
        # rope_and_cache's rotation (rotate-half), each column with its partner in the other half:
        # fp32, rounded to q's dtype; the new k rotated the same way and rounded to the cache's dtype,
        # written with v to its slot by one program of the kv head; the split that holds position
        # ctx - 1 adds that key and value from registers after its loop (the write may not be visible
        # to another program's load in this launch, and a select in every tile cost 53 us a layer at
        # B = 256 on the H200: 10.9 against 9.17 ms a step)
        half = HEAD_DIM // 2
        lo_half = d < half
        j = tl.where(lo_half, d, d - half)
        pd = tl.where(lo_half, d + half, d - half)
        pos = tl.load(pos_ptr + b)
        cos = tl.load(cs_ptr + pos * HEAD_DIM + j, mask=dmask, other=0.0)
        sin = tl.load(cs_ptr + pos * HEAD_DIM + half + j, mask=dmask, other=0.0)
        sin = tl.where(lo_half, -sin, sin)
        qp = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + pd[None, :],
                     mask=row_ok[:, None] & dmask[None, :], other=0.0)
        q = (q.to(tl.float32) * cos[None, :] + qp.to(tl.float32) * sin[None, :]).to(q.dtype)
        kn_row = kn_ptr + b * stride_kt + kvh.to(tl.int64) * stride_kh
        kn = tl.load(kn_row + d, mask=dmask, other=0.0)
        knp = tl.load(kn_row + pd, mask=dmask, other=0.0)
        k_new = (kn.to(tl.float32) * cos + knp.to(tl.float32) * sin).to(kn.dtype).to(k_cache_ptr.dtype.element_ty)
        v_new = tl.load(vn_ptr + b * stride_vt + kvh.to(tl.int64) * stride_vh + d, mask=dmask, other=0.0)
        if V_T:  # as rope_cache.finite_v: the stale slots a keys-inner tile reads must be finite
            v_new = v_new.to(tl.float32)
            v_new = tl.where(v_new == v_new, tl.minimum(tl.maximum(v_new, -V_MAX), V_MAX), 0.0)
        v_new = v_new.to(v_cache_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + b)
        if (split == 0) & (chunk == 0):
            s_blk = (slot // BLOCK_SIZE).to(tl.int64)
            s_off = (slot % BLOCK_SIZE).to(tl.int64)
            w_off = s_blk * stride_cb + s_off * stride_cs + kvh.to(tl.int64) * stride_ch + d
            w_ok = dmask & ((d * 0 + slot) >= 0)  # as a block: the interpreter rejects a scalar mask term
            tl.store(k_cache_ptr + w_off, k_new, mask=w_ok)
            if V_T:
                w_off = s_blk * stride_vcb + kvh.to(tl.int64) * stride_vch + d * BLOCK_SIZE + s_off
            tl.store(v_cache_ptr + w_off, v_new, mask=w_ok)
    if WIDEN_F16:
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)  # pre-scaled: far from fp16's range limit
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt
    kv_head_off = kvh.to(tl.int64) * stride_ch
    v_head_off = kvh.to(tl.int64) * stride_vch
    k_end = k_stop
    if ROPE:  # the new key (at ctx - 1) is not read from its slot: it joins after the loop, from registers
        k_end = tl.minimum(k_stop, ctx - 1)
    if PREFETCH:  # the K/V addresses of a tile then hang on no load of their own iteration
        kpos0 = k_start + tl.arange(0, BLOCK_N)
        blk_next = tl.load(bt_row + kpos0 // BLOCK_SIZE, mask=kpos0 < k_end, other=0)
    for start in range(k_start, k_end, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < k_end
        blk_in = k_ok
        if V_T:  # every key of a block in range gets the block's id: V's runs are whole blocks (the hints below)
            blk_in = tl.max_constancy(kpos - kpos % BLOCK_SIZE < k_end, BLOCK_SIZE)
        if PREFETCH:
            blk = blk_next.to(tl.int64)
            kpos_n = kpos + BLOCK_N
            blk_next = tl.load(bt_row + kpos_n // BLOCK_SIZE, mask=blk_in, other=0)
        else:
            blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=blk_in, other=0).to(tl.int64)
        c_off = blk * stride_cb + (kpos % BLOCK_SIZE).to(tl.int64) * stride_cs + kv_head_off  # [BLOCK_N]
        if V_T and HAS_WINDOW:  # after the block ids: a window's first block is read whole
            k_ok = k_ok & (kpos >= lo)
        kv_mask = k_ok[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + c_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if V_T:  # V^T [BLOCK_D, BLOCK_N] in whole blocks, each block's keys of a dim one aligned run (as the
            # prefill kernel); the slots past the context's end hold finite values (kernels/kv_layout.py), p = 0
            vk = blk * stride_vcb + (kpos % BLOCK_SIZE).to(tl.int64) + v_head_off
            vk = tl.max_contiguous(tl.multiple_of(vk, BLOCK_SIZE), BLOCK_SIZE)  # a block's keys: one aligned run
            vt = tl.load(v_cache_ptr + (d * BLOCK_SIZE)[:, None] + vk[None, :],
                         mask=dmask[:, None] & blk_in[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
            v = tl.trans(vt)
        else:
            v = tl.load(v_cache_ptr + c_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if WIDEN_F16:
            k = k.to(tl.float16)  # e4m3 -> fp16 is exact
            v = v.to(tl.float16)
        else:
            k = k.to(q_ptr.dtype.element_ty)  # an fp8 cache widens exactly to q's dtype (else a no-op)
            v = v.to(q_ptr.dtype.element_ty)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
        if not WIDEN_F16:
            s = s * qk_scale
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
    if ROPE:  # the new key and value, in the split whose range holds ctx - 1, as the loop would add them
        new_pos = r * 0 + ctx - 1  # [BLOCK_H]: a block, as the interpreter wants a mask
        owns = (new_pos >= k_start) & (new_pos < k_stop) & row_ok
        if WIDEN_F16:
            kw = k_new.to(tl.float16)
            vw = v_new.to(tl.float16)
        else:
            kw = k_new.to(q_ptr.dtype.element_ty)
            vw = v_new.to(q_ptr.dtype.element_ty)
        s_new = tl.sum(q.to(tl.float32) * kw.to(tl.float32)[None, :], 1)  # [BLOCK_H]
        if not WIDEN_F16:
            s_new = s_new * qk_scale
        s_new = tl.where(owns, s_new, float("-inf"))
        m_new = tl.maximum(m_i, s_new)
        alpha = tl.math.exp2(m_i - m_new)
        p_new = tl.math.exp2(s_new - m_new)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new.to(vw.dtype).to(tl.float32)[:, None] * vw.to(tl.float32)[None, :]
        m_i = m_new

    part = (b * num_q_heads + qh) * num_splits + split  # [BLOCK_H]
    if not SPLIT:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # an empty context (seq_len 0, padding) gives zeros
        tl.store(out_ptr + part[:, None] * HEAD_DIM + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dmask[None, :])
    else:
        # an empty split (short context) stores m = -1e30, l = 0 (and no acc) and drops out of the combine
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=(row_ok & (l_i > 0.0))[:, None] & dmask[None, :])


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



# launch plans: static checks per (shapes but B, strides, dtypes, devices); tiles per (B, table width)
_STATIC: dict = {}
_TILES: dict = {}


def _static_plan(q, k_cache, v_cache, block_tables, seq_lens, sliding_window) -> tuple:
    """All argument checks but the batch size (run once per key).

    Returns (Hq, Hk, D, block_size, on_gpu, fp32, has_window, fp8_cache, v_t).
    """
    hq, hk, d, bs = check_paged_inputs("decode_attention", q, k_cache, v_cache, block_tables)
    check(seq_lens.dim() == 1 and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(),
          "decode_attention: seq_lens must be contiguous [B] int32")
    check(seq_lens.device == q.device, "decode_attention: seq_lens on another device than q")
    check(sliding_window is None or sliding_window >= 1, "decode_attention: bad sliding_window {}", sliding_window)
    return (hq, hk, d, bs, q.device.type == "cuda", q.dtype == torch.float32, sliding_window is not None,
            k_cache.dtype == torch.float8_e4m3fn, v_keys_inner(v_cache))


def _tile_plan(static: tuple, b: int, max_context: int, sms: int, over: tuple) -> tuple:
    """(grid, consts, num_warps, num_stages, num_splits) of the partial launch."""
    hq, hk, d, bs, on_gpu, fp32, has_window, fp8_cache, v_t = static
    num_splits, block_n, num_warps, num_stages, widen, prefetch = over
    check(widen in (None, "q", "fp16"), "decode_attention: widen must be 'q' or 'fp16', not {!r}", widen)
    # a V cache with its keys innermost: the block ids a tile ahead by default on the GPU (at blocks of 64, B =
    # 1000, context 1500: 2898 GB/s against 2755 without, on an H100 with 40 SMs held; session22.md)
    if prefetch is None:
        prefetch = v_t and on_gpu
    group = hq // hk
    g_pack = min(group, 64)
    head_chunks = cdiv(group, g_pack)
    if num_splits is None:
        num_splits = default_num_splits(b, hk * head_chunks, max_context, sms)
    check(1 <= num_splits <= 256, "decode_attention: num_splits {} not in [1, 256]", num_splits)
    # 128-key tiles on the GPU: 3-10% over 64 at B=1..256 on H200 (kernels-2026-11-30.md, sweep)
    # an fp8 cache on the GPU: 64-key tiles, 2 warps, tiles widened to fp16 (one cvt per pair of
    # values): 0.176 ms against 0.252 for the bf16-path tiles at B=224, context ~1000, where a
    # bf16 cache takes 0.221 (kernels-2026-11-30-session3.md, kv-dtype sweep)
    fp8_gpu = fp8_cache and on_gpu and not fp32
    if widen is None and fp8_gpu:
        widen = "fp16"
    bn = block_n or (32 if fp32 else 64 if fp8_gpu else 128 if on_gpu else 64)
    num_warps = num_warps or (2 if fp8_gpu else 4)
    check(bn >= 16 and bn & (bn - 1) == 0, "decode_attention: block_n must be a power of two >= 16")
    # a V cache with its keys innermost is read in tiles of whole blocks (a window's first tile starts on
    # its block, the keys before the window masked): block_n a multiple of the block size
    if v_t and block_n is None:
        bn = max(bn, bs)
    check(not v_t or bn % bs == 0, "decode_attention: a V cache with its keys innermost reads whole blocks: "
          "block_n {} must be a multiple of the block size {}", bn, bs)
    consts = {
        "GROUP": group, "G_PACK": g_pack, "HEAD_CHUNKS": head_chunks, "BLOCK_H": max(16, next_pow2(g_pack)),
        "BLOCK_N": bn, "HEAD_DIM": d, "BLOCK_D": next_pow2(d), "BLOCK_SIZE": bs, "SPLIT": num_splits > 1,
        "HAS_WINDOW": has_window, "PRECISION": "ieee" if fp32 or not on_gpu else None, "DOT_FP32": not on_gpu,
        "WIDEN_F16": fp8_cache and widen == "fp16", "PREFETCH": prefetch, "ROPE": False,
        "V_T": v_t, "V_MAX": 0.0,
    }
    return (b, hk * head_chunks, num_splits), consts, num_warps, num_stages or 3, num_splits



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
    widen: str | None = None,
    prefetch: bool | None = None,
    rope: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """Triton `decode_attention_ref` (flash-decoding): q [B, Hq, D] -> [B, Hq, D].

    Grid (B, kv heads x head chunks, num_splits) computes partial (max, sum, acc) per split; a
    second launch combines them (`combine_splits`); with one split the first launch writes the
    output and there is no second. Nothing is read on the host and every shape depends on
    (B, num_splits) only, so the call can be captured in a CUDA graph. num_splits defaults to
    `default_num_splits` (B, heads, SM count); block_n / num_warps / num_stages override tiles.
    widen: what an fp8 cache's tiles are widened to before the dots: "q" (q's dtype) or "fp16"
    (q, pre-scaled, and the probabilities cast to fp16 too); None: "fp16" for an fp8 cache on
    the GPU with a 16-bit q, else "q". prefetch: load each key tile's block-table entries in the
    iteration before; None: on the GPU over a keys-inner V cache (+5% at blocks of 64), else off (V in rows:
    2% at B=640 on the H200, noise-level). A V cache with its keys
    innermost (`kernels.kv_layout`) is read as V^T tiles of whole blocks. (Measured and removed: a
    register cap on this launch, 128 or 96 against Triton's 167, 13% and 45% slower at B = 1000 on the
    H200, bench/results/2026-12-04-session8-h200.md; tiles addressed by one block-table entry per block
    through tl.reshape, 305-324 GB/s against 1945-2570 at B = 256-1000 on an H100, Triton 3.6,
    bench/results/2026-12-06-v-layout-h100.md; each block's K and V brought to shared memory by one TMA copy
    (host descriptors over the cache as [blocks x block size, Hk x D], a block a loop iteration, 4-10 stages:
    96 registers, no per-thread tile addressing), 2161-2266 against 2679-2739 GB/s at B = 1000 on an H100 and
    1639-1786 against 2291 with 40 of its SMs held (an H200's bandwidth per SM), keys-inner V included,
    bench/results/2026-12-07-session21-decode-tma-*.)

    rope = (k, v, positions, cos_sin, slot_mapping): `rope_and_cache` fused in (a pure decode step):
    q and k [B, Hk, D] arrive unrotated (strided views of the fused qkv output are fine), the kernel
    rotates them as `rope_and_cache_ref` does and writes k and v to their slots (a negative slot:
    nothing), and attends over the cache with the new key and value in it. q itself is not changed.
    """
    # q: [B, Hq, D]; partials: [B * Hq, S] and [B * Hq, S, D] fp32
    skey = (q.shape[1:], q.stride()[1:], q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype,
            k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
            block_tables.stride()[1:], block_tables.dtype, block_tables.device, seq_lens.stride(), seq_lens.dtype,
            seq_lens.device, sliding_window)
    static = _STATIC.get(skey)
    if static is None:
        static = bounded_put(_STATIC, skey, _static_plan(q, k_cache, v_cache, block_tables, seq_lens, sliding_window))
    hq, _hk, d, bs, on_gpu = static[:5]
    v_t = static[8]
    b = q.shape[0]
    check(block_tables.shape[0] == b and seq_lens.shape == (b,),
          "decode_attention: block_tables ({} rows) and seq_lens {} must match q's batch {}",
          block_tables.shape[0], seq_lens.shape, b)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    over = (num_splits, block_n, num_warps, num_stages, widen, prefetch)
    tkey = (skey, b, block_tables.shape[1], over, rope is None)
    plan = _TILES.get(tkey)
    if plan is None:
        plan = _tile_plan(static, b, block_tables.shape[1] * bs, num_sms(q.device), over)
        if rope is not None:
            plan = (plan[0], {**plan[1], "ROPE": True, "V_MAX": v_max(v_cache.dtype) if v_t else 0.0},
                    *plan[2:])
        bounded_put(_TILES, tkey, plan)
    grid, consts, warps, stages, splits = plan
    if splits > 1:
        m, lsum, acc = split_partials(b * hq, splits, d, q.device)
    else:
        m = lsum = acc = out
    if rope is not None:
        kn, vn, positions, cos_sin, slots = rope
        _check_rope(q, kn, vn, positions, cos_sin, slots, k_cache)
        rope_args = (kn, vn, positions, cos_sin, slots, kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1))
    else:
        rope_args = (q, q, q, q, q, 0, 0, 0, 0)
    _decode_partial_kernel.launch(grid, (
        q, k_cache, v_cache, block_tables, seq_lens, m, lsum, acc, out, *rope_args,
        scale * 1.4426950408889634,
        sliding_window or 0,
        splits,
        hq,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(2),
        block_tables.stride(0),
    ), consts, warps, stages, on_gpu)
    if splits > 1:
        combine_splits(m, lsum, acc, out, on_gpu)
    return out


def _check_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                slots: torch.Tensor, k_cache: torch.Tensor) -> None:
    b, _hq, d = q.shape
    hk = k_cache.shape[2]
    check(k.shape == (b, hk, d) and v.shape == (b, hk, d), "decode_attention: rope's k {} / v {} are not [{}, {}, {}]",
          tuple(k.shape), tuple(v.shape), b, hk, d)
    check(k.stride(2) == 1 and v.stride(2) == 1, "decode_attention: rope's k and v need a contiguous last dim")
    check(k.dtype == v.dtype == q.dtype, "decode_attention: rope's k {} / v {} are not q's {}", k.dtype, v.dtype, q.dtype)
    check(d % 2 == 0, "decode_attention: rope needs an even head_dim, not {}", d)
    check(cos_sin.dim() == 2 and cos_sin.shape[1] == d and cos_sin.dtype == torch.float32 and cos_sin.is_contiguous(),
          "decode_attention: cos_sin must be contiguous fp32 [max_pos, {}]", d)
    check(positions.shape == (b,) and slots.shape == (b,) and positions.dtype == slots.dtype == torch.int64
          and positions.is_contiguous() and slots.is_contiguous(),
          "decode_attention: rope's positions and slot_mapping must be contiguous [{}] int64", b)
    check(len({x.device for x in (q, k, v, positions, cos_sin, slots, k_cache)}) == 1,
          "decode_attention: rope's tensors on several devices")


def decode_rope_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                              cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """`rope_and_cache_ref`, then `decode_attention_ref` (what the fused decode computes)."""
    from kernels.rope_cache import rope_and_cache_ref

    q_rot, _ = rope_and_cache_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    return decode_attention_ref(q_rot, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)


def decode_rope_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                                 cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                 scale: float, sliding_window: int | None = None,
                                 num_splits: int | None = None, **tiles: Any) -> torch.Tensor:
    """`decode_rope_attention_ref` in the decode attention's launches: one kernel a layer fewer in a
    pure decode step (rope_and_cache took 2.5 us a layer at batch 1 on the H200, b9352b7's profile).
    tiles: `decode_attention_triton`'s tile keywords (block_n, num_warps, num_stages, prefetch)."""
    return decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, num_splits,
                                   rope=(k, v, positions, cos_sin, slot_mapping), **tiles)


TILES_ENV = "FIRSTTOKEN_DECODE_TILES"
TILE_KEYWORDS = {"block_n": int, "num_warps": int, "num_stages": int, "prefetch": bool}


def tiles_from_env() -> dict[str, Any]:
    """FIRSTTOKEN_DECODE_TILES, an A/B switch: a JSON object of `decode_attention_triton` tile keywords
    (block_n, num_warps, num_stages, prefetch) that every decode launch of an engine built afterwards
    takes, its warm-up too (read when the engine binds its ops). Empty or unset: the defaults."""
    import json
    import os

    raw = os.environ.get(TILES_ENV, "").strip()
    if not raw:
        return {}
    try:
        tiles = json.loads(raw)
    except ValueError:
        raise ValueError(f"{TILES_ENV} must be a JSON object, not {raw!r}") from None
    if not isinstance(tiles, dict) or not all(
            k in TILE_KEYWORDS and type(v) is TILE_KEYWORDS[k] for k, v in tiles.items()):
        raise ValueError(f"{TILES_ENV}: a JSON object of {sorted(TILE_KEYWORDS)} (ints, prefetch a bool), "
                         f"not {raw!r}")
    return tiles


def warm_up_decode(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, scale: float,
                   sliding_window: int | None, q_dtype: torch.dtype, tiles: dict | None = None) -> None:
    """Compile every variant `decode_attention_triton` can pick here (split or not), and the
    combine kernel for every split count it can use (up to 64), so serving never compiles.
    Reads block 0 of the caches; writes nothing there. tiles: the tile keywords serving passes."""
    if k_cache.device.type != "cuda":
        return
    dev = k_cache.device
    q = torch.zeros((2, num_heads, k_cache.shape[-1]), dtype=q_dtype, device=dev)
    tables = torch.zeros((2, 1), dtype=torch.int32, device=dev)
    lens = torch.ones(2, dtype=torch.int32, device=dev)
    hk, d = k_cache.shape[2], k_cache.shape[3]
    # the fused rope's variants too, its k / v as views of a fused qkv row (the strides serving passes)
    qkv = torch.zeros((2, (num_heads + 2 * hk) * d), dtype=q_dtype, device=dev)
    kn = qkv[:, num_heads * d:(num_heads + hk) * d].view(2, hk, d)
    vn = qkv[:, (num_heads + hk) * d:].view(2, hk, d)
    qv = qkv[:, :num_heads * d].view(2, num_heads, d)
    cos_sin = torch.zeros((1, d), dtype=torch.float32, device=dev)
    pos = torch.zeros(2, dtype=torch.int64, device=dev)
    no_slot = torch.full((2,), -1, dtype=torch.int64, device=dev)  # writes nothing
    tiles = tiles or {}
    for splits in (1, 2, 4, 8, 16, 32, 64):
        decode_attention_triton(q, k_cache, v_cache, tables, lens, scale, sliding_window, splits, **tiles)
        decode_attention_triton(qv, k_cache, v_cache, tables, lens, scale, sliding_window, splits,
                                rope=(kn, vn, pos, cos_sin, no_slot), **tiles)
