"""The set of kernel ops the engine binds once at construction: PyTorch references or Triton."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial, update_wrapper


@dataclass(frozen=True)
class KernelOps:
    """Callables with the signatures of the `*_ref` functions in this package."""

    name: str
    rms_norm: Callable  # (x, weight, eps, residual|None) -> (normed, new_residual)
    silu_and_mul: Callable  # (x [T, 2I]) -> [T, I]
    # the same, their output quantized per token for an FP8 projection: ((e4m3, scale [T, 1]), new_residual)
    rms_norm_quant: Callable
    silu_and_mul_quant: Callable  # (x [T, 2I]) -> (e4m3 [T, I], scale [T, 1])
    rope_and_cache: Callable  # (q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping) -> (q, k)
    prefill_attention: Callable  # (q, k_cache, v_cache, block_tables, qsl, seq_lens, scale, window) -> out
    decode_attention: Callable  # (q, k_cache, v_cache, block_tables, seq_lens, scale, window) -> out
    # rope_and_cache then decode_attention in one op for a pure decode step: (q, k, v, positions, cos_sin,
    # k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale, window) -> out; None: the two ops
    decode_rope_attention: Callable | None = None
    # (k_cache, v_cache, num_heads, scale, window, q_dtype) -> None: compile every kernel variant the attention
    # ops can pick, so that no step of serving waits for a compile; a no-op for the references
    warm_up: Callable = lambda *args: None
    # (q_dtype, num_heads, k_cache, batch, num_tokens, max_query_len, ctx_bound, window) -> int: the
    # key-range splits prefill_attention would pick for these shapes (1 for the references)
    prefill_splits: Callable = lambda *args: 1
    # (q, k, v, scale) -> (e4m3 [T, Hq * D], descale [T, 1]): one uncached prompt's causal attention on
    # FP8 tensor cores, its output quantized for an FP8 o_proj (kernels/cudnn_attention.py); None: the
    # dense path stays bf16. Set by the engine (`with_fp8_attention`), not by get_ops
    dense_attention_fp8: Callable | None = None
    # (q, k, v, scale, positions, cos_sin, k_cache, v_cache, slot_mapping) -> the same, from q and k not yet
    # rotated: rope_and_cache and the e4m3 cast in one launch first; None: rope_and_cache, then
    # dense_attention_fp8. Set by `with_fp8_attention` (FIRSTTOKEN_FP8_ATTENTION_ROPE=0: None, an A/B switch)
    dense_attention_fp8_rope: Callable | None = None


def get_ops(backend: str) -> KernelOps:
    """Return the op set for `backend`: "torch" (PyTorch ops, any device) or "triton".

    The Triton ops take the references' arguments, plus optional extras: prefill_attention a
    `max_query_len` int that sizes its grid and a `num_splits` int, decode_attention a `num_splits` int. Triton's
    rope_and_cache rotates q and k in place (the reference returns new tensors).
    """
    if backend == "torch":
        from kernels.fp8_quant import rms_norm_quant_ref, silu_and_mul_quant_ref
        from kernels.rmsnorm import rms_norm_ref
        from kernels.rope_cache import rope_and_cache_ref
        from kernels.silu_mul import silu_and_mul_ref
        from kernels.torch_attention import decode_attention_torch, paged_attention_torch

        return KernelOps(
            name="torch",
            rms_norm=rms_norm_ref,
            silu_and_mul=silu_and_mul_ref,
            rms_norm_quant=rms_norm_quant_ref,
            silu_and_mul_quant=silu_and_mul_quant_ref,
            rope_and_cache=rope_and_cache_ref,
            # the references' math, batched over sequences (the references loop over them)
            prefill_attention=paged_attention_torch,
            decode_attention=decode_attention_torch,
        )
    if backend == "triton":
        from kernels.decode_attention import (
            decode_attention_triton,
            decode_rope_attention_triton,
            tiles_from_env,
        )
        from kernels.fp8_quant import rms_norm_quant_triton, silu_and_mul_quant_triton
        from kernels.prefill_attention import keywords_from_env, paged_attention_triton, plan_prefill_splits
        from kernels.rmsnorm import rms_norm_triton
        from kernels.rope_cache import rope_and_cache_triton
        from kernels.silu_mul import silu_and_mul_triton

        # FIRSTTOKEN_PREFILL_WIDEN: what the prefill attention widens an fp8 cache to, or k8 (QK^T in FP8);
        # FIRSTTOKEN_PREFILL_COMPACT=0: its grid per sequence, not the compact one; FIRSTTOKEN_PREFILL_PREFETCH=1:
        # block ids a tile ahead (kernels.prefill_attention.keywords_from_env; A/B switches)
        prefill_kw = keywords_from_env()
        # FIRSTTOKEN_DECODE_TILES: decode attention's tile keywords, for every launch and the warm-up (an A/B switch)
        tiles = tiles_from_env()
        return KernelOps(
            name="triton",
            rms_norm=rms_norm_triton,
            silu_and_mul=silu_and_mul_triton,
            rms_norm_quant=rms_norm_quant_triton,
            silu_and_mul_quant=silu_and_mul_quant_triton,
            rope_and_cache=rope_and_cache_triton,
            prefill_attention=_bind(paged_attention_triton, prefill_kw),
            decode_attention=_bind(decode_attention_triton, tiles),
            # FIRSTTOKEN_FUSED_DECODE_ROPE=0: rope_and_cache's own launch in decode steps too (an A/B switch)
            decode_rope_attention=None if os.environ.get("FIRSTTOKEN_FUSED_DECODE_ROPE") == "0"
            else _bind(decode_rope_attention_triton, tiles),
            warm_up=partial(_warm_up_triton, **prefill_kw, decode_tiles=tiles),
            prefill_splits=plan_prefill_splits,
        )
    raise ValueError(f"unknown kernel backend {backend!r}; expected 'torch' or 'triton'")


def with_fp8_attention(ops: KernelOps) -> KernelOps:
    """ops whose dense prefill attention runs on FP8 tensor cores: cuDNN's (Triton ops) or its PyTorch
    emulation (the references, for CPU tests)."""
    from dataclasses import replace

    from kernels.cudnn_attention import dense_attention_fp8, dense_attention_fp8_rope

    ref = ops.name == "torch"
    fused = os.environ.get(FP8_ATTENTION_ROPE_ENV) or "1"
    if fused not in ("0", "1"):
        raise ValueError(f"{FP8_ATTENTION_ROPE_ENV} must be 0 or 1, not {fused!r}")
    return replace(ops, dense_attention_fp8=partial(dense_attention_fp8, reference=ref),
                   dense_attention_fp8_rope=partial(dense_attention_fp8_rope, reference=ref) if fused == "1" else None)


FP8_ATTENTION_ROPE_ENV = "FIRSTTOKEN_FP8_ATTENTION_ROPE"


def _bind(fn: Callable, keywords: dict) -> Callable:
    """fn itself without keywords (no wrapper on the hot path), else fn with them bound, keeping its name."""
    return update_wrapper(partial(fn, **keywords), fn) if keywords else fn


def _warm_up_triton(k_cache, v_cache, num_heads: int, scale: float, sliding_window: int | None, q_dtype,
                    widen: str | None = None, compact: bool = True, prefetch: bool = False,
                    decode_tiles: dict | None = None) -> None:
    from kernels.decode_attention import warm_up_decode
    from kernels.prefill_attention import warm_up_prefill

    warm_up_prefill(k_cache, v_cache, num_heads, scale, sliding_window, q_dtype, widen, compact, prefetch)
    warm_up_decode(k_cache, v_cache, num_heads, scale, sliding_window, q_dtype, decode_tiles)
