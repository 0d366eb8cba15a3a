"""KV import integrity: every malformed chunk is refused before it can reach the pool."""

from __future__ import annotations

import numpy as np
import pytest

from megaserve.kv import frames, wire
from megaserve.kv.staging import KVImport
from megaserve.kv.wire import PageGeometry, TransferError, make_chunk
from megaserve.rpc import kv_transfer_pb2

GEO = PageGeometry(num_layers=3, page_size=4, kv_heads=2, head_dim=8, dtype="float32")


def _kv(layers=3, pages=2, seed=0):
    rng = np.random.default_rng(seed)
    shape = (layers, pages, GEO.page_size, GEO.kv_heads, GEO.head_dim)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(
        np.float32
    )


def _header(**kw):
    """The sender's header for reservation pages [1, 3) of GEO, with fields overridden."""
    h = wire.header("r", GEO, first_page=1, num_pages=2).header
    for field, value in kw.items():
        setattr(h, field, value)
    return h


def _import():
    return KVImport(GEO, reserved_pages=3, cached_pages=1, header=_header())


def test_layer_by_layer_chunks_complete_and_round_trip():
    k, v = _kv()
    imp = _import()
    for layer in range(3):
        assert not imp.complete
        imp.add(make_chunk(k[layer : layer + 1], v[layer : layer + 1], layer, [1, 2]))
    assert imp.complete and imp.chunks == 3
    np.testing.assert_array_equal(imp.k, k)
    np.testing.assert_array_equal(imp.v, v)


def _corrupt(c):
    data = bytearray(c.data)
    data[7] ^= 0xFF
    c.data = bytes(data)
    return c


@pytest.mark.parametrize(
    "mutate,match",
    [
        (_corrupt, "checksum mismatch"),
        (lambda c: (c.shape.__setitem__(3, 5), c)[1], "shape"),
        (lambda c: (setattr(c, "data", c.data[:-4]), c)[1], "data has"),
        (lambda c: (c.page_index.__setitem__(0, 0), c)[1], r"outside \[1, 3\)"),
        (lambda c: (c.page_index.__setitem__(1, 1), c)[1], "repeats a page"),
        (lambda c: (setattr(c, "layer_end", 9), c)[1], "outside"),
    ],
    ids=["checksum", "shape", "truncated-data", "page-range", "repeated-page", "layer-range"],
)
def test_bad_chunks_refused(mutate, match):
    k, v = _kv()
    imp = _import()
    with pytest.raises(TransferError, match=match):
        imp.add(mutate(make_chunk(k[:1], v[:1], 0, [1, 2])))
    assert not imp.got.any()  # nothing staged


def test_a_long_bad_page_index_is_named_briefly():
    """A chunk naming thousands of pages is refused with a message of a few hundred bytes
    that still names the offending pages (a status is no place for the whole list)."""
    k, v = _kv()
    c = make_chunk(k[:1], v[:1], 0, [1, 2])
    del c.page_index[:]
    c.page_index.extend([1, *range(1000, 6000)])
    with pytest.raises(TransferError) as e:
        _import().add(c)
    msg = str(e.value)
    assert len(msg) < 300, msg
    assert "(5001 pages)" in msg and "1000, 1001" in msg and "5999]" in msg, msg
    assert "(5000 pages) outside [1, 3)" in msg, msg


def test_duplicate_chunk_refused():
    k, v = _kv()
    imp = _import()
    imp.add(make_chunk(k[:1], v[:1], 0, [1, 2]))
    with pytest.raises(TransferError, match="duplicate chunk"):
        imp.add(make_chunk(k[:1, 1:], v[:1, 1:], 0, [2]))


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"dtype": "bfloat16"}, "dtype='bfloat16'"),
        ({"num_layers": 4}, "num_layers=4"),
        ({"first_page": 0, "num_pages": 3}, "missing pages"),
        # The header says what the pages hold; anything else than this pool's pages is refused.
        ({"cache_kind": kv_transfer_pb2.CACHE_KIND_UNSPECIFIED}, "cache_kind=CACHE_KIND_UNSPEC"),
        ({"layout_version": 2}, "layout_version=2"),
        ({"has_scales": True}, "has_scales=true"),
        ({"page_size": 8}, "page_size=8"),
        ({"head_start": 1}, r"KV heads \[1, 2\)"),
        ({"head_end": 1}, r"KV heads \[0, 1\)"),
        ({"head_dim": 16}, "head_dim=16"),
        ({"checksum": kv_transfer_pb2.CHECKSUM_UNSPECIFIED}, "checksum=CHECKSUM_UNSPECIFIED"),
        ({"checksum": 9}, "checksum=9"),
    ],
)
def test_bad_headers_refused(kw, match):
    with pytest.raises(TransferError, match=match):
        KVImport(GEO, reserved_pages=3, cached_pages=1, header=_header(**kw))


