"""Attention of a varlen batch of new tokens over the paged KV cache (prefill, chunked prefill, prefix hits)."""

from __future__ import annotations

import torch


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context in the paged cache.

    q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hk, D] (the new tokens' k/v are
    already written); block_tables: [B, max_blocks] int32; query_start_loc: [B + 1] int32;
    seq_lens: [B] int32 (context length including the new tokens). Hq is a multiple of Hk
    (grouped-query heads). Returns [T, Hq, D] in q.dtype; softmax in fp32.
    """
    T, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    group = hq // hk
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx in enumerate(lens):
        s, e = qsl[i], qsl[i + 1]
        n = e - s
        if n == 0:
            continue
        nblk = (ctx + bs - 1) // bs
        blocks = block_tables[i, :nblk].long()
        k = k_cache[blocks].reshape(-1, hk, d)[:ctx].float()  # [ctx, Hk, D]
        v = v_cache[blocks].reshape(-1, hk, d)[:ctx].float()
        k = k.repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qi = q[s:e].float()  # [n, Hq, D]
        scores = torch.einsum("nhd,khd->hnk", qi, k) * scale  # [Hq, n, ctx]
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        allowed = kpos <= qpos
        if sliding_window is not None:
            allowed = allowed & (kpos > qpos - sliding_window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hnk,khd->nhd", p, v).to(q.dtype)
    return out
