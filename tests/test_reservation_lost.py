"""KV that arrives after its reservation's lease ran out (a decode worker stalled, e.g.
compiling a new program, past the lease): NOT_FOUND with RESERVATION_NOT_FOUND on the wire,
nothing leaked, and the router counts a hand-off that lost its reservation as the decode
worker's failure (it retries) rather than the request's."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from decode_service.engine import DecodeEngine, EngineConfig, wait_idle
from decode_service.server import create_server
from megaserve.kv import wire
from megaserve.rpc import decode_pb2, decode_pb2_grpc, kv_transfer_pb2_grpc
from megaserve.server_thread import ServerThread
from megaserve.status import Reason, reason_of, rich_status
from router.frontend import RouterError
from router.workers import HandoffFailed, WorkerFailed, classify

PROMPT = list(range(3, 23))  # 20 tokens: two pages of 16


def test_kv_after_the_lease_is_not_found_and_frees_everything(tiny_model):
    engine = DecodeEngine(tiny_model, EngineConfig(max_context=128))
    engine.start()
    servers = ServerThread(lambda: create_server(engine))
    addr = servers.addresses[0]
    geo = wire.PageGeometry.of_pool(engine.pool)
    try:

        async def main():
            async with grpc.aio.insecure_channel(addr) as ch:
                res = await decode_pb2_grpc.DecodeStub(ch).Reserve(
                    decode_pb2.ReserveRequest(request_id="late", prompt_token_ids=PROMPT)
                )
                n = res.total_pages - res.cached_pages
                shape = (geo.num_layers, n, geo.page_size, geo.kv_heads, geo.head_dim)
                k = np.ones(shape, np.dtype(geo.dtype))

                async def messages():
                    chunks = list(wire.chunk_messages(res.cached_pages, k, k, k[:, :1].nbytes))
                    assert len(chunks) >= 2
                    yield wire.header("late", geo, res.cached_pages, n)
                    yield chunks[0]
                    # The server has taken the header (and the reservation) once it has read
                    # on; then the lease ends mid-push.
                    await asyncio.sleep(1.0)
                    await asyncio.to_thread(_end_lease, engine, "late")
                    for m in chunks[1:]:
                        yield m
                    yield wire.trailer(7)

                stub = kv_transfer_pb2_grpc.KVTransferStub(ch)
                try:
                    await stub.Push(messages())
                except grpc.aio.AioRpcError as e:
                    return e
                raise AssertionError("a push after the lease was accepted")

        e = asyncio.run(main())
        assert e.code() == grpc.StatusCode.NOT_FOUND, e.details()
        assert reason_of(e) == Reason.RESERVATION_NOT_FOUND
        assert "'late' expired before its KV committed" in e.details()
        wait_idle(engine)
        engine.alloc.check_invariants()
        assert engine.alloc.all_free_or_cached() and engine.expired_reservations == 1
    finally:
        servers.stop()
        engine.stop()


def _end_lease(engine: DecodeEngine, rid: str) -> None:
    """Ends the lease on the engine thread, then waits for its next iteration to drop it."""

    def end():
        engine.reservations[rid].expires = float("-inf")

    engine._call(end)
    deadline = time.monotonic() + 30
    while engine.reservation(rid) is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)


class _Worker:
    id, address = "decode-x", "127.0.0.1:1"


def _prefill_error(decode_reason: str) -> grpc.aio.AioRpcError:
    """What a prefill worker answers when the decode worker refused its push."""
    s = rich_status(
        grpc.StatusCode.NOT_FOUND,
        Reason.KV_HANDOFF_FAILED,
        "decode worker refused the KV",
        decode_reason=decode_reason,
    )
    md = grpc.aio.Metadata(*s.trailing_metadata)
    return grpc.aio.AioRpcError(s.code, grpc.aio.Metadata(), md, s.details)


def test_the_router_retries_a_handoff_that_lost_its_reservation():
    lost = classify(_Worker(), _prefill_error(Reason.RESERVATION_NOT_FOUND), "kv push")
    assert isinstance(lost, WorkerFailed) and lost.worker.id == "decode-x"
    assert "reservation lost before the KV" in str(lost)
    assert HandoffFailed("kv push", _prefill_error(Reason.RESERVATION_NOT_FOUND)).at_decode
    # KV the decode worker found invalid is the sender's: the prefill worker is blamed, and
    # the request is retried (tests/test_handoff_invalid.py runs it through real workers).
    bad = HandoffFailed("kv push", _prefill_error(Reason.KV_TRANSFER_INVALID))
    assert not bad.at_decode
    assert isinstance(classify(_Worker(), bad.error, "kv push"), WorkerFailed)
    # A refusal without a reason of the decode worker's stays the request's own error.
    other = classify(_Worker(), _prefill_error(""), "kv push")
    assert isinstance(other, RouterError)


def test_a_lease_does_not_run_while_the_engine_itself_is_stalled(tiny_model):
    """A 4 s decode step (as a cold compile would be) against a 2 s lease: the reservation
    survives the step, then lapses after 2 s of the engine's ordinary time."""
    engine = DecodeEngine(tiny_model, EngineConfig(max_context=128))
    engine.start()
    servers = ServerThread(lambda: create_server(engine))
    addr = servers.addresses[0]
    real = engine.runner.decode
    slow = {"left": 0}

    def decode(*args, **kwargs):
        if slow["left"]:
            slow["left"] -= 1
            time.sleep(4.0)
        return real(*args, **kwargs)

    engine.runner.decode = decode
    try:

        async def main():
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = decode_pb2_grpc.DecodeStub(ch)
                gen = decode_pb2.GenerateRequest(
                    request_id="g0",
                    prompt_token_ids=[5, 6, 7],
                    stopping=decode_pb2.StoppingParams(max_tokens=3, ignore_eos=True),
                )
                _ = [r async for r in stub.Generate(gen)]  # the shapes compiled
                slow["left"] = 1
                await stub.Reserve(
                    decode_pb2.ReserveRequest(
                        request_id="held", prompt_token_ids=PROMPT, lease_ms=2000
                    )
                )
                gen.request_id = "g1"
                t0 = time.monotonic()
                _ = [r async for r in stub.Generate(gen)]
                return time.monotonic() - t0

        took = asyncio.run(main())
        assert took >= 4.0 and engine.reservation("held") is not None, took
        _end = time.monotonic() + 30
        while engine.reservation("held") is not None:
            assert time.monotonic() < _end
            time.sleep(0.05)
        assert engine.expired_reservations == 1
    finally:
        servers.stop()
        engine.stop()


