"""Per-step attention metadata and the attention layer over the paged KV cache."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kernels.cudnn_attention import HEAD_DIMS as FP8_ATTENTION_HEAD_DIMS
from kernels.cudnn_attention import Unsupported as FP8AttentionUnsupported
from kernels.ops import KernelOps

log = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """Where the step's tokens go in the KV cache and what each sequence attends to.

    The flattened batch holds `num_decodes` single-token sequences first, then the prefills.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    num_decodes: int  # sequences (= tokens) in the decode part
    num_decode_tokens: int  # == num_decodes; the prefill part starts at this token index
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int32
    prefill_block_tables: torch.Tensor | None  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor | None  # [num_prefills + 1] int32, relative to the prefill part
    prefill_seq_lens: torch.Tensor | None  # [num_prefills] int32
    prefill_max_query_len: int = 0
    decode_num_splits: int | None = None  # flash-decoding splits; fixed when the step is graph-captured
    prefill_num_splits: int | None = None  # prefill key-range splits (None: the kernel's choice from shapes)
    # the step is one long prompt with nothing cached: attention runs on the contiguous new
    # q/k/v with a dense causal kernel instead of through the cache
    prefill_dense: bool = False


# decode batches up to which rope_and_cache runs inside the decode attention (KernelOps.decode_rope_attention).
# On the H200, Llama-3.1-8B shape, fp8 + fp8 KV, context ~600 (bench/results/2026-12-03-engine-h200-b3eebdf.md),
# fused against its own launch: batch 1 2.96 / 3.03 ms, 8 3.41 / 3.48, 64 4.33 / 4.35, 256 9.16 / 8.68
# (at 256 there is one split a sequence, and each program's rotation before its long loop costs more
# than the launch it saves). With V's keys innermost (an fp8 cache's default since session 23), on an H100,
# one process (bench/results/2026-12-07-session25-fused-rope-h100-29cb0dd.md), fused at every batch against
# fused up to 16: b64 5.04 / 5.12 ms, b256 9.07 / 8.97, b512 15.52 / 15.35 (b1, the same path in both,
# 3.61 / 3.62). Both cards put 64 on the fused side, 256 on the other.
FUSED_ROPE_MAX_BATCH = 64
FUSED_ROPE_ENV = "FIRSTTOKEN_FUSED_ROPE_MAX_BATCH"  # an A/B switch: the bound for engines built afterwards


def fused_rope_max_batch() -> int:
    """FUSED_ROPE_MAX_BATCH, or FIRSTTOKEN_FUSED_ROPE_MAX_BATCH (a non-negative int; 0: never fused)."""
    env = os.environ.get(FUSED_ROPE_ENV)
    if env is None or env == "":
        return FUSED_ROPE_MAX_BATCH
    try:
        n = int(env)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{FUSED_ROPE_ENV} must be a non-negative integer, not {env!r}")
    return n


class PagedAttention:
    """Attention of the step's new tokens over one layer's paged KV cache (no weights)."""

    def __init__(self, ops: KernelOps, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None) -> None:
        self.ops = ops
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        # FP8 dense attention where the ops have it and cuDNN's FP8 forward takes these heads
        self.dense_fp8 = ops.dense_attention_fp8 if head_dim in FP8_ATTENTION_HEAD_DIMS else None
        self.fused_rope_max = fused_rope_max_batch()
        # cuDNN's FP8 attention with rope_and_cache and the e4m3 cast in one launch before it (or None)
        self.dense_fp8_rope = ops.dense_attention_fp8_rope if self.dense_fp8 is not None else None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k, v: [T, Hk, D] (rotated); the step's k/v are already in k_cache/v_cache
        if meta.prefill_dense and self.sliding_window is None:
            if self.dense_fp8 is not None:  # (e4m3 [T, Hq * D], descale [T, 1]) for o_proj
                try:
                    return self.dense_fp8(q, k, v, self.scale)
                except FP8AttentionUnsupported as e:  # this shape runs in bf16 (the o_proj takes either)
                    _warn_fp8_fallback(e)
            return dense_causal_attention(q, k, v, self.scale)
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:
            return self.ops.decode_attention(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
                self.sliding_window, **_splits(meta),
            )
        if nd == 0:
            return self._prefill(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        out[:nd] = self.ops.decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
            self.sliding_window, **_splits(meta),
        )
        out[nd:] = self._prefill(q[nd:], k_cache, v_cache, meta)
        return out

    def dense_fp8_with_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One uncached prompt's FP8 attention from q, k, v not yet rotated: rope_and_cache and the e4m3 cast in
        one launch, then cuDNN's attention (KernelOps.dense_attention_fp8_rope): (e4m3 [T, Hq * D], descale
        [T, 1]) for the FP8 o_proj. None where that path does not run this step (the caller rotates and
        calls the layer): not a dense prefill, a sliding window, ops without it, or cuDNN refusing the shape."""
        if self.dense_fp8_rope is None or not meta.prefill_dense or self.sliding_window is not None:
            return None
        try:
            return self.dense_fp8_rope(q, k, v, self.scale, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
        except FP8AttentionUnsupported as e:  # refused before anything was written: the caller's path runs
            _warn_fp8_fallback(e)
            return None

    def fuses_rope(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """A pure decode step of at most FUSED_ROPE_MAX_BATCH sequences (`fused_rope_max_batch`) on ops
        that fuse rope_and_cache into the decode attention."""
        return (self.ops.decode_rope_attention is not None and 0 < num_tokens <= self.fused_rope_max
                and meta.num_decode_tokens == num_tokens and not meta.prefill_dense)

    def decode_with_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        # q: [B, Hq, D], k, v: [B, Hk, D] not rotated yet; written to the cache by the op
        assert self.ops.decode_rope_attention is not None
        return self.ops.decode_rope_attention(
            q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping, meta.decode_block_tables,
            meta.decode_seq_lens, self.scale, self.sliding_window, **_splits(meta),
        )

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        kwargs = {}
        if self.ops.name != "torch":
            kwargs["max_query_len"] = meta.prefill_max_query_len
            if meta.prefill_num_splits is not None:
                kwargs["num_splits"] = meta.prefill_num_splits
        return self.ops.prefill_attention(
            q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
            meta.prefill_seq_lens, self.scale, self.sliding_window, **kwargs,
        )


_FALLBACKS: set[str] = set()  # FP8 attention refusals logged (each once)


def _warn_fp8_fallback(e: Exception) -> None:
    if str(e) not in _FALLBACKS:
        _FALLBACKS.add(str(e))
        log.warning("FP8 attention unavailable for this prompt length, running it in bf16: %s", e)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence over itself through PyTorch SDPA, cuDNN's kernel first.

    On an H200 (bench/results), cuDNN ran 32768 causal tokens at 563 TFLOP/s against 379 for our
    paged Triton kernel and 342 for SDPA's flash backend; long uncached prompts take this path.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq, D]
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]
    gqa = q.shape[1] != k.shape[1]
    with sdpa_kernel(order, set_priority=True):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=gqa,
        )
    return out[0].transpose(0, 1)


def _splits(meta: AttentionMetadata) -> dict:
    return {} if meta.decode_num_splits is None else {"num_splits": meta.decode_num_splits}
