"""FP8 dense prefill attention (kernels/cudnn_attention.py) on the CPU: the one-launch e4m3 cast of q | k | v
(Triton's interpreter) against its reference, and the PyTorch emulation of cuDNN's FP8 forward against
exact attention. cuDNN itself runs only on a GPU (bench/bench_fp8_attention.py, tests/workers/engine/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import cudnn_attention as ca
from kernels.fp8_linear import FP8, FP8_MAX
from kernels.fp8_quant import cast_e4m3_ref, cast_e4m3_triton


def _steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 steps two e4m3 tensors are apart, per element (their codes are ordered within a sign)."""
    ia, ib = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    sa, sb = ia >> 7, ib >> 7
    same_sign = (ia & 127) - (ib & 127)
    return torch.where(sa == sb, same_sign.abs(), (ia & 127) + (ib & 127))


@pytest.mark.parametrize(("t", "c", "v_col", "dtype"), [(1, 5, 3, torch.float32), (7, 1100, 700, torch.float32),
                                                       (33, 96, 64, torch.bfloat16), (3, 40, 40, torch.float32)])
def test_cast_e4m3_matches_its_reference(poison_empty, t, c, v_col, dtype):
    """Rows wider than one program's block and narrower; V columns in the last program only, across
    programs, or none; values beyond +-448 saturate, not NaN; O's scale from the V columns only."""
    g = torch.Generator().manual_seed(t * c)
    x = (torch.randn(t, c, generator=g) * 3).to(dtype)
    x[0, 0] = 1000.0  # beyond e4m3: clamped to 448, and outside V: not in O's scale
    if v_col < c:
        x[-1, c - 1] = -20.0  # V's largest magnitude, negative, in the last column
        x[0, v_col] = float("nan")  # not in O's scale
    y, scale = cast_e4m3_triton(x, v_col, ca.O_MARGIN)
    yr, sr = cast_e4m3_ref(x, v_col, ca.O_MARGIN)
    assert y.dtype == FP8 and y.shape == (t, c) and scale.shape == (1,)
    assert float(y[0, 0].float()) == FP8_MAX
    # the same codes: the interpreter's emulated rounding is torch's and the GPU's, to nearest with ties
    # to even (bf16 inputs put many values on a tie; rounded half away from zero they were a step apart)
    # the NaN element: the reference keeps it; Triton's interpreter casts an fp32 NaN to e4m3 as 384
    # (the GPU's cvt keeps NaN), so it is left out of the comparison here
    nan = yr.float().isnan()
    assert int(nan.sum()) == (1 if v_col < c else 0)
    apart = _steps_apart(y, yr)[~nan]
    assert int(apart.max()) == 0
    torch.testing.assert_close(scale, sr, rtol=1e-6, atol=0)
    want = FP8_MAX / (ca.O_MARGIN * (20.0 if v_col < c else 2.0**-9))
    assert float(scale) == pytest.approx(want, rel=1e-6)


def test_cast_e4m3_into_a_longer_buffer_shares_one_scale(poison_empty):
    """out: the first T rows of a padded buffer are written, the rest left; a given scale tensor takes
    the minimum (two casts, one V scale)."""
    x1 = torch.randn(5, 24) * 2
    x2 = torch.randn(5, 24) * 8
    buf = torch.zeros(8, 24, dtype=FP8)
    scale = torch.full((1,), 1e6)
    y, s = cast_e4m3_triton(x1, 16, 1.0, scale=scale, out=buf)
    assert y is buf and s is scale
    assert bool((buf[5:].float() == 0).all())
    cast_e4m3_triton(x2, 16, 1.0, scale=scale)
    amax = max(float(x1[:, 16:].abs().max()), float(x2[:, 16:].abs().max()))
    assert float(scale) == pytest.approx(FP8_MAX / amax, rel=0.07)  # amax as cast: within one e4m3 step


def _exact(q, k, v, scale):
    t, hq, _ = q.shape
    g = hq // k.shape[1]
    s = torch.einsum("thd,shd->hts", q.double(), k.double().repeat_interleave(g, 1)) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), v.double().repeat_interleave(g, 1))


