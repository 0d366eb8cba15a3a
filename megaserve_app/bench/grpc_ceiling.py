"""A bare gRPC bytes stream between in-process peers: the ceiling a KV push can approach
(same sizes, same message limits, no protobuf, no checksum, no staging, no commit)."""

from __future__ import annotations

import time

import grpc
import numpy as np

_METHOD = "/megaserve.bench.Sink/Push"
# The decode worker's server and the prefill worker's channel use these limits.
SERVER_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20)]


async def _sink(request_iterator, context) -> bytes:
    n = 0
    async for msg in request_iterator:
        n += len(msg)
    return n.to_bytes(8, "little")


async def create_server(address: str = "127.0.0.1:0"):
    """A server whose Sink.Push takes any stream of bytes; returns (server, port)."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    handler = grpc.stream_unary_rpc_method_handler(_sink)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("megaserve.bench.Sink", {"Push": handler}),)
    )
    port = server.add_insecure_port(address)
    await server.start()
    return server, port


def payloads(sizes: list[int]) -> list[bytes]:
    """Distinct random messages of `sizes` bytes (no buffer reused from a warm cache)."""
    rng = np.random.default_rng(0)
    return [rng.bytes(n) for n in sizes]


async def stream_seconds(address: str, messages: list[bytes]) -> float:
    """Seconds for one client-streaming call that sends `messages` and gets the count back."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        call = ch.stream_unary(_METHOD)
        await call(iter([b"warm"]))  # the connection is up before the clock starts
        t = time.perf_counter()
        got = int.from_bytes(await call(iter(messages)), "little")
        dt = time.perf_counter() - t
    if got != sum(len(m) for m in messages):
        raise RuntimeError(f"sink counted {got} bytes of {sum(len(m) for m in messages)}")
    return dt
