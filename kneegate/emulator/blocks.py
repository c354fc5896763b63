"""The KV cache's blocks: how many are free, and which free ones still hold a known prefix.

A block is free or held. A held block is either private to one request or *published* under
its prefix-cache key (vLLM's block hash) and shared by every request that references it. A
published block whose last reference goes is still free, but it keeps its key: it sits in
`cached` in the order blocks were freed, and a later request with the same prefix revives it
instead of recomputing it. An allocation takes uncached free blocks first and evicts cached
ones, least recently freed first, only for the rest (vLLM's free block queue,
vllm/v1/core/block_pool.py).
"""

from __future__ import annotations

__all__ = ["BlockPool"]


class BlockPool:
    """`free` counts every free block, cached ones included; `free <= total` always."""

    __slots__ = ("cached", "free", "shared", "total")

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self.shared: dict[int, int] = {}  # published key -> references
        self.cached: dict[int, None] = {}  # free blocks still keyed, least recently freed first

    def knows(self, key: int) -> bool:
        return key in self.shared or key in self.cached

    def take(self, n: int) -> None:
        """Allocate `n` private blocks (the caller checked `n <= free`)."""
        evict = n - (self.free - len(self.cached))
        cached = self.cached
        while evict > 0:
            del cached[next(iter(cached))]
            evict -= 1
        self.free -= n

    def give(self, n: int) -> None:
        """Free `n` private blocks."""
        self.free += n

    def ref(self, key: int) -> None:
        """One more reference on a known key, reviving it if it was cached."""
        if key in self.cached:
            del self.cached[key]
            self.free -= 1
            self.shared[key] = 1
        else:
            self.shared[key] += 1

    def unref(self, keys: list[int]) -> None:
        """Drop one reference on each key; a key nobody holds stays cached, free."""
        shared, cached = self.shared, self.cached
        for key in keys:
            left = shared[key] - 1
            if left:
                shared[key] = left
            else:
                del shared[key]
                cached[key] = None  # the most recently freed
                self.free += 1

    def publish(self, key: int) -> None:
        """A private block now holds `key`'s prefix: it becomes shared under that key; if the
        key is known already, the caller's copy is freed and it references the known one."""
        if self.knows(key):
            self.ref(key)
            self.free += 1
        else:
            self.shared[key] = 1

    def revived(self, keys: list[int]) -> int:
        """How many of `keys` are free (cached) blocks that referencing them would take."""
        return sum(1 for key in keys if key in self.cached)
