"""Rotary embedding tables, with `llama3` and `linear` frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, as Hugging Face computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    rtype = scaling["rope_type"]
    factor = float(scaling["factor"])
    if rtype == "linear":
        return inv_freq / factor
    if rtype == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope type {rtype!r}")


def rope_cos_sin(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int, device: torch.device
) -> torch.Tensor:
    """cos_sin table [max_positions, head_dim] fp32: cos of the half-dim frequencies, then sin."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
    pos = torch.arange(max_positions, device=device, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()
