"""Paged prefill attention and flash-decoding against their references, plus negative checks."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import TOL, dense_attention, make_paged_kv

from kernels.decode_attention import decode_attention_ref, decode_attention_triton
from kernels.kv_layout import heads_first, to_k_layout, to_v_layout, v_keys_inner
from kernels.prefill_attention import (
    paged_attention_ref,
    paged_attention_triton,
    prefill_splits,
    q_as_e4m3_ref,
)

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
@pytest.mark.parametrize("v_layout", ["rows", "keys_inner"])
def test_paged_prefill(dtype, prefix, new, hq, hk, d, window, tiles, v_layout) -> None:
    """keys_inner: the V cache with each block's keys innermost, read in whole blocks (the unwritten
    slots past a context, finite as the layout needs, must get no weight)."""
    q, kc, vc, bt, qsl, sl = make_prefill(prefix, new, hq, hk, d, 16, dtype)
    vc = to_v_layout(vc, v_layout, stale=300.0)
    scale = d**-0.5
    out = paged_attention_triton(q, kc, vc, bt, qsl, sl, scale, window, max_query_len=max(new), **tiles)
    assert not out.isnan().any(), "unwritten (or NaN-polluted) output rows"
    ref = paged_attention_ref(q, kc, vc, bt, qsl, sl, scale, window)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("v_layout", ["rows", "keys_inner"])
def test_paged_prefill_head_dim_below_its_power_of_two(v_layout) -> None:
    """D = 80 (tiles of 128 columns, 48 masked): a keys-inner V's rows are D x block_size apart, so a
    column past D would read the next head's (or past the pool's end)."""
    q, kc, vc, bt, qsl, sl = make_prefill([19, 0], [5, 37], 4, 2, 80, 16, BF16)
    vc = to_v_layout(vc, v_layout, stale=300.0)
    out = paged_attention_triton(q, kc, vc, bt, qsl, sl, 80**-0.5, None, max_query_len=37, block_m=32, block_n=32)
    assert not out.isnan().any()
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, qsl, sl, 80**-0.5), **TOL[BF16])


@pytest.mark.usefixtures("poison_empty")
def test_paged_prefill_without_max_query_len() -> None:
    # grid sized by T: programs past each sequence's tokens must exit without writing
    q, kc, vc, bt, qsl, sl = make_prefill([5, 0, 20], [3, 17, 1], 8, 2, 64, 16, F32)
    out = paged_attention_triton(q, kc, vc, bt, qsl, sl, 0.125, None, block_m=32, block_n=16)
    assert not out.isnan().any()
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, qsl, sl, 0.125), **TOL[F32])


@pytest.mark.parametrize(("window", "splits"), [(None, 1), (9, 1), (9, 4)])
@pytest.mark.parametrize("compact", [True, False])
def test_paged_prefill_catches_mask_and_paging_bugs(window: int | None, splits: int, compact: bool) -> None:
    """The tolerance fails an off-by-one causal mask, an off-by-one window, and a swapped block; in both grids
    (compact, the default, and per sequence: what batches of more than COMPACT_MAX_SEQS sequences get)."""
    prefix, new = [20, 0], [13, 30]
    q, kc, vc, bt, qsl, sl = make_prefill(prefix, new, 4, 1, 64, 16, F32)
    out = paged_attention_triton(q, kc, vc, bt, qsl, sl, 0.125, window, block_m=32, block_n=16, num_splits=splits,
                                 compact=compact)
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


# Split-KV prefill, splits forced: (prefix lens, new lens, Hq, Hk, window, num_splits, dtype). Prefixes
# that end mid-block and cross blocks, partly filled last blocks, GQA 1/4/8, windows that leave
# whole splits outside some rows' range (those splits must combine to nothing, not NaN), more
# splits than key tiles (empty splits), fp32 and bf16. block_m 32, block_n 16 keep several tiles.
SPLIT_CASES = [
    ([37, 0], [9, 12], 8, 2, None, 3, F32),
    ([100], [5], 4, 4, None, 5, BF16),
    ([19, 64], [13, 1], 8, 1, 11, 4, F32),
    ([45], [17], 4, 4, 6, 6, BF16),
    ([3], [2], 4, 1, None, 7, F32),
    ([70, 16], [12, 17], 4, 1, 40, 2, BF16),
]


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize(("prefix", "new", "hq", "hk", "window", "splits", "dtype"), SPLIT_CASES)
@pytest.mark.parametrize("v_layout", ["rows", "keys_inner"])
def test_paged_prefill_split(prefix, new, hq, hk, window, splits, dtype, v_layout) -> None:
    q, kc, vc, bt, qsl, sl = make_prefill(prefix, new, hq, hk, 64, 16, dtype)
    vc = to_v_layout(vc, v_layout, stale=300.0)
    out = paged_attention_triton(q, kc, vc, bt, qsl, sl, 0.125, window, max_query_len=max(new),
                                 block_m=32, block_n=16, num_splits=splits)
    assert not out.isnan().any(), "unwritten (or NaN-polluted) output rows"
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, qsl, sl, 0.125, window), **TOL[dtype])


# (prefix lens, new lens): a captured graph's one real sequence before its padding (no new tokens, no
# context), decodes beside prefills with padding between them, decodes alone, tiles of several sequences
COMPACT_CASES = [
    ([37, 0, 0, 0, 0, 0], [45, 0, 0, 0, 0, 0]),
    ([20, 50, 3, 0, 70], [1, 33, 1, 0, 17]),
    ([5, 9, 40, 2, 17, 33, 1], [1, 1, 1, 1, 1, 1, 1]),
    ([0, 16, 0], [40, 23, 9]),
]


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize(("prefix", "new"), COMPACT_CASES)
@pytest.mark.parametrize(("splits", "compact"), [(1, True), (3, True), (1, False)])
def test_paged_prefill_compact_grid(prefix, new, splits, compact) -> None:
    """compact (the default): the grid enumerates the batch's query tiles, sequence after sequence (padded
    sequences get none); the output is the reference's, split or not, GQA packing included. The grid per
    sequence on the same batches too."""
    q, kc, vc, bt, qsl, sl = make_prefill(prefix, new, 8, 2, 64, 16, F16)
    out = paged_attention_triton(q, kc, vc, bt, qsl, sl, 0.125, None, max_query_len=max(new), block_m=32,
                                 block_n=16, num_splits=splits, compact=compact)
    assert not out.isnan().any(), "unwritten (or NaN-polluted) output rows"
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, qsl, sl, 0.125), **TOL[F16])


def test_prefill_compact_grid_counts_only_the_batchs_tiles() -> None:
    """2048 cached + 128 new in the prefill graph's 16 rows (15 padding): 23 tile slots, not 16 x 8, and one
    along axis 2; past COMPACT_MAX_SEQS sequences the grid stays per sequence."""
    from kernels import prefill_attention as pa

    static = (32, 8, 128, 16, 16, True, True, False)  # Llama heads, block 16, 16 rows, an fp8 cache, a GPU
    compact = (None,) * 6 + (True, False)
    cgrid, consts, _, stages, splits, tiles = pa._tile_plan(static, BF16, 128, 128, 33024, False, 132, compact)
    assert consts["COMPACT"] and tiles == 8 + 15 and cgrid == (23 * splits, 8, 1)
    assert not consts["PREFETCH"] and stages == 2  # the small tiles' 2 stages
    grid, consts, _, _, splits, tiles = pa._tile_plan(static, BF16, 128, 128, 33024, False, 132, (None,) * 8)
    assert not consts["COMPACT"] and tiles == 8 and grid == (8 * splits, 8, 16)
    wide = static[:4] + (pa.COMPACT_MAX_SEQS + 1,) + static[5:]
    assert not pa._tile_plan(wide, BF16, 128, 1, 33024, False, 132, compact)[1]["COMPACT"]
    # the block ids a tile ahead: the same grid, at least the 3 stages that give K and V a second buffer
    pf = pa._tile_plan(static, BF16, 128, 128, 33024, False, 132, (None,) * 6 + (True, True))
    assert pf[1]["PREFETCH"] and pf[3] == 3 and pf[0] == cgrid
    for asked, got in ((4, 4), (2, 3)):  # more stages asked for are kept; fewer raised to the 3 it needs
        plan = pa._tile_plan(static, BF16, 128, 128, 33024, False, 132, (None, None, None, asked, None, None, True, True))
        assert plan[3] == got


def test_prefill_split_choice_depends_on_shapes_only() -> None:
    """Few programs on many SMs split (bounded by the context); a full grid keeps one launch."""
    assert prefill_splits(64, 132, 17) == 4  # 2048 cached + 128 new, M64 tiles: 64 programs
    assert prefill_splits(64, 132, 1000) == 4  # same, context bound unknown: still one wave (256 <= 264)
    assert prefill_splits(100, 132, 1000) == 2
    assert prefill_splits(8, 132, 1000) == 16
    assert prefill_splits(64, 132, 2) == 1  # short context: nothing worth splitting
    assert prefill_splits(132, 132, 1000) == 1
    assert prefill_splits(2048, 132, 1000) == 1


def test_prefill_split_default_and_graph_safety(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the interpreter's 8 'SMs' a one-tile prompt over a long prefix splits by itself; the
    intermediates depend on shapes only, max_seq_len bounds the splits, and seq_lens is never
    read on the host (CUDA-graph capture)."""
    q, kc, vc, bt, qsl, sl = make_prefill([150], [3], 4, 1, 64, 16, F32)
    shapes = []
    real_empty = torch.empty

    def spy(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        shapes.append(tuple(t.shape))
        return t

    def no_host_read(*_a, **_k):
        raise AssertionError("metadata read on the host")

    monkeypatch.setattr(torch, "empty", spy)
    monkeypatch.setattr(torch.Tensor, "tolist", no_host_read)
    monkeypatch.setattr(torch.Tensor, "item", no_host_read)
    out = paged_attention_triton(q, kc, vc, bt, qsl, sl, 0.125, max_query_len=3, block_n=16)
    first = list(shapes)
    sl.fill_(40)  # a shorter context, same shapes: same launches
    out_short = paged_attention_triton(q, kc, vc, bt, qsl, sl, 0.125, max_query_len=3, block_n=16)
    assert shapes[len(first):] == first
    assert first[1][1] > 1, f"expected a split launch, intermediates {first}"
    shapes.clear()
    paged_attention_triton(q, kc, vc, bt, qsl, sl, 0.125, max_query_len=3, block_n=16, max_seq_len=40)
    assert shapes == [(3, 4, 64)], "40 keys (3 tiles of 16) are too few to split"
    monkeypatch.undo()
    sl.fill_(153)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, qsl, sl, 0.125), **TOL[F32])
    sl.fill_(40)
    torch.testing.assert_close(out_short, paged_attention_ref(q, kc, vc, bt, qsl, sl, 0.125), **TOL[F32])


