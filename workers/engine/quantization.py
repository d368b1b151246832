"""Quantized linear layers: `quantize_fp8(model)` swaps every projection of the decoder layers
(qkv, o, gate_up, down) for an `Fp8Linear`: e4m3 weights with one scale per output channel, made
once from the loaded weights, and activations quantized per token at run time. Embeddings, norms
and the LM head stay in the model's dtype."""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8_linear import fp8_linear_ref, fp8_linear_scaled_mm, quantize_rowwise, scaled_mm_supported

QUANTIZATIONS = ("fp8",)


class Fp8Linear(nn.Module):
    """A linear layer with FP8 (e4m3) weights and per-token FP8 activations (W8A8)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()  # [N, K]
        q, scale = quantize_rowwise(w)
        self.register_buffer("weight_fp8", q, persistent=False)  # [N, K] e4m3
        self.register_buffer("weight_scale", scale, persistent=False)  # [N, 1] fp32
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        # the GEMM picked once here, not per call: FP8 tensor cores where they exist, else the reference
        use_mm = scaled_mm_supported(w.device, self.in_features, self.out_features)
        self._fn = fp8_linear_scaled_mm if use_mm else fp8_linear_ref
        self.kernel = "scaled_mm" if use_mm else "reference"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N]
        return self._fn(x, self.weight_fp8, self.weight_scale, self.bias)


_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantize_fp8(model: nn.Module) -> int:
    """Replace the decoder layers' projections by Fp8Linear, in place. Returns how many."""
    n = 0
    for layer in model.layers:  # type: ignore[attr-defined]
        for path in _PROJECTIONS:
            parent_name, _, attr = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, attr)
            if isinstance(linear, nn.Linear):
                setattr(parent, attr, Fp8Linear(linear))
                n += 1
    return n
