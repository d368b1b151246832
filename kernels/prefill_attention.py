"""Attention of a varlen batch of new tokens over the paged KV cache (prefill, chunked prefill, prefix hits)."""

from __future__ import annotations

import os
from typing import Any

import torch

from kernels._triton import bounded_put, cdiv, check, lazy_helper, lazy_jit, next_pow2, num_sms
from kernels.fp8_quant import _round_e4m3
from kernels.kv_layout import check_v_layout, v_keys_inner


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context in the paged cache.

    q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hk, D] (the new tokens' k/v are
    already written); block_tables: [B, max_blocks] int32; query_start_loc: [B + 1] int32;
    seq_lens: [B] int32 (context length including the new tokens). Hq is a multiple of Hk
    (grouped-query heads). Returns [T, Hq, D] in q.dtype; softmax in fp32.
    """
    _T, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    group = hq // hk
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx in enumerate(lens):
        s, e = qsl[i], qsl[i + 1]
        n = e - s
        if n == 0:
            continue
        nblk = (ctx + bs - 1) // bs
        blocks = block_tables[i, :nblk].long()
        k = k_cache[blocks].reshape(-1, hk, d)[:ctx].float()  # [ctx, Hk, D]
        v = v_cache[blocks].reshape(-1, hk, d)[:ctx].float()
        k = k.repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qi = q[s:e].float()  # [n, Hq, D]
        scores = torch.einsum("nhd,khd->hnk", qi, k) * scale  # [Hq, n, ctx]
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        allowed = kpos <= qpos
        if sliding_window is not None:
            allowed = allowed & (kpos > qpos - sliding_window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hnk,khd->nhd", p, v).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

tl: Any = None  # triton.language, bound at the first launch by kernels._triton.lazy_jit


@lazy_helper
def _tile_block_ids(bt_row, start, k_end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, V_T: tl.constexpr):
    """The block id of each key of the tile at `start` (0 past k_end): the loop's, read in its own iteration or,
    with PREFETCH, in the one before (the default's PTX is the same as when the loop read them inline)."""
    kpos = start + tl.arange(0, BLOCK_N)
    blk_in = kpos < k_end
    if V_T:
        blk_in = tl.max_constancy(kpos - kpos % BLOCK_SIZE < k_end, BLOCK_SIZE)
    return tl.load(bt_row + kpos // BLOCK_SIZE, mask=blk_in, other=0)


@lazy_jit(do_not_specialize=("window", "num_m_tiles", "num_splits", "num_seqs", "stride_bt"),
          do_not_specialize_on_alignment=("bt_ptr", "qsl_ptr", "seq_lens_ptr"))
def _paged_attention_kernel(
    q_ptr,  # q: [T, Hq, D], last dim contiguous
    k_cache_ptr,  # k_cache: [num_blocks, block_size, Hk, D], last dim contiguous; q's dtype or fp8 e4m3
    v_cache_ptr,  # v_cache: k_cache's shape and dtype; k_cache's strides, or V_T's (keys innermost)
    out_ptr,  # out: [T, Hq, D], last dim contiguous (written when not SPLIT)
    m_ptr,  # SPLIT: partial row max [T, Hq, num_splits] fp32 (exp2 domain); else unused
    l_ptr,  # SPLIT: partial row sum [T, Hq, num_splits] fp32; else unused
    acc_ptr,  # SPLIT: partial unnormalised output [T, Hq, num_splits, D] fp32 (rows with l = 0 unwritten)
    bt_ptr,  # block_tables: [B, max_blocks] int32
    qsl_ptr,  # query_start_loc: [B + 1] int32
    seq_lens_ptr,  # seq_lens: [B] int32, context length including the new tokens
    qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
    window,  # sliding window W (read only when HAS_WINDOW)
    num_m_tiles,  # query tiles per sequence (an upper bound); axis 0 of the grid is num_m_tiles * num_splits
    num_splits,  # key-range parts per (query tile, head chunk, sequence); 1 unless SPLIT
    num_seqs,  # B (read only when COMPACT)
    num_q_heads,  # Hq (row index of the partials)
    stride_qt,  # q token stride (elements)
    stride_qh,  # q head stride
    stride_ot,  # out token stride
    stride_oh,  # out head stride
    stride_cb,  # cache block stride (k and v caches share strides)
    stride_cs,  # cache slot-in-block stride
    stride_ch,  # cache kv-head stride
    stride_vcb,  # v_cache block stride (stride_cb unless V_T)
    stride_vch,  # v_cache kv-head stride (stride_ch unless V_T)
    stride_bt,  # block_tables row stride
    GROUP: tl.constexpr,  # q heads per kv head (Hq // Hk)
    G_PACK: tl.constexpr,  # q heads of the group packed into one program's M rows
    HEAD_CHUNKS: tl.constexpr,  # programs per kv head along axis 1 = cdiv(GROUP, G_PACK)
    BLOCK_Q: tl.constexpr,  # query tokens per program = BLOCK_M // G_PACK
    BLOCK_M: tl.constexpr,  # rows of the score tile (BLOCK_Q tokens x G_PACK heads)
    BLOCK_N: tl.constexpr,  # keys per tile
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # power of two >= D
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens per block)
    HAS_WINDOW: tl.constexpr,  # apply the sliding window
    SPLIT: tl.constexpr,  # write partials (m, l, acc) for `combine_splits` instead of the output
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs (no tf32) and the interpreter, None (default) for 16 bit
    DOT_FP32: tl.constexpr,  # upcast dot operands to fp32 (the CPU interpreter's 16-bit dot is wrong)
    WIDEN_F16: tl.constexpr,  # an fp8 cache: widen K/V (and q, P) to fp16 (one cvt per pair) instead of q's dtype
    QK_FP8: tl.constexpr,  # an fp8 cache: K stays e4m3, q is rounded to e4m3 per row (QK^T on FP8 tensor cores)
    V_T: tl.constexpr,  # v_cache holds each block's keys innermost: read in whole blocks (BLOCK_N % BLOCK_SIZE == 0)
    COMPACT: tl.constexpr,  # axis 0 enumerates the batch's query tiles (num_m_tiles of them at most), axis 2 is 1
    BLOCK_B: tl.constexpr,  # COMPACT: power of two > num_seqs
    PREFETCH: tl.constexpr,  # load the next key tile's block-table entries one iteration ahead
):
    pid0 = tl.program_id(0)
    pid_h = tl.program_id(1)
    kvh = pid_h // HEAD_CHUNKS
    chunk = pid_h % HEAD_CHUNKS
    split = pid0 % num_splits
    slot = num_m_tiles - 1 - pid0 // num_splits  # the longest (last) tiles start first
    if COMPACT:
        # tile `slot` of the batch, counted over each sequence's cdiv(new tokens, BLOCK_Q) tiles in order: a
        # captured graph's padded sequences (no new tokens) have none, so they launch no program at all
        i = tl.arange(0, BLOCK_B)
        lo = tl.load(qsl_ptr + i, mask=i < num_seqs, other=0)
        hi = tl.load(qsl_ptr + i + 1, mask=i < num_seqs, other=0)
        tiles = tl.cdiv(hi - lo, BLOCK_Q)  # [BLOCK_B], 0 past the batch
        upto = tl.cumsum(tiles, 0)  # tiles of sequences 0..i
        b = tl.sum((upto <= slot).to(tl.int32), 0)  # the first sequence whose tiles reach past `slot`
        if b >= num_seqs:
            return
        m_tile = slot - tl.sum(tl.where(i == b, upto - tiles, 0), 0)
    else:
        b = tl.program_id(2)
        m_tile = slot

    q_start = tl.load(qsl_ptr + b)
    n_new = tl.load(qsl_ptr + b + 1) - q_start
    ctx = tl.load(seq_lens_ptr + b)
    prefix = ctx - n_new  # cached tokens before the new ones
    if m_tile * BLOCK_Q >= n_new:
        return

    # rows r of the tile: token m_tile * BLOCK_Q + r // G_PACK, head kvh * GROUP + chunk * G_PACK + r % G_PACK
    r = tl.arange(0, BLOCK_M)
    tok = m_tile * BLOCK_Q + r // G_PACK  # [BLOCK_M] index among the sequence's new tokens
    g = chunk * G_PACK + r % G_PACK  # [BLOCK_M] head within the group
    row_ok = (r < BLOCK_Q * G_PACK) & (tok < n_new) & (g < GROUP)
    qpos = prefix + tok  # [BLOCK_M] absolute position of each row's query
    qh = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    row_t = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + row_t[:, None] * stride_qt + qh[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & dmask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if QK_FP8:  # pre-scaled, then one scale per row maps its largest |q| to e4m3's 448 (the scores get it back)
        qf = q.to(tl.float32) * qk_scale
        amax = tl.max(tl.abs(qf), 1)
        q_sc = tl.where(amax > 0.0, amax / 448.0, 1.0)  # [BLOCK_M]
        if DOT_FP32:  # the interpreter: rounded as the GPU's cvt rounds (its own cast is off), the dot reads fp32
            q = _round_e4m3(qf / q_sc[:, None], False)
        else:
            q = (qf / q_sc[:, None]).to(k_cache_ptr.dtype.element_ty)
    elif WIDEN_F16:  # pre-scaled (far from fp16's range limit; clamped to it), so the scores need no scaling
        q = tl.minimum(tl.maximum(q.to(tl.float32) * qk_scale, -65504.0), 65504.0).to(tl.float16)
    if DOT_FP32:
        q = q.to(tl.float32)

    q_lo = prefix + m_tile * BLOCK_Q  # smallest query position in the tile
    q_hi = prefix + tl.minimum((m_tile + 1) * BLOCK_Q, n_new) - 1  # largest
    k_end = q_hi + 1  # causal: no key past the last query
    k_begin = 0
    if HAS_WINDOW:
        k_begin = tl.maximum(q_lo - window + 1, 0)
        k_begin = (k_begin // BLOCK_N) * BLOCK_N  # tiles fully outside every row's window are skipped
    k_stop = k_end
    if SPLIT:
        # this split's whole key tiles of the tile's range, spread evenly (sizes differ by at most one tile)
        n_tiles = tl.cdiv(k_end - k_begin, BLOCK_N)
        t_lo = split * n_tiles // num_splits
        t_hi = (split + 1) * n_tiles // num_splits
        k_stop = tl.minimum(k_begin + t_hi * BLOCK_N, k_end)
        k_begin = k_begin + t_lo * BLOCK_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows give p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kv_head_off = kvh.to(tl.int64) * stride_ch
    v_head_off = kvh.to(tl.int64) * stride_vch
    if PREFETCH:  # a tile's K/V addresses then hang on no load of its own iteration: Triton 3.6 gives its K and V
        # two shared buffers at 3 stages (one without), so the next tile's copy runs under this tile's math
        blk_next = _tile_block_ids(bt_row, k_begin, k_end, BLOCK_N, BLOCK_SIZE, V_T)
    for start in range(k_begin, k_stop, BLOCK_N):  # start: a multiple of BLOCK_N
        kpos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        k_ok = kpos < k_end
        blk_in = k_ok
        if V_T:  # every key of a block in range gets the block's id: V's runs are whole blocks (the hints below)
            blk_in = tl.max_constancy(kpos - kpos % BLOCK_SIZE < k_end, BLOCK_SIZE)
        if PREFETCH:
            blk = blk_next.to(tl.int64)
            blk_next = _tile_block_ids(bt_row, start + BLOCK_N, k_end, BLOCK_N, BLOCK_SIZE, V_T)
        else:
            blk = _tile_block_ids(bt_row, start, k_end, BLOCK_N, BLOCK_SIZE, V_T).to(tl.int64)
        c_off = blk * stride_cb + (kpos % BLOCK_SIZE).to(tl.int64) * stride_cs + kv_head_off  # [BLOCK_N]
        kv_mask = k_ok[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + c_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if not QK_FP8:  # an fp8 cache widens exactly to q's dtype (else a no-op), or to fp16 (exact too)
            k = k.to(tl.float16) if WIDEN_F16 else k.to(q_ptr.dtype.element_ty)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        if QK_FP8:
            s = s * q_sc[:, None]
        elif not WIDEN_F16:
            s = s * qk_scale
        # only tiles on the causal diagonal or the window's edge need the per-element mask
        need_mask = start + BLOCK_N - 1 > q_lo
        if HAS_WINDOW:
            need_mask = need_mask | (start < q_hi - window + 1)
        if need_mask:
            allowed = kpos[None, :] <= qpos[:, None]
            if HAS_WINDOW:
                allowed = allowed & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_T:  # V^T [BLOCK_D, BLOCK_N] in whole blocks: each block's BLOCK_SIZE keys of a dim are one aligned
            # run (the hints let the load take 16 bytes at a time; a 3D [blocks, D, keys] load permuted into
            # [keys, D] cost the wgmma path 64 2-byte shared stores a thread a tile, Triton 3.9's sm90 SASS).
            # Slots past k_end hold finite values (kernels/kv_layout.py) and get p = 0 on the causal diagonal
            vk = blk * stride_vcb + v_head_off + (kpos % BLOCK_SIZE).to(tl.int64)  # [BLOCK_N]
            vk = tl.max_contiguous(tl.multiple_of(vk, BLOCK_SIZE), BLOCK_SIZE)
            vt = tl.load(v_cache_ptr + (d * BLOCK_SIZE)[:, None] + vk[None, :],
                         mask=dmask[:, None] & blk_in[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
            v = tl.trans(vt)
        else:
            v = tl.load(v_cache_ptr + c_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = v.to(tl.float16) if WIDEN_F16 else v.to(q_ptr.dtype.element_ty)
        if DOT_FP32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SPLIT:
        # a split with no key a row may see (empty range, or all masked) keeps m = -1e30, l = 0
        part = (row_t * num_q_heads + qh) * num_splits + split  # [BLOCK_M]
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=(row_ok & (l_i > 0.0))[:, None] & dmask[None, :])
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + row_t[:, None] * stride_ot + qh[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dmask[None, :],
        )


@lazy_jit(do_not_specialize=("num_rows", "num_splits"))
def _combine_splits_kernel(
    m_ptr,  # partial row max: [R, num_splits] fp32 (exp2 domain), -1e30 where a split saw no key
    l_ptr,  # partial row sum: [R, num_splits] fp32
    acc_ptr,  # partial unnormalised output: [R, num_splits, D] fp32, read only where l > 0
    out_ptr,  # out: [R, D], contiguous
    num_rows,  # R
    num_splits,  # partitions to combine
    ROWS: tl.constexpr,  # output rows per program
    BLOCK_S: tl.constexpr,  # splits read at once (ROWS x BLOCK_S x BLOCK_D values in flight)
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # power of two >= D
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (token or sequence) * Hq + head
    rmask = rows < num_rows
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    sb = tl.arange(0, BLOCK_S)
    # one pass, rescaled online: m, l and acc of a chunk of splits load together (one round trip
    # when num_splits <= BLOCK_S); an empty split's acc is unwritten, so it is read and discarded
    m_run = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    total = tl.zeros([ROWS], dtype=tl.float32)
    o = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + sb
        part = rows[:, None] * num_splits + s[None, :]  # [ROWS, BLOCK_S]
        ok = rmask[:, None] & (s < num_splits)[None, :]
        m = tl.load(m_ptr + part, mask=ok, other=-1.0e30)
        lsum = tl.load(l_ptr + part, mask=ok, other=0.0)
        acc = tl.load(acc_ptr + part[:, :, None] * HEAD_DIM + d[None, None, :],
                      mask=ok[:, :, None] & dmask[None, None, :], other=0.0)  # [ROWS, BLOCK_S, BLOCK_D]
        live = ok & (lsum > 0.0)
        m_new = tl.maximum(m_run, tl.max(m, 1))
        alpha = tl.math.exp2(m_run - m_new)
        w = tl.where(live, tl.math.exp2(m - m_new[:, None]), 0.0)
        total = total * alpha + tl.sum(w * lsum, 1)
        o = o * alpha[:, None] + tl.sum(w[:, :, None] * tl.where(live[:, :, None], acc, 0.0), 1)
        m_run = m_new
    o = o / tl.where(total > 0.0, total, 1.0)[:, None]  # a row that saw no key (seq_len 0, padding) gives zeros
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


# rows per combine program: one row per program while that still fills the GPU several times over
COMBINE_ROWS = (1, 4, 16)


def combine_rows_per_program(rows: int) -> int:
    return 1 if rows <= 2048 else 4 if rows <= 16384 else 16


def split_partials(rows: int, num_splits: int, d: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Uninitialised partials (m, l, acc) for `rows` output rows: [rows, S], [rows, S], [rows, S, D] fp32."""
    m = torch.empty((rows, num_splits), dtype=torch.float32, device=device)
    lsum = torch.empty((rows, num_splits), dtype=torch.float32, device=device)
    acc = torch.empty((rows, num_splits, d), dtype=torch.float32, device=device)
    return m, lsum, acc


def combine_splits(m: torch.Tensor, lsum: torch.Tensor, acc: torch.Tensor, out: torch.Tensor, fast: bool,
                   rows_per_program: int | None = None) -> None:
    """out[r] = sum_s 2^(m[r,s] - M) acc[r,s] / sum_s 2^(m[r,s] - M) l[r,s] (flash-decoding's combine).

    m, lsum: [R, S]; acc: [R, S, D] fp32, contiguous (split_partials); out: contiguous, R * D
    elements. Used by the split prefill and by decode. fast: see LazyKernel.launch.
    (Measured and removed: this launch quantizing an FP8 o_proj's input as well, one program a token for
    the token's scale over all its heads, one launch a layer fewer. In the engine on an H100 it was slower
    where it ran: decode b8 4.36 against 4.18 ms, TTFT 2048 cached + 128 6.21 against 6.00, the rest within
    noise; 8 to 128 programs a launch each combining 32 heads wait on their loads one after another,
    bench/results/2026-12-07-session21-engine-foq-h100-06a8890.md. And the combine moved into the split launch
    itself, for decode and the prefill alike: each split program took a ticket once its partials were stored and the
    last to arrive combined them in split order, the split-K GEMV's arrival counters (d686aa7, a65fb30). Right on the
    GPU (its tests passed) but no faster in the engine on an H100, one process: decode b1 3.54 -> 3.77 ms (the last
    program walks the 64 splits of a long max_model_len one after another, where this launch spreads them over
    programs), b8 4.02 -> 4.02, b64 4.93 -> 4.89, TTFT 2048 cached + 128 6.00 -> 5.99, 512 8.55 -> 8.49;
    bench/results/2026-12-08-session28.md.)
    """
    rows, splits, d = acc.shape
    per = rows_per_program or combine_rows_per_program(rows)
    _combine_splits_kernel.launch(
        (cdiv(rows, per),), (m, lsum, acc, out, rows, splits),
        {"ROWS": per, "BLOCK_S": 32 // per, "HEAD_DIM": d, "BLOCK_D": next_pow2(d)}, 4, 1, fast,
    )


def warm_up_combine(d: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile the combine kernel for every rows-per-program choice (the split count is a runtime int)."""
    m, lsum, acc = split_partials(2, 3, d, device)
    m.fill_(0.0)
    lsum.fill_(1.0)
    acc.fill_(0.0)
    out = torch.empty((2, d), dtype=dtype, device=device)
    for per in COMBINE_ROWS:
        combine_splits(m, lsum, acc, out, True, per)


def check_paged_inputs(
    name: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, int, int, int]:
    """Shared launcher checks of the attention ops; returns (Hq, Hk, D, block_size)."""
    check(q.dim() == 3, "{}: q must be [T, Hq, D], got {}", name, tuple(q.shape))
    _, hq, d = q.shape
    check(k_cache.dim() == 4, "{}: k_cache must be [num_blocks, block_size, Hk, D], got {}", name, tuple(k_cache.shape))
    _, bs, hk, dk = k_cache.shape
    check(dk == d, "{}: head_dim of q ({}) != cache ({})", name, d, dk)
    check(hq % hk == 0, "{}: Hq={} is not a multiple of Hk={}", name, hq, hk)
    check_v_layout(name, k_cache, v_cache)
    check(q.stride(2) == 1 and k_cache.stride(3) == 1, "{}: q and the caches need a contiguous last dim", name)
    check(k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn),
          "{}: the caches must both be q's dtype or float8_e4m3fn: q {}, k_cache {}, v_cache {}",
          name, q.dtype, k_cache.dtype, v_cache.dtype)
    check(q.dtype in (torch.float16, torch.bfloat16, torch.float32), "{}: unsupported dtype {}", name, q.dtype)
    check(block_tables.dim() == 2 and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1,
          "{}: block_tables must be [B, max_blocks] int32 with a contiguous last dim", name)
    devs = {q.device, k_cache.device, v_cache.device, block_tables.device}
    check(len(devs) == 1, "{}: tensors on several devices {}", name, devs)
    check(d <= 256, "{}: head_dim {} > 256 is not supported", name, d)
    return hq, hk, d, bs


def prefill_splits(work_programs: int, sms: int, key_tiles: int) -> int:
    """Key-range splits for a prefill grid of `work_programs` programs that do work (shapes only).

    One split (one launch, no partials) once the programs fill the SMs; otherwise as many splits
    as keep every program in one wave of two resident programs per SM (the small tiles' shared
    memory allows two), each split keeping at least 4 key tiles of the longest possible range
    (key_tiles), at most 16. One wave matters: 2048 cached + 128 new tokens, graph-replayed on an
    H200, ran 24.7 us with 4 splits (256 programs) against 30.3 us with 5 (320: a second wave)
    (bench/results/kernels-2026-11-30-session3.md).
    """
    if work_programs >= sms:
        return 1
    return max(1, min(2 * sms // work_programs, key_tiles // 4, 16))


# the compact grid's batch bound (the prefill graphs hold 16): each program finds its tile in a 32-wide vector
# of the sequences' tile counts (Triton 3.6's sm_90 build: 170 registers as without, where a 16- or 64-wide
# vector took 244 / 219)
COMPACT_MAX_SEQS = 31

# launch plans: static checks per (shapes but T, strides, dtypes, devices); tiles per dynamic shapes
_STATIC: dict = {}
_TILES: dict = {}


def default_widen(q_dtype: torch.dtype, fp8_cache: bool, on_gpu: bool) -> str:
    """What an fp8 cache's tiles are widened to before the dots: "fp16" for 16-bit q on a GPU, else "q".

    e4m3 widens to fp16 in one instruction per pair of values, to bf16 only through more: on the
    H200 (bench_kernels' prefill_graph_shape, graph-replayed, 4b075a9) widening to bf16 took 31.7 us
    against 24.6 with a bf16 cache at 2048 cached + 128 new tokens, 26.3 against 14.8 at 512 new.
    fp16 holds e4m3 exactly and p in [0, 1] with 3 more bits than bf16; q is pre-scaled by the
    softmax scale (as decode_attention's fp16 path does) and rounded to fp16's 11 bits (bf16 has 8)."""
    sixteen = q_dtype in (torch.bfloat16, torch.float16)
    return "fp16" if fp8_cache and sixteen and on_gpu else "q"


def _static_plan(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, sliding_window) -> tuple:
    """All argument checks (run once per key); returns (Hq, Hk, D, block_size, B, on_gpu, fp8 cache, v_t)."""
    hq, hk, d, bs = check_paged_inputs("paged_attention", q, k_cache, v_cache, block_tables)
    b = block_tables.shape[0]
    check(query_start_loc.shape == (b + 1,) and query_start_loc.dtype == torch.int32,
          "paged_attention: query_start_loc must be [{}] int32", b + 1)
    check(seq_lens.shape == (b,) and seq_lens.dtype == torch.int32, "paged_attention: seq_lens must be [{}] int32", b)
    check(query_start_loc.is_contiguous() and seq_lens.is_contiguous(),
          "paged_attention: query_start_loc and seq_lens must be contiguous")
    check(query_start_loc.device == q.device and seq_lens.device == q.device,
          "paged_attention: metadata on another device than q")
    check(sliding_window is None or sliding_window >= 1, "paged_attention: bad sliding_window {}", sliding_window)
    return hq, hk, d, bs, b, q.device.type == "cuda", k_cache.dtype == torch.float8_e4m3fn, v_keys_inner(v_cache)


# 16-bit tiles on the GPU (block_m, block_n, num_warps, num_stages): large grids, and grids too
# small to fill the chip with the large tiles (see _tile_plan)
GPU_TILES_LARGE = (128, 128, 8, 3)
GPU_TILES_SMALL = (64, 64, 4, 2)


def _tile_plan(static: tuple, dtype: torch.dtype, t: int, max_q: int, ctx_bound: int, has_window: bool,
               sms: int, over: tuple) -> tuple:
    """(grid, consts, num_warps, num_stages, num_splits, num_m_tiles) of one launch."""
    hq, hk, d, bs, b, on_gpu, fp8_cache, v_t = static
    block_m, block_n, num_warps, num_stages, num_splits, widen, compact, prefetch = over
    check(widen in (None, "q", "fp16", "k8"), "paged_attention: widen must be 'q', 'fp16' or 'k8', not {!r}", widen)
    if widen is None:
        widen = default_widen(dtype, fp8_cache, on_gpu)
    group = hq // hk
    # Tiles from the H200 sweeps (bf16, Hq=32, Hk=8, D=128; bench/results/kernels-2026-11-30.md):
    # M128 N128 w8 s3 ran 8192 / 32768 causal tokens at 390 / 414 TFLOP/s against 324 / 360 for
    # M128 N64 w8 s3. With too few programs to fill the chip, M64 N64 w4 s2 (two programs fit on
    # an SM): at the prefill graph's shapes it ran 2048 cached + 128 new in 24.7 us (4 splits)
    # against 28.6 for M64 N128 w4 s2 (its best, 2 splits), and 512 new in 14.9 us against 23.2.
    if dtype == torch.float32:
        bm, bn, warps, stages = 64, 32, 4, 2
    elif on_gpu:
        bm, bn, warps, stages = GPU_TILES_LARGE
    else:
        bm, bn, warps, stages = 64, 64, 4, 2
    g_pack = min(group, 16)
    if block_m is None and on_gpu and bm == 128:
        # fewer, fatter programs only when there are enough of them to fill the chip; counted as
        # the split rule below counts them (a captured graph's padded sequences have no tiles)
        bq = bm // g_pack
        progs = min(cdiv(max_q, bq) * b, cdiv(t, bq)) * hk * cdiv(group, g_pack)
        if progs < 2 * sms:
            bm, bn, warps, stages = GPU_TILES_SMALL
    bm = block_m or bm
    bn = block_n or (max(bn, bs) if v_t else bn)
    check(not v_t or bn % bs == 0, "paged_attention: a V cache with its keys innermost reads whole blocks: "
          "block_n {} must be a multiple of the block size {}", bn, bs)
    warps = num_warps or warps
    stages = num_stages or stages
    if prefetch:  # the K/V tiles get a second shared buffer only from 3 stages (Triton 3.6)
        stages = max(stages, 3)
    check(bm >= 16 and bm & (bm - 1) == 0 and bn >= 16 and bn & (bn - 1) == 0,
          "paged_attention: block_m and block_n must be powers of two >= 16")
    g_pack = min(g_pack, bm)
    block_q = bm // g_pack
    head_chunks = cdiv(group, g_pack)
    num_m_tiles = cdiv(max_q, block_q)
    if num_splits is None:
        # programs that can do work, either grid: at least the T tokens' tiles (padded sequences of a
        # captured graph have none, so B x tiles would overstate them)
        work = min(num_m_tiles * b, cdiv(t, block_q)) * hk * head_chunks
        num_splits = prefill_splits(work, sms, cdiv(ctx_bound, bn))
    compact = bool(compact) and b <= COMPACT_MAX_SEQS
    if compact:  # every tile the batch can hold (sum of cdiv(n_i, block_q) <= cdiv(t, block_q) + b - 1)
        num_m_tiles = min(num_m_tiles * b, cdiv(t, block_q) + b - 1)
    check(1 <= num_splits <= 256, "paged_attention: num_splits {} not in [1, 256]", num_splits)
    grid = (num_m_tiles * num_splits, hk * head_chunks, 1 if compact else b)
    consts = {
        "GROUP": group, "G_PACK": g_pack, "HEAD_CHUNKS": head_chunks, "BLOCK_Q": block_q,
        "BLOCK_M": bm, "BLOCK_N": bn, "HEAD_DIM": d, "BLOCK_D": next_pow2(d), "BLOCK_SIZE": bs,
        "HAS_WINDOW": has_window, "SPLIT": num_splits > 1,
        "PRECISION": "ieee" if dtype == torch.float32 or not on_gpu else None,
        "DOT_FP32": not on_gpu, "WIDEN_F16": fp8_cache and widen in ("fp16", "k8") and dtype != torch.float32,
        "QK_FP8": fp8_cache and widen == "k8" and dtype != torch.float32,
        "V_T": v_t, "COMPACT": compact, "BLOCK_B": COMPACT_MAX_SEQS + 1, "PREFETCH": bool(prefetch),
    }
    return grid, consts, warps, stages, num_splits, num_m_tiles


def plan_prefill_splits(q_dtype: torch.dtype, num_heads: int, k_cache: torch.Tensor, batch: int, num_tokens: int,
                        max_query_len: int, ctx_bound: int, sliding_window: int | None) -> int:
    """The key-range split count `paged_attention_triton` picks for these shapes (no launch).

    A caller that captures a launch in a CUDA graph for the worst-case context can ask what a
    step with the real, shorter context would pick, and replay an unsplit capture when it is 1.
    """
    _, bs, hk, d = k_cache.shape
    static = (num_heads, hk, d, bs, batch, k_cache.device.type == "cuda", k_cache.dtype == torch.float8_e4m3fn,
              False)  # the V layout changes no split count
    plan = _tile_plan(static, q_dtype, num_tokens, min(max_query_len, num_tokens), ctx_bound,
                      sliding_window is not None, num_sms(k_cache.device), (None,) * 8)
    return plan[4]


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    widen: str | None = None,
    compact: bool = True,
    prefetch: bool = False,
) -> torch.Tensor:
    """Triton `paged_attention_ref`: the whole varlen batch in one launch (two when split), no host sync.

    Grid (query tiles x splits, kv heads x head chunks, sequences); each program packs G_PACK q
    heads of one kv head's group times BLOCK_Q tokens into its M rows, so each K/V tile is loaded
    once for the group. max_query_len (a Python int, the longest new-token run in the batch) sizes
    the grid; without it T is the upper bound and tiles past a sequence's end exit at once.
    When the grid cannot fill the GPU, each tile's key range is split in `num_splits` parts
    (`prefill_splits`; from shapes only: T, max_query_len, B, heads, SM count and the context
    bound min(max_seq_len, block table width x block size)) whose partials a second launch
    combines. block_m / block_n / num_warps / num_stages / num_splits override the choice.
    widen: what an fp8 cache's tiles are widened to before the dots, "q" (q's dtype) or "fp16"
    (None: `default_widen`), or "k8": K stays e4m3 and q is rounded to e4m3 with one scale per row
    (query token and head), so QK^T runs on FP8 tensor cores; V is widened to fp16 (H100, 2048 cached +
    128 new tokens graph-replayed: 23.0 against 27.5 us; relative error from exact 0.026 against 0.001:
    bench/results/2026-12-06-session13-prefill-cached-variants-h100-13b18df.jsonl). Loading the next
    key tile's K and block ids a tile ahead in registers (Triton leaves these gathers synchronous) was
    no faster there: 28.0 us alone, 27.3 with k8, so it is not kept. Nor a register cap of 168 on the small tiles
    (Triton's 170 let two programs share an SM, 168 three, so six splits fit one wave): 27.0 against 27.5 us,
    the engine's cached + 128 6.04 against 5.99 ms on an H100 (bench/results/2026-12-06-session19.md).
    compact (the default; used for at most COMPACT_MAX_SEQS sequences, more keep the grid per sequence): axis 0
    enumerates the batch's query tiles, sequence after sequence, and axis 2 is 1, so sequences with no new tokens
    (a captured graph's padding) launch no program: the prefill graph's 15 padding rows of 16 cost 2.25 us a
    layer at 2048 cached + 128 on the H200 (27.25 against 25.0 us with one row: 3840 programs that exit at once
    beside 256 that work). In the engine on an H100 (one process): TTFT 2048 cached + 128 6.68 -> 6.42 ms (the
    first figure above that card's 5.9-6.1 of earlier runs: part of the gain may be noise), TTFT 512 8.61 -> 8.36,
    TTFT 2048 and decode unchanged (bench/results/2026-12-07-session20-ab20-h100-16ef669.md).
    compact=False (FIRSTTOKEN_PREFILL_COMPACT=0) is the per-sequence grid: the A/B switch.
    prefetch (FIRSTTOKEN_PREFILL_PREFETCH=1; off by default, no faster in the engine: below): each key tile's
    block-table entries are loaded in the iteration before, as decode_attention_triton's prefetch does, and the
    launch takes at least 3 stages (fewer asked for are raised to 3). Compiled for sm90 by Triton 3.6, the K and V tiles then get two shared
    buffers instead of one, so the next tile's copy runs under this tile's math; without it, the copy waits for
    this tile to be read (bench/probe_attention_sm90.py): it is the fp8 tiles' widening through registers that
    leaves them one buffer (a 16-bit cache's get two without it). The same keys in the same order: the same output.
    In the engine on an H100 it was no faster: TTFT 2048 cached + 128 6.44 -> 6.34 ms with it second in the
    process, 6.45 against 6.38 without with it first (the engine timed second gains ~0.07 ms either way), TTFT 2048
    29.5 / 29.6 either way (bench/results/2026-12-08-session28.md); the kernel alone has not been timed.
    """
    # q: [T, Hq, D]; out: [T, Hq, D]; split partials: [T * Hq, S] and [T * Hq, S, D] fp32
    skey = (q.shape[1:], q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype,
            k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, block_tables.shape[:1],
            block_tables.stride()[1:], block_tables.dtype, block_tables.device, query_start_loc.shape,
            query_start_loc.stride(), query_start_loc.dtype, query_start_loc.device, seq_lens.shape,
            seq_lens.stride(), seq_lens.dtype, seq_lens.device, sliding_window)
    static = _STATIC.get(skey)
    if static is None:
        static = bounded_put(_STATIC, skey, _static_plan(q, k_cache, v_cache, block_tables, query_start_loc,
                                                         seq_lens, sliding_window))
    hq, _hk, d, bs, b, on_gpu = static[:6]
    t = q.shape[0]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    max_q = t if max_query_len is None else min(max_query_len, t)
    if t == 0 or b == 0 or max_q <= 0:
        return out
    ctx_bound = block_tables.shape[1] * bs
    if max_seq_len is not None:
        ctx_bound = min(ctx_bound, max_seq_len)
    over = (block_m, block_n, num_warps, num_stages, num_splits, widen, compact, prefetch)
    tkey = (skey, t, max_q, ctx_bound, over)
    plan = _TILES.get(tkey)
    if plan is None:
        plan = bounded_put(_TILES, tkey, _tile_plan(static, q.dtype, t, max_q, ctx_bound, sliding_window is not None,
                                                    num_sms(q.device), over))
    grid, consts, warps, stages, splits, num_m_tiles = plan
    if splits > 1:
        m, lsum, acc = split_partials(t * hq, splits, d, q.device)
        dst = (out, m, lsum, acc)
    else:
        dst = (out, out, out, out)
    _paged_attention_kernel.launch(grid, (
        q, k_cache, v_cache, *dst, block_tables, query_start_loc, seq_lens,
        scale * 1.4426950408889634,
        sliding_window or 0,
        num_m_tiles, splits, b, hq,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(2),
        block_tables.stride(0),
    ), consts, warps, stages, on_gpu)
    if splits > 1:
        combine_splits(m, lsum, acc, out, on_gpu)
    return out


def q_as_e4m3_ref(q: torch.Tensor, scale: float) -> torch.Tensor:
    """q as widen="k8" multiplies it into K (fp32, the scales undone): pre-scaled by scale * log2(e), one
    scale per (token, head) row taking its largest |value| to e4m3's 448, rounded to e4m3 (nearest even).
    `paged_attention_ref` over it is the k8 kernel's emulation."""
    qk_scale = scale * 1.4426950408889634
    qf = q.float() * qk_scale
    amax = qf.abs().amax(-1, keepdim=True)
    sc = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (qf / sc).to(torch.float8_e4m3fn).float() * sc / qk_scale


def keywords_from_env() -> dict:
    """The prefill attention's A/B switches, bound into every launch and the warm-up by kernels.ops:
    FIRSTTOKEN_PREFILL_WIDEN (q, fp16 or k8: `paged_attention_triton`'s widen), FIRSTTOKEN_PREFILL_COMPACT
    (0: the grid per sequence instead of the default compact one; 1: compact) and FIRSTTOKEN_PREFILL_PREFETCH
    (1: block ids a tile ahead; 0: not). Unset: the defaults. A bad value raises ValueError naming the variable."""
    out: dict = {}
    widen = os.environ.get("FIRSTTOKEN_PREFILL_WIDEN")
    if widen:
        check(widen in ("q", "fp16", "k8"), "FIRSTTOKEN_PREFILL_WIDEN must be q, fp16 or k8, not {!r}", widen)
        out["widen"] = widen
    for name, key in (("FIRSTTOKEN_PREFILL_COMPACT", "compact"), ("FIRSTTOKEN_PREFILL_PREFETCH", "prefetch")):
        value = os.environ.get(name)
        if value:
            check(value in ("0", "1"), "{} must be 0 or 1, not {!r}", name, value)
            out[key] = value == "1"
    return out


def warm_up_prefill(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, scale: float,
                    sliding_window: int | None, q_dtype: torch.dtype, widen: str | None = None,
                    compact: bool = True, prefetch: bool = False) -> None:
    """Compile every variant `paged_attention_triton` can pick on this GPU for these caches.

    A variant is a tile configuration times split-or-not times the grid (with compact, both: a batch of more
    than COMPACT_MAX_SEQS sequences keeps the grid per sequence); the runtime ints are not specialised
    on (see _triton), so serving never stops for a compile (about a second each on an H200).
    Reads block 0 of the caches; writes nothing there.
    """
    if k_cache.device.type != "cuda" or q_dtype == torch.float32:
        return
    dev = k_cache.device
    d = k_cache.shape[-1]
    t = 64
    q = torch.zeros((t, num_heads, d), dtype=q_dtype, device=dev)
    tables = torch.zeros((1, 4), dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, t], dtype=torch.int32, device=dev)
    lens = torch.tensor([t], dtype=torch.int32, device=dev)
    warm_up_combine(d, q_dtype, dev)
    for bm, bn, warps, stages in (GPU_TILES_LARGE, GPU_TILES_SMALL):
        for splits in (1, 2):
            for c in sorted({False, compact}):
                paged_attention_triton(q, k_cache, v_cache, tables, qsl, lens, scale, sliding_window, t,
                                       num_splits=splits, block_m=bm, block_n=bn, num_warps=warps,
                                       num_stages=stages, widen=widen, compact=c, prefetch=prefetch)
