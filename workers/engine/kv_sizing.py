"""How many KV-cache blocks fit: what a block holds, and what the device has left for them."""

from __future__ import annotations

import torch

from workers.engine.config import EngineConfig, ModelConfig


def kv_bytes_per_block(mc: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one block's K and V over every layer."""
    return 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * kv_dtype.itemsize


def auto_num_blocks(c: EngineConfig, mc: ModelConfig, device: torch.device, bytes_per_block: int,
                    max_blocks_per_seq: int) -> int:
    """Blocks for the KV cache: on a CPU `cpu_kv_cache_tokens` of them; on a GPU what is left of
    `gpu_memory_utilization` of its memory after everything already on it (the weights) and the
    activations of the largest step with its logits, with margin (measured peaks are below it)."""
    if device.type != "cuda":
        return max(c.cpu_kv_cache_tokens // c.block_size, 1)
    free, total = torch.cuda.mem_get_info(device)
    used_by_others_and_us = total - free
    t = c.max_num_batched_tokens
    per_token = mc.hidden_size * 12 + mc.intermediate_size * 6 + (mc.q_size + 2 * mc.kv_size) * 4
    act = t * per_token
    if c.cuda_graphs:  # the dense prefill graphs' activations live in the graph pool, beside the eager step's
        act += min(c.dense_graph_max_tokens, t) * per_token
    act += c.max_num_seqs * mc.vocab_size * 4 * 4 + (1 << 30)
    budget = total * c.gpu_memory_utilization - used_by_others_and_us - act
    n = int(budget // bytes_per_block)
    if n < max_blocks_per_seq // 4:
        raise RuntimeError(
            f"only {max(n, 0)} KV blocks fit in GPU memory; lower max_num_batched_tokens or "
            "raise gpu_memory_utilization"
        )
    return n

