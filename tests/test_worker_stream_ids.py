"""The router's side of a worker's GenerateStream, against a real gRPC server that records
what it receives: a call's cancel acts on that call only, never on a later call that took
the same request id on the stream."""

from __future__ import annotations

import asyncio

import grpc

from megaserve.rpc import decode_pb2, decode_pb2_grpc
from router.worker_stream import WorkerStream


class _Recorder(decode_pb2_grpc.DecodeServicer):
    """Records every stream message; once a request "go" arrives, finishes every request it
    got (each with one token), in arrival order."""

    def __init__(self):
        self.got: list[decode_pb2.StreamRequest] = []

    async def GenerateStream(self, request_iterator, context):  # noqa: N802
        await context.send_initial_metadata(())
        async for m in request_iterator:
            self.got.append(m)
            if m.HasField("generate") and m.generate.request_id == "go":
                for g in [x.generate for x in self.got if x.HasField("generate")]:
                    r = decode_pb2.GenerateResponse(
                        token_ids=[7], finish_reason=decode_pb2.FINISH_REASON_LENGTH
                    )
                    yield decode_pb2.StreamResponse(request_id=g.request_id, response=r)


def test_a_stale_cancel_leaves_the_call_that_took_its_id():
    async def main():
        server, recorder = grpc.aio.server(), _Recorder()
        decode_pb2_grpc.add_DecodeServicer_to_server(recorder, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            stream = WorkerStream(decode_pb2_grpc.DecodeStub(channel).GenerateStream, "w")
            await asyncio.wait_for(stream.opened.wait(), 10)
            old = stream.start(decode_pb2.GenerateRequest(request_id="x"), None)
            new = stream.start(decode_pb2.GenerateRequest(request_id="x"), None)
            assert old.cancel()  # old's cancel: "x" is new's now, so nothing is cancelled
            go = stream.start(decode_pb2.GenerateRequest(request_id="go"), None)
            assert (
                await asyncio.wait_for(go.read(), 10)
            ).finish_reason == decode_pb2.FINISH_REASON_LENGTH
            got = await asyncio.wait_for(new.read(), 10)
            await stream.close()
            return got, recorder.got
        finally:
            await channel.close()
            await server.stop(None)

    got, received = asyncio.run(main())
    assert list(got.token_ids) == [7] and got.finish_reason == decode_pb2.FINISH_REASON_LENGTH
    assert not [m for m in received if m.HasField("cancel")], received
