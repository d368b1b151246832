"""Rotary position embedding on q and k, fused with writing k and v into their paged-cache slots."""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import cdiv, check, lazy_helper, lazy_jit, next_pow2
from kernels.fp8_linear import FP8_MAX
from kernels.fp8_quant import _hw_cast, _round_e4m3, cast_outputs
from kernels.kv_layout import check_v_layout, finite_v_ref, v_max


def rope_and_cache_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (rotate-half / NeoX layout, as Hugging Face Llama), write k and v to the cache.

    q: [T, Hq, D]; k, v: [T, Hk, D] (may be strided views of a fused qkv output; last dim contiguous)
    positions: [T] int64; cos_sin: [max_pos, D] fp32 = cat(cos[:, :D/2], sin[:, :D/2])
    k_cache, v_cache: [num_blocks, block_size, Hk, D]; slot_mapping: [T] int64.
    Returns (q_rot, k_rot) as new contiguous tensors; the rotation is computed in fp32 and rounded
    to q.dtype. The Triton launcher rotates q and k in place and returns the same tensors.
    """
    half = q.shape[-1] // 2
    cs = cos_sin[positions]  # [T, D]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    q_rot, k_rot = rot(q), rot(k)
    bs = k_cache.shape[1]
    blk, off = slot_mapping // bs, slot_mapping % bs
    k_cache[blk, off] = k_rot.to(k_cache.dtype)
    v_cache[blk, off] = finite_v_ref(v, v_cache).to(v_cache.dtype)
    return q_rot, k_rot


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

tl: Any = None  # triton.language, bound at the first launch by kernels._triton.lazy_jit


@lazy_helper
def finite_v(v, V_MAX: tl.constexpr):
    """v as a V cache with its keys innermost stores it (`finite_v_ref`): NaN -> 0, clamped to +-V_MAX, fp32."""
    vf = v.to(tl.float32)
    return tl.where(vf == vf, tl.minimum(tl.maximum(vf, -V_MAX), V_MAX), 0.0)


@lazy_jit
def _rope_and_cache_kernel(
    q_ptr,  # q: [T, Hq, D], last dim contiguous; rotated in place
    k_ptr,  # k: [T, Hk, D], last dim contiguous; rotated in place
    v_ptr,  # v: [T, Hk, D], last dim contiguous
    pos_ptr,  # positions: [T] int64
    cs_ptr,  # cos_sin: [max_pos, D] fp32, contiguous = cat(cos[:, :D/2], sin[:, :D/2])
    kc_ptr,  # k_cache: [num_blocks, block_size, Hk, D], last dim contiguous
    vc_ptr,  # v_cache: k_cache's shape; k_cache's strides, or (V_T) each block's keys innermost
    slot_ptr,  # slot_mapping: [T] int64; a negative slot (padding) writes nothing
    y_ptr,  # CAST: [>= T, (Hq + 2 Hk) * D] e4m3, contiguous: the rotated q | k | v cast (rope_cache_cast's)
    scale_ptr,  # CAST: [1] fp32, V's scale taken by atomic min (rope_cache_cast's)
    stride_qt,  # q token stride (elements)
    stride_qh,  # q head stride
    stride_kt,  # k token stride
    stride_kh,  # k head stride
    stride_vt,  # v token stride
    stride_vh,  # v head stride
    stride_cb,  # cache block stride (k_cache and v_cache share strides)
    stride_cs,  # cache slot-in-block stride
    stride_ch,  # cache head stride
    stride_vcb,  # v_cache block stride (stride_cb unless V_T)
    stride_vch,  # v_cache head stride (stride_ch unless V_T)
    HQ: tl.constexpr,  # number of q heads
    HK: tl.constexpr,  # number of kv heads
    HALF: tl.constexpr,  # head_dim / 2
    BLOCK_HQ: tl.constexpr,  # power of two >= HQ
    BLOCK_HK: tl.constexpr,  # power of two >= HK
    BLOCK_HALF: tl.constexpr,  # power of two >= HALF
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens per block)
    V_T: tl.constexpr,  # v_cache [blocks, Hk, D, block_size] in memory; v written finite (kernels/kv_layout.py)
    V_MAX: tl.constexpr,  # V_T: the largest finite value of the cache's dtype (v is clamped to it, NaN -> 0)
    WRITE_QK: tl.constexpr,  # rotate q and k in place (rope_and_cache); else (CAST) leave them
    CAST: tl.constexpr,  # write y and V's scale too (rope_cache_cast_triton with tile 0)
    FP8_MAX_: tl.constexpr,
    MARGIN: tl.constexpr,
    HW_CAST: tl.constexpr,  # CAST: the store's cast to e4m3 rounds (a GPU), else _round_e4m3 does
):
    # one program rotates every head of one token and writes its k/v slot
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    cos = tl.load(cs_ptr + pos * (2 * HALF) + d, mask=dmask, other=0.0)[None, :]  # [1, BLOCK_HALF]
    sin = tl.load(cs_ptr + pos * (2 * HALF) + HALF + d, mask=dmask, other=0.0)[None, :]

    # q: [BLOCK_HQ, HALF] x 2 halves
    hq = tl.arange(0, BLOCK_HQ)
    qm = (hq < HQ)[:, None] & dmask[None, :]
    qp = q_ptr + t * stride_qt + hq[:, None] * stride_qh + d[None, :]
    r1, r2 = _rotated(qp, qm, cos, sin, HALF)
    if WRITE_QK:
        _store_pair(qp, r1, r2, qm, HALF)
    C: tl.constexpr = (HQ + 2 * HK) * 2 * HALF
    y_row = y_ptr + t * C + d[None, :]
    if CAST:
        _store_cast_pair(y_row + hq[:, None] * (2 * HALF), r1, r2, qm, HALF, FP8_MAX_, HW_CAST)

    # k: [BLOCK_HK, HALF] x 2 halves, rotated (in place: WRITE_QK) and written with v to the cache slot
    hk = tl.arange(0, BLOCK_HK)
    km = (hk < HK)[:, None] & dmask[None, :]
    kp = k_ptr + t * stride_kt + hk[:, None] * stride_kh + d[None, :]
    k1r, k2r = _rotated(kp, km, cos, sin, HALF)
    if WRITE_QK:
        _store_pair(kp, k1r, k2r, km, HALF)
    if CAST:
        _store_cast_pair(y_row + (HQ + hk[:, None]) * (2 * HALF), k1r, k2r, km, HALF, FP8_MAX_, HW_CAST)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    cm = km & ((hk * 0 + slot) >= 0)[:, None]  # as a block: the interpreter rejects a scalar mask term
    c_off = blk * stride_cb + off * stride_cs + hk[:, None] * stride_ch + d[None, :]
    _store_pair(kc_ptr + c_off, k1r, k2r, cm, HALF)
    vp = v_ptr + t * stride_vt + hk[:, None] * stride_vh + d[None, :]
    v1 = tl.load(vp, mask=km, other=0.0)
    v2 = tl.load(vp + HALF, mask=km, other=0.0)
    if V_T:
        v_off = blk * stride_vcb + hk[:, None] * stride_vch + d[None, :] * BLOCK_SIZE + off
        _store_pair(vc_ptr + v_off, finite_v(v1, V_MAX), finite_v(v2, V_MAX), cm, HALF * BLOCK_SIZE)
    else:
        _store_pair(vc_ptr + c_off, v1, v2, cm, HALF)
    if CAST:
        _cast_v(y_row + (HQ + HK + hk[:, None]) * (2 * HALF), scale_ptr, v1, v2, km, HALF, FP8_MAX_, MARGIN, HW_CAST)


@lazy_jit(do_not_specialize=("T",))
def _rope_cache_tiles_kernel(
    q_ptr,  # q: [T, Hq, D], last dim contiguous; rotated in place (WRITE_QK)
    k_ptr,  # k: [T, Hk, D], last dim contiguous; rotated in place (WRITE_QK)
    v_ptr,  # v: [T, Hk, D], last dim contiguous
    pos_ptr,  # positions: [T] int64
    cs_ptr,  # cos_sin: [max_pos, D] fp32, contiguous
    kc_ptr,  # k_cache: [num_blocks, block_size, Hk, D] (any block, slot and head strides), last dim contiguous
    vc_ptr,  # v_cache: k_cache's strides, or (V_T) each block's keys innermost
    slot_ptr,  # slot_mapping: [T] int64; a negative slot (padding) writes nothing
    y_ptr,  # [>= T, (Hq + 2 Hk) * D] e4m3, contiguous: the rotated q | k | v cast (scale 1, saturating)
    scale_ptr,  # [1] fp32, min over V's cast values of FP8_MAX_ / (MARGIN * |v|) (cast_e4m3's), atomically
    T,  # tokens
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,  # q/k/v token and head strides
    stride_cb, stride_cs, stride_ch,  # k_cache block, slot and head strides (v_cache's too unless V_T)
    stride_vcb, stride_vch,  # v_cache block and head strides
    HQ: tl.constexpr,
    HK: tl.constexpr,
    HALF: tl.constexpr,  # head_dim / 2
    BLOCK_HALF: tl.constexpr,  # power of two >= HALF
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    V_T: tl.constexpr,  # v_cache [blocks, Hk, D, block_size] in memory; v written finite
    V_MAX: tl.constexpr,  # V_T: the largest finite value of the cache's dtype
    TOK: tl.constexpr,  # tokens per program (a power of two)
    QG: tl.constexpr,  # q heads per program
    WRITE_QK: tl.constexpr,  # rotate q and k in place
    FP8_MAX_: tl.constexpr,
    MARGIN: tl.constexpr,
    HW_CAST: tl.constexpr,  # the store's cast to e4m3 rounds (a GPU), else _round_e4m3 does
):
    # rope_cache_cast in tiles. grid: (token tiles, q head groups + kv heads). A program rotates QG q heads, or one kv head's k and
    # writes it and v to the cache, for TOK consecutive tokens as [TOK, HALF] tiles. With V's keys
    # innermost a block's slots of one (head, dim) are consecutive bytes: V goes out as [HALF, TOK] tiles,
    # the lanes along the tokens, so that a prompt's consecutive slots are one row's consecutive bytes
    # (the per-token kernel writes each byte of a token's V into its own 64-byte row)
    t = tl.program_id(0).to(tl.int64) * TOK + tl.arange(0, TOK)
    unit = tl.program_id(1)
    NQG: tl.constexpr = (HQ + QG - 1) // QG
    C: tl.constexpr = (HQ + 2 * HK) * 2 * HALF
    tm = t < T
    d = tl.arange(0, BLOCK_HALF)
    dm = d < HALF
    m2 = tm[:, None] & dm[None, :]
    pos = tl.load(pos_ptr + t, mask=tm, other=0).to(tl.int64)
    cs = cs_ptr + pos[:, None] * (2 * HALF) + d[None, :]
    cos = tl.load(cs, mask=m2, other=0.0)
    sin = tl.load(cs + HALF, mask=m2, other=0.0)
    yrow = y_ptr + t[:, None] * C + d[None, :]
    if unit < NQG:
        for i in range(QG):
            h = unit * QG + i
            mq = m2 & ((d * 0 + h) < HQ)[None, :]  # as a block: the interpreter rejects a scalar mask term
            qp = q_ptr + t[:, None] * stride_qt + h * stride_qh + d[None, :]
            r1, r2 = _rotated(qp, mq, cos, sin, HALF)
            if WRITE_QK:
                _store_pair(qp, r1, r2, mq, HALF)
            _store_cast_pair(yrow + h * 2 * HALF, r1, r2, mq, HALF, FP8_MAX_, HW_CAST)
    else:
        h = unit - NQG
        slot = tl.load(slot_ptr + t, mask=tm, other=-1).to(tl.int64)
        sm = tm & (slot >= 0)
        blk = tl.where(sm, slot // BLOCK_SIZE, 0)
        off = tl.where(sm, slot % BLOCK_SIZE, 0)
        cm = sm[:, None] & dm[None, :]
        kp = k_ptr + t[:, None] * stride_kt + h * stride_kh + d[None, :]
        k1r, k2r = _rotated(kp, m2, cos, sin, HALF)
        if WRITE_QK:
            _store_pair(kp, k1r, k2r, m2, HALF)
        c_off = blk[:, None] * stride_cb + off[:, None] * stride_cs + h * stride_ch + d[None, :]
        _store_pair(kc_ptr + c_off, k1r, k2r, cm, HALF)
        _store_cast_pair(yrow + (HQ + h) * 2 * HALF, k1r, k2r, m2, HALF, FP8_MAX_, HW_CAST)
        if V_T:  # [BLOCK_HALF, TOK] tiles
            mt = dm[:, None] & tm[None, :]
            vp = v_ptr + t[None, :] * stride_vt + h * stride_vh + d[:, None]
            v1 = tl.load(vp, mask=mt, other=0.0)
            v2 = tl.load(vp + HALF, mask=mt, other=0.0)
            v_off = blk[None, :] * stride_vcb + h * stride_vch + d[:, None] * BLOCK_SIZE + off[None, :]
            _store_pair(vc_ptr + v_off, finite_v(v1, V_MAX), finite_v(v2, V_MAX), dm[:, None] & sm[None, :],
                        HALF * BLOCK_SIZE)
            yv = y_ptr + t[None, :] * C + (HQ + HK + h) * 2 * HALF + d[:, None]
        else:
            mt = m2
            vp = v_ptr + t[:, None] * stride_vt + h * stride_vh + d[None, :]
            v1 = tl.load(vp, mask=mt, other=0.0)
            v2 = tl.load(vp + HALF, mask=mt, other=0.0)
            _store_pair(vc_ptr + c_off, v1, v2, cm, HALF)
            yv = yrow + (HQ + HK + h) * 2 * HALF
        _cast_v(yv, scale_ptr, v1, v2, mt, HALF, FP8_MAX_, MARGIN, HW_CAST)


@lazy_helper
def _rotated(p, mask, cos, sin, HALF: tl.constexpr):
    """The halves x1 at p and x2 at p + HALF rotated in fp32, rounded to their dtype: (x1 cos - x2 sin,
    x2 cos + x1 sin) (rotate-half, as rope_and_cache_ref)."""
    x1 = tl.load(p, mask=mask, other=0.0)
    x2 = tl.load(p + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    return (x1f * cos - x2f * sin).to(x1.dtype), (x2f * cos + x1f * sin).to(x1.dtype)


@lazy_helper
def _store_pair(p, x1, x2, mask, STEP: tl.constexpr):
    """x1 at p and x2 at p + STEP (a head's two halves), in p's dtype."""
    tl.store(p, x1.to(p.dtype.element_ty), mask=mask)
    tl.store(p + STEP, x2.to(p.dtype.element_ty), mask=mask)


@lazy_helper
def _store_cast_pair(p, x1, x2, mask, HALF: tl.constexpr, FP8_MAX_: tl.constexpr, HW_CAST: tl.constexpr):
    """A head's two halves into e4m3 rows at p, cast as cast_e4m3 casts (`_cast_sat`)."""
    _store_pair(p, _cast_sat(x1, FP8_MAX_, HW_CAST), _cast_sat(x2, FP8_MAX_, HW_CAST), mask, HALF)


@lazy_helper
def _cast_v(p, scale_ptr, v1, v2, mask, HALF: tl.constexpr, FP8_MAX_: tl.constexpr, MARGIN: tl.constexpr,
            HW_CAST: tl.constexpr):
    """v's two halves into the e4m3 rows at p (`_store_cast_pair`), and O's scale from them into scale_ptr
    (cast_e4m3's: FP8_MAX_ / (MARGIN * the largest finite |v|)). The scale only falls, so a program whose
    candidate is not under the value read skips the atomic (thousands of atomics on one address cost
    ~0.1 ms: cast_e4m3's note)."""
    v1c = _cast_sat(v1, FP8_MAX_, HW_CAST)
    v2c = _cast_sat(v2, FP8_MAX_, HW_CAST)
    _store_pair(p, v1c, v2c, mask, HALF)
    cand = FP8_MAX_ / (MARGIN * tl.maximum(tl.maximum(_finite_amax(v1c, mask), _finite_amax(v2c, mask)), 0.001953125))
    if cand < tl.load(scale_ptr):
        tl.atomic_min(scale_ptr, cand)


@lazy_helper
def _cast_sat(x, FP8_MAX_: tl.constexpr, HW_CAST: tl.constexpr):
    """x cast as kernels.fp8_quant.cast_e4m3 casts (scale 1, clamped to +-FP8_MAX_, NaN kept), fp32 on
    the e4m3 grid (or, HW_CAST, left for the store's cast to round)."""
    xf = x.to(tl.float32)
    return _round_e4m3(tl.minimum(tl.maximum(xf, -FP8_MAX_, propagate_nan=tl.PropagateNan.ALL), FP8_MAX_,
                                  propagate_nan=tl.PropagateNan.ALL), HW_CAST)


@lazy_helper
def _finite_amax(x, mask):
    """The largest |x| over the mask's non-NaN elements (0 for none), a scalar."""
    return tl.max(tl.max(tl.where(mask & (x == x), tl.abs(x), 0.0), axis=1), axis=0)


def _check_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Checks rope_and_cache's arguments (`rope_and_cache_ref`'s docstring); returns V's layout (`v_keys_inner`)."""
    # q: [T, Hq, D]; k, v: [T, Hk, D]; k_cache, v_cache: [num_blocks, block_size, Hk, D]
    check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "rope_and_cache: q, k, v must be [T, H, D]")
    t, _hq, d = q.shape
    hk = k.shape[1]
    check(k.shape == (t, hk, d) and v.shape == (t, hk, d),
          "rope_and_cache: k {} / v {} do not match q {}", tuple(k.shape), tuple(v.shape), tuple(q.shape))
    check(d % 2 == 0, "rope_and_cache: head_dim {} must be even", d)
    check(q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1,
          "rope_and_cache: q, k, v need a contiguous last dim")
    check(q.dtype == k.dtype == v.dtype, "rope_and_cache: dtypes differ: q {} k {} v {}", q.dtype, k.dtype, v.dtype)
    check(k_cache.dim() == 4 and k_cache.shape[2:] == (hk, d),
          "rope_and_cache: k_cache must be [num_blocks, block_size, {}, {}], got {}", hk, d, tuple(k_cache.shape))
    v_t = check_v_layout("rope_and_cache", k_cache, v_cache)
    check(k_cache.stride(3) == 1, "rope_and_cache: the cache's last dim must be contiguous")
    check(cos_sin.dim() == 2 and cos_sin.shape[1] == d and cos_sin.dtype == torch.float32 and cos_sin.is_contiguous(),
          "rope_and_cache: cos_sin must be contiguous fp32 [max_pos, {}]", d)
    check(positions.shape == (t,) and slot_mapping.shape == (t,),
          "rope_and_cache: positions and slot_mapping must be [T]")
    check(not positions.is_floating_point() and not slot_mapping.is_floating_point(),
          "rope_and_cache: positions and slot_mapping must be integer tensors")
    check(positions.is_contiguous() and slot_mapping.is_contiguous(),
          "rope_and_cache: positions and slot_mapping must be contiguous")
    devs = {x.device for x in (q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)}
    check(len(devs) == 1, "rope_and_cache: tensors on several devices {}", devs)
    return v_t


