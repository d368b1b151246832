"""The W8A16 GEMV (kernels/fp8_gemv.py) in the interpreter against its reference: each prologue
(none, RMSNorm with and without the residual add, SiLU-and-mul), split K, ragged N and K, bias,
poisoned outputs; and that a wrong prologue or scale would be caught."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemv import PROLOGUE_NONE, PROLOGUE_RMS, PROLOGUE_SILU, fp8_gemv_ref, fp8_gemv_triton
from kernels.fp8_linear import quantize_rowwise


def _row_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest relative error of a row (norm of the difference over the row's norm)."""
    return ((got.float() - want.float()).norm(dim=1) / want.float().norm(dim=1)).max().item()


# both sides multiply the same activations by the same e4m3 values in fp32; what differs is the
# order of the sums (fp32) or, in 16 bits, the roundings of the prologue: the interpreter's fp32 ->
# bf16 cast truncates where torch rounds (one ulp, 2^-8, biased toward zero)
ROW_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # bf16: two truncations (2 x 2^-8), the output's rounding


def _case(m, n, k, dtype, prologue, seed):
    g = torch.Generator().manual_seed(seed)
    xk = 2 * k if prologue == PROLOGUE_SILU else k
    x = (torch.randn(m, xk, generator=g) * torch.logspace(-1, 1, m).unsqueeze(1)).to(dtype)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n).unsqueeze(1)  # a scale per channel matters
    w_q, w_s = quantize_rowwise(w)
    # x + residual exact in 16 bits (multiples of 1/16 below 8): the interpreter's fp32 -> bf16 cast
    # truncates where the GPU rounds, and the new residual is compared bit for bit
    res = (torch.randint(-128, 128, (m, k), generator=g) / 16).to(dtype)
    if prologue == PROLOGUE_RMS:
        x = (torch.randint(-128, 128, (m, k), generator=g) / 16).to(dtype)
    nw = (1 + 0.5 * torch.randn(k, generator=g)).to(dtype)
    return x, w_q, w_s, res, nw


@pytest.mark.parametrize(("m", "n", "k", "dtype", "prologue", "residual", "bias", "split", "row_max"), [
    (1, 32, 16, torch.float32, PROLOGUE_NONE, False, False, 1, 8192),
    (3, 96, 272, torch.float32, PROLOGUE_NONE, False, True, 3, 8192),
    (1, 33, 431, torch.bfloat16, PROLOGUE_RMS, True, False, 1, 8192),
    (1, 33, 431, torch.bfloat16, PROLOGUE_RMS, True, True, 2, 0),  # the row in a loop
    (2, 70, 100, torch.float32, PROLOGUE_RMS, True, True, 2, 0),
    (2, 70, 100, torch.float32, PROLOGUE_RMS, True, False, 1, 8192),
    (1, 48, 128, torch.bfloat16, PROLOGUE_RMS, False, False, 4, 8192),
    (4, 40, 96, torch.bfloat16, PROLOGUE_SILU, False, False, 1, 8192),
    (1, 17, 200, torch.float32, PROLOGUE_SILU, False, True, 3, 8192),
])
def test_fp8_gemv_triton_against_reference(poison_empty, monkeypatch, m, n, k, dtype, prologue, residual, bias,
                                           split, row_max):
    import kernels.fp8_gemv

    monkeypatch.setattr(kernels.fp8_gemv, "ROW_MAX", row_max)
    x, w_q, w_s, res, nw = _case(m, n, k, dtype, prologue, m * n + k)
    b = torch.randn(n).to(dtype) if bias else None
    kw = {"prologue": prologue, "residual": res if residual else None,
          "norm_weight": nw if prologue == PROLOGUE_RMS else None, "eps": 1e-5}
    want, want_res = fp8_gemv_ref(x, w_q, w_s, b, **kw)
    for _ in range(2):  # the split counters are left at zero for the next launch
        got, got_res = fp8_gemv_triton(x, w_q, w_s, b, **kw, block_n=16, block_k=32, split=split)
        assert got.dtype == dtype and got.shape == (m, n) and not got.isnan().any()
        assert _row_err(got, want) < ROW_TOL[dtype]
    if residual:
        assert torch.equal(got_res, want_res)  # x + residual, rounded as the reference rounds it
    else:
        assert got_res is None
    from kernels._triton import ARRIVAL_COUNTERS
    assert all(int(c.abs().sum()) == 0 for c in ARRIVAL_COUNTERS.values())
    swapped, _ = fp8_gemv_triton(x, w_q, w_s.flip(0), b, **kw, block_n=16, block_k=32, split=split)
    assert _row_err(swapped, want) > 10 * ROW_TOL[dtype]  # the scales are per channel
    if prologue != PROLOGUE_NONE:  # the prologue is applied: the raw input times the weight is far off
        raw = x[:, :k].float() @ (w_q.float() * w_s).t()
        assert _row_err(raw, want) > 10 * ROW_TOL[dtype]


