"""Page arithmetic and the one prefix-match-then-allocate step every tier runs."""

from __future__ import annotations

from megaserve.errors import NoCapacity
from megaserve.kv.allocator import PageAllocator
from megaserve.kv.block_hash import block_hashes


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """Pages that hold num_tokens tokens (the last one may be partly filled)."""
    return -(-num_tokens // page_size)


def claim_pages(alloc: PageAllocator, tokens: list[int], extra: int = 0) -> tuple[list[int], int]:
    """Pages for `tokens` (+ `extra` more): cached prefix pages first, then fresh ones.

    The last token is never taken from the cache (its logits must be computed), so at most
    the full blocks of tokens[:-1] hit. Returns (pages, number of prefix hits); raises
    NoCapacity, holding nothing, when the pool cannot supply the rest.
    """
    ps = alloc.page_size
    hit = alloc.match_prefix(block_hashes(tokens[: len(tokens) - 1], ps))
    alloc.acquire(hit)
    need = pages_for_tokens(len(tokens), ps) + extra - len(hit)
    try:
        fresh = alloc.allocate(need)
    except NoCapacity:
        alloc.release(hit)
        raise
    return hit + fresh, len(hit)
