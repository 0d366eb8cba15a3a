"""KV import integrity: every malformed chunk is refused before it can reach the pool."""

from __future__ import annotations

import numpy as np
import pytest

from megaserve.kv import wire
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
    ],
)
def test_bad_headers_refused(kw, match):
    with pytest.raises(TransferError, match=match):
        KVImport(GEO, reserved_pages=3, cached_pages=1, header=_header(**kw))
