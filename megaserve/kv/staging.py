"""Receiving side of a KV transfer: validate every chunk, stage it in the page blocks the
pool's write takes as they are, and hand each block on as soon as all its cells are in."""

from __future__ import annotations

from typing import Any

import numpy as np

from megaserve.kv import checksum
from megaserve.kv.wire import (
    MAX_CHUNK_BYTES,
    PageGeometry,
    TransferError,
    check_header,
    page_blocks,
    pages_per_block,
)

# jax on CPU takes a host array of this alignment as it is (no copy) into a program call.
_ALIGN = 64


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    off = -raw.ctypes.data % _ALIGN
    return raw[off : off + nbytes].view(dtype).reshape(shape)


def _run(cols: np.ndarray) -> tuple[int, int] | None:
    """(a, b) when cols is exactly a, a+1, ..., b-1."""
    a = int(cols[0])
    if cols[-1] - a + 1 == cols.size and (cols.size < 2 or (np.diff(cols) == 1).all()):
        return a, a + cols.size
    return None


class KVImport:
    """Stages pages first_page..first_page+num_pages-1 of one reservation.

    Every (layer, page) cell must arrive exactly once; `complete` says when they all have.
    Inline chunks land in the blocks of `wire.page_blocks` ([L, n, page_size, Hkv, D], n a
    power of two; a chunk that is exactly a block is kept as it came, else it is copied into
    a 64-byte aligned block jax reads in place). Pulled chunks (all layers of consecutive
    pages) stay on device as they came. `take_ready` hands on each block once all its cells
    are in; nothing else touches the pool, and a push is only committed when `complete`.
    """

    def __init__(
        self,
        geo: PageGeometry,
        reserved_pages: int,
        cached_pages: int,
        header,
        max_block_bytes: int = MAX_CHUNK_BYTES,
    ):
        check_header(header, geo)
        if header.first_page != cached_pages or header.first_page + header.num_pages != (
            reserved_pages
        ):
            raise TransferError(
                f"pages [{header.first_page}, {header.first_page + header.num_pages}) do not "
                f"match the reservation's missing pages [{cached_pages}, {reserved_pages})"
            )
        self.geo, self.header, self.kind = geo, header, header.checksum
        self.first, self.n = header.first_page, header.num_pages
        page_bytes = 2 * geo.num_layers * geo.page_size * geo.kv_heads * geo.head_dim
        page_bytes *= np.dtype(geo.dtype).itemsize
        self.sizes = dict(page_blocks(self.n, pages_per_block(page_bytes, max_block_bytes)))
        self.blocks: dict[int, tuple[Any, Any]] = {}  # offset -> K, V, until taken
        self._ready: list[int] = []  # offsets complete and not yet taken
        self.pulled: bool | None = None  # whether this push's chunks are pulls
        # Every uuid a pull was started for, in order (the sender may take back the rest).
        self.pull_attempts: list[int] = []
        self.got = np.zeros((geo.num_layers, self.n), bool)
        self.chunks = 0
        self.bytes = 0

    @property
    def complete(self) -> bool:
        return bool(self.got.all())

    @property
    def missing(self) -> int:
        return int((~self.got).sum())

    def take_ready(self) -> list[tuple[int, Any, Any]]:
        """(offset, K, V) of the blocks completed since the last call: pages first + offset,
        ... of the import, ready to be written. The import lets go of them: a block read in
        place holds a received message, whose memory the next one can then reuse."""
        out = [(s, *self.blocks.pop(s)) for s in self._ready]
        self._ready = []
        return out

    @property
    def k(self) -> np.ndarray:
        """The staged K not yet taken, [L, n, page_size, Hkv, D] (zeros elsewhere)."""
        return self._assembled(0)

    @property
    def v(self) -> np.ndarray:
        return self._assembled(1)

    def _assembled(self, i: int) -> np.ndarray:
        g = self.geo
        out = np.zeros((g.num_layers, self.n, g.page_size, g.kv_heads, g.head_dim), g.dtype)
        for s, kv in self.blocks.items():
            out[:, s : s + kv[i].shape[1]] = np.asarray(kv[i])
        return out

    def add(self, c, data=None) -> None:
        """Validates chunk c (a KVChunk; `data` its payload when not in c.data) and stages
        it; raises TransferError naming the fault."""
        g = self.geo
        if not 0 <= c.layer_start < c.layer_end <= g.num_layers:
            raise TransferError(
                f"layers [{c.layer_start}, {c.layer_end}) outside [0, {g.num_layers})"
            )
        idx = np.asarray(c.page_index, np.int64)
        if idx.size == 0 or np.unique(idx).size != idx.size:
            raise TransferError(f"page_index {_pages(idx)} is empty or repeats a page")
        if idx.min() < self.first or idx.max() >= self.first + self.n:
            out = idx[(idx < self.first) | (idx >= self.first + self.n)]
            raise TransferError(
                f"page_index {_pages(idx)} has {_pages(out)} outside "
                f"[{self.first}, {self.first + self.n})"
            )
        l0, l1 = c.layer_start, c.layer_end
        want = [2, l1 - l0, idx.size, g.page_size, g.kv_heads, g.head_dim]
        if list(c.shape) != want:
            raise TransferError(f"shape {list(c.shape)} != expected {want}")
        cols = idx - self.first
        run = _run(cols)
        pulled = c.HasField("pull")
        if self.pulled is not None and pulled != self.pulled:
            raise TransferError("a push carries either inline data or pulls, not both")
        if pulled and (run is None or l1 - l0 != g.num_layers):
            raise TransferError(
                f"pulled chunk of layers [{l0}, {l1}) pages {_pages(idx)}: a pull "
                "holds all layers of consecutive pages"
            )
        if not pulled:
            buf = c.data if data is None else data
            self._check_data(buf, c.checksum, want)
        if self.got[l0:l1][:, cols].any():
            raise TransferError(
                f"duplicate chunk: layers [{l0}, {l1}) pages {_pages(idx)} already received"
            )
        if pulled:
            k, v = self._pull(c, want)
            self.blocks[run[0]] = (k, v)
            self._ready.append(run[0])
        else:
            arr = np.frombuffer(buf, dtype=g.dtype).reshape(want)
            k, v = arr[0], arr[1]
            self._stage(l0, l1, cols, run, k, v)
        self.pulled = pulled
        self.got[l0:l1, cols] = True
        self.chunks += 1
        self.bytes += k.nbytes + v.nbytes
        if not pulled:
            self._ready += [
                s for s in self._touched(cols) if self.got[:, s : s + self.sizes[s]].all()
            ]

    def _touched(self, cols: np.ndarray) -> list[int]:
        return [s for s, n in self.sizes.items() if ((cols >= s) & (cols < s + n)).any()]

    def _check_data(self, buf, sent: int, want: list[int]) -> None:
        g = self.geo
        need = int(np.prod(want)) * np.dtype(g.dtype).itemsize
        if len(buf) != need:
            raise TransferError(
                f"data has {len(buf)} bytes, shape {want} of {g.dtype} needs {need}"
            )
        got = checksum.compute(self.kind, [buf])
        if got != sent:
            raise TransferError(
                f"checksum mismatch: {checksum.name(self.kind)} of data {got:#x} != sent {sent:#x}"
            )

    def _block(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        if s not in self.blocks:
            g = self.geo
            shape = (g.num_layers, self.sizes[s], g.page_size, g.kv_heads, g.head_dim)
            self.blocks[s] = (aligned_empty(shape, g.dtype), aligned_empty(shape, g.dtype))
        return self.blocks[s]

    def _stage(self, l0: int, l1: int, cols: np.ndarray, run, k, v) -> None:
        """Keeps a chunk that is exactly one block; else copies its layers [l0, l1) x pages
        `cols` into the blocks they fall in."""
        if run and l1 - l0 == self.geo.num_layers and self.sizes.get(run[0]) == run[1] - run[0]:
            self.blocks[run[0]] = (k, v)  # read in place from the received message
            return
        for s, n in self.sizes.items():
            if run is not None:
                lo, hi = max(run[0], s), min(run[1], s + n)
                if lo < hi:
                    bk, bv = self._block(s)
                    bk[l0:l1, lo - s : hi - s] = k[:, lo - run[0] : hi - run[0]]
                    bv[l0:l1, lo - s : hi - s] = v[:, lo - run[0] : hi - run[0]]
                continue
            sel = np.nonzero((cols >= s) & (cols < s + n))[0]
            if sel.size:
                bk, bv = self._block(s)
                bk[l0:l1, cols[sel] - s] = k[:, sel]
                bv[l0:l1, cols[sel] - s] = v[:, sel]

    def _pull(self, c, want: list[int]):
        """Fetches a chunk offered on the sender's jax transfer server; checks what came."""
        import jax

        from megaserve import jax_transfer

        n_arrays = c.pull.arrays or 1
        if n_arrays not in (1, 2):
            raise TransferError(f"pull.arrays={c.pull.arrays}: K and V come as 1 or 2 arrays")
        shapes = [tuple(want)] if n_arrays == 1 else [tuple(want[1:])] * 2
        self.pull_attempts.append(c.pull.uuid)  # before: a pull that breaks may have taken it
        try:  # waits for the arrays: a failed transfer fails here, not in the commit
            out = jax.block_until_ready(
                jax_transfer.pull(c.pull.address, c.pull.uuid, shapes, self.geo.dtype)
            )
        except Exception as e:  # the transfer library raises runtime errors of its own
            raise TransferError(
                f"pull of uuid {c.pull.uuid} from {c.pull.address} failed: {e}"
            ) from e
        if len(out) != len(shapes):
            raise TransferError(f"pulled {len(out)} arrays, the chunk names {len(shapes)}")
        for a, s in zip(out, shapes):
            if tuple(a.shape) != s or str(a.dtype) != self.geo.dtype:
                raise TransferError(f"pulled {a.dtype}{list(a.shape)} != {self.geo.dtype}{s}")
        return (out[0][0], out[0][1]) if n_arrays == 1 else (out[0], out[1])


def _pages(idx: np.ndarray, shown: int = 8) -> str:
    """A page list for an error message: whole when short, else its length, first and last
    few (a chunk can name thousands of pages; a status carries a few hundred bytes well)."""
    v = [int(x) for x in idx]
    if len(v) <= shown:
        return str(v)
    head, tail = ", ".join(map(str, v[: shown // 2])), ", ".join(map(str, v[-shown // 2 :]))
    return f"[{head}, ..., {tail}] ({len(v)} pages)"
