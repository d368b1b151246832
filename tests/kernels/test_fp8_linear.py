"""FP8 W8A8 linear layers: row-wise quantization within e4m3's error, the reference GEMM against
fp32 on awkward shapes with tolerances that fail on a wrong scale, and the engine with
quantization="fp8" serving the tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from kernels.fp8_linear import FP8, FP8_MAX, fp8_linear_ref, quantize_rowwise, quantize_weight
from workers.engine.quantization import Fp8Linear


@pytest.mark.parametrize(("rows", "cols"), [(1, 6), (7, 42), (123, 64), (33, 431)])
def test_rowwise_quantization_error(rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)  # rows of any magnitude
    q, scale = quantize_rowwise(x)
    assert q.dtype == FP8 and scale.shape == (rows, 1)
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((rows,), FP8_MAX))  # each row uses the range
    back = q.float() * scale
    rel = (back - x).abs() / x.abs().amax(dim=1, keepdim=True)
    assert rel.max() <= 2**-4 + 1e-6  # e4m3: 3 mantissa bits, half an ulp at the top of the range
    assert torch.equal(quantize_rowwise(torch.zeros(2, 5))[0].float(), torch.zeros(2, 5))  # no division by 0


def _q4_grid_rows(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Rows as a dequantized 4-bit checkpoint has them (SmolLM2's Q4_1): each block of 32 columns
    min + d x {0..15}, with its own d and min."""
    blocks = k // 32
    d = torch.rand(n, blocks, 1, generator=g) * 0.02 + 0.001
    lo = -8 * d + torch.randn(n, blocks, 1, generator=g) * 0.002
    levels = torch.randint(0, 16, (n, blocks, 32), generator=g).float()
    return (lo + d * levels).reshape(n, k)


@pytest.mark.parametrize("kind", ["gaussian", "q4_grid"])
def test_weight_scale_search_never_loses_to_amax(kind):
    """Each channel's searched scale leaves at most amax / 448's squared error (amax is its first
    candidate), lies in [0.7, 1] x amax / 448, and on a 4-bit checkpoint's grid takes a visible
    share of the error away; rows are independent of how they are chunked; search=False is amax."""
    g = torch.Generator().manual_seed(7)
    n, k = 48, 256
    w = (torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n).unsqueeze(1) if kind == "gaussian"
         else _q4_grid_rows(n, k, g))
    q_a, s_a = quantize_rowwise(w)
    q_s, s_s = quantize_weight(w)
    err_a = (q_a.float() * s_a - w).square().sum(1)
    err_s = (q_s.float() * s_s - w).square().sum(1)
    assert q_s.dtype == FP8 and s_s.shape == (n, 1)
    assert bool((err_s <= err_a).all())
    ratio = s_s / (w.abs().amax(1, keepdim=True) / FP8_MAX)
    assert bool(((ratio > 0.7 - 1e-6) & (ratio < 1 + 1e-6)).all())
    # per row, mean error ratio (seeds 7-9): gaussian 0.93-0.95, 4-bit grid 0.895-0.905
    mean_ratio = (err_s / err_a).mean().item()
    assert mean_ratio < (0.97 if kind == "gaussian" else 0.93), mean_ratio
    q_c, s_c = quantize_weight(w, chunk=3 * k)  # 16 chunks of 3 rows
    assert torch.equal(q_c.view(torch.uint8), q_s.view(torch.uint8)) and torch.equal(s_c, s_s)
    q_n, s_n = quantize_weight(w, search=False)
    assert torch.equal(q_n.view(torch.uint8), q_a.view(torch.uint8)) and torch.equal(s_n, s_a)


@pytest.mark.parametrize(("t", "k", "n", "dtype"), [(1, 16, 32, torch.float32), (6, 42, 123, torch.float32),
                                                      (123, 431, 64, torch.bfloat16), (17, 576, 960, torch.float32)])
