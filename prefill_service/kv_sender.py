"""Sending side of the gRPC KV transport: pages out of a pool, chunked by layer groups."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from decode_service.kv_import import make_chunk
from kernels.kv_cache import KVPool
from megaserve.rpc import kv_transfer_pb2

# Keep every message well under the receiver's 64 MiB limit and small enough to pipeline.
MAX_CHUNK_BYTES = 4 << 20


def extract_pages(pool: KVPool, pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """K, V of `pages` as host arrays [L, len(pages), page_size, Hkv, D]."""
    pieces = pool.read_pages(pages)
    if not pieces:
        empty = np.zeros((pool.k.shape[0], 0, *pool.k.shape[2:]), pool.k.dtype)
        return empty, empty.copy()
    return tuple(np.concatenate([np.asarray(p[i]) for p in pieces], axis=1) for i in (1, 2))


def header(request_id: str, num_layers: int, first_page: int, num_pages: int, dtype: str):
    """First message of a push: which reservation pages will follow."""
    return kv_transfer_pb2.KVPush(
        header=kv_transfer_pb2.KVHeader(
            request_id=request_id,
            num_layers=num_layers,
            first_page=first_page,
            num_pages=num_pages,
            dtype=dtype,
        )
    )


def trailer(first_token: int):
    """Last message of a push: the receiver commits only after it."""
    return kv_transfer_pb2.KVPush(trailer=kv_transfer_pb2.KVTrailer(first_token=first_token))


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
    yield header(request_id, k.shape[0], first_page, k.shape[1], str(k.dtype))
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
