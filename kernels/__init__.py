"""Fused kernels for the engine's hot path, one op a file.

Each op file holds a Triton kernel, its launcher (`<op>_triton`) and a plain PyTorch
reference (`<op>_ref`) that defines the op's semantics; the reference runs on CPU and in
tests. `kernels.ops.get_ops(backend)` returns the set the engine binds once at construction.

Shared conventions:
- KV cache of one layer: `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim];
  a token's slot is `block_id * block_size + offset_in_block`. V may lie in memory with each block's
  keys innermost, seen through a permuted view of that shape (`kernels/kv_layout.py`).
- A varlen batch is flattened to T tokens; `query_start_loc` [B + 1] (int32) marks where each
  sequence's new tokens start, `seq_lens` [B] (int32) is each sequence's total context length
  including its new tokens, `block_tables` [B, max_blocks_per_seq] (int32) maps logical to
  physical blocks.
- Sliding window W (Mistral): a query at position p sees keys at positions k with p - W < k <= p.
- No code runs at import; triton is imported lazily by the launchers (kernels/_triton.py jits a
  kernel at its first launch, so TRITON_INTERPRET=1 set before then runs it on CPU).
- Triton launchers: `<op>_triton` takes the reference's arguments; rope_and_cache rotates q/k in
  place and skips negative slots (padding); prefill takes `max_query_len`, decode `num_splits`
  (both optional, host-sync free; decode is CUDA-graph capturable).
"""
