"""The paged KV cache's two V layouts: what the attention kernels and the cache writers accept.

Every op sees a layer's caches as [num_blocks, block_size, Hk, D]. K is always laid out that way in
memory (a key's D values contiguous). V may be too ("rows"), or may hold each block's keys
innermost ("keys inner"): memory [num_blocks, Hk, D, block_size], seen through a permuted view with
strides (Hk * D * block_size, 1, D * block_size, block_size) - vLLM's first paged V layout.

Why keys inner: the attention's P @ V product reduces over keys, and a tensor-core operand holds
pairs of consecutive reduction elements in one register. With an fp8 cache in rows, the decode
kernel reads V from shared memory one byte at a time (128 LDS.U8 a thread a 64-key tile; Triton
3.6's sm90 SASS, 1350 instructions a tile against 791 keys-inner), where 16-bit caches have
ldmatrix's transpose. Keys inner, a block's 16 keys of one (head, dim) are 16 contiguous bytes: V
loads like K. Measured on an H100 it was not faster (2-6% slower in decode,
bench/results/2026-12-06-v-layout-h100.md), so the engine's default stays rows.

The PyTorch references index the view and need no change; the Triton kernels read the layout from
the strides (`v_keys_inner`).
"""

from __future__ import annotations

import torch

V_LAYOUTS = ("rows", "keys_inner")


def empty_kv_caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device | str, v_layout: str = "rows") -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (k_cache, v_cache) of one layer, both seen as [num_blocks, block_size, Hk, D]."""
    if v_layout not in V_LAYOUTS:
        raise ValueError(f"v_layout must be one of {V_LAYOUTS}, not {v_layout!r}")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.zeros(shape, dtype=dtype, device=device)
    if v_layout == "rows":
        return k, torch.zeros(shape, dtype=dtype, device=device)
    v = torch.zeros((num_blocks, num_kv_heads, head_dim, block_size), dtype=dtype, device=device)
    return k, v.permute(0, 3, 1, 2)


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


def to_v_layout(v_cache: torch.Tensor, v_layout: str, stale: float = 0.0) -> torch.Tensor:
    """A copy of v_cache (seen as [num_blocks, block_size, Hk, D]) in the given layout; with the keys
    innermost, NaN slots (a test's poison for unwritten ones) become `stale`, as the layout needs."""
    nb, bs, hk, d = v_cache.shape
    _k, out = empty_kv_caches(nb, bs, hk, d, v_cache.dtype, v_cache.device, v_layout)
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
