"""The KV wire format (KVTransfer.Push): a self-describing header, chunks of pages with
checksums, a trailer. Builders for the sender and the header check for the receiver."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kernels.kv_cache import KVPool, pow2_pieces
from megaserve.kv import checksum, frames
from megaserve.rpc import kv_transfer_pb2

# Well under the receiver's 64 MiB limit, small enough to pipeline: a bare gRPC stream of
# 188.7 MB on loopback ran at 1.34 / 1.67 / 1.74 / 0.77 GB/s with 1 / 4 / 16 / 64 MiB
# messages (`megaserve bench disagg --raw-only` prints the ceiling of this size).
MAX_CHUNK_BYTES = 16 << 20
# Chunk payload: row-major [2 (K, V), layers, pages, page_size, heads, dim], the heads those
# of the model (each once, in order) whatever the sender's mesh: a tensor-parallel pool
# drops its replicas on the way out and re-splits on the way in (megaserve.parallel.tp_pool).
LAYOUT_VERSION = 1


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
            checksum=checksum.SEND_KIND,
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
            f"KV heads [{h.head_start}, {h.head_end}): this receiver's model has "
            f"{geo.kv_heads}, sent whole as [0, {geo.kv_heads}) in the one-device layout "
            "(whatever either side's mesh)"
        )
    if h.head_dim != geo.head_dim:
        raise TransferError(f"head_dim={h.head_dim}, the pool's heads have {geo.head_dim}")
    if not checksum.known(h.checksum):
        raise TransferError(
            f"checksum={checksum.name(h.checksum)}: this receiver checks "
            f"{checksum.name(kv_transfer_pb2.CHECKSUM_XXH3_64)} or "
            f"{checksum.name(kv_transfer_pb2.CHECKSUM_CRC32)}"
        )


def trailer(first_token: int):
    """Last message of a push: the receiver commits only after it."""
    return kv_transfer_pb2.KVPush(trailer=kv_transfer_pb2.KVTrailer(first_token=first_token))


def make_chunk(k: np.ndarray, v: np.ndarray, layer_start: int, page_index: list[int]):
    """One chunk (a KVChunk message) from K/V [layers, pages, page_size, kv_heads, head_dim]."""
    return kv_transfer_pb2.KVPush.FromString(
        frames.encode_chunk(layer_start, page_index, k, v)
    ).chunk


def pages_per_block(page_bytes: int, max_chunk_bytes: int = MAX_CHUNK_BYTES) -> int:
    """Pages (all layers, K and V: `page_bytes` each) per chunk and per receiver block: the
    largest power of two that fits in max_chunk_bytes, at least 1 (the pool writes pages
    in power-of-two counts, so a block is written as it is)."""
    n = max(1, max_chunk_bytes // max(page_bytes, 1))
    return 1 << (n.bit_length() - 1)


def page_blocks(n_pages: int, size: int) -> list[tuple[int, int]]:
    """[0, n_pages) as (start, count) blocks: `size` pages each, then power-of-two pieces
    of the rest. Sender chunks and receiver blocks both follow it, so they line up."""
    full = n_pages - n_pages % size
    rest = pow2_pieces(n_pages - full)
    return [(s, size) for s in range(0, full, size)] + [(full + s, n) for s, n in rest]


def chunk_spans(
    n_layers: int, n_pages: int, page_layer_bytes: int, max_chunk_bytes: int
) -> Iterator[tuple[int, int, int, int]]:
    """(l0, l1, p0, p1) of each chunk: all layers of a page block when one fits (the
    receiver writes whole blocks as they complete), else layer groups of one page."""
    per_page = page_layer_bytes * n_layers
    if per_page <= max_chunk_bytes:
        for p0, n in page_blocks(n_pages, pages_per_block(per_page, max_chunk_bytes)):
            yield 0, n_layers, p0, p0 + n
        return
    step = max(1, max_chunk_bytes // page_layer_bytes)
    for p0 in range(n_pages):
        for l0 in range(0, n_layers, step):
            yield l0, min(n_layers, l0 + step), p0, p0 + 1


def chunk_frames(
    first_page: int, k: np.ndarray, v: np.ndarray, max_chunk_bytes: int = MAX_CHUNK_BYTES
) -> Iterator[bytes]:
    """Serialized chunk messages of K/V [L, pages, page_size, Hkv, D] that hold reservation
    pages first_page, ...: what a sender writes (one copy of the payload)."""
    n_layers, n_pages = k.shape[:2]
    page_layer = 2 * k[0, 0].nbytes if k.size else 1
    for l0, l1, p0, p1 in chunk_spans(n_layers, n_pages, page_layer, max_chunk_bytes):
        pages = list(range(first_page + p0, first_page + p1))
        yield frames.encode_chunk(l0, pages, k[l0:l1, p0:p1], v[l0:l1, p0:p1])


def chunk_messages(
    first_page: int, k: np.ndarray, v: np.ndarray, max_chunk_bytes: int = MAX_CHUNK_BYTES
) -> Iterator[kv_transfer_pb2.KVPush]:
    """chunk_frames as KVPush messages (for callers that edit or inspect them)."""
    for f in chunk_frames(first_page, k, v, max_chunk_bytes):
        yield kv_transfer_pb2.KVPush.FromString(f)


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
    """A chunk whose K/V stay on device, offered on this process's jax transfer server as
    two arrays that the receiver fetches with one pull."""
    from megaserve import jax_transfer

    address, uuid = jax_transfer.offer([k, v])
    n_layers, n_pages = k.shape[:2]
    return kv_transfer_pb2.KVPush(
        chunk=kv_transfer_pb2.KVChunk(
            layer_start=0,
            layer_end=n_layers,
            page_index=list(range(first_page, first_page + n_pages)),
            shape=[2, *k.shape],
            pull=kv_transfer_pb2.PullRef(address=address, uuid=uuid, arrays=2),
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