def test_fp8_attention_emulation_against_exact_attention():
    """The emulation of cuDNN's FP8 forward stays within FP8's error of exact attention over the same
    e4m3 q/k/v (P and O rounded to e4m3: a few percent RMS), and is not that close to a wrong answer:
    attention without the causal mask is far off."""
    g = torch.Generator().manual_seed(0)
    t, hq, hk, d = 37, 4, 2, 16
    q = torch.randn(t, hq, d, generator=g) * 2
    k = torch.randn(t, hk, d, generator=g)
    v = torch.randn(t, hk, d, generator=g) * 0.5
    q8, k8, v8 = (x.to(FP8) for x in (q, k, v))
    o_scale = torch.tensor([FP8_MAX / (ca.O_MARGIN * float(v8.float().abs().max()))])
    o = ca.causal_attention_fp8_ref(q8, k8, v8, d**-0.5, o_scale).double() / float(o_scale)
    exact = _exact(q8.float(), k8.float(), v8.float(), d**-0.5)
    err = float((o - exact).norm() / exact.norm())
    assert err < 0.05, err
    full = torch.einsum("hts,shd->thd", torch.softmax(torch.einsum(
        "thd,shd->hts", q8.double(), k8.double().repeat_interleave(2, 1)) * d**-0.5, -1), v8.double().repeat_interleave(2, 1))
    assert float((full - exact).norm() / exact.norm()) > 10 * err


def test_dense_attention_fp8_takes_the_fused_rows_or_separate_tensors():
    """The layer op (reference mode): q/k/v as views of one fused projection's rows, or as separate
    tensors, give the same (e4m3 [T, Hq * D], descale [T, 1]); the descale is 1 / O's scale per row."""
    g = torch.Generator().manual_seed(1)
    t, hq, hk, d = 19, 4, 2, 8
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)
    q, k, v = ca.qkv_views(qkv, hq, hk, d)
    assert (q.shape, k.shape, v.shape) == ((t, hq, d), (t, hk, d), (t, hk, d))
    assert torch.equal(v[3, 1], qkv[3, (hq + hk) * d + d :])
    assert ca._split_qkv(q, k, v).data_ptr() == qkv.data_ptr()  # the views' rows found again
    o8, descale = ca.dense_attention_fp8(q, k, v, d**-0.5, reference=True)
    qs, ks, vs = q.clone(), k.clone(), v.clone()
    assert ca._split_qkv(qs, ks, vs) is None
    o8s, descale_s = ca.dense_attention_fp8(qs, ks, vs, d**-0.5, reference=True)
    assert o8.dtype == FP8 and o8.shape == (t, hq * d) and descale.shape == (t, 1)
    assert torch.equal(o8.view(torch.uint8), o8s.view(torch.uint8)) and torch.equal(descale, descale_s)
    want = FP8_MAX / (ca.O_MARGIN * float(v.to(FP8).float().abs().max()))
    torch.testing.assert_close(descale, torch.full((t, 1), 1 / want), rtol=1e-6, atol=0)
    exact = _exact(q.to(FP8).float(), k.to(FP8).float(), v.to(FP8).float(), d**-0.5).reshape(t, hq * d)
    assert float(((o8.double() * descale.double()) - exact).norm() / exact.norm()) < 0.05


def test_buckets_are_an_eighth_of_an_octave():
    """Up to 2048 each length its own; then buckets 256 apart up to 4096, 512 up to 8192, ... so a prompt
    runs at most 1/8 more rows than it has; buckets_up_to lists each once."""
    assert [ca.bucket_tokens(n) for n in (1, 1025, 2048, 2049, 2304, 2305, 4095, 4096, 4097, 8191, 8193, 32768)] == \
        [1, 1025, 2048, 2304, 2304, 2560, 4096, 4096, 4608, 8192, 9216, 32768]
    for n in range(2049, 70000, 7):
        b = ca.bucket_tokens(n)
        assert n <= b < n * 1.125 + 256 and ca.bucket_tokens(b) == b, n
    ups = ca.buckets_up_to(8192)
    assert ups == [2304, 2560, 2816, 3072, 3328, 3584, 3840, 4096, 4608, 5120, 5632, 6144, 6656, 7168, 7680, 8192]
    assert ca.buckets_up_to(2048) == [] and ca.buckets_up_to(2049) == [2304]


def test_available_says_why_not_on_a_cpu():
    assert "CUDA" in ca.available("cpu")