def test_fp8_gemv_rejects_bad_shapes():
    x, w_q, w_s, _, _ = _case(2, 16, 32, torch.float32, PROLOGUE_NONE, 0)
    with pytest.raises(ValueError):
        fp8_gemv_triton(x, w_q, w_s[:-1])  # a scale per output channel
    with pytest.raises(ValueError):
        fp8_gemv_triton(x, w_q, w_s, prologue=PROLOGUE_SILU)  # SiLU-and-mul takes [M, 2K]
    with pytest.raises(ValueError):
        fp8_gemv_triton(x, w_q, w_s, prologue=PROLOGUE_RMS)  # RMSNorm needs its weight


def test_fp8_linear_takes_the_gemv_at_few_rows(monkeypatch):
    """Fp8Linear with gemv_rows: up to that many rows the activation is not quantized (W8A16: the
    dequantized weight's product to fp32 rounding), above it W8A8; the norm and activation
    wrappers hand their op to the GEMV, and the residual it writes is x + residual."""
    from kernels.fp8_linear import dequantize, fp8_linear_ref
    from kernels.rmsnorm import rms_norm_ref
    from kernels.silu_mul import silu_and_mul_ref
    from workers.engine.quantization import Fp8Linear, GemvInput, _act_for, _norm_for

    monkeypatch.setenv("FIRSTTOKEN_FP8_GEMV_ROWS", "4")
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(64, 48, bias=True)
    f = Fp8Linear(lin)
    assert f.gemv_rows == 4
    w16 = dequantize(f.weight_fp8, f.weight_scale)
    x = torch.randn(3, 64, generator=g)
    exact = x @ w16.t() + f.bias
    assert ((f(x) - exact).norm() / exact.norm()).item() < 1e-6
    x5 = torch.randn(5, 64, generator=g)  # above gemv_rows: the W8A8 reference, activation quantized
    assert torch.equal(f(x5), fp8_linear_ref(x5, f.weight_fp8, f.weight_scale, f.bias))
    assert ((f(x5) - (x5 @ w16.t() + f.bias)).norm() / exact.norm()).item() > 1e-3

    nw, res = torch.rand(64, generator=g) + 0.5, torch.randn(3, 64, generator=g)
    norm = _norm_for(f, lambda *a: pytest.fail("quantized at 3 rows"))
    h, new_res = norm(x, nw, 1e-5, res)
    assert isinstance(h, GemvInput) and h.res_out is new_res
    normed, summed = rms_norm_ref(x, nw, 1e-5, res)
    assert ((f(h) - (normed @ w16.t() + f.bias)).norm() / exact.norm()).item() < 1e-6
    assert torch.equal(new_res, summed)
    act = _act_for(f, lambda *a: pytest.fail("quantized at 3 rows"))
    gu = torch.randn(2, 128, generator=g)
    want = silu_and_mul_ref(gu) @ w16.t() + f.bias
    assert ((f(act(gu)) - want).norm() / want.norm()).item() < 1e-6
    monkeypatch.setenv("FIRSTTOKEN_FP8_GEMV_ROWS", "0")
    assert Fp8Linear(lin).gemv_rows == 0 and _norm_for(Fp8Linear(lin), rms_norm_ref) is rms_norm_ref


def _greedy_from_one_token_prompts(eng) -> dict[str, list[int]]:
    """10 greedy tokens after each of three one-token prompts: steps of at most 3 rows."""
    from schemas.sampling import SamplingParams

    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    for i, tok in enumerate([11, 257, 501]):
        eng.add_request(f"r{i}", prompt_token_ids=[tok], sampling=sp)
    outs = {}
    while eng.has_unfinished():
        for fin in eng.step().finished:
            outs[fin.request_id] = fin.output_token_ids
    return outs


