"""Decode.GenerateStream against a peer other than the router: a half-closed stream still
answers the requests it carries, and a second live request id ends both with one status and
nothing after it for that id."""

from __future__ import annotations

import asyncio

import grpc

from megaserve.rpc import decode_pb2
from router import worker_stream as router_stream
from router.workers import WorkerClients
from tests.polling import until
from tests.test_generate_stream import _req, workers  # noqa: F401


async def _read_all(call) -> list:
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out


def test_a_half_closed_stream_answers_its_requests(workers):  # noqa: F811
    _, addr, _, _, _, _ = workers

    async def main():
        clients = WorkerClients()
        try:
            stub = clients.decode(addr)
            call = stub.GenerateStream()
            for rid, prompt in (("h1", [1, 2, 3]), ("h2", [4, 5])):
                await call.write(decode_pb2.StreamRequest(generate=_req(rid, prompt)))
            await call.done_writing()  # nothing more: the two still run to their end
            got = await _read_all(call)
            want = {
                rid: [t async for r in stub.Generate(_req(f"{rid}-alone", p)) for t in r.token_ids]
                for rid, p in (("h1", [1, 2, 3]), ("h2", [4, 5]))
            }
            return got, want, await call.code()
        finally:
            await clients.close()

    got, want, code = asyncio.run(main())
    assert code == grpc.StatusCode.OK
    for rid, tokens in want.items():
        mine = [m for m in got if m.request_id == rid]
        assert [t for m in mine if m.HasField("response") for t in m.response.token_ids] == tokens
        assert mine[-1].response.finish_reason, mine[-1]  # its last message ends it


def test_a_second_live_request_id_ends_both_with_one_status(workers):  # noqa: F811
    dec, addr, _, _, _, _ = workers

    async def main():
        clients = WorkerClients()
        try:
            call = clients.decode(addr).GenerateStream()
            await call.write(decode_pb2.StreamRequest(generate=_req("dup", [1, 2], 100)))
            first = await call.read()  # running
            await call.write(decode_pb2.StreamRequest(generate=_req("dup", [3], 100)))
            await call.write(decode_pb2.StreamRequest(generate=_req("after", [5], 8)))
            await call.done_writing()
            return first, await _read_all(call)
        finally:
            await clients.close()

    first, rest = asyncio.run(main())
    assert first.request_id == "dup" and first.HasField("response")
    dup = [m for m in rest if m.request_id == "dup"]
    statuses = [i for i, m in enumerate(dup) if m.HasField("status")]
    assert statuses == [len(dup) - 1], dup  # one status, the id's last message
    e = router_stream._status_error(dup[-1].status)
    assert e.code() == grpc.StatusCode.ALREADY_EXISTS and "both ended" in e.details()
    assert [m for m in rest if m.request_id == "after"][-1].response.finish_reason
    until(lambda: dec.stats()["running"] == 0, "the first 'dup' ended", 10)


def test_a_malformed_status_from_a_worker_fails_only_its_request():
    """A worker's status with text metadata that is not UTF-8, or with code OK (a request
    ended without finishing), is still one request's failure (retried elsewhere), not an
    exception that would end the router's whole stream to that worker."""
    s = decode_pb2.StreamStatus(code=0, message="ended early")
    s.trailing.add(key="megaserve-reason", value=b"\xff\xfe")
    e = router_stream._status_error(s)
    assert e.code() == grpc.StatusCode.UNKNOWN and e.details() == "ended early"
    assert dict(e.trailing_metadata())["megaserve-reason"] == "\ufffd\ufffd"
