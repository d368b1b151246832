"""Attention of one new token per sequence over the paged KV cache (decode)."""

from __future__ import annotations

import torch

from kernels.prefill_attention import paged_attention_ref


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D], one token per sequence at position seq_lens[b] - 1 -> [B, Hq, D]."""
    b = q.shape[0]
    qsl = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, qsl, seq_lens, scale, sliding_window)