# (context lens, Hq, Hk, D, window, num_splits, block_n)
DECODE_CASES = [
    ([1, 17, 100], 8, 2, 64, None, None, None),
    ([33, 200], 8, 1, 128, 7, None, None),
    ([40, 123, 16], 4, 4, 64, None, 3, 16),
    ([300], 8, 1, 128, 50, 5, 64),
    ([1, 64, 65], 32, 4, 64, None, 1, None),
    ([50, 96, 129], 4, 2, 80, None, 2, 32),  # head_dim below its power of two: the masked columns
]


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize(("ctx", "hq", "hk", "d", "window", "splits", "block_n"), DECODE_CASES)
@pytest.mark.parametrize("mode", [{}, {"prefetch": True}, {"v_layout": "keys_inner"},
                                  {"v_layout": "keys_inner", "prefetch": True}],
                         ids=["plain", "prefetch", "v_keys_inner", "v_keys_inner_prefetch"])
def test_decode(dtype, ctx, hq, hk, d, window, splits, block_n, mode) -> None:
    """prefetch: the next key tile's block ids loaded an iteration ahead (with keys inner, the candidate
    for the H200: bench/results/2026-12-06-session11-h100.md); v_keys_inner: the V cache
    with each block's keys innermost (kernels/kv_layout.py), read in tiles of whole blocks (a tile of
    16-64 keys is 1-4 blocks of 16; a window's first tile starts on its block, the keys before the
    window masked), the unwritten slots past a context in its last block finite and large; the block
    tables are a random permutation of the pool, so a stale or shifted id reads another sequence's block."""
    kc, vc, bt = make_paged_kv(ctx, hk, d, 16, dtype)
    mode = dict(mode)
    if "v_layout" in mode:
        vc = to_v_layout(vc, mode.pop("v_layout"), stale=300.0)  # unwritten slots: finite, large
        assert v_keys_inner(vc)
    q = torch.randn(len(ctx), hq + 2 * hk, d).to(dtype)[:, :hq]  # strided view of a fused qkv
    sl = torch.tensor(ctx, dtype=torch.int32)
    out = decode_attention_triton(q, kc, vc, bt, sl, d**-0.5, window, num_splits=splits, block_n=block_n, **mode)
    assert not out.isnan().any(), "unwritten (or NaN-polluted) output rows"
    torch.testing.assert_close(out, decode_attention_ref(q, kc, vc, bt, sl, d**-0.5, window), **TOL[dtype])


