"""Shared helpers of the kernel tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch

# Tolerances per dtype: well above rounding (fp32 exact math in the interpreter; 16-bit outputs
# rounded once, the interpreter truncating fp32 -> bf16 instead of rounding), well below any
# indexing or masking bug (errors of order 0.1 to 1). test_kernel_attention.py shows that a
# one-key causal/window shift or a swapped block fails them.
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def make_paged_kv(
    ctx_lens: list[int], hk: int, d: int, block_size: int, dtype: torch.dtype, spare_blocks: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A poisoned paged cache holding random K/V for each sequence's first ctx_lens[i] tokens.

    Returns (k_cache, v_cache, block_tables): block tables are a random permutation of the
    blocks (not the identity), one spare column past each sequence's last block; every slot
    that no sequence owns, including the tail of a partly filled last block, holds NaN.
    """
    max_blocks = max(-(-c // block_size) for c in ctx_lens) + 1
    num_blocks = len(ctx_lens) * max_blocks + spare_blocks
    k_cache = torch.full((num_blocks, block_size, hk, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.randperm(num_blocks)[: len(ctx_lens) * max_blocks].view(len(ctx_lens), max_blocks)
    block_tables = block_tables.to(torch.int32).contiguous()
    for i, c in enumerate(ctx_lens):
        for p in range(c):
            blk, off = int(block_tables[i, p // block_size]), p % block_size
            k_cache[blk, off] = torch.randn(hk, d).to(dtype)
            v_cache[blk, off] = torch.randn(hk, d).to(dtype)
    return k_cache, v_cache, block_tables


def dense_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    ctx_lens: list[int],
    scale: float,
    window: int | None,
    causal_shift: int = 0,
    window_shift: int = 0,
) -> torch.Tensor:
    """Float64 attention written independently of the references, with deliberate bugs on demand.

    causal_shift=1 lets each query see one key past itself; window_shift=1 widens the window by one.
    """
    t, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    for i, ctx in enumerate(ctx_lens):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        pos = torch.arange(ctx)
        slots = block_tables[i, pos // bs].long() * bs + pos % bs
        k = k_cache.reshape(-1, hk, d)[slots].double()  # [ctx, Hk, D]
        v = v_cache.reshape(-1, hk, d)[slots].double()
        for h in range(hq):
            kv = h // (hq // hk)
            for j in range(e - s):
                qp = ctx - (e - s) + j
                ok = pos <= qp + causal_shift
                if window is not None:
                    ok &= pos > qp - window - window_shift
                sc = (k[ok, kv] @ q[s + j, h].double()) * scale
                out[s + j, h] = torch.softmax(sc, 0) @ v[ok, kv]
    return out
