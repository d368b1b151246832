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