def test_fp8_linear_reference_against_fp32(t, k, n, dtype):
    g = torch.Generator().manual_seed(t + k + n)
    x = torch.randn(t, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g)
    w_q, w_scale = quantize_rowwise(w)
    got = fp8_linear_ref(x, w_q, w_scale, bias)
    assert got.dtype == dtype and got.shape == (t, n)
    want = x.float() @ w.t() + bias
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < 0.04, err  # two e4m3 roundings, averaged over K products
    if t < 4:
        return
    # the scales matter: a wrong one (per-tensor amax instead of per row) is visibly worse on skewed rows
    skew = x.float() * torch.logspace(-2, 2, t).unsqueeze(1)
    per_tensor = (skew / (skew.abs().max() / FP8_MAX)).to(FP8).float() * (skew.abs().max() / FP8_MAX)
    assert ((per_tensor - skew).norm(dim=1) / skew.norm(dim=1)).max() > (
        (quantize_rowwise(skew)[0].float() * quantize_rowwise(skew)[1] - skew).norm(dim=1) / skew.norm(dim=1)
    ).max()


def test_fp8_linear_module_and_model_swap():
    lin = torch.nn.Linear(64, 96, bias=True)
    f = Fp8Linear(lin)
    assert f.kernel == "reference" and f.weight_fp8.dtype == FP8  # CPU: the reference GEMM
    x = torch.randn(5, 64)
    assert ((f(x) - lin(x)).norm() / lin(x).norm()).item() < 0.04


def test_engine_serves_with_fp8_projections():
    from schemas.sampling import SamplingParams
    from workers.engine import EngineConfig, LLMEngine

    base = LLMEngine("tiny", EngineConfig(device="cpu"))
    fp8 = LLMEngine("tiny", EngineConfig(device="cpu", quantization="fp8"))
    layer = fp8.runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    assert sum(isinstance(m, Fp8Linear) for m in fp8.runner.model.modules()) == 4 * len(fp8.runner.model.layers)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for name, eng in (("base", base), ("fp8", fp8)):
        for i, p in enumerate(["The quick brown fox", "Kafka partitions", "def f(x):"]):
            eng.add_request(f"{name}{i}", prompt=p, sampling=sp)
        while eng.has_unfinished():
            for f in eng.step().finished:
                outs[f.request_id] = f.output_token_ids
    assert all(len(v) == 8 for v in outs.values())
    # a quantized model is a close model: most greedy tokens agree (the random tiny model is the worst case)
    same = sum(a == b for i in range(3) for a, b in zip(outs[f"base{i}"], outs[f"fp8{i}"]))
    assert same >= 8, outs


# --- RMSNorm / SiLU-and-mul fused with the activation quantization (kernels/fp8_quant.py) ---------

@pytest.mark.parametrize(("t", "h", "dtype", "residual"), [(1, 6, torch.float32, False), (7, 42, torch.float32, True),
                                                           (33, 431, torch.bfloat16, True), (5, 128, torch.float16, False)])
def test_rms_norm_quant_triton_matches_the_unfused_path(poison_empty, t, h, dtype, residual):
    from kernels.fp8_quant import rms_norm_quant_ref, rms_norm_quant_triton

    g = torch.Generator().manual_seed(t * h)
    x = (torch.randn(t, h, generator=g) * 3).to(dtype)
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    r = torch.randn(t, h, generator=g).to(dtype) if residual else None
    (q, s), nr = rms_norm_quant_triton(x, w, 1e-5, r)
    (qr, sr), nrr = rms_norm_quant_ref(x, w, 1e-5, r)
    assert q.dtype == FP8 and s.shape == (t, 1) and not s.isnan().any()
    torch.testing.assert_close(s, sr, rtol=_scale_rtol(dtype), atol=0)
    _same_up_to_one_step(q, s, qr, sr, dtype)
    torch.testing.assert_close(nr, nrr)


@pytest.mark.parametrize(("t", "inter", "dtype"), [(1, 6, torch.float32), (7, 42, torch.float32),
                                                  (33, 431, torch.bfloat16), (4, 128, torch.float16)])
def test_silu_and_mul_quant_triton_matches_the_unfused_path(poison_empty, t, inter, dtype):
    """The whole-row kernel, the row's largest magnitude negative and in its last column."""
    from kernels.fp8_quant import silu_and_mul_quant_ref, silu_and_mul_quant_triton

    g = torch.Generator().manual_seed(t + inter)
    x = (torch.randn(t, 2 * inter, generator=g) * 2).to(dtype)
    x[-1, inter - 1], x[-1, 2 * inter - 1] = 9.0, -9.0  # the row's largest magnitude: negative, in its last column
    q, s = silu_and_mul_quant_triton(x)
    qr, sr = silu_and_mul_quant_ref(x)
    torch.testing.assert_close(s, sr, rtol=_scale_rtol(dtype), atol=0)
    _same_up_to_one_step(q, s, qr, sr, dtype)


