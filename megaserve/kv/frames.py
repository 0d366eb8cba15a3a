"""KVTransfer.Push messages as raw protobuf bytes: a chunk's payload is copied once on the
sender (straight from the K/V arrays into the message) and read in place on the receiver,
where the protobuf runtime would copy it twice on each side (construct + serialize, parse +
field access). The bytes are ordinary KVPush encodings; any protobuf peer reads them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from megaserve.futures import retrieve, spawn
from megaserve.kv import checksum
from megaserve.rpc import kv_transfer_pb2

SERVICE = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
PUSH_METHOD = f"/{SERVICE}/Push"
_CHUNK_TAG = b"\x12"  # KVPush.chunk: field 2, length-delimited
# Initial metadata a receiver sends when it refuses a push whose sender may still be
# writing (the value names the status code that follows once the sender half-closes).
REFUSED_KEY = "megaserve-kv-refused"
_DATA_FIELD = 5  # KVChunk.data


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    n = shift = 0
    while pos < end and shift < 64:
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, pos
        shift += 7
    raise _Unusual


class _Unusual(Exception):
    """Not the shape the fast path reads; the message is parsed by the protobuf runtime."""


def byte_parts(x: np.ndarray) -> list[np.ndarray]:
    """x's bytes in C order as contiguous uint8 views; copies only when no leading-axis
    split is contiguous (e.g. a page range of a [L, pages, ...] array splits per layer)."""
    if x.flags.c_contiguous:
        return [x.reshape(-1).view(np.uint8)]
    if x.ndim > 1 and x[0].flags.c_contiguous:
        return [x[i].reshape(-1).view(np.uint8) for i in range(x.shape[0])]
    return [np.ascontiguousarray(x).reshape(-1).view(np.uint8)]


def encode_chunk(
    layer_start: int,
    page_index: list[int],
    k: np.ndarray,
    v: np.ndarray,
    kind: int = checksum.SEND_KIND,
) -> bytes:
    """A serialized KVPush holding one chunk of K/V [layers, pages, page_size, Hkv, D]."""
    parts = byte_parts(k) + byte_parts(v)
    n = k.nbytes + v.nbytes
    meta = kv_transfer_pb2.KVChunk(
        layer_start=layer_start,
        layer_end=layer_start + k.shape[0],
        page_index=page_index,
        shape=[2, *k.shape],
        checksum=checksum.compute(kind, parts),
    ).SerializeToString()
    data_head = bytes([_DATA_FIELD << 3 | 2]) + _varint(n)
    body = len(meta) + len(data_head) + n
    return b"".join([_CHUNK_TAG, _varint(body), meta, data_head, *parts])


def serialize(msg) -> bytes:
    """Request serializer of a push: pre-encoded bytes as they are, messages serialized."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


@dataclass(frozen=True, slots=True)
class Frame:
    """One received push message; `data` is a chunk's payload viewed in the received bytes
    (None when it was parsed into msg.chunk.data instead)."""

    msg: kv_transfer_pb2.KVPush
    data: memoryview | None = None


def decode_push(raw: bytes) -> Frame:
    """Request deserializer of a push: a chunk message's fields other than `data` are
    parsed by protobuf, `data` is left in place; anything unusual is parsed whole."""
    if raw[:1] == _CHUNK_TAG:
        try:
            return _decode_chunk(memoryview(raw))
        except _Unusual:
            pass
    return Frame(kv_transfer_pb2.KVPush.FromString(raw))


def _decode_chunk(buf: memoryview) -> Frame:
    end = len(buf)
    size, pos = _read_varint(buf, 1, end)
    if pos + size != end:  # not exactly one chunk field (merged or extra fields)
        raise _Unusual
    meta, data = [], None
    while pos < end:
        start = pos
        tag, pos = _read_varint(buf, pos, end)
        wire_type = tag & 7
        if wire_type == 0:
            _, pos = _read_varint(buf, pos, end)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            n, pos = _read_varint(buf, pos, end)
            if tag >> 3 == _DATA_FIELD and pos + n <= end:
                data = buf[pos : pos + n]  # the last occurrence wins, as in protobuf
                pos += n
                continue
            pos += n
        else:  # groups: nothing of ours
            raise _Unusual
        if pos > end:
            raise _Unusual
        meta.append(buf[start:pos])
    chunk = kv_transfer_pb2.KVChunk.FromString(b"".join(meta))
    return Frame(kv_transfer_pb2.KVPush(chunk=chunk), data)


async def write_ahead(call, messages: Iterator, stop: asyncio.Event | None = None) -> None:
    """Writes `messages` to a streaming call, taking (e.g. encoding) the next one from the
    iterator while the one before is on its way: the write is handed to gRPC's own threads
    first, so the two overlap without a thread of ours contending for the GIL. Stops
    early, without taking another message, once `stop` is set (e.g. `watch_refusal`)."""
    msg = next(messages, None)
    while msg is not None and not (stop is not None and stop.is_set()):
        writing = asyncio.ensure_future(call.write(msg))
        try:
            await asyncio.sleep(0)  # the write task runs up to gRPC taking the message
            msg = next(messages, None)
        except BaseException:  # cancelled, or the encoding failed: the call's status (e.g.
            # "RPC already finished" once the receiver refused) is not this error's news
            writing.add_done_callback(retrieve)
            raise
        await writing


_watching: set[asyncio.Future] = set()


def watch_refusal(call, on_refused: Callable[[], None] | None = None) -> asyncio.Event:
    """An Event set when the receiver of push `call` sends its refusal notice (initial
    metadata with REFUSED_KEY; `on_refused` is called then too). The sender then stops
    writing and half-closes, and the receiver's status follows: a status that reached
    grpcio while one of our writes was still in flight would be replaced by that write's
    INTERNAL "Internal error from Core" (see decode_service/kv_service.py)."""
    refused = asyncio.Event()

    async def watch():
        metadata = await call.initial_metadata()  # at the refusal, or with the response
        if any(key == REFUSED_KEY for key, _ in metadata or ()):
            refused.set()
            if on_refused is not None:
                on_refused()

    spawn(watch(), _watching).add_done_callback(retrieve)  # ends with the call at the latest
    return refused


def push_call(channel: grpc.aio.Channel):
    """KVTransfer.Push on `channel`, taking pre-encoded bytes as well as KVPush messages."""
    return channel.stream_unary(
        PUSH_METHOD,
        request_serializer=serialize,
        response_deserializer=kv_transfer_pb2.KVPushResponse.FromString,
    )


def add_push_handler(push, server) -> None:
    """Serves `push(frames, context)` as KVTransfer.Push, its requests decoded as Frames."""
    handlers = {
        "Push": grpc.stream_unary_rpc_method_handler(
            push,
            request_deserializer=decode_push,
            response_serializer=kv_transfer_pb2.KVPushResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
