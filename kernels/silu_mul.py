"""SiLU-and-multiply for the SwiGLU MLP."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels._triton import cdiv, check, lazy_jit, next_pow2


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] (gate | up) -> [T, I] = silu(gate) * up, computed in x.dtype."""
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

tl: Any = None  # triton.language, bound at the first launch by kernels._triton.lazy_jit


@lazy_jit
def _silu_and_mul_kernel(
    x_ptr,  # x: [T, 2 * I] (gate | up), last dim contiguous
    out_ptr,  # out: [T, I], contiguous
    stride_x,  # row stride of x (elements)
    inter,  # I: the intermediate size
    BLOCK: tl.constexpr,  # columns per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # silu rounded to x.dtype, then the product rounded again: the reference's two rounding steps
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton `silu_and_mul_ref`: x [T, 2 * I] -> [T, I]."""
    check(x.dim() == 2, "silu_and_mul: x must be [T, 2 * I], got {}", tuple(x.shape))
    t, two_i = x.shape
    check(two_i % 2 == 0, "silu_and_mul: last dim {} is odd", two_i)
    check(x.stride(1) == 1, "silu_and_mul: x's last dim must be contiguous")
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t == 0 or inter == 0:
        return out
    block = min(1024, next_pow2(inter))
    _silu_and_mul_kernel.launch((t, cdiv(inter, block)), (x, out, x.stride(0), inter), {"BLOCK": block}, 4, 3,
                                x.device.type == "cuda")
    return out