@pytest.mark.parametrize(("t", "inter", "dtype", "chunk"), [(1, 6, torch.float32, 16), (7, 42, torch.float32, 16),
                                                           (33, 431, torch.bfloat16, 64), (4, 128, torch.float16, 32)])
def test_silu_and_mul_quant_in_chunks_matches_the_unfused_path(poison_empty, t, inter, dtype, chunk):
    """The two-pass kernel (the row in chunks: its largest magnitude, then the quantized row):
    rows of one chunk, of several, and a last chunk cut short."""
    from kernels.fp8_quant import silu_and_mul_quant_ref, silu_and_mul_quant_triton

    g = torch.Generator().manual_seed(t * inter + chunk)
    x = (torch.randn(t, 2 * inter, generator=g) * 2).to(dtype)
    x[0, inter - 1] = 9.0  # the row's largest value in its last column: a pass that skips the tail misses it
    x[0, 2 * inter - 1] = 9.0
    q, s = silu_and_mul_quant_triton(x, chunk=chunk)
    qr, sr = silu_and_mul_quant_ref(x)
    torch.testing.assert_close(s, sr, rtol=_scale_rtol(dtype), atol=0)
    _same_up_to_one_step(q, s, qr, sr, dtype)


def _scale_rtol(dtype):
    # 16-bit outputs are rounded twice before the scale is taken, and Triton's interpreter truncates
    # fp32 -> 16-bit where torch rounds (kernel_testutil.py): two 16-bit ulps apart at most
    return 1e-5 if dtype == torch.float32 else 2 * 2.0 ** -(7 if dtype == torch.bfloat16 else 10)


def _same_up_to_one_step(q, s, qr, sr, dtype):
    """The same e4m3 values, but for a few one e4m3 step apart (a value on a rounding boundary whose
    fp32 computation differs in the last bit); a wrong scale or index moves many, by more. Scales
    per row ([T, 1])."""
    got, want = q.float() * s, qr.float() * sr
    step = 0.125 * want.abs() + 2.0**-9 * sr  # one step: 3 mantissa bits, or a subnormal step
    step = step * (1.0 + _scale_rtol(dtype)) + (s - sr).abs() * 448
    assert ((got - want).abs() <= step * 1.001).all(), ((got - want).abs() / step).max()
    moved = (q.float() != qr.float()).sum()
    assert moved <= max(2, q.numel() // (50 if dtype == torch.float32 else 5)), moved


def test_fused_activation_quantization_gives_the_unfused_tokens():
    """Norms and SiLU handing FP8 projections quantized activations (quantize_fp8(fuse=True), the
    engine's default) compute what quantizing inside each projection computes."""
    from schemas.sampling import SamplingParams
    from workers.engine import EngineConfig, LLMEngine
    from workers.engine.quantization import quantize_fp8

    fused = LLMEngine("tiny", EngineConfig(device="cpu", quantization="fp8"))
    layer = fused.runner.model.layers[0]
    assert layer.input_layernorm.norm_fn is fused.runner.ops.rms_norm_quant
    assert layer.mlp.act_fn is fused.runner.ops.silu_and_mul_quant
    plain = LLMEngine("tiny", EngineConfig(device="cpu"))
    assert quantize_fp8(plain.runner.model, fuse=False) == 4 * len(plain.runner.model.layers)
    assert plain.runner.model.layers[0].input_layernorm.norm_fn is plain.runner.ops.rms_norm
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for name, eng in (("fused", fused), ("plain", plain)):
        for i, p in enumerate(["The quick brown fox", "Kafka partitions", "def f(x):"]):
            eng.add_request(f"{i}", prompt=p, sampling=sp)
        got = {}
        while eng.has_unfinished():
            for f in eng.step().finished:
                got[f.request_id] = f.output_token_ids
        outs[name] = got
    assert outs["fused"] == outs["plain"]


@pytest.mark.parametrize(("m", "n", "k", "bias", "out_dtype", "block_m"), [
    (1, 32, 16, False, torch.float32, None), (3, 96, 272, True, torch.float32, None),
    (16, 70, 100, False, torch.bfloat16, None), (7, 33, 431, True, torch.float32, None),
    (40, 48, 128, True, torch.float32, None), (64, 16, 64, False, torch.bfloat16, None),
    (37, 40, 96, True, torch.float32, 16), (130, 24, 80, False, torch.bfloat16, None),
])
def test_small_m_gemm_triton_against_reference(poison_empty, m, n, k, bias, out_dtype, block_m):
    """The few-row GEMM (per-token and per-channel scales) against the fp32 reference of the same
    quantized operands, on ragged N and K, in one row tile and in several (a ragged last one:
    37 rows in tiles of 16, 130 in tiles of 64), poisoned outputs: every element written."""
    from kernels_testutil_tol import tol

    from kernels.fp8_gemm import fp8_gemm_rowwise_small_m
    from kernels.fp8_linear import fp8_gemm_ref

    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m).unsqueeze(1)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n).unsqueeze(1)  # a scale per channel matters
    b = torch.randn(n, generator=g) if bias else None
    a_q, a_s = quantize_rowwise(x)
    w_q, w_s = quantize_rowwise(w)
    got = fp8_gemm_rowwise_small_m(a_q, a_s, w_q, w_s, b, out_dtype, block_n=16, block_k=64, block_m=block_m)
    want = fp8_gemm_ref(a_q, a_s, w_q, w_s, b, out_dtype)
    assert got.dtype == out_dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **tol(out_dtype))
    swapped = fp8_gemm_rowwise_small_m(a_q, a_s, w_q, w_s.flip(0), b, out_dtype, block_n=16, block_k=64,
                                       block_m=block_m)
    assert not torch.allclose(swapped.float(), want.float(), **tol(out_dtype))  # the scales are per channel
    with pytest.raises(ValueError):
        fp8_gemm_rowwise_small_m(a_q, a_s[:-1], w_q, w_s)  # a scale per row of A


