"""The KV wire format (KVTransfer.Push): a self-describing header, chunks of pages with
checksums, a trailer. Builders for the sender and the header check for the receiver."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kernels.kv_cache import KVPool
from megaserve.rpc import kv_transfer_pb2

# Keep every message well under the receiver's 64 MiB limit and small enough to pipeline.
MAX_CHUNK_BYTES = 4 << 20
LAYOUT_VERSION = 1  # chunk payload: row-major [2 (K, V), layers, pages, page_size, heads, dim]


class TransferError(ValueError):
    """A chunk or stream that must not reach the pool; the message names the bad field."""


@dataclass(frozen=True)
class PageGeometry:
    """What one page holds: [L, page_size, kv_heads, head_dim] of K and of V, in dtype."""

    num_layers: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of_pages(cls, k: np.ndarray) -> PageGeometry:
        """The geometry of pages as arrays [L, pages, page_size, kv_heads, head_dim]."""
        num_layers, _, page_size, kv_heads, head_dim = k.shape
        return cls(num_layers, page_size, kv_heads, head_dim, str(k.dtype))

    @classmethod
    def of_pool(cls, pool: KVPool) -> PageGeometry:
        return cls(
            pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim, str(pool.k.dtype)
        )


def header(request_id: str, geo: PageGeometry, first_page: int, num_pages: int):
    """First message of a push: which reservation pages follow, and what they hold."""
    return kv_transfer_pb2.KVPush(
        header=kv_transfer_pb2.KVHeader(
            request_id=request_id,
            num_layers=geo.num_layers,
            first_page=first_page,
            num_pages=num_pages,
            dtype=geo.dtype,
            cache_kind=kv_transfer_pb2.CACHE_KIND_PAGED_KV,
            page_size=geo.page_size,
            head_start=0,
            head_end=geo.kv_heads,
            head_dim=geo.head_dim,
            has_scales=False,
            layout_version=LAYOUT_VERSION,
        )
    )


def check_header(h: kv_transfer_pb2.KVHeader, geo: PageGeometry) -> None:
    """TransferError unless the header describes exactly the pages this receiver holds."""
    if h.cache_kind != kv_transfer_pb2.CACHE_KIND_PAGED_KV:
        name = kv_transfer_pb2.CacheKind.Name(h.cache_kind) if h.cache_kind in (0, 1) else None
        raise TransferError(
            f"cache_kind={name or h.cache_kind}: this receiver holds CACHE_KIND_PAGED_KV"
        )
    if h.layout_version != LAYOUT_VERSION:
        raise TransferError(
            f"layout_version={h.layout_version}: this receiver reads layout {LAYOUT_VERSION}"
        )
    if h.has_scales:
        raise TransferError("has_scales=true: this receiver's pool holds no quantization scales")
    if h.num_layers != geo.num_layers:
        raise TransferError(f"num_layers={h.num_layers}, this worker's model has {geo.num_layers}")
    if h.dtype != geo.dtype:
        raise TransferError(f"dtype={h.dtype!r}, the pool holds {geo.dtype!r}")
    if h.page_size != geo.page_size:
        raise TransferError(f"page_size={h.page_size}, the pool's pages hold {geo.page_size}")
    if (h.head_start, h.head_end) != (0, geo.kv_heads):
        raise TransferError(
            f"KV heads [{h.head_start}, {h.head_end}): this receiver holds all "
            f"[0, {geo.kv_heads}) (re-splitting heads across meshes is not supported yet)"
        )
    if h.head_dim != geo.head_dim:
        raise TransferError(f"head_dim={h.head_dim}, the pool's heads have {geo.head_dim}")


def trailer(first_token: int):
    """Last message of a push: the receiver commits only after it."""
    return kv_transfer_pb2.KVPush(trailer=kv_transfer_pb2.KVTrailer(first_token=first_token))


def make_chunk(k: np.ndarray, v: np.ndarray, layer_start: int, page_index: list[int]):
    """One chunk from K/V [layers, pages, page_size, kv_heads, head_dim]."""
    arr = np.ascontiguousarray(np.stack([k, v]))
    data = arr.tobytes()
    return kv_transfer_pb2.KVChunk(
        layer_start=layer_start,
        layer_end=layer_start + k.shape[0],
        page_index=page_index,
        shape=list(arr.shape),
        data=data,
        crc32=zlib.crc32(data),
    )


def chunk_messages(
    first_page: int, k: np.ndarray, v: np.ndarray, max_chunk_bytes: int = MAX_CHUNK_BYTES
) -> Iterator[kv_transfer_pb2.KVPush]:
    """Chunks of K/V [L, pages, page_size, Hkv, D] that hold reservation pages first_page, ...

    Whole layers per chunk when they fit, else page groups of one layer; layer-major order.
    """
    n_layers, n_pages = k.shape[:2]
    per_page_layer = 2 * k[0, 0].nbytes
    pages_per_chunk = max(1, min(n_pages, max_chunk_bytes // per_page_layer))
    layers_per_chunk = 1
    if pages_per_chunk == n_pages:
        layers_per_chunk = max(1, max_chunk_bytes // (per_page_layer * n_pages))
    for l0 in range(0, n_layers, layers_per_chunk):
        l1 = min(n_layers, l0 + layers_per_chunk)
        for p0 in range(0, n_pages, pages_per_chunk):
            p1 = min(n_pages, p0 + pages_per_chunk)
            pages = list(range(first_page + p0, first_page + p1))
            chunk = make_chunk(k[l0:l1, p0:p1], v[l0:l1, p0:p1], l0, pages)
            yield kv_transfer_pb2.KVPush(chunk=chunk)


def push_messages(
    request_id: str,
    first_token: int,
    first_page: int,
    k: np.ndarray,
    v: np.ndarray,
    max_chunk_bytes: int = MAX_CHUNK_BYTES,
) -> Iterator[kv_transfer_pb2.KVPush]:
    """A whole push at once: header, chunks, trailer."""
    yield header(request_id, PageGeometry.of_pages(k), first_page, k.shape[1])
    yield from chunk_messages(first_page, k, v, max_chunk_bytes)
    yield trailer(first_token)


def pull_message(first_page: int, k, v) -> kv_transfer_pb2.KVPush:
    """A chunk whose K/V stay on device, offered on this process's jax transfer server."""
    import jax.numpy as jnp

    from megaserve import jax_transfer

    arr = jnp.stack([k, v])  # [2, L, pages, page_size, Hkv, D]
    address, uuid = jax_transfer.offer([arr])
    n_layers, n_pages = k.shape[:2]
    return kv_transfer_pb2.KVPush(
        chunk=kv_transfer_pb2.KVChunk(
            layer_start=0,
            layer_end=n_layers,
            page_index=list(range(first_page, first_page + n_pages)),
            shape=list(arr.shape),
            pull=kv_transfer_pb2.PullRef(address=address, uuid=uuid),
        )
    )


def extract_pages(pool: KVPool, pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """K, V of `pages` as host arrays [L, len(pages), page_size, Hkv, D]."""
    pieces = pool.read_pages(pages)
    if not pieces:
        empty = np.zeros(pool.heads_shape(0), pool.k.dtype)
        return empty, empty.copy()
    shape = pool.heads_shape(len(pages))
    return tuple(
        np.concatenate([np.asarray(p[i]) for p in pieces], axis=1).reshape(shape) for i in (1, 2)
    )