def test_early_page_writes_of_a_lost_reservation_write_nothing():
    """Blocks of a push are written into the reservation's pages before its commit; once
    that reservation is gone (and its id reserved again) a late block writes nothing."""
    from decode_service.reservations import Reservations
    from kernels.kv_cache import KVPool
    from megaserve.errors import ReservationGone
    from megaserve.kv.allocator import PageAllocator

    pool = KVPool.create(2, 8, 4, 1, 4)
    res = Reservations(PageAllocator(8, 4), pool, 60.0, lambda r: None, lambda s: None)
    old = res.reserve("r", list(range(1, 9)), 60.0)  # two pages
    block = [(0, np.ones((2, 2, 4, 1, 4), np.float32), np.ones((2, 2, 4, 1, 4), np.float32))]
    assert res.write(old, block)
    assert np.asarray(pool.k)[:, old.pages].all()
    res.drop("r")
    new = res.reserve("r", list(range(1, 9)), 60.0)
    zero = [(0, np.zeros((2, 2, 4, 1, 4), np.float32), np.zeros((2, 2, 4, 1, 4), np.float32))]
    assert res.write(new, zero)
    assert not res.write(old, block)  # the stale push's block: not into the new pages
    assert not np.asarray(pool.k)[:, new.pages].any()
    with pytest.raises(ReservationGone, match="'r' expired before its KV committed"):
        res.commit(old, 7, [])
    res.commit(new, 7, [])
    assert new.first_token == 7
    assert not res.write(new, block)  # committed: nothing more goes in
