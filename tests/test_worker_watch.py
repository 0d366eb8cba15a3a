"""WorkerWatch: a worker out of the view for the grace is gone once (its stream's requests and
its Generate calls fail over, hand-off futures complete, its channel closes); one back within
the grace (Redis restarted empty) is not. A gone worker's circuit breaker goes with it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from megaserve.rpc import decode_pb2, decode_pb2_grpc
from router.absence import Absences
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.state import ClusterState
from router.worker_stream import WorkerCalls, WorkerStream, rpc_error
from router.worker_watch import WorkerWatch
from router.workers import WorkerClients
from tests.conftest import FakeClock
from tests.dispatch_helpers import worker_view


def _watch():
    clock, gone = FakeClock(), []
    return WorkerWatch(2.0, lambda a, why: gone.append((a, why)), clock), clock, gone


def test_absent_past_the_grace_is_gone_once():
    w, clock, gone = _watch()
    assert w.update(["a:1", "b:2"]) == []
    clock.advance(1.5)
    assert w.update(["b:2"]) == []  # a:1 missing since now
    clock.advance(1.75)
    assert w.update(["b:2"]) == []  # 1.75 s of 2
    clock.advance(0.25)
    assert w.update(["b:2"]) == ["a:1"]
    assert [a for a, _ in gone] == ["a:1"] and "heartbeat expired" in gone[0][1]
    clock.advance(10.0)
    assert w.update(["b:2"]) == [] and len(gone) == 1  # not gone twice


def test_back_within_the_grace_is_not_gone():
    w, clock, gone = _watch()
    w.update(["a:1", "b:2"])
    clock.advance(0.5)
    assert w.update([]) == []  # Redis restarted empty: nobody registered yet
    clock.advance(1.5)
    assert w.update(["a:1", "b:2"]) == []  # both heartbeat again
    clock.advance(5.0)
    assert w.update(["a:1", "b:2"]) == [] and gone == []
    # Gone later, the absence counts from its own start, not the earlier one.
    w.update(["b:2"])
    clock.advance(1.0)
    assert w.update(["b:2"]) == []


def test_gone_futures_complete_and_unregister():
    async def main():
        w, clock, _ = _watch()
        w.update(["d:1", "p:2", "x:3"])
        f = w.gone("d:1", "p:2")
        other = w.gone("x:3")
        assert w.waiting == 3
        w.update(["d:1", "x:3"])
        clock.advance(2.0)
        w.update(["d:1", "x:3"])
        assert f.done() and f.result() == "p:2" and not other.done()
        await asyncio.sleep(0)  # done callbacks run on the loop
        assert w.waiting == 1
        other.cancel()
        await asyncio.sleep(0)
        assert w.waiting == 0

    asyncio.run(main())


class _Hung:
    """A stream-stream call whose worker never answers (a frozen process)."""

    def __init__(self):
        self._cancelled = asyncio.Event()

    async def initial_metadata(self):
        await self._cancelled.wait()
        raise asyncio.CancelledError

    async def read(self):
        await self._cancelled.wait()
        raise asyncio.CancelledError

    async def write(self, m):
        pass

    def cancel(self):
        self._cancelled.set()
        return True


@pytest.mark.parametrize("opened", [False, True])
def test_abort_fails_the_streams_requests_with_its_reason(opened):
    """A request waiting on a stream nobody answers fails with UNAVAILABLE and the reason."""

    async def main():
        s = WorkerStream(_Hung, "w:1")
        if opened:
            s.opened.set()
        call = s.start(decode_pb2.GenerateRequest(request_id="r1"), None)
        reading = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.01)
        assert not reading.done()
        s.abort(rpc_error(grpc.StatusCode.UNAVAILABLE, "w:1 left"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(reading, 5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == "w:1 left"
        assert s.closed and s.opened.is_set()

    asyncio.run(main())


class _HungDecode(decode_pb2_grpc.DecodeServicer):
    """A decode worker that takes Generate calls and never answers them."""

    async def Generate(self, request, context):  # noqa: N802
        await asyncio.Event().wait()
        yield decode_pb2.GenerateResponse()


def test_fail_ends_a_generate_call_with_its_reason_and_a_cancel_stays_a_cancel():
    """Per-request calls (`worker_streams: false`) to a gone worker end with UNAVAILABLE; a
    request cancelled by its own task is still a cancel, not a worker failure."""

    async def main():
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServicer_to_server(_HungDecode(), server)
        addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        channel = grpc.aio.insecure_channel(addr)
        calls = WorkerCalls(lambda a: channel, streams=False)
        try:
            a = await calls.start(addr, decode_pb2.GenerateRequest(request_id="a"), None)
            b = await calls.start(addr, decode_pb2.GenerateRequest(request_id="b"), None)
            ra, rb = asyncio.ensure_future(a.read()), asyncio.ensure_future(b.read())
            await asyncio.sleep(0.2)
            assert not ra.done() and not rb.done()
            rb.cancel()  # b's own task is cancelled: CancelledError, as ever
            with pytest.raises(asyncio.CancelledError):
                await rb
            calls.fail(addr, f"worker {addr} left the view")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(ra, 5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert e.value.details() == f"worker {addr} left the view"
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(main())


def test_a_gone_workers_channel_closes_and_one_back_gets_a_new_one():
    async def main():
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServicer_to_server(_HungDecode(), server)
        addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        clients = WorkerClients()
        calls = WorkerCalls(clients.channel, streams=False)
        try:
            first = clients.channel(addr)
            a = await calls.start(addr, decode_pb2.GenerateRequest(request_id="a"), None)
            ra = asyncio.ensure_future(a.read())
            await asyncio.sleep(0.2)
            calls.fail(addr, "gone")  # what the Dispatcher's view listener does, in its order
            await clients.forget(addr)
            with pytest.raises(grpc.aio.AioRpcError):
                await asyncio.wait_for(ra, 5)
            assert first.get_state() == grpc.ChannelConnectivity.SHUTDOWN
            b = await calls.start(addr, decode_pb2.GenerateRequest(request_id="b"), None)
            assert clients.channel(addr) is not first  # b went out on a new channel
            rb = asyncio.ensure_future(b.read())
            await asyncio.sleep(0.2)
            assert not rb.done()  # sent and waiting on the (hung) worker, not refused
            rb.cancel()
            await clients.forget("127.0.0.1:1")  # never called: nothing to close
        finally:
            await clients.close()
            await server.stop(0)

    asyncio.run(main())


def test_a_gone_workers_circuit_breaker_is_dropped_with_it():
    """Worker ids are new at every start, even on the same address: the breaker of one that
    died must not stay for ever (one per restart). One back within the grace (a heartbeat
    late) keeps its breaker."""

    async def main():
        state = ClusterState(None)
        a, b = worker_view("a", "decode", "127.0.0.1:1"), worker_view("b", "decode", "127.0.0.1:2")
        state.workers = {"a": a, "b": b}
        disp = Dispatcher(state, RouterConfig(worker_gone_s=5.0))
        clock = disp.breakers.clock = FakeClock()
        for wid in ("a", "b"):
            for _ in range(disp.cfg.circuit_breaker_failures):
                disp.breakers.failure(wid)
        b2 = worker_view("b2", "decode", "127.0.0.1:2")  # b restarted on its address
        state.workers = {"b2": b2}  # a's heartbeat is late
        await disp._view_changed()
        clock.advance(4.0)
        state.workers = {"a": a, "b2": b2}  # a is back within the grace
        await disp._view_changed()
        assert disp.breakers.is_open("a") and disp.breakers.is_open("b")  # b: 4 s of 5
        clock.advance(1.0)
        await disp._view_changed()
        assert disp.breakers.is_open("a") and not disp.breakers.is_open("b")
        assert len(disp.breakers) == 1
        state.workers = {"b2": b2}  # a late again: its grace starts again
        await disp._view_changed()
        assert disp.breakers.is_open("a")
        await disp.close()

    asyncio.run(main())


def test_an_absence_ends_when_the_key_is_back_or_no_longer_tracked():
    """A key's absence starts again from zero after it was back or untracked (a breaker
    closed by a success and opened again later gets a whole grace)."""
    absent = Absences()
    assert absent.follow({"a", "b"}, set(), now=0.0, grace_s=5.0) == []
    assert absent.follow({"a", "b"}, {"a"}, now=3.0, grace_s=5.0) == []  # a is back
    assert absent.follow({"a"}, set(), now=4.0, grace_s=5.0) == []  # b no longer tracked
    assert absent.follow({"a", "b"}, set(), now=8.0, grace_s=5.0) == []  # both from 4 / 8
    assert absent.follow({"a", "b"}, set(), now=9.0, grace_s=5.0) == ["a"]
    assert len(absent) == 1
    assert absent.follow({"b"}, set(), now=13.0, grace_s=5.0) == ["b"]
    assert len(absent) == 0
