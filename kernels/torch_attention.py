"""Paged attention in batched PyTorch ops: the attention of the "torch" backend (the CPU engine).

The `*_ref` functions loop over sequences, a gather, two einsums and a softmax each: they are
the oracle the Triton kernels are tested against, and they cost the tiny model on CPU 95 ms a
decode step at 150 sequences (60,000 einsums for 100 steps). These gather every sequence's keys
into one padded batch and run one masked softmax per layer: the same fp32 math in a handful of
ops whatever the batch. A step whose padded score tensor would be large (one long prompt beside
short ones) goes through the reference instead.
"""

from __future__ import annotations

import torch

from kernels.prefill_attention import paged_attention_ref

# Largest padded score tensor (elements) the batched prefill builds; beyond it, the reference's
# loop (whose per-sequence scores are no larger than the real ones).
MAX_PADDED_SCORES = 1 << 25


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length, Hk, D] fp32: each row's first `length` cache slots, through its block table,
    zero past the row's own length. Those slots hold whatever the cache held (table padding
    points past the cache and is clamped to a real block; a last block is partly filled), and
    a masked score still multiplies its value: 0 * NaN would be NaN."""
    b, nb = block_tables.shape
    idx = block_tables.long().clamp(0, cache.shape[0] - 1)
    x = cache[idx]  # [B, nb, block_size, Hk, D]
    x = x.reshape(b, nb * cache.shape[1], *cache.shape[2:])[:, :length].float()
    beyond = torch.arange(length, device=x.device)[None, :] >= lens[:, None]
    return x.masked_fill_(beyond[:, :, None, None], 0.0)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """q: [B, N, Hq, D] fp32, k/v: [B, L, Hk, D] fp32, qpos: [B, N] (query positions; a key at
    position j is seen by a query at p when j <= p, and j > p - window) -> [B, N, Hq, D] fp32."""
    b, n, hq, d = q.shape
    hk = k.shape[2]
    qg = q.view(b, n, hk, hq // hk, d)
    scores = torch.einsum("bnkgd,blkd->bkgnl", qg, k) * scale  # [B, Hk, G, N, L]
    kpos = torch.arange(k.shape[1], device=q.device)
    allowed = kpos[None, None, :] <= qpos[:, :, None]  # [B, N, L]
    if window is not None:
        allowed &= kpos[None, None, :] > qpos[:, :, None] - window
    scores.masked_fill_(~allowed[:, None, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bkgnl,blkd->bnkgd", p, v).reshape(b, n, hq, d)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """decode_attention_ref's contract (q: [B, Hq, D], one token per sequence at position
    seq_lens[b] - 1 -> [B, Hq, D]), batched."""
    b = q.shape[0]
    if b == 0:
        return torch.empty_like(q)
    lens = seq_lens.long()
    length = int(lens.max())
    k = _gather(k_cache, block_tables, lens, length)
    v = _gather(v_cache, block_tables, lens, length)
    out = _attend(q.float()[:, None], k, v, (lens - 1)[:, None], scale, sliding_window)
    return out[:, 0].to(q.dtype)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """paged_attention_ref's contract (a varlen batch of new tokens, each sequence's over its
    whole context in the paged cache), batched: queries padded to the longest, keys to the
    longest context."""
    t, hq, _d = q.shape
    qsl = query_start_loc.long()
    lens = seq_lens.long()
    n = qsl[1:] - qsl[:-1]
    b = n.shape[0]
    if t == 0 or b == 0:
        return torch.empty_like(q)
    n_max, length = int(n.max()), int(lens.max())
    if b * hq * n_max * length > MAX_PADDED_SCORES:
        return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window)
    j = torch.arange(n_max, device=q.device)
    real = j[None, :] < n[:, None]  # [B, N]: padded query rows are computed and dropped
    tok = (qsl[:-1, None] + j[None, :]).clamp(max=t - 1)  # [B, N] -> row of q
    k = _gather(k_cache, block_tables, lens, length)
    v = _gather(v_cache, block_tables, lens, length)
    qpos = (lens - n)[:, None] + j[None, :]  # the new tokens sit at the end of each context
    o = _attend(q.float()[tok], k, v, qpos, scale, sliding_window)
    out = torch.empty_like(q)
    out[tok[real]] = o[real].to(q.dtype)
    return out
