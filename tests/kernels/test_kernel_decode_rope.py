"""Decode attention with rope_and_cache fused in, against rope_and_cache then decode attention."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import TOL, make_paged_kv
from test_kernel_rope_cache import cos_sin_table

from kernels.decode_attention import decode_rope_attention_ref, decode_rope_attention_triton
from kernels.kv_layout import heads_first, to_k_layout, to_v_layout, v_keys_inner

F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn

# (context lens incl. the new token, Hq, Hk, D, window, num_splits)
CASES = [
    ([1, 17, 100], 8, 2, 64, None, None),
    ([33, 200], 8, 1, 128, 7, None),
    ([40, 123, 16], 4, 4, 64, None, 3),
    ([300], 8, 1, 128, 50, 5),
    ([1, 64, 65], 32, 4, 64, None, 1),
    ([30, 7], 4, 2, 96, None, 2),  # a head_dim that is not a power of two (masked columns, partners in range)
]


def make_step(ctx: list[int], hq: int, hk: int, d: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None,
              v_layout: str = "rows", k_layout: str = "nhd"):
    """Caches holding each sequence's first ctx - 1 tokens (the new token's slot poisoned with NaN),
    the V cache in `v_layout` and K (V in rows too) in `k_layout` (kernels/kv_layout.py), the step's q / k / v as views of one fused qkv
    output, positions and slots."""
    kc, vc, bt = make_paged_kv(ctx, hk, d, 16, dtype)
    b = len(ctx)
    slots = torch.tensor([int(bt[i, (c - 1) // 16]) * 16 + (c - 1) % 16 for i, c in enumerate(ctx)], dtype=torch.int64)
    blk, off = slots // 16, slots % 16
    kc[blk, off] = float("nan")
    vc[blk, off] = float("nan")
    if cache_dtype is not None:
        kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    vc = to_v_layout(vc, v_layout, stale=300.0)  # unwritten slots: finite (the layout needs it), large
    kc = to_k_layout(kc, k_layout)
    if v_layout == "rows":
        vc = to_k_layout(vc, k_layout)
    qkv = torch.randn(b, (hq + 2 * hk) * d).to(dtype)
    q = qkv[:, : hq * d].view(b, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(b, hk, d)
    v = qkv[:, (hq + hk) * d :].view(b, hk, d)
    positions = torch.tensor(ctx, dtype=torch.int64) - 1
    return q, k, v, positions, kc, vc, bt, torch.tensor(ctx, dtype=torch.int32), slots


def run_both(q, k, v, pos, kc, vc, bt, sl, slots, d, window, splits):
    cs = cos_sin_table(512, d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    want = decode_rope_attention_ref(q.clone(), k.clone(), v.clone(), pos, cs, kc_ref, vc_ref, slots, bt, sl,
                                     d**-0.5, window)
    got = decode_rope_attention_triton(q, k, v, pos, cs, kc, vc, slots, bt, sl, d**-0.5, window, num_splits=splits)
    assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0), "q, k, v are inputs: left as they are"
    return got, want, kc_ref, vc_ref


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize(("ctx", "hq", "hk", "d", "window", "splits"), CASES)
@pytest.mark.parametrize("v_layout", ["rows", "keys_inner"])
def test_decode_rope_matches_rope_then_decode(dtype, ctx, hq, hk, d, window, splits, v_layout) -> None:
    """keys_inner: the V cache with each block's keys innermost, read in tiles of whole blocks, the new
    key still joining from registers in the split that owns it and the new v written to its place."""
    q, k, v, pos, kc, vc, bt, sl, slots = make_step(ctx, hq, hk, d, dtype, v_layout=v_layout)
    assert v_keys_inner(vc) == (v_layout == "keys_inner")
    got, want, kc_ref, vc_ref = run_both(q, k, v, pos, kc, vc, bt, sl, slots, d, window, splits)
    assert not got.isnan().any(), "the new token's slot was read before it was written (or not substituted)"
    torch.testing.assert_close(got, want, **TOL[dtype])
    # the new k (rotated) and v are in their slots, as rope_and_cache writes them; nothing else moved
    # (exact in fp32; the interpreter truncates fp32 -> 16 bit where torch rounds: TOL)
    tol = {"atol": 0, "rtol": 0} if dtype == F32 else TOL[dtype]
    torch.testing.assert_close(kc, kc_ref, equal_nan=True, **tol)
    torch.testing.assert_close(vc, vc_ref, equal_nan=True, atol=0, rtol=0)


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize(("ctx", "hq", "hk", "d", "window", "splits"), [CASES[0], CASES[2], CASES[3]])
@pytest.mark.parametrize("v_layout", ["rows", "keys_inner"])
def test_decode_rope_k_heads_first(ctx, hq, hk, d, window, splits, v_layout) -> None:
    """K heads first in memory (kernels/kv_layout.py "hnd"; V in rows too): the new k written to its slot
    through the cache's strides and every key read through them."""
    q, k, v, pos, kc, vc, bt, sl, slots = make_step(ctx, hq, hk, d, F32, v_layout=v_layout, k_layout="hnd")
    assert heads_first(kc) and heads_first(vc) == (v_layout == "rows")
    got, want, kc_ref, vc_ref = run_both(q, k, v, pos, kc, vc, bt, sl, slots, d, window, splits)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL[F32])
    torch.testing.assert_close(kc, kc_ref, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(vc, vc_ref, equal_nan=True, atol=0, rtol=0)


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(("ctx", "hq", "hk", "d", "window", "splits"), CASES[:4])
@pytest.mark.parametrize("v_layout", ["rows", "keys_inner"])
def test_decode_rope_fp8_cache(dtype, ctx, hq, hk, d, window, splits, v_layout) -> None:
    """An fp8 cache: the new k and v written as e4m3 and attended as the cache holds them. The CPU
    interpreter's fp8 rounding is wrong where a carry crosses a power of two (the GPU converts in
    hardware, to nearest even; test_kernel_rope_cache.py), so, as there, the new k and v are fp8
    values already and the position is 0 (no rotation to round); the other tests rotate."""
    q, k, v, pos, kc, vc, bt, sl, slots = make_step(ctx, hq, hk, d, dtype, FP8, v_layout)
    k.copy_(k.to(FP8).to(dtype))
    v.copy_(v.to(FP8).to(dtype))
    pos.zero_()
    got, want, kc_ref, vc_ref = run_both(q, k, v, pos, kc, vc, bt, sl, slots, d, window, splits)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))


