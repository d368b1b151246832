"""Quantized linear layers: `quantize_fp8(model)` swaps every projection of the decoder layers
(qkv, o, gate_up, down) for an `Fp8Linear`: e4m3 weights with one scale per output channel, made
once from the loaded weights, and activations quantized per token at run time. Embeddings, norms
and the LM head stay in the model's dtype."""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8_gemm import fp8_gemm_grouped_triton, fp8_linear_grouped_ref, quantize_groupwise
from kernels.fp8_linear import fp8_linear_ref, fp8_linear_scaled_mm, quantize_rowwise, scaled_mm_supported

QUANTIZATIONS = ("fp8",)


class Fp8Linear(nn.Module):
    """A linear layer with FP8 (e4m3) weights and per-token FP8 activations (W8A8).

    `group`: one weight scale per output channel and group of `group` input columns (finer; the
    GEMM is then kernels/fp8_gemm.py's Triton kernel on CUDA) instead of one per output channel
    (torch._scaled_mm on sm89+). A layer whose input size the group does not divide keeps one
    scale per channel."""

    def __init__(self, linear: nn.Linear, group: int | None = None) -> None:
        super().__init__()
        w = linear.weight.detach()  # [N, K]
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.group = group if group is not None and self.in_features % group == 0 else None
        if self.group is not None:
            q, scale = quantize_groupwise(w, self.group)  # scale: [N, K / group]
        else:
            q, scale = quantize_rowwise(w)  # scale: [N, 1]
        self.register_buffer("weight_fp8", q, persistent=False)  # [N, K] e4m3
        self.register_buffer("weight_scale", scale, persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        # the GEMM picked once here, not per call: FP8 tensor cores where they exist, else the reference
        cuda = w.device.type == "cuda"
        if self.group is not None:
            self._fn, self.kernel = (
                (fp8_linear_grouped_triton, "triton_grouped") if cuda else (fp8_linear_grouped_ref, "reference_grouped")
            )
        elif scaled_mm_supported(w.device, self.in_features, self.out_features):
            self._fn, self.kernel = fp8_linear_scaled_mm, "scaled_mm"
        else:
            self._fn, self.kernel = fp8_linear_ref, "reference"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N]
        return self._fn(x, self.weight_fp8, self.weight_scale, self.bias)


_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def fp8_linear_grouped_triton(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x quantized per token, then kernels/fp8_gemm.py's group-scaled GEMM -> [T, N] in x's dtype."""
    x_q, x_scale = quantize_rowwise(x)
    return fp8_gemm_grouped_triton(x_q, x_scale, w_q, w_scale, bias, x.dtype)


def quantize_fp8(model: nn.Module, group: int | None = None) -> int:
    """Replace the decoder layers' projections by Fp8Linear (weight scales per channel, or per
    `group` input columns), in place. Returns how many."""
    n = 0
    for layer in model.layers:  # type: ignore[attr-defined]
        for path in _PROJECTIONS:
            parent_name, _, attr = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, attr)
            if isinstance(linear, nn.Linear):
                setattr(parent, attr, Fp8Linear(linear, group))
                n += 1
    return n
