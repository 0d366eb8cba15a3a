"""The paged KV pool on device: two arrays of pages shared by every sequence."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from functools import cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.programs import Program, ProgramCache, abstract

# Lanes of a TPU vreg: a pool row is padded to a multiple of this on TPU (below).
LANES = 128


def lane_padded(n: int) -> int:
    """n rounded up to whole 128-lane tiles: the width a TPU's tiled layout gives a row."""
    return -(-n // LANES) * LANES


def pool_row(num_kv_heads: int, head_dim: int, platform: str) -> int:
    """Elements of one pool row (one token's K or V in one layer) on `platform`.

    On TPU the row is padded to whole 128-lane tiles: the tiled layout pads a 192-lane row
    (SmolLM2: 3 x 64) to 256 anyway, and without the padding XLA's default layout of a large
    [L, pages, page_size, 192] pool puts the page dim minor, which the megakernel's page
    DMAs and the XLA programs' row writes cannot use (`compile-worker` found 4-5 pool-sized
    re-layout copies per program). Elsewhere rows are dense: padding would cost CPU memory
    and bandwidth for nothing. The padding lanes hold zeros and are never read as K/V.
    """
    kv = num_kv_heads * head_dim
    return lane_padded(kv) if platform == "tpu" else kv


def _write_pages(kv: int, k, v, pages, k_new, v_new):
    # k_new/v_new rows are [Hkv * D]: a padded pool row keeps its zero padding lanes.
    return (
        k.at[:, pages, :, :kv].set(k_new.astype(k.dtype)),
        v.at[:, pages, :, :kv].set(v_new.astype(v.dtype)),
    )


def _write_pages_looped(kv: int, k, v, pages, k_new, v_new):
    # XLA:CPU runs the scatter above element by element (115 ms for 188.7 MB of pages here);
    # whole-page dynamic_update_slices, in place in the donated pool, take 29 ms.
    def one(i, kv_pair):
        start = (0, pages[i], 0, 0)
        return tuple(
            lax.dynamic_update_slice(
                x, lax.dynamic_slice_in_dim(new, i, 1, 1).astype(x.dtype), start
            )
            for x, new in zip(kv_pair, (k_new, v_new))
        )

    return lax.fori_loop(0, pages.shape[0], one, (k, v))


def _read_pages(kv: int, k, v, pages):
    # Gather whole rows, then drop the padding: indexing `k[:, pages, :, :kv]` in one step
    # compiled for tpu7x into 268 GB of temporaries for a 46 GB SmolLM2 pool (compile-worker).
    return tuple(lax.slice_in_dim(jnp.take(x, pages, axis=1), 0, kv, axis=3) for x in (k, v))


@cache
def page_fns(kv: int, looped_write: bool = False) -> tuple[Any, Any]:
    """The jitted (write, read) page programs for rows of kv = Hkv * D K/V elements; the
    write as a loop of page copies (for a pool on CPU) or as one scatter."""
    write = partial(_write_pages_looped if looped_write else _write_pages, kv)
    return jax.jit(write, donate_argnums=(0, 1)), jax.jit(partial(_read_pages, kv))


def _on_cpu(x) -> bool:
    """Whether x (an array, or an abstract one: then not) lives on a CPU device."""
    sharding = getattr(x, "sharding", None)
    return sharding is not None and next(iter(sharding.device_set)).platform == "cpu"


def _in_host_memory(x) -> bool:
    """Whether x is one buffer in this process's memory: a concrete array on one CPU device
    (not on TPU, not sharded, not abstract)."""
    return _on_cpu(x) and len(x.sharding.device_set) == 1


def _host_view(x: jax.Array) -> np.ndarray:
    """A writable numpy view of the memory of x (ready, `_in_host_memory`)."""
    buf = (ctypes.c_char * x.nbytes).from_address(x.unsafe_buffer_pointer())
    return np.frombuffer(buf, x.dtype).reshape(x.shape)


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
    """K and V pages, f32/bf16[L, num_pages, page_size, row]; page 0 is the null page.

    `row` is Hkv * D, padded to 128 lanes on TPU (`pool_row`). One layout for every program
    that touches the pool (the megakernel, the XLA prefill and decode steps, page
    import/export): a page is one contiguous [page_size, row] block,
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
        row: int | None = None,
    ) -> KVPool:
        """row: elements per pool row (default `pool_row` for this process's backend)."""
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the null page)")
        if page_size < 1:
            raise ValueError(f"{page_size=} must be >= 1")
        row = check_row(num_kv_heads, head_dim, row)
        shape = (num_layers, num_pages, page_size, row)
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
    def kv_width(self) -> int:
        """Hkv * D: the K/V elements of a row (the rest of a padded row is padding)."""
        return self.num_kv_heads * self.head_dim

    @property
    def bytes_per_page(self) -> int:
        """Bytes of K and V one page holds across all layers."""
        per = int(np.prod(self.k.shape)) // self.num_pages * self.k.dtype.itemsize
        return 2 * per

    def heads_shape(self, n_pages: int) -> tuple[int, ...]:
        """Host-side shape of n_pages pages: [L, n_pages, page_size, Hkv, D]."""
        return (self.num_layers, n_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def page_fns(self) -> tuple[Any, Any]:
        """This pool's (write, read) page programs: the write loops on CPU, where XLA runs
        a scatter element by element; an abstract pool (AOT compiles for a TPU target)
        gets the scatter."""
        return page_fns(self.kv_width, _on_cpu(self.k))

    def write_pages(self, pages: np.ndarray, k_new, v_new) -> None:
        """Writes whole pages (imported KV): k_new/v_new [L, len(pages), page_size, Hkv, D],
        host arrays (copied straight into a pool in host memory, else taken by the write
        program) or device arrays (kept on device)."""
        pages = np.asarray(pages, np.int32)
        rows = (*k_new.shape[:3], -1)  # [.., Hkv * D] rows: a free reshape
        dt = self.k.dtype

        def as_rows(x):
            if isinstance(x, jax.Array):  # pulled pages: never through the host
                return x.astype(dt).reshape(rows)
            return np.asarray(x, dt).reshape(rows)

        k_new, v_new = as_rows(k_new), as_rows(v_new)
        if not isinstance(k_new, jax.Array) and _in_host_memory(self.k):
            self._write_in_place(pages, k_new, v_new)
            return
        for s, n in pow2_pieces(len(pages)):
            self.k, self.v = self.programs_run.call(
                "kv_write", (n,), self.page_fns()[0], self.k, self.v,
                pages[s : s + n], k_new[:, s : s + n], v_new[:, s : s + n],
            )  # fmt: skip

    def _write_in_place(self, pages: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray):
        """Copies host rows [L, n, page_size, Hkv * D] straight into a host-memory pool.

        Why: the program path copies the bytes twice (jax's copy of a host array that is not
        64-byte aligned, a received payload's usual case, then the page writes), and the KV
        hand-off is bound by the two CPU cores' memory traffic (docs/benchmarks.md); numpy's
        copy is one pass, and it lets go of the GIL while it runs. Safe because the pool's
        arrays belong to this object alone (every program that takes them donates them, and
        the caller replaces its references), the last program that produced them has
        finished (waited for below), and nothing reads these pages until they are committed.
        """
        jax.block_until_ready((self.k, self.v))
        kv = self.kv_width
        for x, rows in ((self.k, k_rows), (self.v, v_rows)):
            _host_view(x)[:, pages, :, :kv] = rows

    def read_pages(self, pages) -> list[tuple[int, jax.Array, jax.Array]]:
        """K, V of `pages` as (offset, k, v) pieces, each [L, n, page_size, Hkv * D] on device
        (the pool's rows without their padding: `heads_shape` splits the heads on the host);
        offsets index into `pages`."""
        pages = np.asarray(pages, np.int32)
        return [
            (
                s,
                *self.programs_run.call(
                    "kv_read",
                    (n,),
                    self.page_fns()[1],
                    self.k,
                    self.v,
                    pages[s : s + n],
                ),  # fmt: skip
            )
            for s, n in pow2_pieces(len(pages))
        ]

    def page_programs(self, max_pages: int, read: bool, write: bool) -> list[Program]:
        """The page read/write programs for any count up to max_pages (power-of-two pieces)."""
        k, v = abstract(self.k), abstract(self.v)
        write_fn, read_fn = self.page_fns()
        out = []
        n = 1
        while n <= max_pages:
            idx = jax.ShapeDtypeStruct((n,), np.int32)
            if write:
                shape = (self.num_layers, n, self.page_size, self.kv_width)
                rows = jax.ShapeDtypeStruct(shape, self.k.dtype)
                out.append(Program("kv_write", (n,), write_fn, (k, v, idx, rows, rows)))
            if read:
                out.append(Program("kv_read", (n,), read_fn, (k, v, idx)))
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
        row: int | None = None,
    ) -> KVPool:
        """The largest pool (null page included) whose K and V fit in budget_bytes."""
        row = check_row(num_kv_heads, head_dim, row)
        per_page = 2 * num_layers * page_size * row * np.dtype(dtype).itemsize
        n = cls.pages_for_budget(budget_bytes, per_page)
        return cls.create(num_layers, n, page_size, num_kv_heads, head_dim, dtype, row)

    @staticmethod
    def pages_for_budget(budget_bytes: int, bytes_per_page: int) -> int:
        """How many pages (null page included) fit in a memory budget."""
        n = budget_bytes // bytes_per_page
        if n < 2:
            raise ValueError(f"KV budget {budget_bytes} B holds {n} pages of {bytes_per_page} B")
        return int(n)


def check_row(num_kv_heads: int, head_dim: int, row: int | None) -> int:
    """The pool row width: `row`, or this backend's `pool_row`; ValueError naming a row
    that cannot hold Hkv * D or is not that width padded to whole lanes."""
    kv = num_kv_heads * head_dim
    if row is None:
        return pool_row(num_kv_heads, head_dim, jax.default_backend())
    if row not in (kv, lane_padded(kv)):
        raise ValueError(f"pool {row=}: must be Hkv * D = {kv} or that padded to {LANES} lanes")
    return row
