"""Rotary position embedding on q and k, fused with writing k and v into their paged-cache slots."""

from __future__ import annotations

import torch


def rope_and_cache_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (rotate-half / NeoX layout, as Hugging Face Llama), write k and v to the cache.

    q: [T, Hq, D]; k, v: [T, Hk, D] (may be strided views of a fused qkv output; last dim contiguous)
    positions: [T] int64; cos_sin: [max_pos, D] fp32 = cat(cos[:, :D/2], sin[:, :D/2])
    k_cache, v_cache: [num_blocks, block_size, Hk, D]; slot_mapping: [T] int64.
    Returns (q_rot, k_rot) as new contiguous tensors; the rotation is computed in fp32 and rounded
    to q.dtype. The Triton launcher rotates q and k in place and returns the same tensors.
    """
    half = q.shape[-1] // 2
    cs = cos_sin[positions]  # [T, D]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    q_rot, k_rot = rot(q), rot(k)
    bs = k_cache.shape[1]
    blk, off = slot_mapping // bs, slot_mapping % bs
    k_cache[blk, off] = k_rot.to(k_cache.dtype)
    v_cache[blk, off] = v.to(v_cache.dtype)
    return q_rot, k_rot
