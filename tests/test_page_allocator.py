"""Page allocator: refcounts, prefix sharing, LRU eviction; invariants after every scenario."""

from __future__ import annotations

import random

import pytest

from megaserve.errors import NoCapacity
from megaserve.kv.allocator import PageAllocator
from megaserve.kv.block_hash import block_hashes


@pytest.fixture
def alloc():
    a = PageAllocator(num_pages=9, page_size=4)
    yield a
    a.check_invariants()


def test_allocate_release_returns_to_free(alloc):
    pages = alloc.allocate(5)
    assert 0 not in pages and len(set(pages)) == 5 and alloc.num_available == 3
    alloc.release(pages)
    assert alloc.num_available == 8 and alloc.all_free_or_cached()


def test_prefix_sharing_and_lru_eviction(alloc):
    tokens = list(range(12))
    hashes = block_hashes(tokens, 4)
    pages = alloc.allocate(3)
    for p, h in zip(pages, hashes):
        assert alloc.register(p, h) == p
    alloc.release(pages)  # cached, not free
    assert alloc.match_prefix(hashes) == pages
    # A request sharing the first two blocks reuses them.
    other = block_hashes(tokens[:8] + [99, 98, 97, 96], 4)
    hit = alloc.match_prefix(other)
    assert hit == pages[:2]
    alloc.acquire(hit)
    assert alloc.ref[pages[0]] == 1
    # Exhaust the pool: the one unreferenced cached page (block 3) is evicted, LRU first.
    fresh = alloc.allocate(alloc.num_available)
    assert pages[2] in fresh and alloc.evictions == 1
    assert alloc.match_prefix(hashes) == pages[:2]
    with pytest.raises(NoCapacity, match="need 1 pages, 0 available"):
        alloc.allocate(1)
    alloc.release(fresh)
    alloc.release(hit)


def test_chained_hash_names_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second block, different prefix
    assert block_hashes([1, 2, 3], 4) == []  # partial blocks are never hashed


def test_duplicate_register_returns_existing(alloc):
    p1, p2 = alloc.allocate(2)
    assert alloc.register(p1, 42) == p1
    assert alloc.register(p2, 42) == p1
    alloc.release([p1, p2])
    assert alloc.ref[p2] == 0 and p2 in alloc.free


def test_random_workload_keeps_invariants():
    rng = random.Random(0)
    a = PageAllocator(num_pages=33, page_size=4)
    live: list[list[int]] = []
    for _ in range(2000):
        if live and (rng.random() < 0.45 or a.num_available == 0):
            pages = live.pop(rng.randrange(len(live)))
            a.release(pages)
        else:
            prefix = [rng.randrange(3)] * 4 * rng.randrange(1, 4)
            hashes = block_hashes(prefix, 4)
            hit = a.match_prefix(hashes)
            a.acquire(hit)
            need = rng.randrange(1, 4)
            try:
                new = a.allocate(need)
            except NoCapacity:
                a.release(hit)
                continue
            for p, h in zip(new, hashes[len(hit) :]):
                if a.register(p, h) != p:
                    pass  # an equal block exists; this copy stays private
            live.append(hit + new)
        a.check_invariants()
    for pages in live:
        a.release(pages)
    a.check_invariants()
    assert a.all_free_or_cached()


def test_drop_cache_forgets_every_block_and_frees_cached_pages():
    """After a lost pool: no hash survives, cached pages are free, owned ones stay owned."""
    a = PageAllocator(num_pages=9, page_size=4)
    hashes = block_hashes(list(range(12)), 4)
    cached, owned = a.allocate(2), a.allocate(1)
    for p, h in zip(cached + owned, hashes):
        a.register(p, h)
    a.release(cached)
    a.block_events.clear()
    assert a.drop_cache() == 3
    a.check_invariants()
    assert a.by_hash == {} and a.match_prefix(hashes) == []
    assert sorted(h for sign, h in a.block_events if sign < 0) == sorted(hashes)
    assert len(a.free) == 7 and a.ref[owned[0]] == 1
    a.release(owned)
    assert len(a.free) == 8 and a.all_free_or_cached()