# blocks of 32 and 64 tokens (EngineConfig.block_size: any power of two; TensorRT-LLM serves 32-64): key tiles
# shorter than a block (rows only: keys inner reads whole blocks), as long, and longer; windows across blocks.
# k_layout "hnd": K (and V in rows) heads first in memory, one head's block one run (kernels/kv_layout.py)
LARGE_BLOCK_CASES = [
    (32, "rows", 16, None, None, "nhd"),
    (64, "rows", None, 37, 2, "nhd"),
    (64, "rows", 128, None, 3, "nhd"),
    (32, "keys_inner", None, None, 2, "nhd"),
    (64, "keys_inner", 64, 37, None, "nhd"),
    (64, "keys_inner", None, None, 2, "hnd"),
    (32, "rows", 16, 37, None, "hnd"),
]


def lay_out(kc: torch.Tensor, vc: torch.Tensor, v_layout: str, k_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of caches made in rows, laid out as an engine of these layouts holds them."""
    kc = to_k_layout(kc, k_layout)
    vc = to_k_layout(vc, k_layout) if v_layout == "rows" else to_v_layout(vc, v_layout, stale=300.0)
    assert heads_first(kc) == (k_layout == "hnd") and v_keys_inner(vc) == (v_layout == "keys_inner")
    return kc, vc


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize(("bs", "v_layout", "block_n", "window", "splits", "k_layout"), LARGE_BLOCK_CASES)
def test_decode_large_blocks(bs, v_layout, block_n, window, splits, k_layout) -> None:
    ctx, hq, hk, d = [1, 70, 130], 8, 2, 64
    kc, vc, bt = make_paged_kv(ctx, hk, d, bs, F32)
    kc, vc = lay_out(kc, vc, v_layout, k_layout)
    q = torch.randn(len(ctx), hq + 2 * hk, d)[:, :hq]
    sl = torch.tensor(ctx, dtype=torch.int32)
    # keys inner with the block ids a tile ahead: an fp8 cache's default on the GPU (blocks of 64)
    prefetch = v_layout == "keys_inner"
    out = decode_attention_triton(q, kc, vc, bt, sl, d**-0.5, window, num_splits=splits, block_n=block_n,
                                  prefetch=prefetch)
    assert not out.isnan().any()
    torch.testing.assert_close(out, decode_attention_ref(q, kc, vc, bt, sl, d**-0.5, window), **TOL[F32])


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize(("bs", "v_layout", "block_n", "window", "splits", "k_layout"), LARGE_BLOCK_CASES)
def test_paged_prefill_large_blocks(bs, v_layout, block_n, window, splits, k_layout) -> None:
    prefix, new, hq, hk, d = [0, 61, 100], [45, 9, 30], 8, 2, 64
    q, kc, vc, bt, qsl, sl = make_prefill(prefix, new, hq, hk, d, bs, F32)
    kc, vc = lay_out(kc, vc, v_layout, k_layout)
    tiles = {"block_m": 32, **({"block_n": block_n} if block_n else {})}
    if splits:
        tiles["num_splits"] = splits
    out = paged_attention_triton(q, kc, vc, bt, qsl, sl, d**-0.5, window, max_query_len=max(new), **tiles)
    assert not out.isnan().any()
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, qsl, sl, d**-0.5, window), **TOL[F32])


# the prefetch's cases: (bs, v_layout, block_n, window, splits, compact); tiles of one block and of two, a
# window whose first tile starts mid-range, splits whose ranges start mid-context, both grids; each has
# programs of several key tiles (a block id taken a tile off changes the output)
PREFETCH_CASES = [
    (16, "rows", 16, None, None, True),
    (16, "keys_inner", 16, 37, 3, True),
    (32, "keys_inner", 32, None, 2, False),
    (64, "keys_inner", 64, None, None, True),
    (16, "rows", 32, 40, 2, True),
]


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize(("bs", "v_layout", "block_n", "window", "splits", "compact"), PREFETCH_CASES)
def test_paged_prefill_prefetch_gives_the_same_bits(bs, v_layout, block_n, window, splits, compact) -> None:
    """prefetch (each key tile's block ids loaded in the iteration before) reads the same keys in the same
    order: the same bits as without it, with prefixes ending mid-block, empty splits and padding-free grids;
    a tile taken one too early or late would change them. And the reference's output."""
    prefix, new, hq, hk, d = [0, 61, 100, 7], [19, 9, 14, 1], 4, 2, 32
    q, kc, vc, bt, qsl, sl = make_prefill(prefix, new, hq, hk, d, bs, F32)
    kc, vc = lay_out(kc, vc, v_layout, "nhd")
    kw = {"max_query_len": max(new), "block_m": 16, "block_n": block_n, "num_splits": splits, "compact": compact}
    base = paged_attention_triton(q, kc, vc, bt, qsl, sl, d**-0.5, window, **kw)
    out = paged_attention_triton(q, kc, vc, bt, qsl, sl, d**-0.5, window, prefetch=True, **kw)
    assert torch.equal(out, base)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, qsl, sl, d**-0.5, window), **TOL[F32])


