"""The paged KV cache's layouts: what the attention kernels and the cache writers accept.

Every op sees a layer's caches as [num_blocks, block_size, Hk, D] and reads the layout from the strides.

K is laid out that way in memory ("nhd": a block's keys outermost, a key's D values contiguous), or heads
first ("hnd", FlashInfer's name: memory [num_blocks, Hk, block_size, D], one head's block a single run of
block_size * D values, seen through a permuted view).

V may lie as K does ("rows"), or may hold each block's keys innermost ("keys inner"): memory
[num_blocks, Hk, D, block_size], seen through a permuted view with strides
(Hk * D * block_size, 1, D * block_size, block_size) - vLLM's first paged V layout.

Why keys inner: the attention's P @ V product reduces over keys, and a tensor-core operand holds
pairs of consecutive reduction elements in one register. With an fp8 cache in rows, the decode
kernel reads V from shared memory one byte at a time (128 LDS.U8 a thread a 64-key tile; Triton
3.6's sm90 SASS, 1350 instructions a tile against 791 keys-inner), where 16-bit caches have
ldmatrix's transpose. Keys inner, a block's keys of one (head, dim) are contiguous bytes: V loads like
K. At blocks of 16 (16-byte runs) it was not faster on an H100 (bench/results/2026-12-06-v-layout-h100.md);
at blocks of 64 (64-byte runs) with the block ids prefetched it read 98-100% of the copy rate with 40 of an
H100's SMs held (bench/results/2026-12-07-session22.md), so an fp8 cache defaults to it (EngineConfig).

The PyTorch references index the views and need no change; the Triton kernels take the strides
(`v_keys_inner` tells V's layout apart).
"""

from __future__ import annotations

import torch

V_LAYOUTS = ("rows", "keys_inner")
K_LAYOUTS = ("nhd", "hnd")


def _zeros_in_rows(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device | str, k_layout: str) -> torch.Tensor:
    """A zeroed cache with its values in rows, seen as [num_blocks, block_size, Hk, D], laid out as k_layout says."""
    if k_layout not in K_LAYOUTS:
        raise ValueError(f"k_layout must be one of {K_LAYOUTS}, not {k_layout!r}")
    if k_layout == "nhd":
        return torch.zeros((num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
    heads = torch.zeros((num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype, device=device)
    return heads.permute(0, 2, 1, 3)


def _zeros_v(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device | str, v_layout: str, k_layout: str) -> torch.Tensor:
    """A zeroed V cache, seen as [num_blocks, block_size, Hk, D], in v_layout (in rows: laid out as K, k_layout)."""
    if v_layout not in V_LAYOUTS:
        raise ValueError(f"v_layout must be one of {V_LAYOUTS}, not {v_layout!r}")
    if v_layout == "rows":
        return _zeros_in_rows(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, k_layout)
    v = torch.zeros((num_blocks, num_kv_heads, head_dim, block_size), dtype=dtype, device=device)
    return v.permute(0, 3, 1, 2)


def empty_kv_caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device | str, v_layout: str = "rows",
                    k_layout: str = "nhd") -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (k_cache, v_cache) of one layer, both seen as [num_blocks, block_size, Hk, D]; V in rows
    lies as K does (k_layout)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    v = _zeros_v(*shape, dtype, device, v_layout, k_layout)
    return _zeros_in_rows(*shape, dtype, device, k_layout), v


def v_keys_inner(v_cache: torch.Tensor) -> bool:
    """True when v_cache (seen as [num_blocks, block_size, Hk, D]) holds each block's keys innermost."""
    _nb, bs, hk, d = v_cache.shape
    s = v_cache.stride()
    return bs > 1 and s[1] == 1 and s[3] == bs and s[2] == d * bs and s[0] >= hk * d * bs


def check_v_layout(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Checks that v_cache is k_cache's shape in one of the two layouts; returns `v_keys_inner`."""
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: v_cache {tuple(v_cache.shape)} must have k_cache's shape {tuple(k_cache.shape)}")
    inner = v_keys_inner(v_cache)
    if not inner and v_cache.stride() != k_cache.stride():
        raise ValueError(f"{name}: v_cache must have k_cache's strides or hold each block's keys innermost "
                         f"(kernels/kv_layout.py), not strides {v_cache.stride()}")
    return inner


def heads_first(cache: torch.Tensor) -> bool:
    """True when cache (seen as [num_blocks, block_size, Hk, D], its values in rows) lies heads first ("hnd")."""
    _nb, bs, hk, d = cache.shape
    s = cache.stride()
    return s[3] == 1 and s[1] == d and s[2] == bs * d and hk * bs * d <= s[0]


def to_k_layout(cache: torch.Tensor, k_layout: str) -> torch.Tensor:
    """A copy of a cache in rows (seen as [num_blocks, block_size, Hk, D]) laid out as k_layout says."""
    return _zeros_in_rows(*cache.shape, cache.dtype, cache.device, k_layout).copy_(cache)


def to_v_layout(v_cache: torch.Tensor, v_layout: str, stale: float = 0.0) -> torch.Tensor:
    """A copy of v_cache (seen as [num_blocks, block_size, Hk, D]) in the given layout; with the keys
    innermost, NaN slots (a test's poison for unwritten ones) become `stale`, as the layout needs."""
    out = _zeros_v(*v_cache.shape, v_cache.dtype, v_cache.device, v_layout, "nhd")
    if v_layout == "keys_inner":
        v_cache = torch.where(v_cache.float().isnan(), stale, v_cache.float()).to(v_cache.dtype)
    return out.copy_(v_cache)


def v_max(dtype: torch.dtype) -> float:
    """The largest finite value a V cache of this dtype holds."""
    return float(torch.finfo(dtype).max)


def finite_v_ref(v: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """The values a V cache stores for v: as they are in rows; with the keys innermost, NaN -> 0 and
    +-inf or beyond the cache dtype's range clamped to it (fp32).

    Why: the attention kernels read a keys-inner block whole, the slots past a context's end in its
    last block too, and give those keys probability 0; 0 * NaN is NaN, so those stale slots must
    hold finite values, whatever request wrote them last (the cache starts zeroed). A masked load per
    key would cost the vectorised V load its 16-byte runs (the mask then varies along them).
    """
    if not v_keys_inner(v_cache):
        return v
    lim = v_max(v_cache.dtype)
    return torch.nan_to_num(v.float(), nan=0.0, posinf=lim, neginf=-lim).clamp(-lim, lim)
