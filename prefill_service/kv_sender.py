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
    idx = np.asarray(pages, np.int32)
    return np.asarray(pool.k[:, idx]), np.asarray(pool.v[:, idx])


def push_messages(
    request_id: str,
    first_token: int,
    first_page: int,
    k: np.ndarray,
    v: np.ndarray,
    max_chunk_bytes: int = MAX_CHUNK_BYTES,
) -> Iterator[kv_transfer_pb2.KVPush]:
    """Header, then chunks of whole layers (and page groups if one layer is too big).

    Layer-major order lets a receiver (and a prefill that computes layer by layer) overlap.
    """
    n_layers, n_pages = k.shape[:2]
    yield kv_transfer_pb2.KVPush(
        header=kv_transfer_pb2.KVHeader(
            request_id=request_id,
            first_token=first_token,
            num_layers=n_layers,
            first_page=first_page,
            num_pages=n_pages,
            dtype=str(k.dtype),
        )
    )
    per_page_layer = 2 * k[0, 0].nbytes
    pages_per_chunk = max(1, min(n_pages, max_chunk_bytes // per_page_layer))
    layers_per_chunk = (
        max(1, max_chunk_bytes // (per_page_layer * n_pages)) if (pages_per_chunk == n_pages) else 1
    )
    for l0 in range(0, n_layers, layers_per_chunk):
        l1 = min(n_layers, l0 + layers_per_chunk)
        for p0 in range(0, n_pages, pages_per_chunk):
            p1 = min(n_pages, p0 + pages_per_chunk)
            yield kv_transfer_pb2.KVPush(
                chunk=make_chunk(
                    k[l0:l1, p0:p1],
                    v[l0:l1, p0:p1],
                    l0,
                    list(range(first_page + p0, first_page + p1)),
                )
            )