@pytest.mark.parametrize(("m", "n", "k", "split", "bias"), [
    (130, 24, 272, 3, True), (70, 40, 431, 2, False), (9, 16, 200, 4, False), (65, 33, 64, 3, True),
])
def test_small_m_gemm_split_k_against_reference(poison_empty, m, n, k, split, bias):
    """K in parts (the last part ragged, or fewer parts than asked when K is short: 64 columns in
    tiles of 64 make one), the last program to arrive adding the fp32 partials: the reference's
    result, the same bits twice (the parts are added in part order whichever arrives last), and
    the counters back at zero for the next launch."""
    from kernels_testutil_tol import tol

    from kernels._triton import ARRIVAL_COUNTERS
    from kernels.fp8_gemm import fp8_gemm_rowwise_small_m
    from kernels.fp8_linear import fp8_gemm_ref

    g = torch.Generator().manual_seed(m + n * k)
    a_q, a_s = quantize_rowwise(torch.randn(m, k, generator=g))
    w_q, w_s = quantize_rowwise(torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n).unsqueeze(1))
    b = torch.randn(n, generator=g) if bias else None
    kw = {"block_n": 16, "block_k": 64, "block_m": 32, "split": split}
    got = fp8_gemm_rowwise_small_m(a_q, a_s, w_q, w_s, b, torch.float32, **kw)
    want = fp8_gemm_ref(a_q, a_s, w_q, w_s, b, torch.float32)
    torch.testing.assert_close(got, want, **tol(torch.float32))
    assert torch.equal(fp8_gemm_rowwise_small_m(a_q, a_s, w_q, w_s, b, torch.float32, **kw), got)
    one = fp8_gemm_rowwise_small_m(a_q, a_s, w_q, w_s, b, torch.float32, **{**kw, "split": 1})
    torch.testing.assert_close(one, got, **tol(torch.float32))
    if k > 64:  # the parts' sums really are partial: dropping the last part's sum is far off
        assert not torch.allclose(got, fp8_gemm_ref(a_q[:, :64].contiguous(), a_s, w_q[:, :64].contiguous(), w_s, b,
                                                      torch.float32), **tol(torch.float32))
    counters = ARRIVAL_COUNTERS.get(got.device)
    assert counters is not None and int(counters.abs().sum()) == 0


