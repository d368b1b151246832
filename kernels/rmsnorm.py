"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import check, lazy_jit, next_pow2


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (normed, new_residual) where new_residual = x + residual (or x when residual is None).

    x, residual: [T, H]; weight: [H]. The sum is rounded to x.dtype (as Hugging Face does),
    the normalisation runs in fp32, the result is cast back before the weight multiply.
    """
    if residual is not None:
        x = x + residual
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    normed = (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return weight * normed, x


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

tl: Any = None  # triton.language, bound at the first launch by kernels._triton.lazy_jit


@lazy_jit
def _rms_norm_kernel(
    x_ptr,  # x: [T, H], last dim contiguous
    res_ptr,  # residual: [T, H] (read only when HAS_RESIDUAL)
    w_ptr,  # weight: [H], contiguous
    out_ptr,  # normed out: [T, H], contiguous
    new_res_ptr,  # new residual out: [T, H], contiguous (written only when HAS_RESIDUAL)
    stride_x,  # row stride of x (elements)
    stride_res,  # row stride of residual (elements)
    H,  # hidden size
    eps,  # variance epsilon
    HAS_RESIDUAL: tl.constexpr,  # fuse new_residual = x + residual
    BLOCK_H: tl.constexpr,  # power of two >= H: one program normalises one whole row
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # the sum is rounded to x.dtype before normalising, as the reference (and HF) do
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + row * H + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    normed = (xf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * H + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `rms_norm_ref`: one pass per row, residual add fused; same return convention."""
    # x, residual: [T, H]; weight: [H]
    check(x.dim() == 2, "rms_norm: x must be [T, H], got {}", tuple(x.shape))
    t, h = x.shape
    check(weight.shape == (h,), "rms_norm: weight must be [{}], got {}", h, tuple(weight.shape))
    check(x.stride(1) == 1 or h == 1, "rms_norm: x's last dim must be contiguous")
    check(weight.is_contiguous(), "rms_norm: weight must be contiguous")
    check(weight.device == x.device, "rms_norm: weight and x on different devices")
    check(h <= 65536, "rms_norm: hidden size {} > 65536 is not supported (one row per program)", h)
    if residual is not None:
        check(residual.shape == x.shape, "rms_norm: residual {} != x {}", tuple(residual.shape), tuple(x.shape))
        check(residual.dtype == x.dtype, "rms_norm: residual dtype {} != x dtype {}", residual.dtype, x.dtype)
        check(residual.stride(1) == 1 or h == 1, "rms_norm: residual's last dim must be contiguous")
        check(residual.device == x.device, "rms_norm: residual and x on different devices")
    out = torch.empty((t, h), dtype=torch.result_type(weight, x), device=x.device)
    new_res = torch.empty((t, h), dtype=x.dtype, device=x.device) if residual is not None else x
    if t == 0:
        return out, new_res
    block_h = next_pow2(h)
    _rms_norm_kernel.launch((t,), (
        x,
        residual if residual is not None else x,
        weight,
        out,
        new_res,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        h,
        eps,
    ), {"HAS_RESIDUAL": residual is not None, "BLOCK_H": block_h},
        min(16, max(1, block_h // 256)), 3, x.device.type == "cuda")  # 3 stages: Triton's default
    return out, new_res