def test_keys_inner_v_needs_whole_blocks_in_a_tile() -> None:
    kc, vc, bt = make_paged_kv([40], 2, 64, 32, F32)
    vc = to_v_layout(vc, "keys_inner", stale=300.0)
    q = torch.randn(1, 8, 64)
    with pytest.raises(ValueError, match="multiple of the block size"):
        decode_attention_triton(q, kc, vc, bt, torch.tensor([40], dtype=torch.int32), 0.125, block_n=16)


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
    with pytest.raises(ValueError, match="the caches must both be"):
        paged_attention_triton(torch.randn(1, 4, 64).half(), kc, vc, bt, torch.tensor([0, 1], dtype=torch.int32), sl, 0.1)


FP8 = torch.float8_e4m3fn


# k8 (opt-in) reads V as fp16 does, so its keys-inner cases (~20 s of the interpreter) are left to fp16's
@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize(("dtype", "widen", "v_layout"), [
    (F32, None, "rows"), (F32, None, "keys_inner"), (BF16, None, "rows"), (BF16, None, "keys_inner"),
    (BF16, "fp16", "rows"), (BF16, "fp16", "keys_inner"), (BF16, "k8", "rows")])
@pytest.mark.parametrize(("prefix", "new", "hq", "hk", "d", "window", "tiles"), PREFILL_CASES[:4])
def test_paged_prefill_fp8_cache(dtype, widen, prefix, new, hq, hk, d, window, tiles, v_layout) -> None:
    """An fp8 (e4m3) KV cache: the kernel widens each loaded tile to q's dtype, or (widen="fp16",
    the GPU's default for 16-bit q) with q pre-scaled and the probabilities in fp16; same answer as
    the reference reading the same fp8 cache (NaN poison survives the cast, so unowned slots
    still fail the test if read; keys_inner: V's unowned slots hold 448, finite as that layout needs).
    widen="k8" (QK^T on FP8 tensor cores) rounds q to e4m3 per row: the reference gets q so rounded."""
    q, kc, vc, bt, qsl, sl = make_prefill(prefix, new, hq, hk, d, 16, dtype)
    kc8, vc8 = kc.to(FP8), to_v_layout(vc.to(FP8), v_layout, stale=448.0)
    assert kc8.float().isnan().any(), "the poison must survive the fp8 cast"
    out = paged_attention_triton(q, kc8, vc8, bt, qsl, sl, d**-0.5, window, max_query_len=max(new), widen=widen,
                                 **tiles)
    assert not out.isnan().any()
    q_ref = q_as_e4m3_ref(q, d**-0.5) if widen == "k8" else q
    ref = paged_attention_ref(q_ref, kc8, vc8, bt, qsl, sl, d**-0.5, window)
    torch.testing.assert_close(out, ref.to(out.dtype), **TOL[dtype])
    if widen == "k8":  # the rounding of q is what it adds: against the unrounded q it is farther off
        exact = paged_attention_ref(q.float(), kc8, vc8, bt, qsl, sl, d**-0.5, window)
        err = lambda a: float((a.float() - exact).norm() / exact.norm())  # noqa: E731
        assert err(ref) > 4 * err(paged_attention_ref(q, kc8, vc8, bt, qsl, sl, d**-0.5, window)), "q not rounded?"
        assert err(out) < 0.05
        split = paged_attention_triton(q, kc8, vc8, bt, qsl, sl, d**-0.5, window, max_query_len=max(new),
                                       widen=widen, num_splits=3, **tiles)  # each split scales its scores alike
        torch.testing.assert_close(split, ref.to(out.dtype), **TOL[dtype])
    # and it is the quantized cache that is read: the unquantized answer differs by far more than TOL
    if dtype == F32:
        assert not torch.allclose(out, paged_attention_ref(q, kc, vc, bt, qsl, sl, d**-0.5, window), **TOL[F32])


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize(("dtype", "widen"), [(F32, None), (BF16, None), (BF16, "fp16")])
@pytest.mark.parametrize(("ctx", "hq", "hk", "d", "window", "splits", "block_n"), DECODE_CASES[:4])
@pytest.mark.parametrize("v_layout", ["rows", "keys_inner"])
def test_decode_fp8_cache(dtype, widen, ctx, hq, hk, d, window, splits, block_n, v_layout) -> None:
    """fp8 tiles widened to q's dtype, or (widen="fp16") with q and the probabilities in fp16."""
    kc, vc, bt = make_paged_kv(ctx, hk, d, 16, dtype)
    kc8, vc8 = kc.to(FP8), to_v_layout(vc.to(FP8), v_layout, stale=448.0)
    q = torch.randn(len(ctx), hq + 2 * hk, d).to(dtype)[:, :hq]
    sl = torch.tensor(ctx, dtype=torch.int32)
    out = decode_attention_triton(q, kc8, vc8, bt, sl, d**-0.5, window, num_splits=splits, block_n=block_n,
                                  widen=widen)
    assert not out.isnan().any()
    torch.testing.assert_close(out, decode_attention_ref(q, kc8, vc8, bt, sl, d**-0.5, window), **TOL[dtype])


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("v_layout", ["rows", "keys_inner"])
def test_decode_fp8_cache_blocks_of_64(v_layout) -> None:
    """An fp8 cache's default decode (since session 23): blocks of 64, tiles widened to fp16, the block ids a tile ahead."""
    ctx, hq, hk, d = [5, 64, 190], 8, 2, 64
    kc, vc, bt = make_paged_kv(ctx, hk, d, 64, BF16)
    kc8, vc8 = kc.to(FP8), to_v_layout(vc.to(FP8), v_layout, stale=448.0)
    q = torch.randn(len(ctx), hq + 2 * hk, d).to(BF16)[:, :hq]
    sl = torch.tensor(ctx, dtype=torch.int32)
    out = decode_attention_triton(q, kc8, vc8, bt, sl, d**-0.5, None, num_splits=2, widen="fp16", prefetch=True)
    assert not out.isnan().any()
    torch.testing.assert_close(out, decode_attention_ref(q, kc8, vc8, bt, sl, d**-0.5, None), **TOL[BF16])