def test_chunk_checked_with_the_kind_the_header_names():
    k, v = _kv()
    crc = kv_transfer_pb2.CHECKSUM_CRC32
    imp = KVImport(GEO, reserved_pages=3, cached_pages=1, header=_header(checksum=crc))
    raw = frames.encode_chunk(0, [1, 2], k, v, kind=crc)
    f = frames.decode_push(raw)
    imp.add(f.msg.chunk, f.data)
    assert imp.complete
    with pytest.raises(TransferError, match="checksum mismatch: CHECKSUM_XXH3_64"):
        _import().add(f.msg.chunk, f.data)  # an XXH3 push: the CRC32 value does not match


def test_corrupted_payload_read_in_place_is_refused():
    k, v = _kv()
    raw = bytearray(frames.encode_chunk(0, [1, 2], k, v))
    raw[-5] ^= 0x40  # one bit of the last value of V
    f = frames.decode_push(bytes(raw))
    imp = _import()
    with pytest.raises(TransferError, match=r"checksum mismatch: CHECKSUM_XXH3_64 of data 0x"):
        imp.add(f.msg.chunk, f.data)
    assert not imp.got.any()


def _big_import(n=37, cached=2, block_pages=16):
    page_bytes = 2 * GEO.num_layers * GEO.page_size * GEO.kv_heads * GEO.head_dim * 4
    h = wire.header("r", GEO, first_page=cached, num_pages=n).header
    return KVImport(GEO, cached + n, cached, h, max_block_bytes=block_pages * page_bytes)


def test_blocks_are_handed_on_as_they_complete_and_whole_chunks_are_not_copied():
    k, v = _kv(pages=37, seed=3)
    imp = _big_import()
    assert imp.sizes == {0: 16, 16: 16, 32: 4, 36: 1}
    raws = list(wire.chunk_frames(2, k, v, max_chunk_bytes=16 * 2 * k[:, 0].nbytes))
    taken = []
    for raw in raws[::-1]:  # any order
        f = frames.decode_push(raw)
        imp.add(f.msg.chunk, f.data)
        ready = imp.take_ready()
        assert len(ready) == 1  # each chunk is exactly one block
        off, bk, _ = ready[0]
        assert np.shares_memory(bk, np.frombuffer(raw, np.uint8))  # read in place
        taken += ready
    assert imp.complete and not imp.blocks
    for off, bk, bv in taken:
        np.testing.assert_array_equal(bk, k[:, off : off + bk.shape[1]])
        np.testing.assert_array_equal(bv, v[:, off : off + bv.shape[1]])


def test_small_chunks_fill_aligned_blocks_layer_by_layer():
    k, v = _kv(pages=37, seed=4)
    imp = _big_import()
    for layer in range(3):
        for p0 in range(0, 37, 5):  # 5-page chunks straddle the 16-page blocks
            p1 = min(37, p0 + 5)
            imp.add(make_chunk(k[layer : layer + 1, p0:p1], v[layer : layer + 1, p0:p1],
                               layer, list(range(2 + p0, 2 + p1))))  # fmt: skip
            if layer < 2:
                assert not imp.take_ready()  # a block waits for its last layer
    ready = imp.take_ready()
    assert sorted(off for off, _, _ in ready) == [0, 16, 32, 36]
    for off, bk, bv in ready:
        assert bk.ctypes.data % 64 == 0 and bv.ctypes.data % 64 == 0  # jax reads in place
        np.testing.assert_array_equal(bk, k[:, off : off + bk.shape[1]])
        np.testing.assert_array_equal(bv, v[:, off : off + bv.shape[1]])


def _pull_chunk(layers=(0, 3), pages=(1, 2), arrays=2):
    return kv_transfer_pb2.KVChunk(
        layer_start=layers[0],
        layer_end=layers[1],
        page_index=list(pages),
        shape=[2, layers[1] - layers[0], len(pages), GEO.page_size, GEO.kv_heads, GEO.head_dim],
        pull=kv_transfer_pb2.PullRef(address="127.0.0.1:1", uuid=1, arrays=arrays),
    )


@pytest.mark.parametrize(
    "chunk,match",
    [
        (_pull_chunk(layers=(0, 1)), "a pull holds all layers of consecutive pages"),
        (_pull_chunk(pages=(2, 1)), "a pull holds all layers of consecutive pages"),
        (_pull_chunk(arrays=3), "pull.arrays=3"),
    ],
    ids=["some-layers", "pages-out-of-order", "arrays"],
)
def test_bad_pulls_refused_before_pulling(chunk, match):
    with pytest.raises(TransferError, match=match):
        _import().add(chunk)


def test_a_push_mixing_pulls_and_inline_data_is_refused():
    k, v = _kv()
    imp = _import()
    imp.add(make_chunk(k[:1], v[:1], 0, [1, 2]))
    with pytest.raises(TransferError, match="either inline data or pulls"):
        imp.add(_pull_chunk(layers=(1, 3)))