@pytest.mark.parametrize(("m", "n", "k", "split", "bias", "out_dtype", "tiles"), [
    (128, 96, 272, 1, True, torch.float32, (128, 32, 64)), (130, 40, 256, 1, False, torch.bfloat16, (64, 16, 64)),
    (100, 33, 208, 3, True, torch.float32, (128, 16, 32)), (7, 64, 64, 2, False, torch.float32, (16, 32, 64)),
])
def test_tma_gemm_against_reference(poison_empty, m, n, k, split, bias, out_dtype, tiles):
    """The few-row GEMM with TMA loads: the reference's result on ragged M and N (rows and channels past
    the tensor read as zeros), K split or not (the parts' sums added in part order: the same bits twice),
    per-channel scales that matter, poisoned outputs; K not a multiple of 16 is refused."""
    from kernels_testutil_tol import tol

    from kernels.fp8_gemm import fp8_gemm_rowwise_tma
    from kernels.fp8_linear import fp8_gemm_ref

    g = torch.Generator().manual_seed(m * n + k)
    a_q, a_s = quantize_rowwise(torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m).unsqueeze(1))
    w_q, w_s = quantize_rowwise(torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n).unsqueeze(1))
    b = torch.randn(n, generator=g) if bias else None
    kw = dict(zip(("block_m", "block_n", "block_k"), tiles, strict=True)) | {"split": split}
    got = fp8_gemm_rowwise_tma(a_q, a_s, w_q, w_s, b, out_dtype, **kw)
    want = fp8_gemm_ref(a_q, a_s, w_q, w_s, b, out_dtype)
    assert got.dtype == out_dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **tol(out_dtype))
    assert torch.equal(fp8_gemm_rowwise_tma(a_q, a_s, w_q, w_s, b, out_dtype, **kw), got)
    swapped = fp8_gemm_rowwise_tma(a_q, a_s, w_q, w_s.flip(0), b, out_dtype, **kw)
    assert not torch.allclose(swapped.float(), want.float(), **tol(out_dtype))
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_gemm_rowwise_tma(a_q[:, : k - 8].contiguous(), a_s, w_q[:, : k - 8].contiguous(), w_s)