def test_release_drops_one_devices_graphs(monkeypatch):
    """An engine closing drops cuDNN's graphs (and workspaces) of its device ("cuda" meaning every index),
    not another device's."""
    graphs = {("s", "st", "k", "ks", "vs", "os", 0.1, torch.device("cuda", 0), False): "g0",
              ("s", "st", "k", "ks", "vs", "os", 0.1, torch.device("cuda", 1), True): "g1"}
    consts = {torch.device("cuda", 0): "c0", torch.device("cuda", 1): "c1"}
    monkeypatch.setattr(ca, "_GRAPHS", graphs)
    monkeypatch.setattr(ca, "_CONSTS", consts)
    ca.release("cuda:1")
    assert list(graphs.values()) == ["g0"] and list(consts.values()) == ["c0"]
    ca.release("cuda")
    assert graphs == {} and consts == {}


def test_warm_up_builds_every_bucket_until_memory_runs_out(monkeypatch):
    """Every bucket's graph is built at start, smallest first, one call each on zeros [bucket, (Hq + 2 Hk) D];
    where a bucket's buffers do not fit, the rest are left to their first prompt (no failed start)."""
    seen = []

    def fake(q, k, v, scale):
        seen.append((q.shape[0], q.shape[1:], k.shape[1:], float(q.abs().sum())))
        if q.shape[0] > 4096:
            raise torch.cuda.OutOfMemoryError("no room")
        return q

    monkeypatch.setattr(ca, "dense_attention_fp8", fake)
    assert ca.warm_up(4, 2, 8, 0.3, torch.float32, torch.device("cpu"), 3000) == 3072
    assert [s[0] for s in seen] == [2304, 2560, 2816, 3072] and seen[0][1:3] == ((4, 8), (2, 8))
    assert all(s[3] == 0 for s in seen)
    seen.clear()
    assert ca.warm_up(4, 2, 8, 0.3, torch.float32, torch.device("cpu"), 8192) == 4096
    assert [s[0] for s in seen][-2:] == [4096, 4608]
    assert ca.warm_up(4, 2, 8, 0.3, torch.float32, torch.device("cpu"), 2048) == 0


def test_a_refused_graph_is_remembered_and_the_layer_runs_bf16(monkeypatch, caplog):
    """cuDNN refusing a graph (its version, the device, the shape) raises Unsupported, remembered so the
    next call does not build again; the attention layer then runs that prompt's attention in bf16 (a tensor
    for the o_proj, as without FP8 attention), logging the fallback once."""
    import logging

    from workers.engine.attention import AttentionMetadata, PagedAttention

    calls = []

    def refuse(*args):
        calls.append(1)
        raise RuntimeError("no engine for this graph")

    monkeypatch.setattr(ca, "_build", refuse)
    monkeypatch.setattr(ca, "_GRAPHS", {})
    monkeypatch.setattr(ca, "_FAILED", {})
    q8 = torch.zeros(4, 2, 64, dtype=FP8)
    for _ in range(2):
        with pytest.raises(ca.Unsupported, match="no engine for this graph"):
            ca._graph(q8, q8[:, :1], q8[:, :1], 0.125, q8, False)
    assert len(calls) == 1  # the second call did not build again

    class Ops:
        dense_attention_fp8_rope = None

        def dense_attention_fp8(self, q, k, v, scale):
            raise ca.Unsupported("refused here")

    attn = PagedAttention(Ops(), 2, 1, 64, None)
    assert attn.dense_fp8 is not None
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 2, 64, generator=g), torch.randn(5, 1, 64, generator=g), torch.randn(5, 1, 64, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.arange(5), num_decodes=0, num_decode_tokens=0,
                             decode_block_tables=None, decode_seq_lens=None, prefill_block_tables=None,
                             prefill_query_start_loc=None, prefill_seq_lens=None, prefill_dense=True)
    with caplog.at_level(logging.WARNING, logger="workers.engine.attention"):
        out = attn(q, k, v, None, None, meta)
        out2 = attn(q, k, v, None, None, meta)
    from workers.engine.attention import dense_causal_attention

    assert torch.equal(out, dense_causal_attention(q, k, v, 64**-0.5)) and torch.equal(out, out2)
    assert sum("refused here" in r.getMessage() for r in caplog.records) == 1
