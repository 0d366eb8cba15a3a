"""The paged KV pool on device: two arrays of pages shared by every sequence."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@partial(jax.jit, donate_argnums=(0, 1))
def _write_pages(k, v, pages, k_new, v_new):
    return k.at[:, pages].set(k_new.astype(k.dtype)), v.at[:, pages].set(v_new.astype(v.dtype))


@jax.jit
def _read_pages(k, v, pages):
    return k[:, pages], v[:, pages]


def pow2_pieces(n: int) -> list[tuple[int, int]]:
    """[0, n) as (start, size) pieces of power-of-two sizes, largest first.

    Page copies run piece by piece, so any page count uses at most log2(n) + 1 compiled
    shapes instead of one program per count (a new prompt length compiled mid-serving)."""
    out, start = [], 0
    for bit in reversed(range(max(n, 0).bit_length())):
        if n & (1 << bit):
            out.append((start, 1 << bit))
            start += 1 << bit
    return out


@dataclass
class KVPool:
    """K and V pages, f32/bf16[L, num_pages, page_size, Hkv, D]; page 0 is the null page.

    The arrays are replaced (not mutated) by every step that donates them, so holders must
    read `pool.k` / `pool.v` after each call rather than keep references.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def create(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any = jnp.float32,
    ) -> KVPool:
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the null page)")
        if page_size < 1:
            raise ValueError(f"{page_size=} must be >= 1")
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def bytes_per_page(self) -> int:
        """Bytes of K and V one page holds across all layers."""
        per = int(np.prod(self.k.shape)) // self.num_pages * self.k.dtype.itemsize
        return 2 * per

    def write_pages(self, pages: np.ndarray, k_new: np.ndarray, v_new: np.ndarray) -> None:
        """Writes whole pages (imported KV): k_new/v_new [L, len(pages), page_size, Hkv, D]."""
        pages = np.asarray(pages, np.int32)
        for s, n in pow2_pieces(len(pages)):
            self.k, self.v = _write_pages(
                self.k, self.v, jnp.asarray(pages[s : s + n]), k_new[:, s : s + n],
                v_new[:, s : s + n],
            )  # fmt: skip

    def read_pages(self, pages) -> list[tuple[int, jax.Array, jax.Array]]:
        """K, V of `pages` as (offset, k, v) pieces, each [L, n, page_size, Hkv, D] on device;
        offsets index into `pages`."""
        pages = np.asarray(pages, np.int32)
        return [
            (s, *_read_pages(self.k, self.v, jnp.asarray(pages[s : s + n])))
            for s, n in pow2_pieces(len(pages))
        ]

    @classmethod
    def for_budget(
        cls,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        budget_bytes: int,
        dtype: Any = jnp.float32,
    ) -> KVPool:
        """The largest pool (null page included) whose K and V fit in budget_bytes."""
        per_page = 2 * num_layers * page_size * num_kv_heads * head_dim
        per_page *= np.dtype(dtype).itemsize
        n = cls.pages_for_budget(budget_bytes, per_page)
        return cls.create(num_layers, n, page_size, num_kv_heads, head_dim, dtype)

    @staticmethod
    def pages_for_budget(budget_bytes: int, bytes_per_page: int) -> int:
        """How many pages (null page included) fit in a memory budget."""
        n = budget_bytes // bytes_per_page
        if n < 2:
            raise ValueError(f"KV budget {budget_bytes} B holds {n} pages of {bytes_per_page} B")
        return int(n)
