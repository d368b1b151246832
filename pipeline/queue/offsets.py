"""In-flight offset tracking: which offset of each partition is safe to commit."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class _Partition:
    in_flight: set[int] = field(default_factory=set)
    heap: list[int] = field(
        default_factory=list
    )  # in_flight offsets, with stale (done) entries popped lazily
    next_offset: int | None = None  # highest delivered offset + 1
    committed: int | None = None  # last offset committed (Kafka meaning: the next one to read)

    def lowest_in_flight(self) -> int | None:
        while self.heap and self.heap[0] not in self.in_flight:
            heapq.heappop(self.heap)
        return self.heap[0] if self.heap else None


class OffsetTracker:
    """Per partition, the offsets handed out and not yet done.

    The offset safe to commit for a partition is its lowest offset still in flight (everything
    below it is done), or one past the highest delivered offset when nothing is in flight. Done
    offsets above an in-flight one wait: a worker that dies re-reads from the lowest in-flight
    offset, and the store's idempotent upsert absorbs the re-delivered jobs that were done.
    Not thread-safe: its owner locks.
    """

    def __init__(self) -> None:
        self._parts: dict[int, _Partition] = {}

    def assign(self, partition: int, committed: int | None = None) -> None:
        """Start tracking a partition (fresh state; `committed` is the group's committed offset)."""
        self._parts[partition] = _Partition(committed=committed)

    def revoke(self, partition: int) -> None:
        """Forget a partition: its in-flight offsets can no longer be committed by us."""
        self._parts.pop(partition, None)

    def partitions(self) -> set[int]:
        """Tracked partitions."""
        return set(self._parts)

    def spans_at_least(self, limit: int) -> set[int]:
        """Partitions whose offsets from the lowest in flight to the highest delivered number
        `limit` or more: what their commit trails their done jobs by, at most."""
        out = set()
        for p, part in self._parts.items():
            low = part.lowest_in_flight()
            if low is not None and part.next_offset is not None and part.next_offset - low >= limit:
                out.add(p)
        return out

    def delivered(self, partition: int, offset: int) -> None:
        """An offset handed to the caller (auto-assigns an untracked partition)."""
        part = self._parts.get(partition)
        if part is None:
            part = self._parts[partition] = _Partition()
        if part.next_offset is None and part.committed is None:
            # The first offset read is where the group's position was: committing it changes nothing.
            part.committed = offset
        if offset not in part.in_flight:
            part.in_flight.add(offset)
            heapq.heappush(part.heap, offset)
        if part.next_offset is None or offset + 1 > part.next_offset:
            part.next_offset = offset + 1

    def done(self, partition: int, offset: int) -> bool:
        """Mark an offset done. False when the partition is not tracked (revoked) or the offset unknown."""
        part = self._parts.get(partition)
        if part is None or offset not in part.in_flight:
            return False
        part.in_flight.discard(offset)
        return True

    def in_flight(self) -> dict[int, int]:
        """Number of in-flight offsets per tracked partition."""
        return {p: len(s.in_flight) for p, s in self._parts.items()}

    def committable(self, partitions: set[int] | None = None) -> dict[int, int]:
        """Per partition, the offset to commit now, where it is beyond the last committed one."""
        out = {}
        for p, part in self._parts.items():
            if partitions is not None and p not in partitions:
                continue
            if part.next_offset is None:
                continue
            low = part.lowest_in_flight()
            offset = part.next_offset if low is None else low
            if part.committed is None or offset > part.committed:
                out[p] = offset
        return out

    def committed(self, offsets: dict[int, int]) -> None:
        """Record offsets as committed."""
        for p, off in offsets.items():
            part = self._parts.get(p)
            if part is not None and (part.committed is None or off > part.committed):
                part.committed = off
