"""The torch backend's batched paged attention (kernels/torch_attention.py) against the per-sequence
references, on a NaN-poisoned cache: padded queries, padded keys and table padding must never
leak into a real row."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import TOL, make_paged_kv

import kernels.torch_attention as ta
from kernels.decode_attention import decode_attention_ref
from kernels.prefill_attention import paged_attention_ref

F32, BF16 = torch.float32, torch.bfloat16

# (prefix lens, new lens, Hq, Hk, D, block size, window): a sequence with no new tokens, single
# tokens beside long ones, contexts that end mid-block, GQA 1/3/4, a window shorter than a block.
PREFILL = [
    ([0, 17, 5], [6, 1, 42], 8, 2, 16, 16, None),
    ([0, 33, 9], [23, 0, 9], 6, 2, 24, 5, 7),
    ([40, 0, 16, 3], [1, 123, 16, 2], 4, 4, 16, 16, None),
    ([100, 3], [42, 6], 4, 1, 32, 8, 3),
]


def prefill_inputs(prefix, new, hq, hk, d, bs, dtype):
    ctx = [p + n for p, n in zip(prefix, new)]
    kc, vc, bt = make_paged_kv(ctx, hk, d, bs, dtype)
    # the engine's padding: an index past the cache
    bt = torch.cat([bt, torch.full((bt.shape[0], 2), kc.shape[0], dtype=torch.int32)], dim=1)
    q = torch.randn(sum(new), hq, d).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    return q, kc, vc, bt, qsl, torch.tensor(ctx, dtype=torch.int32)


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(("prefix", "new", "hq", "hk", "d", "bs", "window"), PREFILL)
def test_batched_prefill_equals_the_reference(dtype, prefix, new, hq, hk, d, bs, window):
    q, kc, vc, bt, qsl, sl = prefill_inputs(prefix, new, hq, hk, d, bs, dtype)
    out = ta.paged_attention_torch(q, kc, vc, bt, qsl, sl, d**-0.5, window)
    assert not out.isnan().any()
    ref = paged_attention_ref(q, kc, vc, bt, qsl, sl, d**-0.5, window)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(("ctx", "hq", "hk", "d", "bs", "window"), [
    ([1, 17, 64, 5], 8, 2, 16, 16, None),
    ([33, 2, 48], 6, 3, 24, 5, 4),
    ([7], 4, 1, 32, 8, 1),
])
def test_batched_decode_equals_the_reference(dtype, ctx, hq, hk, d, bs, window):
    kc, vc, bt = make_paged_kv(ctx, hk, d, bs, dtype)
    q = torch.randn(len(ctx), hq, d).to(dtype)
    sl = torch.tensor(ctx, dtype=torch.int32)
    out = ta.decode_attention_torch(q, kc, vc, bt, sl, d**-0.5, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, decode_attention_ref(q, kc, vc, bt, sl, d**-0.5, window), **TOL[dtype])


def test_a_one_key_causal_shift_fails_the_comparison(monkeypatch):
    """The tolerance catches an off-by-one mask: queries that see one key past themselves."""
    real = ta._attend
    monkeypatch.setattr(ta, "_attend", lambda q, k, v, qpos, scale, window: real(q, k, v, qpos + 1, scale, window))
    q, kc, vc, bt, qsl, sl = prefill_inputs([3, 0], [9, 12], 4, 2, 16, 4, F32)
    shifted = ta.paged_attention_torch(q, kc, vc, bt, qsl, sl, 0.25)
    ref = paged_attention_ref(q, kc, vc, bt, qsl, sl, 0.25)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(shifted, ref, **TOL[F32])


def test_large_padded_batches_go_through_the_reference(monkeypatch):
    calls = []
    real = ta.paged_attention_ref
    monkeypatch.setattr(ta, "paged_attention_ref", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(ta, "MAX_PADDED_SCORES", 1000)
    q, kc, vc, bt, qsl, sl = prefill_inputs([0, 5], [40, 1], 4, 2, 16, 16, F32)
    out = ta.paged_attention_torch(q, kc, vc, bt, qsl, sl, 0.25)
    assert calls == [1]
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, qsl, sl, 0.25), **TOL[F32])
