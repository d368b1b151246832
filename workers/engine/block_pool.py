"""The pool of KV-cache blocks: reference counts, an LRU free queue, and the prefix-cache index."""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

HASH_BYTES = 16  # blake2b digest size of a block hash


def hash_blocks(parent: bytes | None, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of consecutive full blocks: each covers the previous block's hash (`parent`
    for the first) and its own token ids as little-endian int64. The token bytes are packed once for
    the run (a 2k-token prompt: 136 blocks; ~30% less host time than packing each block), by
    struct.pack (23 us for 2176 ids on the 2-core box, against 57 for array("q"))."""
    buf = struct.pack(f"<{len(token_ids)}q", *token_ids)
    step = block_size * 8
    out = []
    h = parent or b""
    for off in range(0, len(buf) - step + 1, step):
        h = hashlib.blake2b(h + buf[off : off + step], digest_size=HASH_BYTES).digest()
        out.append(h)
    return out


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block (see hash_blocks)."""
    return hash_blocks(parent, token_ids, len(token_ids))[0]


@dataclass(eq=False)
class KVBlock:
    """One physical block of the KV cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and indexed in the prefix cache


class BlockPool:
    """Fixed pool of `num_blocks` blocks.

    Free blocks wait in a queue kept in eviction order: the front is evicted first. A freed
    block goes to the back, so the least recently used is reused first. A free block that still
    carries a hash stays findable in the prefix cache until it is handed out again.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (front first)."""
        return list(self._free)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        """The cached block holding exactly this chain of tokens, if any."""
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (removing them from the free queue if unused)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        """Hand out `n` blocks from the front of the free queue, evicting their cached contents."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            b = self.blocks[bid]
            if b.block_hash is not None:
                if self._cached.get(b.block_hash) is b:
                    del self._cached[b.block_hash]
                b.block_hash = None
                self.num_evictions += 1
            b.ref_cnt = 1
            out.append(b)
        return out

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks no one uses join the back of the free queue in order."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"block {b.block_id} released more often than taken")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = None

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Index a full block under its chained hash (first writer wins for duplicate contents)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Take blocks out of the prefix-cache index (their contents may not be what their hash
        says: a step that was to write them failed). Holders keep them; nobody finds them again."""
        for b in blocks:
            if b.block_hash is not None:
                if self._cached.get(b.block_hash) is b:
                    del self._cached[b.block_hash]
                b.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request holds; returns how many were dropped."""
        n = 0
        for h, b in list(self._cached.items()):
            if b.ref_cnt == 0:
                del self._cached[h]
                b.block_hash = None
                n += 1
        return n
