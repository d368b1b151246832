"""FP8 (e4m3) W8A8 linear layers: weights quantized once per output channel, activations per
token at run time, the product accumulated in fp32.

The GEMMs take quantized activations (e4m3 and one scale per token, [T, 1], or per token and group
of columns, [T, K / group]) and weights (e4m3 and one scale per output channel, [N, 1], or per
output channel and group of columns, [N, K / group]): `fp8_gemm_ref` is the reference (and the CPU
path): it dequantizes both operands and multiplies in fp32, which is what an FP8 tensor-core GEMM
with fp32 accumulation computes, up to the order of the sums. `fp8_gemm_scaled_mm` runs it on the GPU with `torch._scaled_mm` (per-channel weight scales;
sm89+); kernels/fp8_gemm.py has a Triton one for group scales. `fp8_linear` quantizes the
activations first, as a layer whose input comes unquantized does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def quantize_groupwise(x: torch.Tensor, group: int, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, C] -> (q: [R, C] e4m3, scale: [R, C // group] fp32), x[:, g*group:(g+1)*group] ~=
    q[...] * scale[:, g], each group scaled so that its largest magnitude maps to e4m3's largest
    value: a weight per (output channel, group of input columns), or an activation per (token,
    group). C must be a multiple of `group`."""
    r, c = x.shape
    if c % group:
        raise ValueError(f"quantize_groupwise: K={c} is not a multiple of the group {group}")
    xg = x.detach().float().reshape(r, c // group, group)  # [R, G, group]
    scale = xg.abs().amax(dim=-1).clamp(min=eps) / FP8_MAX  # [R, G]
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(r, c)
    return q, scale


def quantize_rowwise(x: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, C] -> (q, scale: [R, 1]): one group of the whole row."""
    return quantize_groupwise(x, x.shape[1], eps)


def quantize(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (`group` None: scale [R, 1]) or per row and group of columns (scale [R, C / group])."""
    return quantize_groupwise(x, x.shape[1] if group is None else group)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [R, C] e4m3, scale [R, G]) -> [R, C] fp32, each group of C / G columns times its scale."""
    r, c = q.shape
    return (q.float().reshape(r, scale.shape[1], -1) * scale.float().unsqueeze(-1)).reshape(r, c)


Gemm = Callable[..., torch.Tensor]  # (x_q, x_scale, w_q, w_scale, bias, out_dtype) -> [T, N]


def fp8_gemm_ref(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x_q: [T, K] e4m3, x_scale: [T, Ga], w_q: [N, K] e4m3, w_scale: [N, Gw] (G = 1: per token /
    channel; else per group of K / G columns) -> [T, N] in out_dtype: both dequantized, multiplied
    in fp32."""
    out = dequantize(x_q, x_scale) @ dequantize(w_q, w_scale).t()  # [T, N] fp32
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_gemm_scaled_mm(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The same on CUDA with torch._scaled_mm (FP8 tensor cores, fp32 accumulation), per-channel
    weight scales ([N, 1]) only. K and N must be multiples of 16; w_q.t() is column-major, as
    _scaled_mm wants its second operand."""
    return torch._scaled_mm(
        x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.t().contiguous(), bias=bias, out_dtype=out_dtype
    )


def fp8_linear(
    gemm: Gemm, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
    act_group: int | None = None,
) -> torch.Tensor:
    """x: [T, K] (any float dtype) quantized per token (or per token and `act_group` columns), then
    `gemm` -> [T, N] in x's dtype."""
    x_q, x_scale = quantize(x, act_group)  # [T, K], [T, 1] or [T, K / act_group]
    return gemm(x_q, x_scale, w_q, w_scale, bias, x.dtype)


def fp8_linear_ref(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
    act_group: int | None = None,
) -> torch.Tensor:
    """`fp8_linear` through the reference GEMM."""
    return fp8_linear(fp8_gemm_ref, x, w_q, w_scale, bias, act_group)


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
