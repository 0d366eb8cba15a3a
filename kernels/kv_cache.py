"""The paged KV pool on device: two arrays of pages shared by every sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels.programs import Program, ProgramCache, abstract


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
    """K and V pages, f32/bf16[L, num_pages, page_size, Hkv * D]; page 0 is the null page.

    One layout for every program that touches the pool (the megakernel, the XLA prefill and
    decode steps, page import/export): a page is one contiguous [page_size, Hkv * D] block,
    which is what the megakernel DMAs. On TPU a 5-D [.., Hkv, D] pool tiles its last two dims
    differently, so any program viewing it the other way re-lays out the whole pool; the
    heads are split only on the small arrays a program gathers from it. Host-side page
    buffers (the KV wire) keep [.., Hkv, D]: the same bytes, row-major.

    The arrays are replaced (not mutated) by every step that donates them, so holders must
    read `pool.k` / `pool.v` after each call rather than keep references.
    """

    k: jax.Array
    v: jax.Array
    num_kv_heads: int
    head_dim: int
    programs_run: ProgramCache = field(default_factory=ProgramCache, repr=False)

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
        shape = (num_layers, num_pages, page_size, num_kv_heads * head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), num_kv_heads, head_dim)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

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

    def heads_shape(self, n_pages: int) -> tuple[int, ...]:
        """Host-side shape of n_pages pages: [L, n_pages, page_size, Hkv, D]."""
        return (self.num_layers, n_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def write_pages(self, pages: np.ndarray, k_new: np.ndarray, v_new: np.ndarray) -> None:
        """Writes whole pages (imported KV): k_new/v_new [L, len(pages), page_size, Hkv, D]."""
        pages = np.asarray(pages, np.int32)
        rows = (*k_new.shape[:3], -1)  # the pool's [.., Hkv * D] rows: a free host reshape
        dt = self.k.dtype
        k_new = np.asarray(k_new, dt).reshape(rows)
        v_new = np.asarray(v_new, dt).reshape(rows)
        for s, n in pow2_pieces(len(pages)):
            self.k, self.v = self.programs_run.call(
                "kv_write", (n,), _write_pages, self.k, self.v, pages[s : s + n],
                k_new[:, s : s + n], v_new[:, s : s + n],
            )  # fmt: skip

    def read_pages(self, pages) -> list[tuple[int, jax.Array, jax.Array]]:
        """K, V of `pages` as (offset, k, v) pieces, each [L, n, page_size, Hkv * D] on device
        (the pool's layout: `heads_shape` splits the heads on the host); offsets index into
        `pages`."""
        pages = np.asarray(pages, np.int32)
        return [
            (
                s,
                *self.programs_run.call(
                    "kv_read", (n,), _read_pages, self.k, self.v, pages[s : s + n]
                ),
            )
            for s, n in pow2_pieces(len(pages))
        ]

    def page_programs(self, max_pages: int, read: bool, write: bool) -> list[Program]:
        """The page read/write programs for any count up to max_pages (power-of-two pieces)."""
        k, v = abstract(self.k), abstract(self.v)
        out = []
        n = 1
        while n <= max_pages:
            idx = jax.ShapeDtypeStruct((n,), np.int32)
            if write:
                rows = jax.ShapeDtypeStruct((self.num_layers, n, *self.k.shape[2:]), self.k.dtype)
                out.append(Program("kv_write", (n,), _write_pages, (k, v, idx, rows, rows)))
            if read:
                out.append(Program("kv_read", (n,), _read_pages, (k, v, idx)))
            n *= 2
        return out

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
