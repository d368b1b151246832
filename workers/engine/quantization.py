"""Quantized linear layers: `quantize_fp8(model)` swaps every projection of the decoder layers
(qkv, o, gate_up, down) for an `Fp8Linear`: e4m3 weights with one scale per output channel, made
once from the loaded weights, and activations quantized per token at run time. Embeddings, norms
and the LM head stay in the model's dtype. (Scales per group of input columns, and block-wise FP8
with activation scales per token and group too, were removed: slower at every row on the H200 and
without the few-row GEMM and the GEMV; kernels/fp8_gemm.py says by how much.)

The activations of qkv and gate_up come from an RMSNorm, and down_proj's from SiLU-and-mul: those
ops then write e4m3 and its scales directly (the KernelOps `rms_norm_quant`, `silu_and_mul_quant`:
fused Triton kernels on CUDA, the references' composition elsewhere), and the projection takes the
pair as it is. o_proj quantizes the attention output itself.

At a decode step of a few rows (up to `Fp8Linear.gemv_rows`) nothing is quantized: the norms and
the activation hand their input on unapplied (`GemvInput`) and each projection runs
kernels/fp8_gemv.py's W8A16 GEMV with that op fused before it, four launches a layer fewer.
"""

from __future__ import annotations

import os
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from kernels.fp8_gemm import fp8_gemm_rowwise_small_m, fp8_gemm_rowwise_tma, small_m_rows, tma_tiles
from kernels.fp8_gemv import (
    GEMV_ROWS,
    PROLOGUE_NONE,
    PROLOGUE_RMS,
    PROLOGUE_SILU,
    fp8_gemv_ref,
    fp8_gemv_triton,
)
from kernels.fp8_linear import (
    FAST_ACCUM_MAX_K,
    Gemm,
    fp8_gemm_ref,
    fp8_gemm_scaled_mm,
    quantize,
    quantize_weight,
    scaled_mm_supported,
)
from kernels.fp8_quant import quantize_triton

QUANTIZATIONS = ("fp8",)


class GemvInput(NamedTuple):
    """A projection's input left in the model's dtype with the op that would have produced it,
    for the W8A16 GEMV to apply (kernels/fp8_gemv.py): RMSNorm(x + residual) or silu(gate) * up."""

    x: torch.Tensor  # [T, K], or [T, 2K] gate | up for PROLOGUE_SILU
    prologue: int
    residual: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    res_out: torch.Tensor | None = None  # filled with x + residual by the GEMV (when residual is given)


# a tensor, (e4m3 [T, K], scale [T, 1]), or an unapplied op for the GEMV
Activation = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | GemvInput


