"""Paged prefill attention and flash-decoding against their references, plus negative checks."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import TOL, dense_attention, make_paged_kv

from kernels.decode_attention import decode_attention_ref, decode_attention_triton
from kernels.prefill_attention import paged_attention_ref, paged_attention_triton

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def make_prefill(prefix: list[int], new: list[int], hq: int, hk: int, d: int, bs: int, dtype: torch.dtype):
    ctx = [p + n for p, n in zip(prefix, new)]
    k_cache, v_cache, block_tables = make_paged_kv(ctx, hk, d, bs, dtype)
    t = sum(new)
    # q: a strided view of a fused qkv output, as the engine passes it
    qkv = torch.randn(t, (hq + 2 * hk) * d).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, qsl, torch.tensor(ctx, dtype=torch.int32)


# (prefix lens, new lens, Hq, Hk, D, window, tile overrides): odd token counts, block boundaries
# crossed, partly filled last blocks, cached prefixes of different lengths in one batch,
# GQA ratios 1/4/8, D 64/128, window on/off, the CPU tiles and the GPU tiles (128 x 64).
PREFILL_CASES = [
    ([0, 17, 5], [6, 1, 42], 8, 2, 64, None, {}),
    ([0, 33], [23, 9], 8, 1, 128, 7, {}),
    ([40, 0, 16], [1, 123, 16], 4, 4, 64, None, {"block_m": 32, "block_n": 16}),
    ([100, 3], [42, 6], 4, 1, 128, 20, {"block_m": 32, "block_n": 32}),
    ([70], [57], 8, 2, 128, None, {"block_m": 128, "block_n": 64}),
    ([0, 31], [123, 1], 8, 1, 64, 33, {"block_m": 128, "block_n": 64}),
]


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize(("prefix", "new", "hq", "hk", "d", "window", "tiles"), PREFILL_CASES)
def test_paged_prefill(dtype, prefix, new, hq, hk, d, window, tiles) -> None:
    q, kc, vc, bt, qsl, sl = make_prefill(prefix, new, hq, hk, d, 16, dtype)
    scale = d**-0.5
    out = paged_attention_triton(q, kc, vc, bt, qsl, sl, scale, window, max_query_len=max(new), **tiles)
    assert not out.isnan().any(), "unwritten (or NaN-polluted) output rows"
    ref = paged_attention_ref(q, kc, vc, bt, qsl, sl, scale, window)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.usefixtures("poison_empty")
def test_paged_prefill_without_max_query_len() -> None:
    # grid sized by T: programs past each sequence's tokens must exit without writing
    q, kc, vc, bt, qsl, sl = make_prefill([5, 0, 20], [3, 17, 1], 8, 2, 64, 16, F32)
    out = paged_attention_triton(q, kc, vc, bt, qsl, sl, 0.125, None, block_m=32, block_n=16)
    assert not out.isnan().any()
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, qsl, sl, 0.125), **TOL[F32])


@pytest.mark.parametrize("window", [None, 9])
def test_paged_prefill_catches_mask_and_paging_bugs(window: int | None) -> None:
    """The tolerance fails an off-by-one causal mask, an off-by-one window, and a swapped block."""
    prefix, new = [20, 0], [13, 30]
    q, kc, vc, bt, qsl, sl = make_prefill(prefix, new, 4, 1, 64, 16, F32)
    out = paged_attention_triton(q, kc, vc, bt, qsl, sl, 0.125, window, block_m=32, block_n=16)
    qsl_l, ctx = qsl.tolist(), sl.tolist()
    dense = dense_attention(q, kc, vc, bt, qsl_l, ctx, 0.125, window).float()
    torch.testing.assert_close(dense, paged_attention_ref(q, kc, vc, bt, qsl, sl, 0.125, window), **TOL[F32])
    torch.testing.assert_close(out, dense, **TOL[F32])
    tol = TOL[F32]
    assert not torch.allclose(out, dense_attention(q, kc, vc, bt, qsl_l, ctx, 0.125, window, causal_shift=1).float(), **tol)
    if window is not None:
        wide = dense_attention(q, kc, vc, bt, qsl_l, ctx, 0.125, window, window_shift=1).float()
        assert not torch.allclose(out, wide, **tol)
    bt_bad = bt.clone()
    bt_bad[0, [0, 1]] = bt_bad[0, [1, 0]]  # a paging bug: two blocks of sequence 0 swapped
    assert not torch.allclose(out, dense_attention(q, kc, vc, bt_bad, qsl_l, ctx, 0.125, window).float(), **tol)


# (context lens, Hq, Hk, D, window, num_splits, block_n)
DECODE_CASES = [
    ([1, 17, 100], 8, 2, 64, None, None, None),
    ([33, 200], 8, 1, 128, 7, None, None),
    ([40, 123, 16], 4, 4, 64, None, 3, 16),
    ([300], 8, 1, 128, 50, 5, 64),
    ([1, 64, 65], 32, 4, 64, None, 1, None),
]


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize(("ctx", "hq", "hk", "d", "window", "splits", "block_n"), DECODE_CASES)
def test_decode(dtype, ctx, hq, hk, d, window, splits, block_n) -> None:
    kc, vc, bt = make_paged_kv(ctx, hk, d, 16, dtype)
    q = torch.randn(len(ctx), hq + 2 * hk, d).to(dtype)[:, :hq]  # strided view of a fused qkv
    sl = torch.tensor(ctx, dtype=torch.int32)
    out = decode_attention_triton(q, kc, vc, bt, sl, d**-0.5, window, num_splits=splits, block_n=block_n)
    assert not out.isnan().any(), "unwritten (or NaN-polluted) output rows"
    torch.testing.assert_close(out, decode_attention_ref(q, kc, vc, bt, sl, d**-0.5, window), **TOL[dtype])


def test_decode_catches_window_and_paging_bugs() -> None:
    ctx, window = [70, 45], 20
    kc, vc, bt = make_paged_kv(ctx, 1, 64, 16, F32)
    q = torch.randn(2, 4, 64)
    sl = torch.tensor(ctx, dtype=torch.int32)
    out = decode_attention_triton(q, kc, vc, bt, sl, 0.125, window, num_splits=3)
    qsl = [0, 1, 2]
    torch.testing.assert_close(out, dense_attention(q, kc, vc, bt, qsl, ctx, 0.125, window).float(), **TOL[F32])
    wide = dense_attention(q, kc, vc, bt, qsl, ctx, 0.125, window, window_shift=1).float()
    assert not torch.allclose(out, wide, **TOL[F32])
    bt_bad = bt.clone()
    bt_bad[0, [3, 4]] = bt_bad[0, [4, 3]]
    assert not torch.allclose(out, dense_attention(q, kc, vc, bt_bad, qsl, ctx, 0.125, window).float(), **TOL[F32])


def test_decode_shapes_do_not_depend_on_seq_lens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graph capture needs fixed intermediates and no host reads of seq_lens."""
    kc, vc, bt = make_paged_kv([50, 20], 2, 64, 16, F32)
    q = torch.randn(2, 4, 64)
    shapes = []
    real_empty = torch.empty

    def spy(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        shapes.append(tuple(t.shape))
        return t

    monkeypatch.setattr(torch, "empty", spy)

    def no_host_read(*_a, **_k):
        raise AssertionError("seq_lens read on the host")

    for lens in ([50, 20], [3, 49]):
        sl = torch.tensor(lens, dtype=torch.int32)
        monkeypatch.setattr(type(sl), "tolist", no_host_read)
        monkeypatch.setattr(type(sl), "item", no_host_read)
        decode_attention_triton(q, kc, vc, bt, sl, 0.125, num_splits=4)
        monkeypatch.undo()
        monkeypatch.setattr(torch, "empty", spy)
    assert shapes[: len(shapes) // 2] == shapes[len(shapes) // 2 :]


def test_attention_rejects_bad_inputs() -> None:
    kc, vc, bt = make_paged_kv([20], 2, 64, 16, F32)
    sl = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention_triton(torch.randn(1, 3, 64), kc, vc, bt, sl, 0.125)
    with pytest.raises(ValueError, match="int32"):
        decode_attention_triton(torch.randn(1, 4, 64), kc, vc, bt, sl.long(), 0.125)
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_attention_triton(torch.randn(1, 4, 64).half(), kc, vc, bt, torch.tensor([0, 1], dtype=torch.int32), sl, 0.1)
