"""rope_cache_cast: rope_and_cache and the e4m3 cast of q | k | v for cuDNN's FP8 attention in one launch
(several tokens a program), against the references: its cache writes and rotation as rope_and_cache's
(write_qk rotates q and k in place, as rope_and_cache does), its rows as cast_e4m3's."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import TOL
from test_cudnn_attention import _steps_apart
from test_kernel_rope_cache import cos_sin_table, make_inputs

from kernels.cudnn_attention import O_MARGIN
from kernels.fp8_linear import FP8, FP8_MAX
from kernels.kv_layout import to_k_layout, to_v_layout
from kernels.rope_cache import (
    rope_and_cache_ref,
    rope_and_cache_triton,
    rope_cache_cast_ref,
    rope_cache_cast_triton,
)


def _layouts(kc: torch.Tensor, vc: torch.Tensor, v_layout: str, k_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    kc = to_k_layout(kc, k_layout)
    if v_layout == "keys_inner":
        return kc, to_v_layout(vc, "keys_inner", stale=float("nan"))
    return kc, to_k_layout(vc, k_layout)


def _prompt_slots(t: int, bs: int, num_blocks: int, start: int, decodes: int, g: torch.Generator) -> torch.Tensor:
    """A step's slots as the engine maps them: `decodes` single tokens in blocks of their own, then one
    prompt's t - decodes tokens from offset `start` of its first block, consecutive through its blocks
    (which lie anywhere in the cache)."""
    blocks = torch.randperm(num_blocks, generator=g)
    slots = [int(blocks[i]) * bs + int(torch.randint(0, bs, (1,), generator=g)) for i in range(decodes)]
    table = blocks[decodes:]
    slots += [int(table[(start + j) // bs]) * bs + (start + j) % bs for j in range(t - decodes)]
    return torch.tensor(slots, dtype=torch.int64)


CASES = [  # t, hq, hk, d, block size, tile (0: one program a token, rope_and_cache's kernel), V layout, K layout
    (37, 9, 3, 64, 16, 16, "rows", "nhd"),  # hq not a multiple of the q heads a program takes
    (70, 8, 2, 32, 64, 32, "keys_inner", "nhd"),
    (5, 4, 1, 128, 16, 32, "keys_inner", "hnd"),  # fewer tokens than a tile
    (29, 6, 2, 64, 16, 0, "keys_inner", "nhd"),
    (21, 9, 3, 32, 64, 0, "rows", "hnd"),
    (64, 6, 2, 16, 32, 64, "rows", "hnd"),
    (45, 4, 2, 64, 16, 8, "keys_inner", "hnd"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "hq", "hk", "d", "bs", "tile", "v_layout", "k_layout"), CASES)
def test_tiles_match_the_reference(dtype, t, hq, hk, d, bs, tile, v_layout, k_layout):
    """q and k rotated in place and k, v at their slots as the reference writes them, random slots (each
    token its own row) and a padding slot; every other slot untouched."""
    _qkv, q, k, v, pos, slots, kc, vc = make_inputs(t, hq, hk, d, bs, dtype)
    slots[t // 2] = -1
    kc, vc = _layouts(kc, vc, v_layout, k_layout)
    cs = cos_sin_table(4096, d)
    kr, vr = kc.clone(), vc.clone()
    q_ref, k_ref = rope_and_cache_ref(q.clone(), k.clone(), v.clone(), pos, cs, kr.clone(), vr.clone(), slots)
    real = slots >= 0  # (the reference writes a negative slot as Python indexes it: the last block's)
    rope_and_cache_ref(q[real], k[real], v[real], pos[real], cs, kr, vr, slots[real])
    v0 = v.clone()
    rope_cache_cast_triton(q, k, v, pos, cs, kc, vc, slots, 1.0, tile=tile, write_qk=True)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(k, k_ref, **TOL[dtype])
    assert torch.equal(v, v0)
    for got, want in ((kc, kr), (vc, vr)):
        g, w = got.reshape(-1, hk, d), want.reshape(-1, hk, d)
        assert torch.equal(g.isnan(), w.isnan())  # the same slots written, the padding's none
        torch.testing.assert_close(g.nan_to_num(), w.nan_to_num(), **TOL[dtype])
    written = ~kc.reshape(-1, hk, d).isnan().all(-1).all(-1)
    assert int(written.sum()) == t - 1


@pytest.mark.parametrize(("bs", "start", "decodes", "tile"), [(16, 5, 0, 16), (64, 50, 3, 32), (16, 0, 7, 32),
                                                              (64, 50, 3, 0)])
def test_tiles_write_a_prompts_consecutive_slots(bs, start, decodes, tile):
    """The case the tiles are for: a prompt's consecutive slots, starting mid-block and crossing blocks, after
    some decode tokens, into an fp8 cache with V's keys innermost. Values exact in e4m3 and position 0 (the
    interpreter's fp8 rounding is off, as test_rope_and_cache_fp8_cache says), so the cache must hold them
    exactly."""
    g = torch.Generator().manual_seed(bs + start)
    t, hq, hk, d = 75, 4, 2, 32
    _qkv, q, k, v, pos, _slots, _kc, _vc = make_inputs(t, hq, hk, d, bs, torch.bfloat16)
    num_blocks = decodes + t // bs + 3
    kc = torch.full((num_blocks, bs, hk, d), float("nan"))
    vc = kc.clone()
    slots = _prompt_slots(t, bs, num_blocks, start, decodes, g)
    for x in (k, v):
        x.copy_(x.to(FP8).to(torch.bfloat16))
    pos.zero_()
    kc, vc = _layouts(kc.to(FP8), vc.to(FP8), "keys_inner", "nhd")
    kr, vr = kc.clone(), vc.clone()
    rope_and_cache_ref(q.clone(), k.clone(), v.clone(), pos, cos_sin_table(8, d), kr, vr, slots)
    rope_cache_cast_triton(q, k, v, pos, cos_sin_table(8, d), kc, vc, slots, 1.0, tile=tile)
    for got, want, src in ((kc, kr, k), (vc, vr, v)):
        gf = got.float().reshape(-1, hk, d)
        assert torch.equal(gf[slots], src.float())
        assert torch.equal(gf.isnan(), want.float().reshape(-1, hk, d).isnan())


def test_a_tile_must_be_a_power_of_two():
    _qkv, q, k, v, pos, slots, kc, vc = make_inputs(4, 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        rope_cache_cast_triton(q, k, v, pos, cos_sin_table(4096, 16), kc, vc, slots, 1.0, tile=24)


@pytest.mark.parametrize(("t", "hq", "hk", "d", "bs", "tile", "v_layout", "k_layout"), CASES[:4] + CASES[5:])
def test_rope_cache_cast_matches_rope_then_cast(poison_empty, t, hq, hk, d, bs, tile, v_layout, k_layout):
    """One launch gives what rope_and_cache then cast_e4m3 give: the same e4m3 codes for its rotated q, k and
    v (beyond +-448 saturated; V's NaN left out: the interpreter casts an fp32 NaN to e4m3 as 384, the GPU
    keeps it), O's scale from V's columns only (q's 1000 is not in it), the cache as rope_and_cache writes
    it; q and k rotated in place only when asked, the rows the same either way."""
    _qkv, q, k, v, pos, slots, kc, vc = make_inputs(t, hq, hk, d, bs, torch.bfloat16)
    q.mul_(40)
    q[0, 0, 0] = 1000.0
    pos[0] = 0  # (not rotated)
    v[-1, -1, -1] = -300.0
    if t > 2:
        v[1, 0, 1] = float("nan")
    kc, vc = _layouts(kc.to(FP8), vc.to(FP8), v_layout, k_layout)
    cs = cos_sin_table(4096, d)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    kr, vr = kc.clone(), vc.clone()
    q_ref, k_ref = rope_and_cache_ref(q0.clone(), k0.clone(), v0.clone(), pos, cs, kr, vr, slots)
    y, scale = rope_cache_cast_triton(q, k, v, pos, cs, kc, vc, slots, O_MARGIN, tile=tile, write_qk=True)
    torch.testing.assert_close(q, q_ref, **TOL[torch.bfloat16])  # rotated in place
    torch.testing.assert_close(k, k_ref, **TOL[torch.bfloat16])
    assert y.dtype == FP8 and y.shape == (t, (hq + 2 * hk) * d) and scale.shape == (1,)
    # against the cast of its own rotation (the reference's may be a bf16 step off, and e4m3 ties flip on it)
    yr, sr = rope_cache_cast_ref(q.clone(), k.clone(), v0.clone(), torch.zeros_like(pos), cs, kr.clone(),
                                 vr.clone(), slots, O_MARGIN)
    nan = yr.float().isnan()
    assert int(nan.sum()) == (1 if t > 2 else 0)
    assert int(_steps_apart(y, yr)[~nan].max()) == 0
    assert float(y[0, 0].float()) == FP8_MAX
    torch.testing.assert_close(scale, sr, rtol=1e-6, atol=0)
    assert float(scale) == pytest.approx(FP8_MAX / (O_MARGIN * 288.0), rel=1e-6)  # -300 cast to e4m3: -288
    # the cache as the per-token kernel writes it, to the bit (its e4m3 stores round as these do; the
    # interpreter's fp8 cast is off by a binade just under a power of two, so not against the reference)
    kt, vt = kr.clone().fill_(float("nan")), vr.clone().fill_(float("nan"))
    rope_and_cache_triton(q0.clone(), k0.clone(), v0.clone(), pos, cs, kt, vt, slots)
    for got, want in ((kc, kt), (vc, vt)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    q2, k2 = q0.clone(), k0.clone()
    y2, scale2 = rope_cache_cast_triton(q2, k2, v, pos, cs, kc, vc, slots, O_MARGIN, tile=tile)
    assert torch.equal(q2, q0) and torch.equal(k2, k0)  # not asked: left as they were
    assert torch.equal(y2.view(torch.uint8), y.view(torch.uint8)) and torch.equal(scale2, scale)
    assert torch.equal(v.nan_to_num(), v0.nan_to_num())


def test_rope_cache_cast_into_a_longer_buffer_shares_one_scale():
    """out: the first T rows of a padded buffer, the rest left; a given scale takes the minimum."""
    t, hq, hk, d, bs = 9, 4, 2, 16, 16
    _qkv, q, k, v, pos, slots, kc, vc = make_inputs(t, hq, hk, d, bs, torch.float32)
    buf = torch.zeros(16, (hq + 2 * hk) * d, dtype=FP8)
    scale = torch.full((1,), 1e6)
    y, s = rope_cache_cast_triton(q, k, v, pos, cos_sin_table(4096, d), kc, vc, slots, 1.0, out=buf, scale=scale)
    assert y is buf and s is scale
    assert bool((buf[t:].float() == 0).all()) and bool((buf[:t].float() != 0).any())
    vmax = float(v.to(FP8).float().abs().max())
    assert float(scale) == pytest.approx(FP8_MAX / vmax, rel=1e-6)
    big = torch.full((1,), 1.0)  # already under what this V gives: kept
    rope_cache_cast_triton(q, k, v, pos, cos_sin_table(4096, d), kc, vc, slots, 1.0, scale=big)
    assert float(big) == 1.0
