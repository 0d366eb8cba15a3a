"""Decode.GenerateStream: many requests over one long-lived stream behave as their own Generate
calls would (tokens, status codes, reasons, retry hints, cancellation, deadlines), and a
worker without it, or a stream that breaks, is handled as the router's placement expects."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.generate_stream import StreamHub
from decode_service.scheduler import SchedulerConfig
from decode_service.server import DecodeServicer
from decode_service.server import create_server as create_decode
from megaserve.rpc import decode_pb2, decode_pb2_grpc
from megaserve.server_thread import ServerThread
from megaserve.status import Reason, reason_of, retry_after_ms_of
from router import worker_stream as router_stream
from router.worker_stream import WorkerCalls
from router.workers import WORKER_FAILED_CODES, WorkerClients, WorkerFailed, classify
from tests.polling import until


async def _old_worker(engine: DecodeEngine):
    """A decode worker from before GenerateStream: only Generate is served."""
    servicer = DecodeServicer(engine)
    handler = grpc.method_handlers_generic_handler(
        "megaserve.internal.v1.Decode",
        {
            "Generate": grpc.unary_stream_rpc_method_handler(
                servicer.Generate,
                request_deserializer=decode_pb2.GenerateRequest.FromString,
                response_serializer=decode_pb2.GenerateResponse.SerializeToString,
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.fixture(scope="module")
def workers(tiny_model):
    """A decode worker, one whose queue takes nothing, and an old one (no GenerateStream);
    the first one's servicer, and the servers' event loop."""
    cfg = EngineConfig(max_context=128, scheduler=SchedulerConfig(max_running=8, prefill_chunk=32))
    dec = DecodeEngine(tiny_model, cfg)
    dec.start()
    full = DecodeEngine(
        tiny_model, EngineConfig(max_context=128, scheduler=SchedulerConfig(max_waiting=0))
    )
    servers = ServerThread(
        lambda: create_decode(dec), lambda: create_decode(full), lambda: _old_worker(dec)
    )
    addr, full_addr, old_addr = servers.addresses
    yield dec, addr, full_addr, old_addr, servers.results[0][3], servers.loop
    servers.stop()
    dec.stop()


def _req(rid, prompt, max_tokens=6, **sampling):
    return decode_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=decode_pb2.SamplingParams(**sampling),
        stopping=decode_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )


async def _tokens(calls: WorkerCalls, addr: str, req, timeout=None) -> list[int]:
    call = await calls.start(addr, req, timeout)
    out = []
    while (r := await call.read()) is not grpc.aio.EOF:
        out += r.token_ids
    assert call.done()
    return out


def _run(fn):
    """fn(streamed, per_call) on a stream-using and a call-per-request WorkerCalls."""

    async def main():
        clients = WorkerClients()
        streamed = WorkerCalls(clients.channel, streams=True)
        per_call = WorkerCalls(clients.channel, streams=False)
        try:
            return await fn(streamed, per_call)
        finally:
            await streamed.close()
            await clients.close()

    return asyncio.run(main())


def _requests(tag: str):
    sampling = [{}, {"temperature": 0.8, "seed": 5}, {"temperature": 1.0, "top_k": 5, "seed": 9}]
    prompts = [[(7 * i + j) % 90 + 1 for j in range(5 + 9 * i)] for i in range(6)]
    return [_req(f"{tag}{i}", p, 4 + i, **sampling[i % 3]) for i, p in enumerate(prompts)]


def test_requests_on_one_stream_equal_their_own_calls(workers):
    _, addr, _, _, servicer, _ = workers

    async def fn(streamed, per_call):
        # Concurrent on the one stream, against each request alone on its own call.
        got = await asyncio.gather(*(_tokens(streamed, addr, r) for r in _requests("s")))
        assert len(streamed._streams) == 1 and len(servicer.streams._streams) == 1
        want = [await _tokens(per_call, addr, r) for r in _requests("c")]
        return got, want

    got, want = _run(fn)
    assert got == want and all(len(t) == 4 + i for i, t in enumerate(got))


def _both(addr, req, served_after: bool) -> list[grpc.aio.AioRpcError]:
    """The error of req on a stream and on its own call."""

    async def fn(streamed, per_call):
        errors = []
        for calls in (streamed, per_call):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await _tokens(calls, addr, req)
            errors.append(ei.value)
        if served_after:  # the stream is still up: the next request on it is served
            stream = streamed._streams[addr]
            assert len(await _tokens(streamed, addr, _req(req.request_id + "+", [1, 2]))) == 6
            assert streamed._streams[addr] is stream
        return errors

    return _run(fn)


@pytest.mark.parametrize("case", ["invalid", "full", "draining"])
def test_a_failed_request_ends_as_its_own_call_would(workers, case):
    _, addr, full_addr, _, servicer, _ = workers
    req = _req(case, [1, 2, 3], temperature=-1 if case == "invalid" else 0)
    target = full_addr if case == "full" else addr
    servicer.draining = case == "draining"
    try:
        stream_e, call_e = _both(target, req, served_after=case == "invalid")
    finally:
        servicer.draining = False
    assert stream_e.code() == call_e.code() != grpc.StatusCode.OK
    assert reason_of(stream_e) == reason_of(call_e) is not None
    assert stream_e.details() == call_e.details()
    assert retry_after_ms_of(stream_e) == retry_after_ms_of(call_e)
    if case == "full":
        assert retry_after_ms_of(stream_e) is not None  # the refusal's hint came through
    if case == "invalid":
        assert "temperature=-1" in stream_e.details()


def test_cancel_frees_the_request_on_the_worker(workers):
    dec, addr, _, _, _, _ = workers
    until(lambda: dec.live_count == 0, "idle before")
    unused = lambda: dec.stats()["free_pages"] + dec.stats()["cached_pages"]  # noqa: E731
    free = unused()

    async def fn(streamed, per_call):
        # A running request: cancelled after its first tokens.
        call = await streamed.start(addr, _req("long", list(range(1, 60)), 60), None)
        assert (await call.read()).token_ids
        assert call.cancel() and call.done()
        assert await call.read() is grpc.aio.EOF
        # One waiting on a reservation (a 30 s lease): only the cancel can free it soon.
        clients = WorkerClients()
        await clients.decode(addr).Reserve(
            decode_pb2.ReserveRequest(request_id="held", prompt_token_ids=[1, 2])
        )
        await clients.close()
        held = await streamed.start(addr, _req("held", [1, 2]), None)
        while dec.reservation("held") is None or dec.reservation("held").waiter is None:
            await asyncio.sleep(0.01)
        held.cancel()
        # Freed while the stream stays open (closing it would cancel everything on it).
        for _ in range(500):
            if dec.reservation("held") is None and "long" not in dec._live:
                break
            await asyncio.sleep(0.01)
        assert dec.reservation("held") is None and "long" not in dec._live
        # The stream goes on serving.
        return await _tokens(streamed, addr, _req("next", [3, 4, 5]))

    assert len(_run(fn)) == 6
    until(lambda: dec.live_count == 0, "the cancelled request still runs")
    until(lambda: unused() == free, "its pages are not back (free or cached)")


def test_a_deadline_ends_a_waiting_request_and_frees_its_reservation(workers):
    dec, addr, _, _, _, _ = workers

    async def fn(streamed, per_call):
        # Reserved, never committed: Generate waits on the reservation until the deadline.
        clients = WorkerClients()
        await clients.decode(addr).Reserve(
            decode_pb2.ReserveRequest(request_id="late", prompt_token_ids=[1, 2])
        )
        await clients.close()
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _tokens(streamed, addr, _req("late", [1, 2]), timeout=0.3)
        return ei.value, time.monotonic() - t0

    e, waited = _run(fn)
    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.25 < waited < 5
    until(lambda: dec.reservation("late") is None, "the reservation outlived its deadline")


def test_a_worker_without_generate_stream_gets_a_call_per_request(workers):
    _, addr, _, old_addr, _, _ = workers

    async def fn(streamed, per_call):
        got = [await _tokens(streamed, old_addr, r) for r in _requests("o")]
        assert streamed._streams[old_addr].unimplemented
        return got, [await _tokens(per_call, addr, r) for r in _requests("n")]

    got, want = _run(fn)
    assert got == want


def test_a_broken_stream_fails_its_requests_as_worker_failures(tiny_model):
    dec = DecodeEngine(tiny_model, EngineConfig(max_context=128))
    dec.start()
    servers = ServerThread(lambda: create_decode(dec))
    (addr,) = servers.addresses

    async def fn(streamed, per_call):
        call = await streamed.start(addr, _req("doomed", list(range(1, 20)), 100), None)
        await call.read()
        servers.stop()  # the worker goes away mid-stream
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            while await call.read() is not grpc.aio.EOF:
                pass
        return ei.value

    try:
        e = _run(fn)
    finally:
        dec.stop()
    assert e.code() in WORKER_FAILED_CODES, e
    assert isinstance(classify(_Worker(addr), e, "decode stream"), WorkerFailed)


class _Worker:
    def __init__(self, address):
        self.id, self.address = "w", address


def test_a_draining_worker_ends_its_idle_streams(workers):
    _, addr, _, _, servicer, loop = workers

    async def fn(streamed, per_call):
        await _tokens(streamed, addr, _req("d1", [1, 2]))
        first = streamed._streams[addr]
        # As the worker's drain does it: on the server's event loop.
        closing = asyncio.run_coroutine_threadsafe(_close_idle(servicer), loop)
        assert closing.result(5) >= 1
        for _ in range(200):
            if first.closed:
                break
            await asyncio.sleep(0.01)
        assert first.closed
        # The next request opens a new stream.
        assert len(await _tokens(streamed, addr, _req("d2", [1, 2]))) == 6
        assert streamed._streams[addr] is not first

    _run(fn)


async def _close_idle(servicer) -> int:
    return servicer.streams.close_idle()


class _Silent(decode_pb2_grpc.DecodeServicer):
    """A worker that takes the stream and never answers it (hung)."""

    async def GenerateStream(self, requests, context):  # noqa: N802
        await asyncio.Event().wait()
        yield decode_pb2.StreamResponse()


def _serving(make_servicer):
    """A ServerThread factory: a server for one Decode servicer on a free port."""

    async def start():
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServicer_to_server(make_servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    return start


def test_a_deadline_holds_while_the_worker_never_answers_the_stream():
    servers = ServerThread(_serving(_Silent))
    (addr,) = servers.addresses

    async def fn(streamed, per_call):
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _tokens(streamed, addr, _req("hung", [1, 2]), timeout=0.3)
        return ei.value, time.monotonic() - t0

    try:
        e, waited = _run(fn)
    finally:
        servers.stop()
    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and 0.25 < waited < 5


class _LongPromptScores(decode_pb2_grpc.DecodeServicer):
    """A worker whose first response scores a long prompt: over gRPC's 4 MiB default."""

    def __init__(self):
        self.streams = StreamHub()

    async def Generate(self, request, context):  # noqa: N802
        top = list(range(20))
        scores = [
            decode_pb2.TokenLogprobs(
                token_id=i, logprob=-1.5, top_token_ids=top, top_logprobs=[-2.5] * 20
            )
            for i in range(40_000)
        ]
        yield decode_pb2.GenerateResponse(
            token_ids=[1], finish_reason=decode_pb2.FINISH_REASON_LENGTH, prompt_logprobs=scores
        )

    async def GenerateStream(self, requests, context):  # noqa: N802
        async for m in self.streams.serve(self.Generate, requests, context):
            yield m


