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