@pytest.mark.parametrize(("t", "c", "dtype"), [(1, 16, torch.float32), (5, 100, torch.bfloat16), (3, 96, torch.float32),
                                               (9, 4096 // 8, torch.bfloat16)])
def test_quantize_triton_matches_torch(poison_empty, t, c, dtype):
    """o_proj's input quantization in one kernel: torch's scales, and e4m3 values equal but where a
    scale's last bit moves a value across a rounding boundary (both round to nearest, ties to even)."""
    from kernels.fp8_linear import dequantize, quantize
    from kernels.fp8_quant import quantize_triton

    g = torch.Generator().manual_seed(t * c)
    x = (torch.randn(t, c, generator=g) * torch.logspace(-3, 3, t).unsqueeze(1)).to(dtype)
    q, s = quantize_triton(x)
    q_ref, s_ref = quantize(x)
    assert q.dtype == FP8 and s.shape == s_ref.shape == (t, 1)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() != q_ref.float()).float().mean() < 0.01
    back = dequantize(q, s)
    rel = (back - x.float()).abs().amax(-1) / x.float().abs().amax(-1)
    assert rel.max() <= 2**-4 + 1e-6


def test_small_m_sweep_override(tmp_path, monkeypatch):
    """A sweep's picks above 64 rows (FIRSTTOKEN_FP8_SMALL_M_CONFIG): the few-row kernel up to the
    last bucket it won without a gap, its config there; the built-in choice for weights not listed."""
    from kernels import fp8_gemm

    path = tmp_path / "picks.json"
    path.write_text('{"14336,4096": {"128": [128, 32, 128, 4, 4, 4], "256": [64, 32, 256, 4, 4, 2]},'
                    ' "4096,6144": {"128": null, "256": [128, 64, 128, 8, 3, 2]}}')
    monkeypatch.setenv("FIRSTTOKEN_FP8_SMALL_M_CONFIG", str(path))
    monkeypatch.setattr(fp8_gemm, "_OVERRIDE", None)
    assert fp8_gemm.small_m_rows(4096, 14336) == 256
    assert fp8_gemm.small_m_config(4096, 14336, 100) == (128, 32, 128, 4, 4, 4)
    assert fp8_gemm.small_m_config(4096, 14336, 256) == (64, 32, 256, 4, 4, 2)
    assert fp8_gemm.small_m_rows(6144, 4096) == 64  # lost at 128 rows: _scaled_mm from 65 rows on
    assert fp8_gemm.small_m_rows(4096, 4096) == 128  # not listed: o_proj's built-in 128
    monkeypatch.setattr(fp8_gemm, "_OVERRIDE", None)
    monkeypatch.delenv("FIRSTTOKEN_FP8_SMALL_M_CONFIG")
    assert fp8_gemm.small_m_rows(4096, 14336) == 128
    monkeypatch.setattr(fp8_gemm, "_OVERRIDE", None)


def test_fast_accumulation_where_it_pays(monkeypatch) -> None:
    """_scaled_mm's fast accumulation for K <= FAST_ACCUM_MAX_K only (down_proj's K = 14336 gained
    nothing on the H200 and doubled the error); the switch turns it off or on everywhere."""
    import workers.engine.quantization as quant
    from kernels.fp8_linear import FAST_ACCUM_MAX_K

    monkeypatch.setattr(quant, "scaled_mm_supported", lambda *_a: True)  # as on a sm89+ GPU
    monkeypatch.delenv("FIRSTTOKEN_FP8_FAST_ACCUM", raising=False)

    def fast(k: int) -> bool:
        layer = quant.Fp8Linear(torch.nn.Linear(k, 32, bias=False))
        assert layer.kernel == "scaled_mm"
        assert (getattr(layer._gemm, "keywords", None) == {"fast_accum": True}) == layer.fast_accum
        return layer.fast_accum

    assert fast(256) and fast(FAST_ACCUM_MAX_K)
    assert not fast(FAST_ACCUM_MAX_K + 16)
    monkeypatch.setenv("FIRSTTOKEN_FP8_FAST_ACCUM", "0")
    assert not fast(256)
    monkeypatch.setenv("FIRSTTOKEN_FP8_FAST_ACCUM", "1")
    assert fast(FAST_ACCUM_MAX_K + 16)


def test_tma_tiles_from_a_sweeps_picks(tmp_path, monkeypatch):
    """FIRSTTOKEN_FP8_TMA_CONFIG: a sweep's picks per weight and row bucket (65-128, 129-256 rows), read
    when a projection is built; unpicked buckets (null) keep the other kernels, a weight with neither or
    not listed gets None; unset, nothing changes."""
    from kernels.fp8_gemm import tma_tiles

    path = tmp_path / "tma.json"
    path.write_text(json.dumps({"4096,6144": {"128": [128, 64, 128, 4, 4, 1], "256": None},
                                "4096,4096": {"128": None, "256": None}}))
    monkeypatch.setenv("FIRSTTOKEN_FP8_TMA_CONFIG", str(path))
    assert tma_tiles(6144, 4096) == ((128, 64, 128, 4, 4, 1), None)
    assert tma_tiles(4096, 4096) is None and tma_tiles(28672, 4096) is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"4096,6144": {"128": [128, 64, 128, 4, 4]}}))  # no split
    monkeypatch.setenv("FIRSTTOKEN_FP8_TMA_CONFIG", str(bad))
    with pytest.raises(ValueError, match="FIRSTTOKEN_FP8_TMA_CONFIG"):
        tma_tiles(6144, 4096)
    monkeypatch.setenv("FIRSTTOKEN_FP8_TMA_CONFIG", "off")
    assert tma_tiles(6144, 4096) is None and tma_tiles(4096, 14336) is None


def test_tma_tiles_built_in(monkeypatch):
    """Unset, FIRSTTOKEN_FP8_TMA_CONFIG leaves the built-in tiles (the H100 sweep's picks): qkv 65-128 rows
    only, o_proj and down_proj both buckets, gate_up never (_scaled_mm's wide tiles win there); a K that
    TMA cannot stride (not a multiple of 16) never."""
    from kernels.fp8_gemm import tma_tiles

    monkeypatch.delenv("FIRSTTOKEN_FP8_TMA_CONFIG", raising=False)
    assert tma_tiles(6144, 4096) == ((128, 64, 128, 4, 8, 1), None)
    assert tma_tiles(4096, 4096) == ((64, 32, 256, 4, 4, 1), (128, 64, 128, 4, 8, 1))
    assert tma_tiles(4096, 14336) == ((64, 64, 128, 4, 8, 1), (128, 64, 128, 4, 8, 1))
    assert tma_tiles(28672, 4096) is None
    assert tma_tiles(4096, 4104) is None