def test_fp8_cache_rules() -> None:
    q, kc, vc, bt, qsl, sl = make_prefill([0], [5], 4, 1, 64, 16, F32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        paged_attention_triton(q, kc.to(FP8), vc, bt, qsl, sl, 0.125)  # k and v caches differ
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        paged_attention_triton(q, kc.half(), vc.half(), bt, qsl, sl, 0.125)  # 16-bit cache, fp32 q


@pytest.mark.parametrize("rows_per_program", [1, 4, 16])
@pytest.mark.parametrize(("rows", "splits"), [(1, 1), (37, 5), (130, 3), (9, 70)])
def test_combine_splits_rows_per_program(rows, splits, rows_per_program) -> None:
    """The split combination, any rows per program (a partial last program), against the
    log-sum-exp formula; splits that saw no key (l = 0, acc never written: NaN here) drop out."""
    from kernels.prefill_attention import combine_splits, split_partials

    d = 72  # not a power of two
    g = torch.Generator().manual_seed(rows * 7 + splits)
    m, lsum, acc = split_partials(rows, splits, d, torch.device("cpu"))
    m.copy_(torch.randn(rows, splits, generator=g) * 4)
    lsum.copy_(torch.rand(rows, splits, generator=g) + 0.1)
    acc.copy_(torch.randn(rows, splits, d, generator=g))
    empty = torch.rand(rows, splits, generator=g) < 0.3
    empty[0] = True  # a row with no key at all gives zeros
    m[empty], lsum[empty] = -1.0e30, 0.0
    acc[empty] = float("nan")
    out = torch.empty(rows, d)
    combine_splits(m, lsum, acc, out, False, rows_per_program)
    w = torch.where(empty, 0.0, torch.exp2(m - m.max(1, keepdim=True).values))
    num = (w[:, :, None] * torch.nan_to_num(acc)).sum(1)
    den = (w * lsum).sum(1, keepdim=True)
    want = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert out[0].abs().max() == 0.0


def test_plan_prefill_splits_follows_the_context() -> None:
    """What a prefill graph asks before replaying: split only when the context is long."""
    from kernels.prefill_attention import plan_prefill_splits

    kc = torch.zeros(4, 16, 2, 64)
    short = plan_prefill_splits(BF16, 8, kc, 16, 16, 16, 160, None)
    long = plan_prefill_splits(BF16, 8, kc, 16, 16, 16, 8192, None)
    assert short == 1 and long > 1
    # a sliding window does not change the count (the graphs ask without one)
    assert plan_prefill_splits(BF16, 8, kc, 16, 16, 16, 8192, 32) == long