class Fp8Linear(nn.Module):
    """A linear layer with FP8 (e4m3) weights and per-token FP8 activations (W8A8).

    It takes activations as a tensor (quantized here) or already quantized ((e4m3, scale), from a
    fused norm or activation kernel). The weight has one scale per output channel; the GEMM is
    torch._scaled_mm on sm89+ (kernels/fp8_gemm.py's few-row kernel up to `small_m` rows, the W8A16
    GEMV up to `gemv_rows`), the fp32 reference elsewhere.
    """

    def __init__(self, linear: nn.Linear, scale_search: bool = True) -> None:
        super().__init__()
        w = linear.weight.detach()  # [N, K]
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.out_dtype = w.dtype  # the model's activations (of an input that comes quantized)
        # scale: [N, 1], each channel's least-error scale (scale_search=False: its amax / 448)
        q, scale = quantize_weight(w, scale_search)
        self.register_buffer("weight_fp8", q, persistent=False)  # [N, K] e4m3
        self.register_buffer("weight_scale", scale, persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        # the GEMM picked once here, not per call: FP8 tensor cores where they exist, else the reference
        gemm: Gemm
        self.fast_accum = False  # cuBLASLt's fast accumulation (kernels.fp8_linear.FAST_ACCUM_MAX_K)
        if scaled_mm_supported(w.device, self.in_features, self.out_features):
            gemm, self.kernel = fp8_gemm_scaled_mm, "scaled_mm"
            env = os.environ.get("FIRSTTOKEN_FP8_FAST_ACCUM")  # A/B switches: "0" never, "1" at every K
            self.fast_accum = env == "1" or (env != "0" and self.in_features <= FAST_ACCUM_MAX_K)
            if self.fast_accum:
                gemm = partial(fp8_gemm_scaled_mm, fast_accum=True)
        else:
            gemm, self.kernel = fp8_gemm_ref, "reference"
        self._gemm = gemm
        # rows up to which a step takes kernels/fp8_gemm.py's weight-streaming kernel instead of
        # _scaled_mm (0: never; see kernels.fp8_gemm.SMALL_M); FIRSTTOKEN_FP8_SMALL_M sets it for
        # an experiment
        env = os.environ.get("FIRSTTOKEN_FP8_SMALL_M")
        small = int(env) if env is not None else small_m_rows(self.out_features, self.in_features)
        self.small_m = small if self.kernel == "scaled_mm" else 0
        # 65-256 rows (a cached prefix's new tokens) through the TMA kernel on Hopper, where its tiles
        # beat _scaled_mm's (kernels.fp8_gemm.tma_tiles; FIRSTTOKEN_FP8_TMA_CONFIG=off for an A/B run)
        hopper = (self.kernel == "scaled_mm" and w.device.type == "cuda"
                  and torch.cuda.get_device_capability(w.device)[0] == 9)
        self.tma = tma_tiles(self.out_features, self.in_features) if hopper else None
        # rows up to which a step takes the W8A16 GEMV (0 on the CPU, where FIRSTTOKEN_FP8_GEMV_ROWS
        # turns its reference on for a test)
        env = os.environ.get("FIRSTTOKEN_FP8_GEMV_ROWS")
        cuda = w.device.type == "cuda"
        self.gemv_rows = int(env) if env is not None else GEMV_ROWS if cuda else 0
        self._gemv_fn = fp8_gemv_triton if cuda else fp8_gemv_ref
        # activations that come unquantized (o_proj's): one Triton launch on CUDA, not torch's ~8
        self._quantize = quantize_triton if w.device.type == "cuda" else quantize

    def _run(self, x_q: torch.Tensor, x_s: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        m = x_q.shape[0]
        if self.tma is not None and 64 < m <= 256 and self.tma[m > 128] is not None:
            return fp8_gemm_rowwise_tma(x_q, x_s, self.weight_fp8, self.weight_scale, self.bias, out_dtype,
                                        *self.tma[m > 128])
        if m <= self.small_m:
            return fp8_gemm_rowwise_small_m(x_q, x_s, self.weight_fp8, self.weight_scale, self.bias, out_dtype)
        return self._gemm(x_q, x_s, self.weight_fp8, self.weight_scale, self.bias, out_dtype)

    def _gemv(self, g: GemvInput) -> torch.Tensor:
        return self._gemv_fn(g.x, self.weight_fp8, self.weight_scale, self.bias, g.prologue, g.residual,
                             g.norm_weight, g.eps, g.res_out)[0]

    def forward(self, x: Activation) -> torch.Tensor:
        # x: [..., K], (e4m3 [T, K], scale [T, 1]) or a GemvInput -> [..., N]
        if isinstance(x, GemvInput):
            return self._gemv(x)
        if isinstance(x, torch.Tensor):
            if x.dim() == 2 and x.shape[0] <= self.gemv_rows:
                return self._gemv(GemvInput(x, PROLOGUE_NONE))
            x_q, x_s = self._quantize(x.reshape(-1, self.in_features))
            return self._run(x_q, x_s, x.dtype).reshape(*x.shape[:-1], self.out_features)
        return self._run(x[0], x[1], self.out_dtype)


_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantize_fp8(model: nn.Module, *, fuse: bool = True, lm_head: bool = False) -> int:
    """Replace the decoder layers' projections by Fp8Linear (weight scales per channel, activation
    scales per token), in place; with `fuse`, the norms before qkv and gate_up and the activation
    before down_proj hand them quantized activations. `lm_head`: the lm_head too (an e4m3 copy
    of a tied embedding, whose bf16 weight stays for the lookup; an untied head's bf16 weight goes,
    as the replaced projections' do), the final norm fused with it as the others are. Returns the
    layers replaced."""
    n = 0
    if lm_head:
        w = model.lm_head_weight  # type: ignore[attr-defined]
        head = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        head.weight = nn.Parameter(w.detach(), requires_grad=False)
        model.fp8_head = Fp8Linear(head)  # type: ignore[attr-defined]
        model.lm_head = None  # type: ignore[attr-defined]
        n += 1
        if fuse:
            model.norm.norm_fn = _norm_for(model.fp8_head, model.ops.rms_norm_quant)  # type: ignore[attr-defined]
    for layer in model.layers:  # type: ignore[attr-defined]
        for path in _PROJECTIONS:
            parent_name, _, attr = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, attr)
            if isinstance(linear, nn.Linear):
                setattr(parent, attr, Fp8Linear(linear))
                n += 1
        if fuse:
            ops = model.ops  # type: ignore[attr-defined]
            qkv, gate_up, down = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
            layer.input_layernorm.norm_fn = _norm_for(qkv, ops.rms_norm_quant)
            layer.post_attention_layernorm.norm_fn = _norm_for(gate_up, ops.rms_norm_quant)
            layer.mlp.act_fn = _act_for(down, ops.silu_and_mul_quant)
    return n


def _norm_for(linear: Fp8Linear, quant_op):
    """The RMSNorm before `linear`: quant_op's (e4m3, scale), or at up to linear.gemv_rows rows the
    norm left to the GEMV (GemvInput) and the new residual it will write."""
    if not linear.gemv_rows:
        return quant_op

    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        if x.shape[0] > linear.gemv_rows:
            return quant_op(x, weight, eps, residual)
        res_out = None if residual is None else torch.empty_like(x)
        return GemvInput(x, PROLOGUE_RMS, residual, weight, eps, res_out), (x if residual is None else res_out)

    return norm


def _act_for(linear: Fp8Linear, quant_op):
    """SiLU-and-mul before `linear`: quant_op's (e4m3, scale), or at few rows left to the GEMV."""
    if not linear.gemv_rows:
        return quant_op

    def act(x: torch.Tensor):
        return GemvInput(x, PROLOGUE_SILU) if x.shape[0] <= linear.gemv_rows else quant_op(x)

    return act
