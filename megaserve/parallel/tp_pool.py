"""A tensor-parallel worker's KV pool: split by KV heads, pages in and out one-device style."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from kernels.kv_cache import KVPool, page_fns
from kernels.tp_llama import KV_SPEC, REPLICATED, local_pool_row
from megaserve.parallel.mesh import ParallelConfig, make_mesh


@dataclass(frozen=True)
class StoredRow:
    """How a global pool row [tp * row_local] holds the model's Hkv KV heads of head_dim.

    Shard i's row_local holds `kv_local` heads then padding (TPU lanes); with `replicas` > 1
    (Hkv < tp) each shard holds one head, head i // replicas, so the stored heads run
    h0 h0 h1 h1 ... (see `kernels.tp_llama.tp_layout`).
    """

    tp: int
    kv_local: int
    replicas: int
    head_dim: int
    row_local: int

    @property
    def kv_heads(self) -> int:
        """The model's KV heads: what a one-device row holds, each once."""
        return self.tp * self.kv_local // self.replicas

    def to_model(self, x: jax.Array) -> jax.Array:
        """[..., tp * row_local] stored rows -> [..., Hkv * head_dim] one-device rows:
        padding cut, each replicated head kept once."""
        lead = x.shape[:-1]
        x = x.reshape(*lead, self.tp, self.row_local)[..., : self.kv_local * self.head_dim]
        x = x[..., :: self.replicas, :]  # [..., Hkv / kv_local, kv_local * D]
        return x.reshape(*lead, self.kv_heads * self.head_dim)

    def from_model(self, x: jax.Array) -> jax.Array:
        """[..., Hkv * head_dim] one-device rows -> [..., tp * row_local] stored rows: each
        head repeated on its replicas, each shard's block padded to row_local."""
        lead = x.shape[:-1]
        x = x.reshape(*lead, self.tp // self.replicas, self.kv_local * self.head_dim)
        x = jnp.repeat(x, self.replicas, axis=-2)  # [..., tp, kv_local * D]
        pad = self.row_local - self.kv_local * self.head_dim
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
        return x.reshape(*lead, self.tp * self.row_local)


@cache
def tp_page_fns(mesh: Mesh, row: StoredRow, looped_write: bool) -> tuple[Any, Any]:
    """The (write, read) page programs of a pool sharded by `row` over `mesh`: the
    one-device programs (`kernels.kv_cache.page_fns`) on whole stored rows, with one-device
    rows in and out. Their pages and rows are replicated over the mesh (a read gathers the
    heads from their shards; a write hands each shard the whole rows and keeps its heads)."""
    width = row.tp * row.row_local
    write_rows, read_rows = page_fns(width, looped_write)
    kv, repl = NamedSharding(mesh, KV_SPEC), NamedSharding(mesh, REPLICATED)

    def write(k, v, pages, k_new, v_new):
        # k_new/v_new: [L, n, page_size, Hkv * D] one-device rows; k/v the stored pool.
        return write_rows(k, v, pages, row.from_model(k_new), row.from_model(v_new))

    def read(k, v, pages):
        return tuple(row.to_model(x) for x in read_rows(k, v, pages))

    jit_write = jax.jit(
        write,
        in_shardings=(kv, kv, repl, repl, repl),
        out_shardings=(kv, kv),
        donate_argnums=(0, 1),
    )
    jit_read = jax.jit(read, in_shardings=(kv, kv, repl), out_shardings=(repl, repl))
    return jit_write, jit_read


@dataclass
class TpKVPool(KVPool):
    """A `KVPool` whose arrays [L, pages, page_size, tp * row_local] are split by KV heads
    over `mesh` (`row` says how). `num_kv_heads` is the model's Hkv: page reads return and
    page writes take one-device rows [.., Hkv * D] (the KV wire's layout, whatever either
    side's mesh), so the prefill and decode tiers may run on different meshes."""

    mesh: Mesh | None = None
    row: StoredRow | None = None

    def page_fns(self) -> tuple[Any, Any]:
        on_cpu = self.mesh.devices.flat[0].platform == "cpu"  # the write loops there
        return tp_page_fns(self.mesh, self.row, on_cpu)

    def write_pages(self, pages: np.ndarray, k_new, v_new) -> None:
        """As `KVPool.write_pages`; device arrays elsewhere (a pull lands on one device)
        are replicated over the mesh first, as the write program takes them."""
        super().write_pages(pages, self._on_mesh(k_new), self._on_mesh(v_new))

    def _on_mesh(self, x):
        if not isinstance(x, jax.Array) or x.sharding.device_set == set(self.mesh.devices.flat):
            return x
        return jax.device_put(x, NamedSharding(self.mesh, REPLICATED))

    def read_pages(self, pages) -> list[tuple[int, jax.Array, jax.Array]]:
        """As `KVPool.read_pages`, each piece on the mesh's first device (its replicated
        copy, no copy made): what a sender offers for a pull or fetches to the host."""
        return [
            (s, *(x.addressable_shards[0].data for x in kv)) for s, *kv in super().read_pages(pages)
        ]


def stored_row(cfg: Any, parallel: ParallelConfig, platform: str) -> StoredRow:
    """The global row of a tp pool for `cfg` on `platform` (MeshError if tp does not fit)."""
    lay = parallel.check_model(cfg)
    row_local = local_pool_row(cfg, lay, platform)
    return StoredRow(lay.tp, lay.kv_heads, lay.kv_replicas, cfg.head_dim, row_local)


def tp_pool(
    cfg: Any, parallel: ParallelConfig, num_pages: int, page_size: int, dtype: Any
) -> TpKVPool:
    """A zero pool over `make_mesh(parallel)`, each device holding its KV heads' columns."""
    row = stored_row(cfg, parallel, jax.default_backend())  # the mesh's: its devices are ours
    mesh = make_mesh(parallel)
    if num_pages < 2:
        raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the null page)")
    shape = (cfg.num_layers, num_pages, page_size, row.tp * row.row_local)
    # Made in place on each device: no whole pool on one device first.
    zeros = jax.jit(partial(jnp.zeros, shape, dtype), out_shardings=NamedSharding(mesh, KV_SPEC))
    return TpKVPool(zeros(), zeros(), cfg.num_kv_heads, cfg.head_dim, mesh=mesh, row=row)


def tp_pool_for_budget(
    cfg: Any, parallel: ParallelConfig, page_size: int, budget_bytes: int, dtype: Any
) -> TpKVPool:
    """The largest tp pool (null page included) whose K and V, over all devices and every
    replica of a KV head, fit in budget_bytes; with ep > 1 the ep copies too (the pool is
    split over tp and replicated over ep)."""
    row = stored_row(cfg, parallel, jax.default_backend())
    width = row.tp * row.row_local
    per_page = 2 * cfg.num_layers * page_size * width * np.dtype(dtype).itemsize * parallel.ep
    n = KVPool.pages_for_budget(budget_bytes, per_page)
    return tp_pool(cfg, parallel, n, page_size, dtype)