def test_fp8_engine_decodes_through_the_gemv(monkeypatch):
    """With one-token prompts every step of the tiny model has at most 3 rows, so every FP8
    projection runs the GEMV: the greedy tokens are those of the unquantized engine with each
    projection's weight replaced by its dequantized e4m3 (W8A16 is that model's math, up to fp32
    sum order); the W8A8 engine (GEMV off) quantizes activations and is not held to it."""
    from kernels.fp8_linear import dequantize, quantize_weight
    from workers.engine import EngineConfig, LLMEngine

    monkeypatch.setenv("FIRSTTOKEN_FP8_GEMV_ROWS", "4")
    fp8 = LLMEngine("tiny", EngineConfig(device="cpu", quantization="fp8"))
    assert all(m.gemv_rows == 4 for m in fp8.runner.model.modules() if hasattr(m, "gemv_rows"))
    base = LLMEngine("tiny", EngineConfig(device="cpu"))
    with torch.no_grad():
        for name, p in base.runner.model.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(dequantize(*quantize_weight(p)).to(p.dtype))  # the engine's scales
    assert _greedy_from_one_token_prompts(fp8) == _greedy_from_one_token_prompts(base)


@pytest.mark.parametrize("gemv", [True, False])
def test_fp8_lm_head_is_the_dequantized_head(monkeypatch, gemv):
    """EngineConfig.fp8_lm_head: the lm_head is an Fp8Linear with the final norm fused before it.
    Through the GEMV (one-token prompts, every step <= 4 rows) the greedy tokens are those of the
    FP8 engine without it whose lm_head weight is the e4m3 head dequantized (W8A16 is that math);
    with the GEMV off the logits are the final norm quantized per token times the e4m3 head,
    exactly the W8A8 reference's. It needs quantization='fp8'."""
    from torch import nn

    from kernels.fp8_linear import dequantize, fp8_gemm_ref
    from kernels.fp8_quant import rms_norm_quant_ref
    from workers.engine import EngineConfig, LLMEngine
    from workers.engine.quantization import Fp8Linear

    with pytest.raises(ValueError, match="fp8_lm_head"):
        EngineConfig(device="cpu", fp8_lm_head=True)
    monkeypatch.setenv("FIRSTTOKEN_FP8_GEMV_ROWS", "4" if gemv else "0")
    head = LLMEngine("tiny", EngineConfig(device="cpu", quantization="fp8", fp8_lm_head=True))
    model = head.runner.model
    assert isinstance(model.fp8_head, Fp8Linear) and model.fp8_head.gemv_rows == (4 if gemv else 0)
    assert not model.cfg.tie_word_embeddings and model.lm_head is None  # the bf16 head is not kept beside it
    if not gemv:
        g = torch.Generator().manual_seed(3)
        h, r = torch.randn(5, model.cfg.hidden_size, generator=g), torch.randn(5, model.cfg.hidden_size, generator=g)
        (q, s), _ = rms_norm_quant_ref(h, model.norm.weight, model.norm.eps, r)
        want = fp8_gemm_ref(q, s, model.fp8_head.weight_fp8, model.fp8_head.weight_scale, None, h.dtype).float()
        with torch.no_grad():
            assert torch.equal(model.compute_logits(h, r), want)
        return

    plain = LLMEngine("tiny", EngineConfig(device="cpu", quantization="fp8"))
    pm = plain.runner.model
    w = dequantize(model.fp8_head.weight_fp8, model.fp8_head.weight_scale).to(pm.lm_head_weight.dtype)
    pm.lm_head = nn.Linear(w.shape[1], w.shape[0], bias=False)  # untied: the embedding keeps its weight
    with torch.no_grad():
        pm.lm_head.weight.copy_(w)
    got, want = _greedy_from_one_token_prompts(head), _greedy_from_one_token_prompts(plain)
    assert got == want
    # and the head matters: the bf16 head's tokens are not these (the tiny model's logits are near ties)
    plain_head = LLMEngine("tiny", EngineConfig(device="cpu", quantization="fp8"))
    assert _greedy_from_one_token_prompts(plain_head) != got
