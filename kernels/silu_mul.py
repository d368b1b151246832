"""SiLU-and-multiply for the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] (gate | up) -> [T, I] = silu(gate) * up, computed in x.dtype."""
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]
