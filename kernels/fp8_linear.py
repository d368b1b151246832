"""FP8 (e4m3) W8A8 linear layers: weights quantized once per output channel, activations per
token at run time, the product accumulated in fp32.

The GEMMs take quantized activations (e4m3 and one scale per token, [T, 1]) and weights (e4m3 and
one scale per output channel, [N, 1]): `fp8_gemm_ref` is the reference (and the CPU path): it
dequantizes both operands and multiplies in fp32, which is what an FP8 tensor-core GEMM with fp32
accumulation computes, up to the order of the sums. `fp8_gemm_scaled_mm` runs it on the GPU with
`torch._scaled_mm` (sm89+); kernels/fp8_gemm.py has a Triton one for few rows. `fp8_linear`
quantizes the activations first, as a layer whose input comes unquantized does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def quantize_rowwise(x: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, C] -> (q: [R, C] e4m3, scale: [R, 1] fp32), x ~= q * scale, each row scaled so that
    its largest magnitude maps to e4m3's largest value: a weight per output channel, an activation
    per token."""
    xf = x.detach().float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=eps) / FP8_MAX  # [R, 1]
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rowwise` at its default eps: what the layers and the fused ops' references run."""
    return quantize_rowwise(x)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [R, C] e4m3, scale [R, 1]) -> [R, C] fp32: each row times its scale."""
    return q.float() * scale.float().reshape(-1, 1)


Gemm = Callable[..., torch.Tensor]  # (x_q, x_scale, w_q, w_scale, bias, out_dtype) -> [T, N]


def fp8_gemm_ref(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x_q: [T, K] e4m3, x_scale: [T, 1] (per token), w_q: [N, K] e4m3, w_scale: [N, 1] (per output
    channel) -> [T, N] in out_dtype: both dequantized, multiplied in fp32."""
    out = dequantize(x_q, x_scale) @ dequantize(w_q, w_scale).t()  # [T, N] fp32
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_gemm_scaled_mm(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The same on CUDA with torch._scaled_mm (FP8 tensor cores, fp32 accumulation). K and N must
    be multiples of 16; w_q.t() is column-major, as _scaled_mm wants its second operand."""
    return torch._scaled_mm(
        x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.t().contiguous(), bias=bias, out_dtype=out_dtype
    )


def fp8_linear(
    gemm: Gemm, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [T, K] (any float dtype) quantized per token, then `gemm` -> [T, N] in x's dtype."""
    x_q, x_scale = quantize(x)  # [T, K], [T, 1]
    return gemm(x_q, x_scale, w_q, w_scale, bias, x.dtype)


def fp8_linear_ref(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`fp8_linear` through the reference GEMM."""
    return fp8_linear(fp8_gemm_ref, x, w_q, w_scale, bias)


def fp8_linear_scaled_mm(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`fp8_linear` through torch._scaled_mm."""
    return fp8_linear(fp8_gemm_scaled_mm, x, w_q, w_scale, bias)


def scaled_mm_supported(device: torch.device, k: int, n: int) -> bool:
    """True when torch._scaled_mm can run these shapes here (CUDA sm89+, K and N multiples of 16)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return (major, minor) >= (8, 9) and k % 16 == 0 and n % 16 == 0
