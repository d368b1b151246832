"""Fused RoPE + paged KV-cache write against its reference."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import TOL

from kernels.kv_layout import heads_first, to_k_layout, to_v_layout, v_keys_inner
from kernels.rope_cache import rope_and_cache_ref, rope_and_cache_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def cos_sin_table(max_pos: int, d: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]  # [max_pos, D/2]
    return torch.cat((ang.cos(), ang.sin()), dim=1).contiguous()


def make_inputs(t: int, hq: int, hk: int, d: int, bs: int, dtype: torch.dtype):
    # q, k, v: strided views of one fused qkv output [T, (Hq + 2 Hk) * D]
    qkv = torch.randn(t, (hq + 2 * hk) * d).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    num_blocks = t // bs + 4
    positions = torch.randint(0, 4000, (t,), dtype=torch.int64)
    slots = torch.randperm(num_blocks * bs)[:t].to(torch.int64)  # distinct slots, random blocks and offsets
    k_cache = torch.full((num_blocks, bs, hk, d), float("nan"), dtype=dtype)
    return qkv, q, k, v, positions, slots, k_cache, torch.full_like(k_cache, float("nan"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "hq", "hk", "d"), [(1, 4, 1, 64), (6, 8, 2, 128), (42, 8, 8, 64), (123, 4, 1, 128)])
def test_rope_and_cache(dtype: torch.dtype, t: int, hq: int, hk: int, d: int) -> None:
    bs = 16
    _qkv, q, k, v, pos, slots, kc, vc = make_inputs(t, hq, hk, d, bs, dtype)
    cs = cos_sin_table(4096, d)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref, k_ref = rope_and_cache_ref(q0, k0, v0, pos, cs, kc_ref, vc_ref, slots)

    q_out, k_out = rope_and_cache_triton(q, k, v, pos, cs, kc, vc, slots)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # rotated in place
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(k, k_ref, **TOL[dtype])
    torch.testing.assert_close(v, v0, atol=0, rtol=0)  # v untouched
    # exactly the mapped slots were written (the rest is still NaN), with the right values
    written = torch.zeros(kc.shape[0] * bs, dtype=torch.bool)
    written[slots] = True
    flat_k, flat_v = kc.view(-1, hk, d), vc.view(-1, hk, d)
    assert flat_k[~written].isnan().all() and flat_v[~written].isnan().all()
    torch.testing.assert_close(flat_k[slots], kc_ref.view(-1, hk, d)[slots], **TOL[dtype])
    torch.testing.assert_close(flat_v[slots], v0, atol=0, rtol=0)


def test_rope_and_cache_catches_slot_off_by_one() -> None:
    # negative check: the comparison above fails for a cache written one slot off
    t, hq, hk, d, bs = 6, 4, 2, 64, 16
    _, q, k, v, pos, slots, kc, vc = make_inputs(t, hq, hk, d, bs, torch.float32)
    cs = cos_sin_table(4096, d)
    kc_bad, vc_bad = kc.clone(), vc.clone()
    rope_and_cache_ref(q.clone(), k.clone(), v.clone(), pos, cs, kc_bad, vc_bad, (slots + 1) % (kc.shape[0] * bs))
    rope_and_cache_triton(q, k, v, pos, cs, kc, vc, slots)
    good = kc.view(-1, hk, d)[slots]
    bad = kc_bad.view(-1, hk, d)[slots]
    assert not torch.allclose(good, bad, equal_nan=False, **TOL[torch.float32])


def test_rope_and_cache_skips_negative_slots() -> None:
    t, hq, hk, d, bs = 5, 4, 2, 64, 16
    _, q, k, v, pos, slots, kc, vc = make_inputs(t, hq, hk, d, bs, torch.float32)
    slots[2] = -1
    rope_and_cache_triton(q, k, v, pos, cos_sin_table(4096, d), kc, vc, slots)
    assert (~kc.isnan()).sum() == (t - 1) * hk * d


def test_rope_and_cache_rejects_bad_cache() -> None:
    _, q, k, v, pos, slots, kc, vc = make_inputs(4, 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="k_cache"):
        rope_and_cache_triton(q, k, v, pos, cos_sin_table(64, 64), kc[..., :32], vc[..., :32], slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_fp8_cache(dtype: torch.dtype) -> None:
    """Writing into an fp8 (e4m3) cache. The CPU interpreter's fp8 rounding is wrong where a
    carry crosses a power of two (1.97 -> 1.0; the GPU converts in hardware, to nearest even), so
    the inputs here need no rounding: position 0 (no rotation) and k, v already fp8 values. Then
    the cache must hold them exactly, in the mapped slots only."""
    t, hq, hk, d, bs = 37, 8, 2, 64, 16
    _qkv, q, k, v, pos, slots, kc, vc = make_inputs(t, hq, hk, d, bs, dtype)
    k.copy_(k.to(torch.float8_e4m3fn).to(dtype))
    v.copy_(v.to(torch.float8_e4m3fn).to(dtype))
    pos.zero_()
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    cs = cos_sin_table(4096, d)
    kc_ref, vc_ref = kc8.clone(), vc8.clone()
    q_ref, _ = rope_and_cache_ref(q.clone(), k.clone(), v.clone(), pos, cs, kc_ref, vc_ref, slots)
    rope_and_cache_triton(q, k, v, pos, cs, kc8, vc8, slots)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    written = torch.zeros(kc8.shape[0] * bs, dtype=torch.bool)
    written[slots] = True
    for got, want, src in ((kc8, kc_ref, k), (vc8, vc_ref, v)):
        g = got.view(-1, hk, d).float()
        torch.testing.assert_close(g[slots], src.float(), atol=0, rtol=0)
        torch.testing.assert_close(g[slots], want.view(-1, hk, d)[slots].float(), atol=0, rtol=0)
        assert g[~written].isnan().all()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_rope_and_cache_v_keys_inner(cache_dtype: torch.dtype) -> None:
    """A V cache with each block's keys innermost (kernels/kv_layout.py): each token's v lands at its
    slot of the view (memory [blocks, Hk, D, block_size]), the other slots untouched; and v is stored
    finite, NaN as 0 and +-inf (or, fp8, beyond +-448) clamped, as the reference stores it: the
    attention kernels read whole blocks, stale slots with weight 0, and 0 * NaN would be NaN."""
    t, hq, hk, d, bs = 29, 4, 2, 64, 16
    _qkv, q, k, v, pos, slots, kc, vc = make_inputs(t, hq, hk, d, bs, torch.float32)
    pos.zero_()
    v.copy_(v.to(torch.float8_e4m3fn).float())  # exact in fp8 (the interpreter's fp8 rounding is off)
    v[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1000.0])
    kc, vc = kc.to(cache_dtype), to_v_layout(vc.to(cache_dtype), "keys_inner", stale=float("nan"))
    assert v_keys_inner(vc) and vc.float().isnan().all()
    cs = cos_sin_table(64, d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    rope_and_cache_ref(q.clone(), k.clone(), v.clone(), pos, cs, kc_ref, vc_ref, slots)
    rope_and_cache_triton(q, k, v, pos, cs, kc, vc, slots)
    got, want = vc.float().reshape(-1, hk, d), vc_ref.float().reshape(-1, hk, d)
    torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
    lim = torch.finfo(cache_dtype).max
    assert got[slots[0], 0, :4].tolist() == [0.0, lim, -lim, min(1000.0, lim)]
    assert torch.equal(got[slots[1:]], v[1:].to(cache_dtype).float())
    written = torch.zeros(got.shape[0], dtype=torch.bool)
    written[slots] = True
    assert got[~written].isnan().all() and not got[written].isnan().any()


@pytest.mark.parametrize("v_layout", ["rows", "keys_inner"])
def test_rope_and_cache_k_heads_first(v_layout: str) -> None:
    """K heads first in memory ([blocks, Hk, block_size, D]: one head's block one run; V in rows the same):
    each token's k lands at its slot of the view, as the reference writes it, the other slots untouched."""
    t, hq, hk, d, bs = 21, 4, 2, 32, 64
    _qkv, q, k, v, pos, slots, kc, vc = make_inputs(t, hq, hk, d, bs, torch.float32)
    kc = to_k_layout(kc, "hnd")
    vc = to_k_layout(vc, "hnd") if v_layout == "rows" else to_v_layout(vc, "keys_inner", stale=float("nan"))
    assert heads_first(kc) and kc.permute(0, 2, 1, 3).is_contiguous()
    cs = cos_sin_table(4096, d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref, _k = rope_and_cache_ref(q.clone(), k.clone(), v.clone(), pos, cs, kc_ref, vc_ref, slots)
    rope_and_cache_triton(q, k, v, pos, cs, kc, vc, slots)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    for got, want in ((kc, kc_ref), (vc, vc_ref)):
        torch.testing.assert_close(got.reshape(-1, hk, d), want.reshape(-1, hk, d), atol=1e-5, rtol=1e-5,
                                   equal_nan=True)
    g = kc.reshape(-1, hk, d)
    written = torch.zeros(g.shape[0], dtype=torch.bool)
    written[slots] = True
    assert g[~written].isnan().all() and not g[written].isnan().any()