TILE_TOKENS = 32  # rope_cache_cast's tokens per program: a 32-byte sector of an fp8 keys-inner V row
Q_HEADS_PER_PROGRAM = 4


def _launch_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, v_t: bool, tile: int,
                  write_qk: bool, y: torch.Tensor, scale: torch.Tensor, margin: float) -> None:
    """`_rope_cache_tiles_kernel`: rope_cache_cast, `tile` tokens a program."""
    t, hq, d = q.shape
    hk = k.shape[1]
    check(tile > 0 and tile & (tile - 1) == 0, "rope_cache_cast: tile must be a power of two, not {}", tile)
    qg = min(Q_HEADS_PER_PROGRAM, hq)
    _rope_cache_tiles_kernel.launch((cdiv(t, tile), cdiv(hq, qg) + hk), (
        q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, y, scale, t,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(2),
    ), {
        "HQ": hq, "HK": hk, "HALF": d // 2, "BLOCK_HALF": next_pow2(d // 2), "BLOCK_SIZE": k_cache.shape[1],
        "V_T": v_t, "V_MAX": v_max(v_cache.dtype) if v_t else 0.0, "TOK": tile, "QG": qg,
        "WRITE_QK": write_qk, "FP8_MAX_": FP8_MAX, "MARGIN": float(margin), "HW_CAST": _hw_cast(q, None),
    }, 4, 1, q.device.type == "cuda")


