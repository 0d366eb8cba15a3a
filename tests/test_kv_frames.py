"""Pre-encoded KV push messages: ordinary KVPush bytes for any protobuf peer, payload copied
once by the sender and read in place by the receiver, chunks lined up with receiver blocks."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import xxhash
from google.protobuf.message import DecodeError

from megaserve.kv import checksum, frames, wire
from megaserve.rpc import kv_transfer_pb2


def _kv(layers=3, pages=5, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((layers, pages, 4, 2, 8)).astype(np.float32)
    return k, k + 1


def test_an_encoded_chunk_is_a_plain_kvpush_with_its_checksum():
    k, v = _kv()
    raw = frames.encode_chunk(1, [4, 5, 6, 7, 8], k, v)
    c = kv_transfer_pb2.KVPush.FromString(raw).chunk
    assert (c.layer_start, c.layer_end, list(c.page_index)) == (1, 4, [4, 5, 6, 7, 8])
    assert list(c.shape) == [2, 3, 5, 4, 2, 8]
    assert c.data == k.tobytes() + v.tobytes()
    assert c.checksum == xxhash.xxh3_64_intdigest(c.data)


def test_decode_reads_the_payload_in_place():
    k, v = _kv()
    raw = frames.encode_chunk(0, [0, 1, 2, 3, 4], k, v)
    f = frames.decode_push(raw)
    assert f.msg.chunk.data == b""  # the payload was not copied into the message
    assert bytes(f.data) == k.tobytes() + v.tobytes()
    assert np.shares_memory(np.frombuffer(f.data, np.uint8), np.frombuffer(raw, np.uint8))
    want = kv_transfer_pb2.KVPush.FromString(raw).chunk
    want.ClearField("data")
    assert f.msg.chunk == want


def test_decode_of_other_encodings_equals_protobuf():
    k, v = _kv()
    chunk = wire.make_chunk(k, v, 0, [0, 1, 2, 3, 4])
    # Fields in another order (data first), as another protobuf writer may emit them.
    data_first = kv_transfer_pb2.KVChunk(data=chunk.data).SerializeToString()
    rest = kv_transfer_pb2.KVChunk(
        layer_start=0, layer_end=3, page_index=chunk.page_index, shape=chunk.shape,
        checksum=chunk.checksum,
    ).SerializeToString()  # fmt: skip
    inner = data_first + rest
    raw = b"\x12" + frames._varint(len(inner)) + inner
    f = frames.decode_push(raw)
    assert bytes(f.data) == chunk.data and f.msg.chunk.checksum == chunk.checksum
    # Two chunk fields in one message merge (protobuf semantics): parsed whole.
    merged = frames.decode_push(raw + raw)
    assert merged.data is None and merged.msg == kv_transfer_pb2.KVPush.FromString(raw + raw)
    for msg in (wire.header("r", wire.PageGeometry.of_pages(k), 0, 5), wire.trailer(9)):
        f = frames.decode_push(msg.SerializeToString())
        assert f.msg == msg and f.data is None


def test_decode_of_broken_bytes_fails_like_protobuf():
    k, v = _kv()
    raw = frames.encode_chunk(0, [0, 1, 2, 3, 4], k, v)
    with pytest.raises(DecodeError):
        frames.decode_push(raw[: len(raw) // 2])


def test_serialize_passes_bytes_and_serializes_messages():
    assert frames.serialize(b"\x12\x00") == b"\x12\x00"
    assert frames.serialize(wire.trailer(3)) == wire.trailer(3).SerializeToString()


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x,  # contiguous: one part
        lambda x: x[:, 1:4],  # a page range of every layer: one part per layer
        lambda x: x[:, :, :, :, ::2],  # nothing contiguous: one copy
    ],
    ids=["contiguous", "page-range", "strided"],
)
def test_byte_parts_are_the_array_in_c_order(view):
    x = view(_kv()[0])
    assert b"".join(frames.byte_parts(x)) == x.tobytes()


def test_chunks_are_power_of_two_page_blocks_the_receiver_lines_up_with():
    page_bytes = 2 * 3 * 4 * 2 * 8 * 4  # K and V of 3 layers of a page: 1536 bytes
    assert wire.pages_per_block(page_bytes, 16 * 1536) == 16
    assert wire.pages_per_block(page_bytes, 23 * 1536) == 16  # a power of two that fits
    assert wire.pages_per_block(page_bytes, 100) == 1
    assert wire.page_blocks(37, 16) == [(0, 16), (16, 16), (32, 4), (36, 1)]
    spans = list(wire.chunk_spans(3, 37, page_bytes // 3, 16 * 1536))
    assert [(p0, p1 - p0) for _, _, p0, p1 in spans] == wire.page_blocks(37, 16)
    assert all((l0, l1) == (0, 3) for l0, l1, _, _ in spans)
    # A page larger than a message: layer groups of one page.
    assert list(wire.chunk_spans(3, 2, 512, 1024)) == [
        (0, 2, 0, 1), (2, 3, 0, 1), (0, 2, 1, 2), (2, 3, 1, 2),
    ]  # fmt: skip


def test_chunk_frames_cover_every_page_once_with_large_chunks():
    k, v = _kv(pages=37)
    per_page = 2 * k[:, 0].nbytes
    got_k, got_v = np.zeros_like(k), np.zeros_like(v)
    n = 0
    for raw in wire.chunk_frames(10, k, v, max_chunk_bytes=16 * per_page):
        f = frames.decode_push(raw)
        c, arr = f.msg.chunk, np.frombuffer(f.data, np.float32).reshape(list(f.msg.chunk.shape))
        cols = np.asarray(c.page_index) - 10
        got_k[c.layer_start : c.layer_end, cols], got_v[c.layer_start : c.layer_end, cols] = arr
        n += 1
    assert n == 4  # 16 + 16 + 4 + 1 pages
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)


def test_checksum_kinds():
    data = bytes(range(256)) * 100
    parts = [data[:1000], memoryview(data)[1000:]]
    xxh3, crc32 = kv_transfer_pb2.CHECKSUM_XXH3_64, kv_transfer_pb2.CHECKSUM_CRC32
    assert checksum.compute(xxh3, parts) == xxhash.xxh3_64_intdigest(data)
    assert checksum.compute(crc32, parts) == zlib.crc32(data)
    assert checksum.known(xxh3) and checksum.known(crc32)
    assert not checksum.known(kv_transfer_pb2.CHECKSUM_UNSPECIFIED) and not checksum.known(7)
    assert checksum.name(xxh3) == "CHECKSUM_XXH3_64" and checksum.name(7) == "7"
    assert wire.header("r", wire.PageGeometry.of_pages(_kv()[0]), 0, 5).header.checksum == xxh3