def test_decode_rope_uses_the_new_key_not_its_slot() -> None:
    """With no slot to write (-1), the slot stays NaN; the answer is still the one with the new key
    in the cache: every program takes the new key and value from registers, none from the slot
    (on a GPU the writing program may not have stored it before another program reads it)."""
    ctx, d = [21, 70], 64
    q, k, v, pos, kc, vc, bt, sl, slots = make_step(ctx, 8, 2, d, F32)
    cs = cos_sin_table(512, d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = decode_rope_attention_ref(q, k, v, pos, cs, kc_ref, vc_ref, slots, bt, sl, d**-0.5)
    got = decode_rope_attention_triton(q, k, v, pos, cs, kc, vc, torch.full_like(slots, -1), bt, sl, d**-0.5,
                                       num_splits=3)
    assert kc[slots // 16, slots % 16].isnan().all(), "a negative slot writes nothing"
    torch.testing.assert_close(got, want, **TOL[F32])
    # and the rotation matters: the unrotated key gives another answer
    from kernels.decode_attention import decode_attention_ref

    kc_plain, vc_plain = kc.clone(), vc.clone()
    kc_plain[slots // 16, slots % 16] = k
    vc_plain[slots // 16, slots % 16] = v
    assert not torch.allclose(got, decode_attention_ref(q, kc_plain, vc_plain, bt, sl, d**-0.5), **TOL[F32])


def test_decode_rope_rejects_bad_inputs() -> None:
    q, k, v, pos, kc, vc, bt, sl, slots = make_step([5], 4, 1, 64, F32)
    cs = cos_sin_table(16, 64)
    with pytest.raises(ValueError, match="int64"):
        decode_rope_attention_triton(q, k, v, pos.int(), cs, kc, vc, slots, bt, sl, 0.125)
    with pytest.raises(ValueError, match="cos_sin"):
        decode_rope_attention_triton(q, k, v, pos, cs.double(), kc, vc, slots, bt, sl, 0.125)
    with pytest.raises(ValueError, match=r"rope's k"):
        decode_rope_attention_triton(q, k[:, :, :32], v, pos, cs, kc, vc, slots, bt, sl, 0.125)


def test_the_fused_rope_serves_small_pure_decode_steps_only() -> None:
    """Mixed or prefill steps keep rope_and_cache's launch (it rotates every token of the step), and
    so do decode batches past FUSED_ROPE_MAX_BATCH (slower fused on the H200 at 256)."""
    from kernels.ops import get_ops
    from workers.engine.attention import FUSED_ROPE_MAX_BATCH, AttentionMetadata, PagedAttention

    def meta(decodes: int, prefill_tokens: int = 0, dense: bool = False) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=torch.zeros(decodes + prefill_tokens, dtype=torch.int64),
                                 num_decodes=decodes, num_decode_tokens=decodes, decode_block_tables=None,
                                 decode_seq_lens=None, prefill_block_tables=None, prefill_query_start_loc=None,
                                 prefill_seq_lens=None, prefill_dense=dense)

    attn = PagedAttention(get_ops("triton"), 8, 2, 64, None)
    assert attn.fuses_rope(meta(1), 1) and attn.fuses_rope(meta(FUSED_ROPE_MAX_BATCH), FUSED_ROPE_MAX_BATCH)
    assert not attn.fuses_rope(meta(FUSED_ROPE_MAX_BATCH + 1), FUSED_ROPE_MAX_BATCH + 1)
    assert not attn.fuses_rope(meta(2, 5), 7)  # a mixed step
    assert not attn.fuses_rope(meta(0, 9, dense=True), 9)
    assert not PagedAttention(get_ops("torch"), 8, 2, 64, None).fuses_rope(meta(1), 1)


def test_the_fused_rope_bound_is_an_ab_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """FIRSTTOKEN_FUSED_ROPE_MAX_BATCH moves the bound for attention built afterwards (0: never fused);
    anything but a non-negative integer is refused with the variable's name."""
    from kernels.ops import get_ops
    from workers.engine.attention import (
        FUSED_ROPE_ENV,
        FUSED_ROPE_MAX_BATCH,
        AttentionMetadata,
        PagedAttention,
    )

    def meta(decodes: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=torch.zeros(decodes, dtype=torch.int64), num_decodes=decodes,
                                 num_decode_tokens=decodes, decode_block_tables=None, decode_seq_lens=None,
                                 prefill_block_tables=None, prefill_query_start_loc=None, prefill_seq_lens=None)

    big = FUSED_ROPE_MAX_BATCH * 32
    monkeypatch.setenv(FUSED_ROPE_ENV, str(big))
    attn = PagedAttention(get_ops("triton"), 8, 2, 64, None)
    assert attn.fuses_rope(meta(big), big) and not attn.fuses_rope(meta(big + 1), big + 1)
    monkeypatch.setenv(FUSED_ROPE_ENV, "0")
    assert not PagedAttention(get_ops("triton"), 8, 2, 64, None).fuses_rope(meta(1), 1)
    for bad in ("-1", "x", "1.5"):
        monkeypatch.setenv(FUSED_ROPE_ENV, bad)
        with pytest.raises(ValueError, match=FUSED_ROPE_ENV):
            PagedAttention(get_ops("triton"), 8, 2, 64, None)
    monkeypatch.delenv(FUSED_ROPE_ENV)
    assert PagedAttention(get_ops("triton"), 8, 2, 64, None).fused_rope_max == FUSED_ROPE_MAX_BATCH