def rope_and_cache_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `rope_and_cache_ref` in one launch: rotates q and k IN PLACE and returns them.

    Same arguments as the reference; q/k/v may be strided views of a fused qkv output (any token
    and head strides, last dim contiguous). A negative slot in slot_mapping (padding) writes nothing.
    One program a token, every head. Tried and dropped (session 26, an H100, bench/results/
    2026-12-07-session26-rope-kernels-h100-ea8f463.md): tokens in tiles, so that a keys-inner V's consecutive
    slots go out as runs of a row rather than a byte into each of Hk * D rows: slower at every prompt size
    (8192 tokens 0.184 ms against 0.148 with 32-token tiles; 32768 0.753 against 0.544), level on a decode
    step's scattered slots. The byte-wise stores were not what bounds it.
    """
    v_t = _check_args(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    if q.shape[0] == 0:
        return q, k
    _launch_tokens(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, v_t, True, None, None, 0.0)
    return q, k


def _launch_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, v_t: bool, write_qk: bool,
                   y: torch.Tensor | None, scale: torch.Tensor | None, margin: float) -> None:
    """`_rope_and_cache_kernel`, one program a token: rope_and_cache (y None), or rope_cache_cast's work."""
    t, hq, d = q.shape
    hk, half, cast = k.shape[1], d // 2, y is not None
    _rope_and_cache_kernel.launch((t,), (
        q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, y if cast else q, scale if cast else cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(2),
    ), {
        "HQ": hq, "HK": hk, "HALF": half,
        "BLOCK_HQ": next_pow2(hq), "BLOCK_HK": next_pow2(hk), "BLOCK_HALF": next_pow2(half),
        "BLOCK_SIZE": k_cache.shape[1], "V_T": v_t, "V_MAX": v_max(v_cache.dtype) if v_t else 0.0,
        "WRITE_QK": write_qk, "CAST": cast, "FP8_MAX_": FP8_MAX, "MARGIN": float(margin),
        "HW_CAST": _hw_cast(q, None) if cast else False,
    }, 4, 3, q.device.type == "cuda")


