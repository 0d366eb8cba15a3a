"""What a runner call carries: a ragged batch of new tokens and each sequence's cache state."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SequenceCache:
    """One sequence's per-sequence memory, as the programs address it.

    Today the only kind is paged KV (`pages`: the pool pages holding its K/V, in token
    order). Other kinds (latent-KV pages, recurrent-state slots) become further fields here,
    so every engine keeps passing one object per sequence.
    """

    pages: np.ndarray  # i32[P] pool page ids; trailing 0 (the null page) is padding


@dataclass(frozen=True)
class TokenBatch:
    """New tokens of several sequences in one call; each row has its own new-token count and
    cached length (prefill pieces and decode steps alike; a decode row has one new token)."""

    tokens: np.ndarray  # i32[N] every row's new tokens, concatenated in row order
    num_new: np.ndarray  # i32[S] new tokens per row (>= 1)
    num_cached: np.ndarray  # i32[S] tokens already cached = position of the row's first token
    caches: tuple[SequenceCache, ...]  # S entries

    def __post_init__(self):
        s = len(self.caches)
        if self.num_new.shape != (s,) or self.num_cached.shape != (s,):
            raise ValueError(
                f"num_new {self.num_new.shape} / num_cached {self.num_cached.shape} "
                f"must both be ({s},), one per cache"
            )
        if int(self.num_new.sum()) != self.tokens.shape[0]:
            raise ValueError(f"{self.tokens.shape[0]} tokens != sum(num_new)={self.num_new.sum()}")

    @property
    def num_seqs(self) -> int:
        return len(self.caches)

    @classmethod
    def from_rows(cls, rows: list[tuple[list[int], int, list[int]]]) -> TokenBatch:
        """rows: (new tokens, cached length, pages) per sequence."""
        return cls(
            np.asarray([t for r in rows for t in r[0]], np.int32),
            np.asarray([len(r[0]) for r in rows], np.int32),
            np.asarray([r[1] for r in rows], np.int32),
            tuple(SequenceCache(np.asarray(r[2], np.int32)) for r in rows),
        )

    @classmethod
    def from_padded(
        cls, tokens: np.ndarray, positions: np.ndarray, page_table: np.ndarray
    ) -> TokenBatch:
        """From padded i32[S, T] tokens and positions (-1 = padding, last in a row; a row's
        real positions are consecutive) and an i32[S, P] page table."""
        tokens, positions = np.asarray(tokens), np.asarray(positions)
        rows = []
        for i in range(tokens.shape[0]):
            real = positions[i] >= 0
            n = int(real.sum())
            start = int(positions[i, 0]) if n else 0
            rows.append((tokens[i, :n].tolist(), start, page_table[i]))
        return cls.from_rows(rows)

    @classmethod
    def decode(
        cls, tokens: np.ndarray, positions: np.ndarray, page_table: np.ndarray
    ) -> TokenBatch:
        """One new token per row: i32[S] last tokens at i32[S] positions, i32[S, P] table."""
        tokens = np.asarray(tokens, np.int32)
        return cls(
            tokens,
            np.ones(len(tokens), np.int32),
            np.asarray(positions, np.int32),
            tuple(SequenceCache(np.asarray(row, np.int32)) for row in page_table),
        )

    def page_table(self, rows: int, width: int) -> np.ndarray:
        """i32[rows, width]: each sequence's pages, padded with the null page."""
        out = np.zeros((rows, width), np.int32)
        for i, c in enumerate(self.caches):
            out[i, : len(c.pages)] = c.pages
        return out

    @property
    def max_pages(self) -> int:
        return max((len(c.pages) for c in self.caches), default=0)

    def padded(self, rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, positions) as i32[rows, width], padding token 0 at position -1."""
        tok = np.zeros((rows, width), np.int32)
        pos = np.full((rows, width), -1, np.int32)
        offsets = np.concatenate([[0], np.cumsum(self.num_new)])
        for i in range(self.num_seqs):
            n, start = int(self.num_new[i]), int(self.num_cached[i])
            tok[i, :n] = self.tokens[offsets[i] : offsets[i] + n]
            pos[i, :n] = np.arange(start, start + n)
        return tok, pos
