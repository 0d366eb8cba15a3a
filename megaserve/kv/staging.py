"""Receiving side of a KV transfer: validate every chunk, stage it, commit only when whole."""

from __future__ import annotations

import zlib

import numpy as np

from megaserve.kv.wire import PageGeometry, TransferError, check_header


class KVImport:
    """Stages pages first_page..first_page+num_pages-1 of one reservation.

    Every (layer, page) cell must arrive exactly once; `complete` says when they all have.
    The staged arrays never touch the pool until the caller commits them.
    """

    def __init__(self, geo: PageGeometry, reserved_pages: int, cached_pages: int, header):
        check_header(header, geo)
        if header.first_page != cached_pages or header.first_page + header.num_pages != (
            reserved_pages
        ):
            raise TransferError(
                f"pages [{header.first_page}, {header.first_page + header.num_pages}) do not "
                f"match the reservation's missing pages [{cached_pages}, {reserved_pages})"
            )
        self.geo, self.header = geo, header
        self.first, self.n = header.first_page, header.num_pages
        shape = (geo.num_layers, self.n, geo.page_size, geo.kv_heads, geo.head_dim)
        self.k = np.zeros(shape, geo.dtype)
        self.v = np.zeros(shape, geo.dtype)
        self.got = np.zeros((geo.num_layers, self.n), bool)
        self.chunks = 0
        self.bytes = 0

    @property
    def complete(self) -> bool:
        return bool(self.got.all())

    @property
    def missing(self) -> int:
        return int((~self.got).sum())

    def add(self, c) -> None:
        """Validates chunk c (a KVChunk) and stages it; raises TransferError naming the fault."""
        g = self.geo
        if not 0 <= c.layer_start < c.layer_end <= g.num_layers:
            raise TransferError(
                f"layers [{c.layer_start}, {c.layer_end}) outside [0, {g.num_layers})"
            )
        idx = np.asarray(c.page_index, np.int64)
        if idx.size == 0 or len(set(idx.tolist())) != idx.size:
            raise TransferError(f"page_index {list(c.page_index)} is empty or repeats a page")
        if idx.min() < self.first or idx.max() >= self.first + self.n:
            raise TransferError(
                f"page_index {list(c.page_index)} outside [{self.first}, {self.first + self.n})"
            )
        nl = c.layer_end - c.layer_start
        want = [2, nl, idx.size, g.page_size, g.kv_heads, g.head_dim]
        if list(c.shape) != want:
            raise TransferError(f"shape {list(c.shape)} != expected {want}")
        if c.HasField("pull"):
            arr = self._pull(c, want)
        else:
            itemsize = np.dtype(g.dtype).itemsize
            if len(c.data) != int(np.prod(want)) * itemsize:
                raise TransferError(
                    f"data has {len(c.data)} bytes, shape {want} of {g.dtype} needs "
                    f"{int(np.prod(want)) * itemsize}"
                )
            crc = zlib.crc32(c.data)
            if crc != c.crc32:
                raise TransferError(f"checksum mismatch: crc32 {crc:#010x} != sent {c.crc32:#010x}")
            arr = None
        cols = idx - self.first
        if self.got[c.layer_start : c.layer_end][:, cols].any():
            raise TransferError(
                f"duplicate chunk: layers [{c.layer_start}, {c.layer_end}) pages "
                f"{list(c.page_index)} already received"
            )
        if arr is None:
            arr = np.frombuffer(c.data, dtype=g.dtype).reshape(want)
        self.k[c.layer_start : c.layer_end, cols] = arr[0]
        self.v[c.layer_start : c.layer_end, cols] = arr[1]
        self.got[c.layer_start : c.layer_end, cols] = True
        self.chunks += 1
        self.bytes += arr.nbytes

    def _pull(self, c, want: list[int]) -> np.ndarray:
        """Fetches a chunk offered on the sender's jax transfer server; checks what came."""
        from megaserve import jax_transfer

        try:
            out = np.asarray(
                jax_transfer.pull(c.pull.address, c.pull.uuid, tuple(want), self.geo.dtype)
            )
        except Exception as e:  # the transfer library raises runtime errors of its own
            raise TransferError(
                f"pull of uuid {c.pull.uuid} from {c.pull.address} failed: {e}"
            ) from e
        if list(out.shape) != want or str(out.dtype) != self.geo.dtype:
            raise TransferError(f"pulled {out.dtype}{list(out.shape)} != {self.geo.dtype}{want}")
        return out
