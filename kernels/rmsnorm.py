"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch


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
