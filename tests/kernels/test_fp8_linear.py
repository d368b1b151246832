"""FP8 W8A8 linear layers: row-wise quantization within e4m3's error, the reference GEMM against
fp32 on awkward shapes with tolerances that fail on a wrong scale, and the engine with
quantization="fp8" serving the tiny model."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_linear import FP8, FP8_MAX, fp8_linear_ref, quantize_rowwise
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


# --- group-scaled FP8 GEMM (kernels/fp8_gemm.py) --------------------------------------------------

@pytest.mark.parametrize(("m", "n", "k", "group", "bias", "out_dtype"), [
    (1, 16, 128, 64, False, torch.float32),
    (6, 42, 128, 32, True, torch.float32),
    (123, 64, 192, 64, True, torch.bfloat16),
    (7, 123, 96, 32, False, torch.float16),
])
def test_grouped_gemm_triton_against_reference(poison_empty, m, n, k, group, bias, out_dtype):
    from kernels_testutil_tol import tol

    from kernels.fp8_gemm import fp8_gemm_grouped_triton
    from kernels.fp8_linear import fp8_gemm_ref, quantize_groupwise

    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k).unsqueeze(0)  # columns of any magnitude
    b = torch.randn(n, generator=g) if bias else None
    a_q, a_s = quantize_rowwise(x)
    w_q, w_s = quantize_groupwise(w, group)
    assert w_s.shape == (n, k // group)
    want = fp8_gemm_ref(a_q, a_s, w_q, w_s, b, out_dtype)
    got = fp8_gemm_grouped_triton(a_q, a_s, w_q, w_s, b, out_dtype, block_m=16, block_n=32)
    assert got.dtype == out_dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **tol(out_dtype))
    # a wrong group index (scales of the group before) is far outside the tolerance
    shifted = fp8_gemm_ref(a_q, a_s, w_q, torch.roll(w_s, 1, dims=1), b, torch.float32)
    assert (shifted - want.float()).abs().max() > 100 * tol(out_dtype)["atol"]


def test_group_scales_beat_channel_scales_on_spread_columns():
    from kernels.fp8_linear import quantize_groupwise

    g = torch.Generator().manual_seed(0)
    # columns spanning 1e-6..1: past e4m3's range under one scale per channel (small columns
    # round to subnormals or zero), inside it per group of 32
    w = torch.randn(64, 256, generator=g) * torch.logspace(-6, 0, 256).unsqueeze(0)
    q, s_ = quantize_rowwise(w)
    qg, sg = quantize_groupwise(w, 32)
    per_channel = q.float() * s_
    grouped = (qg.float().reshape(64, 8, 32) * sg.unsqueeze(-1)).reshape(64, 256)
    small = slice(0, 64)  # the smallest columns
    rel = lambda d: ((d[:, small] - w[:, small]).norm() / w[:, small].norm()).item()  # noqa: E731
    assert rel(grouped) < 0.05 and rel(per_channel) > 3 * rel(grouped), (rel(grouped), rel(per_channel))
    x = torch.randn(9, 256, generator=g)
    y = fp8_linear_ref(x, qg, sg)
    assert ((y - x @ w.t()).norm() / (x @ w.t()).norm()).item() < 0.05
    with pytest.raises(ValueError, match="multiple of the group"):
        quantize_groupwise(torch.randn(4, 100), 64)


def test_fp8_linear_with_weight_groups_and_the_engine_option():
    from schemas.sampling import SamplingParams
    from workers.engine import EngineConfig, LLMEngine

    lin = torch.nn.Linear(64, 48, bias=False)
    f = Fp8Linear(lin, group=32)
    assert f.group == 32 and f.weight_scale.shape == (48, 2) and f.kernel == "reference_grouped"
    x = torch.randn(3, 64)
    assert ((f(x) - lin(x)).norm() / lin(x).norm()).item() < 0.04
    assert Fp8Linear(torch.nn.Linear(40, 8), group=32).group is None  # 40 columns: per channel instead
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(quantization="fp8", fp8_weight_group=24)
    eng = LLMEngine("tiny", EngineConfig(device="cpu", quantization="fp8", fp8_weight_group=16))
    layer = eng.runner.model.layers[0]
    assert layer.mlp.down_proj.group == 16 and layer.self_attn.qkv_proj.weight_scale.shape[1] == 64 // 16
    eng.add_request("a", prompt="The quick brown fox", sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    out = []
    while eng.has_unfinished():
        out += eng.step().finished
    assert len(out) == 1 and len(out[0].output_token_ids) == 6


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
    from kernels.fp8_quant import silu_and_mul_quant_ref, silu_and_mul_quant_triton

    g = torch.Generator().manual_seed(t + inter)
    x = (torch.randn(t, 2 * inter, generator=g) * 2).to(dtype)
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
    per row ([T, 1]) or per row and group ([T, C / group])."""
    s, sr = (v.repeat_interleave(q.shape[1] // v.shape[1], dim=1) for v in (s, sr))
    got, want = q.float() * s, qr.float() * sr
    step = 0.125 * want.abs() + 2.0**-9 * sr  # one step: 3 mantissa bits, or a subnormal step
    step = step * (1.0 + _scale_rtol(dtype)) + (s - sr).abs() * 448
    assert ((got - want).abs() <= step * 1.001).all(), ((got - want).abs() / step).max()
    moved = (q.float() != qr.float()).sum()
    assert moved <= max(2, q.numel() // (50 if dtype == torch.float32 else 5)), moved


@pytest.mark.parametrize("act_group", [None, 16])
def test_fused_activation_quantization_gives_the_unfused_tokens(act_group):
    """Norms and SiLU handing FP8 projections quantized activations (quantize_fp8(fuse=True), the
    engine's default) compute what quantizing inside each projection computes, with activation
    scales per token or per token and group (block-wise)."""
    from schemas.sampling import SamplingParams
    from workers.engine import EngineConfig, LLMEngine
    from workers.engine.quantization import quantize_fp8

    fused = LLMEngine("tiny", EngineConfig(device="cpu", quantization="fp8", fp8_act_group=act_group))
    layer = fused.runner.model.layers[0]
    if act_group is None:
        assert layer.input_layernorm.norm_fn is fused.runner.ops.rms_norm_quant
        assert layer.mlp.act_fn is fused.runner.ops.silu_and_mul_quant
    else:  # the fused ops write the groups their projection takes
        assert fused.config.fp8_weight_group == act_group and layer.mlp.down_proj.act_group == act_group
        assert layer.input_layernorm.norm_fn.func is fused.runner.ops.rms_norm_quant
        assert layer.mlp.act_fn.keywords == {"group": act_group}
        h = fused.runner.model_config.hidden_size
        (_, sc), _ = layer.input_layernorm(torch.randn(3, h))
        assert sc.shape == (3, h // act_group)
    plain = LLMEngine("tiny", EngineConfig(device="cpu"))
    assert quantize_fp8(plain.runner.model, act_group, act_group=act_group, fuse=False) == 4 * len(plain.runner.model.layers)
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


# --- block-wise FP8: activation scales per token and group of columns -------------------------------

@pytest.mark.parametrize(("t", "h", "group", "dtype", "residual"), [
    (1, 48, 16, torch.float32, False),  # 3 groups in a 64-wide block: a padded group slot
    (7, 96, 32, torch.float32, True),
    (33, 160, 32, torch.bfloat16, True),  # 5 groups in a 256-wide block
    (5, 128, 128, torch.float16, False),  # one group: the per-token scale
])
def test_grouped_rms_norm_quant_triton_matches_the_unfused_path(poison_empty, t, h, group, dtype, residual):
    from kernels.fp8_quant import rms_norm_quant_ref, rms_norm_quant_triton

    g = torch.Generator().manual_seed(t * h + group)
    x = (torch.randn(t, h, generator=g) * torch.logspace(-2, 1, h)).to(dtype)  # groups of different magnitude
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    r = torch.randn(t, h, generator=g).to(dtype) if residual else None
    (q, s), nr = rms_norm_quant_triton(x, w, 1e-5, r, group=group)
    (qr, sr), nrr = rms_norm_quant_ref(x, w, 1e-5, r, group=group)
    assert q.dtype == FP8 and s.shape == (t, h // group) == sr.shape and not s.isnan().any()
    torch.testing.assert_close(s, sr, rtol=_scale_rtol(dtype), atol=0)
    _same_up_to_one_step(q, s, qr, sr, dtype)
    torch.testing.assert_close(nr, nrr)
    if h // group > 1 and not residual:  # each group has its own scale: the smallest group's is far below the row's
        assert (s[:, 0] < 0.2 * s.amax(dim=1)).all()


@pytest.mark.parametrize(("t", "inter", "group", "dtype"), [(1, 48, 16, torch.float32), (6, 160, 32, torch.bfloat16),
                                                             (9, 64, 16, torch.float16)])
def test_grouped_silu_and_mul_quant_triton_matches_the_unfused_path(poison_empty, t, inter, group, dtype):
    from kernels.fp8_quant import silu_and_mul_quant_ref, silu_and_mul_quant_triton

    g = torch.Generator().manual_seed(t + inter + group)
    x = (torch.randn(t, 2 * inter, generator=g) * 2).to(dtype)
    q, s = silu_and_mul_quant_triton(x, group=group)
    qr, sr = silu_and_mul_quant_ref(x, group=group)
    assert s.shape == (t, inter // group)
    torch.testing.assert_close(s, sr, rtol=_scale_rtol(dtype), atol=0)
    _same_up_to_one_step(q, s, qr, sr, dtype)
    with pytest.raises(ValueError, match="multiple of the group"):
        silu_and_mul_quant_triton(torch.randn(2, 2 * 40), group=16)
    with pytest.raises(ValueError, match="power of two"):
        silu_and_mul_quant_triton(torch.randn(2, 2 * 48), group=24)


@pytest.mark.parametrize(("m", "n", "k", "group", "bias", "out_dtype"), [
    (1, 16, 128, 64, False, torch.float32),
    (6, 42, 128, 32, True, torch.float32),
    (123, 64, 192, 64, True, torch.bfloat16),
    (7, 123, 96, 32, False, torch.float16),
])
def test_blockwise_gemm_triton_against_reference(poison_empty, m, n, k, group, bias, out_dtype):
    from kernels_testutil_tol import tol

    from kernels.fp8_gemm import fp8_gemm_grouped_triton
    from kernels.fp8_linear import fp8_gemm_ref, quantize_groupwise

    g = torch.Generator().manual_seed(m * n + k + 1)
    x = torch.randn(m, k, generator=g) * torch.logspace(1, -2, k).unsqueeze(0)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k).unsqueeze(0)
    b = torch.randn(n, generator=g) if bias else None
    a_q, a_s = quantize_groupwise(x, group)
    w_q, w_s = quantize_groupwise(w, group)
    assert a_s.shape == (m, k // group)
    want = fp8_gemm_ref(a_q, a_s, w_q, w_s, b, out_dtype)
    got = fp8_gemm_grouped_triton(a_q, a_s, w_q, w_s, b, out_dtype, block_m=16, block_n=32)
    assert got.dtype == out_dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **tol(out_dtype))
    # the activations' group index matters as much as the weights'
    shifted = fp8_gemm_ref(a_q, torch.roll(a_s, 1, dims=1), w_q, w_s, b, torch.float32)
    assert (shifted - want.float()).abs().max() > 100 * tol(out_dtype)["atol"]
    with pytest.raises(ValueError, match="a_scale"):
        fp8_gemm_grouped_triton(a_q, torch.ones(m, k // group + 1), w_q, w_s)


def test_blockwise_activations_beat_per_token_ones_on_outlier_columns():
    """The reason for block-wise FP8: a large activation channel (as LLMs have) sets a token's one
    scale, and the other channels fall to e4m3's subnormals or to zero; per group of columns they
    keep their bits."""
    from kernels.fp8_linear import dequantize, fp8_linear_ref, quantize, quantize_groupwise

    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 256, generator=g)
    x[:, 7] *= 1e5  # one outlier channel, in the first group
    w = torch.randn(64, 256, generator=g) * 0.05
    w[:, 7] = 0  # the product then comes from the ordinary channels only
    w_q, w_s = quantize_groupwise(w, 32)
    want = x @ w.t()
    rest = slice(32, 256)  # the groups without the outlier
    err, act_err = {}, {}
    for name, act_group in (("token", None), ("block", 32)):
        back = dequantize(*quantize(x, act_group))
        act_err[name] = ((back[:, rest] - x[:, rest]).norm() / x[:, rest].norm()).item()
        err[name] = ((fp8_linear_ref(x, w_q, w_s, act_group=act_group) - want).norm() / want.norm()).item()
    assert act_err["block"] < 0.04 and act_err["token"] > 4 * act_err["block"], act_err
    # the outlier's own group still loses its other 31 channels: 1/8 of the product
    assert err["block"] < 0.1 and err["token"] > 2 * err["block"], err


def test_fp8_linear_with_activation_groups_and_the_engine_option():
    from workers.engine import EngineConfig

    lin = torch.nn.Linear(64, 48, bias=True)
    f = Fp8Linear(lin, group=32, act_group=32)
    assert f.act_group == 32 and f.kernel == "reference_grouped"
    x = torch.randn(3, 64)
    assert ((f(x) - lin(x)).norm() / lin(x).norm()).item() < 0.04
    fallback = Fp8Linear(torch.nn.Linear(40, 8), group=32, act_group=32)  # 40 columns: per channel and token
    assert fallback.group is None and fallback.act_group is None
    assert fallback(torch.randn(2, 40)).shape == (2, 8)
    with pytest.raises(ValueError, match="must be the weight groups"):
        Fp8Linear(lin, group=32, act_group=16)
    assert EngineConfig(quantization="fp8", fp8_act_group=64).fp8_weight_group == 64
    with pytest.raises(ValueError, match="must equal"):
        EngineConfig(quantization="fp8", fp8_weight_group=32, fp8_act_group=64)
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(quantization="fp8", fp8_act_group=48)


@pytest.mark.parametrize(("m", "n", "group_m", "block_m", "block_n"), [(37, 50, 2, 16, 16), (70, 33, 3, 16, 32),
                                                                        (100, 17, 1, 32, 16), (5, 200, 8, 16, 32)])
def test_grouped_gemm_tile_order_covers_every_tile(poison_empty, m, n, group_m, block_m, block_n):
    """The 1-D grid walked GROUP_M tile rows at a time (L2 reuse of the weight) still computes each
    C tile once, whatever the ragged last group (poison_empty fills torch.empty with NaN)."""
    from kernels.fp8_gemm import fp8_gemm_grouped_triton
    from kernels.fp8_linear import fp8_gemm_ref, quantize_groupwise

    g = torch.Generator().manual_seed(m + n + group_m)
    a_q, a_s = quantize_groupwise(torch.randn(m, 64, generator=g), 32)
    w_q, w_s = quantize_groupwise(torch.randn(n, 64, generator=g), 32)
    got = fp8_gemm_grouped_triton(a_q, a_s, w_q, w_s, None, torch.float32, block_m=block_m, block_n=block_n,
                                  group_m=group_m)
    assert not got.isnan().any()
    torch.testing.assert_close(got, fp8_gemm_ref(a_q, a_s, w_q, w_s, None, torch.float32), atol=1e-4, rtol=1e-5)


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


@pytest.mark.parametrize(("t", "c", "group", "dtype"), [(1, 16, None, torch.float32), (5, 100, None, torch.bfloat16),
                                                        (3, 96, 32, torch.float32), (9, 4096 // 8, 64, torch.bfloat16)])
def test_quantize_triton_matches_torch(poison_empty, t, c, group, dtype):
    """o_proj's input quantization in one kernel: torch's scales, and e4m3 values equal except
    at an exact halfway point (the kernel rounds half away from zero, torch to even)."""
    from kernels.fp8_linear import dequantize, quantize
    from kernels.fp8_quant import quantize_triton

    g = torch.Generator().manual_seed(t * c)
    x = (torch.randn(t, c, generator=g) * torch.logspace(-3, 3, t).unsqueeze(1)).to(dtype)
    q, s = quantize_triton(x, group)
    q_ref, s_ref = quantize(x, group)
    assert q.dtype == FP8 and s.shape == s_ref.shape
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() != q_ref.float()).float().mean() < 0.01
    back = dequantize(q, s)
    rel = (back - x.float()).abs().reshape(t, -1, group or c).amax(-1) / x.float().abs().reshape(t, -1, group or c).amax(-1)
    assert rel.max() <= 2**-4 + 1e-6
