"""A stand-in decode worker for `megaserve bench router --overhead-only --instant-worker`: its
Generate answers at once with one token per step asked for, so the router's own cost is
measured without a model competing for the CPU. Run as a module; prints a READY line."""

from __future__ import annotations

import asyncio
import os

import grpc

from decode_service.generate_stream import StreamHub
from megaserve.logs import announce
from megaserve.rpc import decode_pb2, decode_pb2_grpc

TOKEN = 7


class InstantDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self):
        self.streams = StreamHub()

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        n = max(request.stopping.max_tokens, 1)
        for i in range(n):
            last = i == n - 1
            yield decode_pb2.GenerateResponse(
                token_ids=[TOKEN],
                finish_reason=decode_pb2.FINISH_REASON_LENGTH if last else 0,
            )

    async def GenerateStream(self, request_iterator, context):  # noqa: N802
        async for m in self.streams.serve(self.Generate, request_iterator, context):
            yield m


async def serve() -> None:
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServicer_to_server(InstantDecode(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    announce(f"READY instant decode worker grpc=127.0.0.1:{port}")
    await server.wait_for_termination()


if __name__ == "__main__":
    if os.environ.pop("MEGASERVE_DIE_WITH_PARENT", None) == "1":  # as the CLI's children do
        from megaserve_app.launch import die_with_parent

        die_with_parent()
    asyncio.run(serve())