def test_a_first_response_over_four_mib_does_not_end_the_stream():
    servers = ServerThread(_serving(_LongPromptScores))
    (addr,) = servers.addresses

    async def fn(streamed, per_call):
        sizes = []
        for rid in ("a", "b"):  # the second on the same stream
            call = await streamed.start(addr, _req(rid, [1, 2], 1), None)
            r = await call.read()
            sizes.append(r.ByteSize())
        assert len(streamed._streams) == 1 and not streamed._streams[addr].closed
        return sizes

    try:
        sizes = _run(fn)
    finally:
        servers.stop()
    assert min(sizes) > 4 << 20, sizes


def test_a_second_live_request_id_on_a_stream_is_already_exists(workers):
    dec, addr, _, _, _, _ = workers

    async def main():
        clients = WorkerClients()
        try:
            stub = clients.decode(addr)
            await stub.Reserve(decode_pb2.ReserveRequest(request_id="twice", prompt_token_ids=[1]))
            call = stub.GenerateStream()
            for _ in range(2):  # the first waits on its reservation
                await call.write(decode_pb2.StreamRequest(generate=_req("twice", [1])))
            m = await call.read()
            call.cancel()  # the stream's end cancels the first: its reservation goes too
            return m
        finally:
            await clients.close()

    m = asyncio.run(main())
    assert m.request_id == "twice" and m.HasField("status")
    e = router_stream._status_error(m.status)
    assert e.code() == grpc.StatusCode.ALREADY_EXISTS and "'twice'" in e.details()
    assert reason_of(e) == Reason.DUPLICATE_REQUEST_ID
    until(lambda: dec.reservation("twice") is None, "the stream's end left the reservation")
