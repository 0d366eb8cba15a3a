"""Chained hashes of page-sized token blocks: the key for prefix caching in every tier."""

from __future__ import annotations

import hashlib

import numpy as np


def block_hashes(tokens: list[int], page_size: int, parent: int = 0) -> list[int]:
    """Hash of each *full* block: h_i = H(h_{i-1}, tokens of block i).

    Chaining makes a block's hash name its whole prefix, so equal hashes mean equal KV.
    The router, the prefill workers and the decode workers all compute these the same way.
    """
    out = []
    h = parent
    for start in range(0, len(tokens) - page_size + 1, page_size):
        block = np.asarray(tokens[start : start + page_size], np.int64).tobytes()
        d = hashlib.blake2b(h.to_bytes(8, "little") + block, digest_size=8).digest()
        h = int.from_bytes(d, "little")
        out.append(h)
    return out


class GrowingHashes:
    """The block hashes of an append-only token list (a sequence's prompt, then its output),
    each block hashed once however often they are asked for."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.hashes: list[int] = []

    def first(self, tokens: list[int], n_blocks: int) -> list[int]:
        """Hashes of tokens' first n_blocks full blocks."""
        have, ps = len(self.hashes), self.page_size
        if have < n_blocks:
            parent = self.hashes[-1] if have else 0
            self.hashes += block_hashes(tokens[have * ps : n_blocks * ps], ps, parent)
        return self.hashes[:n_blocks]
