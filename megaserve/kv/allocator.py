"""KV page allocator: refcounted pages, prefix sharing by block hash, LRU eviction of cache."""

from __future__ import annotations

from collections import OrderedDict, deque

from kernels.paged_attention import NULL_PAGE
from megaserve.errors import NoCapacity


class PageAllocator:
    """Owns page ids 1..num_pages-1 of a KVPool (0 is the null page).

    Every page is in exactly one state: free (no content), owned (ref > 0), or cached
    (ref == 0 but holding a full block whose hash is known; reusable until evicted, LRU).
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2")
        self.num_pages, self.page_size = num_pages, page_size
        self.ref = [0] * num_pages
        self.free: deque[int] = deque(range(1, num_pages))
        self.page_hash: dict[int, int] = {}  # page -> block hash of its (full) content
        self.by_hash: dict[int, int] = {}  # block hash -> page
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached pages with ref 0, oldest first
        self.evictions = 0
        # (+1 | -1, block hash) as blocks enter and leave the cache, drained by the heartbeat
        # to publish this worker's blocks in Redis for KV-aware routing. Bounded: a publisher
        # that falls behind resyncs from `cached_hashes()`.
        self.block_events: deque[tuple[int, int]] = deque(maxlen=1 << 16)

    @property
    def num_available(self) -> int:
        """Pages an allocation could take now: free plus evictable cached."""
        return len(self.free) + len(self.lru)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - self.num_available

    def match_prefix(self, hashes: list[int]) -> list[int]:
        """Pages holding the longest cached prefix of these block hashes (not yet acquired)."""
        pages = []
        for h in hashes:
            p = self.by_hash.get(h)
            if p is None:
                break
            pages.append(p)
        return pages

    def acquire(self, pages: list[int]) -> None:
        """Adds a reference to already-populated pages (prefix hits)."""
        for p in pages:
            if self.ref[p] == 0:
                self.lru.pop(p, None)
            self.ref[p] += 1

    def allocate(self, n: int) -> list[int]:
        """n fresh pages with ref 1; evicts least-recently-used cached pages if needed."""
        if n > self.num_available:
            raise NoCapacity(f"need {n} pages, {self.num_available} available")
        out = []
        for _ in range(n):
            if self.free:
                p = self.free.popleft()
            else:
                p, _ = self.lru.popitem(last=False)
                h = self.page_hash.pop(p)
                del self.by_hash[h]
                self.block_events.append((-1, h))
                self.evictions += 1
            self.ref[p] = 1
            out.append(p)
        return out

    def release(self, pages: list[int]) -> None:
        """Drops one reference each; unreferenced pages become cached (if hashed) or free."""
        for p in pages:
            assert self.ref[p] > 0, f"page {p} released more often than acquired"
            self.ref[p] -= 1
            if self.ref[p] == 0:
                if p in self.page_hash:
                    self.lru[p] = None
                else:
                    self.free.append(p)

    def register(self, page: int, block_hash: int) -> int:
        """Records that `page` now holds the full block `block_hash`.

        Returns the page the hash maps to: `page` itself, or an existing page already holding
        the same block (the caller may then switch to it and release its duplicate).
        """
        assert self.ref[page] > 0, f"page {page} registered while not owned"
        existing = self.by_hash.get(block_hash)
        if existing is not None:
            return existing
        if page in self.page_hash:
            return page
        self.page_hash[page] = block_hash
        self.by_hash[block_hash] = page
        self.block_events.append((1, block_hash))
        return page

    def drop_cache(self) -> int:
        """Forgets every cached block (their pages become free); the pool's contents were
        lost. Owned pages keep their references. Returns the number of blocks dropped."""
        self.free.extend(self.lru)
        self.lru.clear()
        self.block_events.extend((-1, h) for h in self.by_hash)
        dropped = len(self.by_hash)
        self.page_hash.clear()
        self.by_hash.clear()
        return dropped

    def cached_hashes(self) -> list[int]:
        """Every block hash held (owned or cached); safe to call from another thread."""
        for _ in range(10):
            try:
                return list(self.by_hash)
            except RuntimeError:  # resized by the engine thread mid-copy; try again
                continue
        return list(self.by_hash.copy())

    def check_invariants(self) -> None:
        """Every page is free, owned or cached exactly once; hash maps agree."""
        free, lru = set(self.free), set(self.lru)
        assert len(free) == len(self.free), "duplicate page in free list"
        assert not (free & lru), f"pages both free and cached: {sorted(free & lru)}"
        assert NULL_PAGE not in free | lru and self.ref[NULL_PAGE] == 0
        for p in range(1, self.num_pages):
            states = (p in free) + (p in lru) + (self.ref[p] > 0)
            assert states == 1, f"page {p}: free={p in free} cached={p in lru} ref={self.ref[p]}"
            assert self.ref[p] >= 0
            if p in lru:
                assert p in self.page_hash, f"cached page {p} has no hash"
            if p in free:
                assert p not in self.page_hash, f"free page {p} still hashed"
        for h, p in self.by_hash.items():
            assert self.page_hash.get(p) == h, f"hash maps disagree on page {p}"

    def all_free_or_cached(self) -> bool:
        return all(r == 0 for r in self.ref)
