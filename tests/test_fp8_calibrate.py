"""bench/fp8_calibrate.py, the quality bench's calibration experiment: GPTQ on the e4m3 grid lowers the
layer's output error on correlated inputs and is plain rounding where inputs are uncorrelated;
SmoothQuant's migration leaves the unquantized model's function as it was."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.fp8_calibrate import gptq_fp8, input_statistics, smooth
from kernels.fp8_linear import FP8_MAX, quantize_weight


def _rounded(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def test_gptq_is_plain_rounding_for_uncorrelated_inputs():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g)
    _, scale = quantize_weight(w)
    q = gptq_fp8(w, torch.eye(40, dtype=torch.float64) * 3.0, scale, damp=0.0)
    assert torch.equal(q.view(torch.uint8), _rounded(w, scale).view(torch.uint8))


def test_gptq_lowers_the_output_error_on_correlated_inputs():
    g = torch.Generator().manual_seed(1)
    k, n = 72, 48  # K not a multiple of the 128-column block, nor of 8
    mix = torch.randn(k, k, generator=g) * 0.3 + torch.eye(k)
    x = torch.randn(4096, k, generator=g) @ mix  # correlated input channels
    x[:, 5] *= 20.0  # and one outlier channel
    w = torch.randn(n, k, generator=g) * 0.05
    _, scale = quantize_weight(w)
    hess = x.double().t() @ x.double()
    q = gptq_fp8(w, hess, scale, damp=0.01, block=32)
    ref = x @ w.t()

    def err(qw: torch.Tensor) -> float:
        return ((x @ (qw.float() * scale).t() - ref).square().sum() / ref.square().sum()).item()

    e_rtn, e_gptq = err(_rounded(w, scale)), err(q)
    assert e_gptq < 0.7 * e_rtn, (e_gptq, e_rtn)
    assert torch.isfinite(q.float()).all() and q.float().abs().max() <= FP8_MAX


def test_smooth_keeps_the_model_function():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 96, (1, 19))
    with torch.no_grad():
        before = model(ids).logits
    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n}
    hess, amax = input_statistics(model, names, [ids[0]])
    assert hess["model.layers.0.mlp.down_proj"].shape == (48, 48)
    factors = smooth(model, amax, 0.5)
    assert len(factors) == 2 * 6 and not torch.allclose(factors["model.layers.1.mlp.down_proj"], torch.ones(48))
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    # the smoothed inputs' amax: each channel's amax / s
    _, amax2 = input_statistics(model, names, [ids[0]])
    name = "model.layers.0.self_attn.q_proj"
    torch.testing.assert_close(amax2[name].float(), amax[name].float() / factors[name], rtol=1e-4, atol=1e-6)