def rope_cache_cast_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_and_cache_ref`, then the rotated q | k | v cast as kernels.fp8_quant.cast_e4m3_ref casts them
    (V's columns giving the scale): (e4m3 [T, (Hq + 2 Hk) * D], scale [1] fp32). q and k are left as they are."""
    from kernels.fp8_quant import cast_e4m3_ref

    t, hq, d = q.shape
    q_rot, k_rot = rope_and_cache_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    rows = torch.cat([x.reshape(t, -1) for x in (q_rot, k_rot, v)], dim=1)
    return cast_e4m3_ref(rows, (hq + k.shape[1]) * d, margin)


def rope_cache_cast_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, margin: float, out: torch.Tensor | None = None,
                           scale: torch.Tensor | None = None, tile: int = TILE_TOKENS,
                           write_qk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `rope_cache_cast_ref` in one launch: q|k|v read once, the cache written, the e4m3 rows and
    V's scale out (for cuDNN's FP8 attention: kernels/cudnn_attention.py), in place of rope_and_cache's
    launch, then cast_e4m3's (which read the rotated q and k back). out: a [>= T, C] contiguous e4m3
    buffer for the first T rows; scale: a [1] fp32 tensor to take the minimum into, else a new one.
    write_qk: rotate q and k in place as well (rope_and_cache does). tile: tokens a program; 0, one program a
    token with every head (rope_and_cache's kernel: not yet timed on a GPU, `bench_rope_tiles.py` rows
    `rope_cache_cast 0`).

    On an H100 (session 26, bench/results/2026-12-07-session26-rope-kernels-h100-ea8f463.md), Llama-3.1-8B's
    heads, an fp8 keys-inner cache: 0.055 / 0.180 / 0.699 ms at 2048 / 8192 / 32768 tokens against 0.085 /
    0.213 / 0.776 for rope_and_cache then cast_e4m3, the same bits out (tests/workers/engine/test_gpu.py).
    It runs tiles of tokens (the layout tried for rope_and_cache alone), 3.1x its bytes' floor where the
    per-token rope_and_cache runs at 2.0-2.2x: tile=0, its per-token form, may beat it (gpu_run.sh rope_ab)."""
    v_t = _check_args(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    t, hq, d = q.shape
    y, scale = cast_outputs("rope_cache_cast", t, (hq + 2 * k.shape[1]) * d, margin, q.device, out, scale)
    if t and tile:
        _launch_tiles(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, v_t, tile, write_qk, y, scale,
                      margin)
    elif t:
        _launch_tokens(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, v_t, write_qk, y, scale, margin)
    return y, scale
