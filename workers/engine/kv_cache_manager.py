"""Per-request block tables over the shared block pool, with prefix reuse."""

from __future__ import annotations

from workers.engine.block_pool import BlockPool, KVBlock, hash_blocks
from workers.engine.sequence import Request


class KVCacheManager:
    """Gives each request the blocks for its tokens; reuses cached full blocks of shared prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        # prefix-cache statistics, counted in prompt tokens at each admission
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def _update_hashes(self, req: Request, upto: int) -> None:
        """Extend req.block_hashes over every full block among its first `upto` known tokens."""
        bs = self.block_size
        n_full = min(upto, req.num_known_tokens) // bs
        hashes = req.block_hashes
        start = len(hashes)
        if start >= n_full:
            return
        hashes.extend(hash_blocks(hashes[-1] if hashes else None, req.token_ids[start * bs : n_full * bs], bs))

    def find_cached_prefix(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute, since its logits give the next token.
        Returns (blocks, number of tokens they hold). Takes no references.
        """
        if not self.enable_prefix_caching or req.sampling.prompt_logprobs is not None:
            return [], 0  # (prompt log-probabilities need every prompt position computed)
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._update_hashes(req, max_blocks * self.block_size)
        blocks: list[KVBlock] = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, req: Request, num_new_tokens: int, cached_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more computed tokens (after `cached_blocks`, if given).

        Returns False, changing nothing, when the pool lacks free blocks. Blocks that become full
        with known tokens are indexed in the prefix cache right away: the step that computes them
        writes their K/V before any attention reads them (steps run in order on one stream). A
        block holding a pending sampled token is indexed by a later call, once the token is known.
        """
        bs = self.block_size
        if not cached_blocks:
            # fast path of a decode step: the new tokens fit the last block and no block filled up
            total = req.num_computed_tokens + num_new_tokens
            if total <= len(req.block_ids) * bs and (
                not self.enable_prefix_caching or min(total, req.num_known_tokens) // bs <= req.num_indexed_blocks
            ):
                return True
        cached_blocks = cached_blocks or []
        num_computed = req.num_computed_tokens + len(cached_blocks) * self.block_size
        total = num_computed + num_new_tokens
        need_blocks = -(-total // self.block_size)
        num_new_blocks = need_blocks - len(req.block_ids) - len(cached_blocks)
        # cached blocks nobody holds sit in the free queue; taking them shrinks it
        num_evictable_cached = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free - num_evictable_cached:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            if req.num_indexed_blocks == len(req.block_ids):
                req.num_indexed_blocks += len(cached_blocks)  # found in the index: nothing to offer it again
            req.block_ids.extend(b.block_id for b in cached_blocks)
        if num_new_blocks > 0:
            req.block_ids.extend(b.block_id for b in self.pool.allocate(num_new_blocks))
        if self.enable_prefix_caching:
            n_full = min(total, req.num_known_tokens) // self.block_size
            self._update_hashes(req, n_full * self.block_size)
            for i in range(req.num_indexed_blocks, n_full):
                self.pool.cache(self.pool.blocks[req.block_ids[i]], req.block_hashes[i])
            req.num_indexed_blocks = max(req.num_indexed_blocks, n_full)
        return True

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted before its prefix."""
        self.pool.release(self.pool.blocks[b] for b in reversed(req.block_ids))
        req.block_ids = []
        req.num_indexed_blocks = 0

    def record_hit(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_prompt_tokens
        self.num_hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache since start."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
