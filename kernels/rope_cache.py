"""Rotary position embedding on q and k, fused with writing k and v into their paged-cache slots."""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import check, lazy_helper, lazy_jit, next_pow2
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
    q1 = tl.load(qp, mask=qm, other=0.0)
    q2 = tl.load(qp + HALF, mask=qm, other=0.0)
    q1f = q1.to(tl.float32)
    q2f = q2.to(tl.float32)
    tl.store(qp, (q1f * cos - q2f * sin).to(q1.dtype), mask=qm)
    tl.store(qp + HALF, (q2f * cos + q1f * sin).to(q1.dtype), mask=qm)

    # k: [BLOCK_HK, HALF] x 2 halves, rotated in place and written with v to the cache slot
    hk = tl.arange(0, BLOCK_HK)
    km = (hk < HK)[:, None] & dmask[None, :]
    kp = k_ptr + t * stride_kt + hk[:, None] * stride_kh + d[None, :]
    k1 = tl.load(kp, mask=km, other=0.0)
    k2 = tl.load(kp + HALF, mask=km, other=0.0)
    k1f = k1.to(tl.float32)
    k2f = k2.to(tl.float32)
    k1r = (k1f * cos - k2f * sin).to(k1.dtype)
    k2r = (k2f * cos + k1f * sin).to(k1.dtype)
    tl.store(kp, k1r, mask=km)
    tl.store(kp + HALF, k2r, mask=km)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    cm = km & ((hk * 0 + slot) >= 0)[:, None]  # as a block: the interpreter rejects a scalar mask term
    c_off = blk * stride_cb + off * stride_cs + hk[:, None] * stride_ch + d[None, :]
    tl.store(kc_ptr + c_off, k1r.to(kc_ptr.dtype.element_ty), mask=cm)
    tl.store(kc_ptr + c_off + HALF, k2r.to(kc_ptr.dtype.element_ty), mask=cm)
    vp = v_ptr + t * stride_vt + hk[:, None] * stride_vh + d[None, :]
    v1 = tl.load(vp, mask=km, other=0.0)
    v2 = tl.load(vp + HALF, mask=km, other=0.0)
    if V_T:
        v_off = blk * stride_vcb + hk[:, None] * stride_vch + d[None, :] * BLOCK_SIZE + off
        tl.store(vc_ptr + v_off, finite_v(v1, V_MAX).to(vc_ptr.dtype.element_ty), mask=cm)
        tl.store(vc_ptr + v_off + HALF * BLOCK_SIZE, finite_v(v2, V_MAX).to(vc_ptr.dtype.element_ty), mask=cm)
    else:
        tl.store(vc_ptr + c_off, v1.to(vc_ptr.dtype.element_ty), mask=cm)
        tl.store(vc_ptr + c_off + HALF, v2.to(vc_ptr.dtype.element_ty), mask=cm)


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
    """
    # q: [T, Hq, D]; k, v: [T, Hk, D]; k_cache, v_cache: [num_blocks, block_size, Hk, D]
    check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "rope_and_cache: q, k, v must be [T, H, D]")
    t, hq, d = q.shape
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
    if t == 0:
        return q, k
    half = d // 2
    _rope_and_cache_kernel.launch((t,), (
        q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(2),
    ), {
        "HQ": hq, "HK": hk, "HALF": half,
        "BLOCK_HQ": next_pow2(hq), "BLOCK_HK": next_pow2(hk), "BLOCK_HALF": next_pow2(half),
        "BLOCK_SIZE": k_cache.shape[1], "V_T": v_t, "V_MAX": v_max(v_cache.dtype) if v_t else 0.0,
    }, 4, 3, q.device.type == "cuda")
    return q, k
