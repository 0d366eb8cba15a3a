"""Every error one tier sends another carries a machine-readable reason (google.rpc.ErrorInfo
in the status details): callers branch on it, never on the message text."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.scheduler import SchedulerConfig
from decode_service.server import create_server as create_decode
from megaserve.kv import wire
from megaserve.rpc import decode_pb2, kv_transfer_pb2_grpc, prefill_pb2
from megaserve.server_thread import ServerThread
from megaserve.status import Reason, reason_of
from prefill_service.engine import PrefillConfig, PrefillEngine
from prefill_service.server import create_server as create_prefill
from router.workers import HandoffFailed, WorkerClients, handoff

PAGE = 16


@pytest.fixture(scope="module")
def tiers(tiny_model):
    """A decode worker with a 12-page pool and room for one queued request, a prefill
    worker with a 6-page pool, and a decode worker whose queue takes nothing."""
    page_bytes = 2 * tiny_model.cfg.num_layers * PAGE * tiny_model.cfg.num_kv_heads
    page_bytes *= tiny_model.cfg.head_dim * 4
    small = EngineConfig(
        kv_budget_bytes=13 * page_bytes,
        max_context=128,
        scheduler=SchedulerConfig(max_running=4, max_waiting=4, prefill_chunk=32),
    )
    dec = DecodeEngine(tiny_model, small)
    dec.start()
    full = DecodeEngine(
        tiny_model, EngineConfig(max_context=128, scheduler=SchedulerConfig(max_waiting=0))
    )
    pre = PrefillEngine(
        tiny_model, PrefillConfig(kv_budget_bytes=7 * page_bytes, max_context=128, chunk=32)
    )
    servers = ServerThread(
        lambda: create_decode(dec), lambda: create_prefill(pre), lambda: create_decode(full)
    )
    d_addr, p_addr, full_addr = servers.addresses
    yield dec, d_addr, p_addr, full_addr, servers.results[0][3]
    servers.stop()
    dec.stop()


def _gen(rid, prompt, max_tokens=4, **sampling):
    return decode_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=decode_pb2.SamplingParams(**sampling),
        stopping=decode_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def _error(coro_fn) -> grpc.aio.AioRpcError:
    async def main():
        clients = WorkerClients()
        try:
            await coro_fn(clients)
        finally:
            await clients.close()

    with pytest.raises((grpc.aio.AioRpcError, HandoffFailed)) as ei:
        asyncio.run(main())
    e = ei.value
    return e.error if isinstance(e, HandoffFailed) else e


def _assert(e: grpc.aio.AioRpcError, code: grpc.StatusCode, reason: Reason, text: str):
    assert (e.code(), reason_of(e)) == (code, reason), (e.code(), e.details())
    assert text in e.details(), e.details()  # the message still names the value, for people


def test_decode_worker_reasons(tiers):
    dec, d_addr, _, full_addr, _ = tiers

    async def stream(clients, addr, req):
        return [r async for r in clients.decode(addr).Generate(req)]

    _assert(
        _error(lambda c: stream(c, d_addr, _gen("bad", [1, 2], temperature=-1))),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.INVALID_REQUEST,
        "temperature=-1",
    )
    _assert(
        _error(lambda c: stream(c, full_addr, _gen("q", [1, 2]))),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        Reason.NO_CAPACITY,
        "queue full",
    )
    _assert(
        _error(lambda c: c.decode(d_addr).Release(decode_pb2.ReleaseRequest(request_id="nobody"))),
        grpc.StatusCode.NOT_FOUND,
        Reason.UNKNOWN_REQUEST,
        "'nobody'",
    )

    async def duplicate(clients):
        prompt = list(range(1, 40))
        await clients.decode(d_addr).Reserve(
            decode_pb2.ReserveRequest(request_id="dup", prompt_token_ids=prompt)
        )
        try:
            await clients.decode(d_addr).Reserve(
                decode_pb2.ReserveRequest(request_id="dup", prompt_token_ids=prompt)
            )
        finally:
            await clients.release(d_addr, "dup")

    _assert(
        _error(duplicate),
        grpc.StatusCode.ALREADY_EXISTS,
        Reason.DUPLICATE_REQUEST_ID,
        "'dup'",
    )

    async def pool_full(clients):
        prompt = np.random.default_rng(1).integers(0, 90, 100).tolist()  # 7 of 12 pages
        await clients.decode(d_addr).Reserve(
            decode_pb2.ReserveRequest(request_id="big1", prompt_token_ids=prompt)
        )
        try:
            await clients.decode(d_addr).Reserve(
                decode_pb2.ReserveRequest(request_id="big2", prompt_token_ids=prompt[::-1])
            )
        finally:
            await clients.release(d_addr, "big1")

    _assert(_error(pool_full), grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.NO_CAPACITY, "pages")

    async def released(clients):
        await clients.decode(d_addr).Reserve(
            decode_pb2.ReserveRequest(request_id="rel", prompt_token_ids=[1, 2, 3])
        )
        call = clients.decode(d_addr).Generate(_gen("rel", [1, 2, 3]))

        async def release_soon():
            while dec.reservation("rel") is None or dec.reservation("rel").waiter is None:
                await asyncio.sleep(0.01)
            await clients.release(d_addr, "rel")

        await asyncio.gather(release_soon(), stream_call(call))

    async def stream_call(call):
        return [r async for r in call]

    _assert(_error(released), grpc.StatusCode.CANCELLED, Reason.RELEASED, "released")


def test_draining_worker_reason(tiers):
    _, d_addr, _, _, servicer = tiers
    servicer.draining = True
    try:
        _assert(
            _error(lambda c: c.decode(d_addr).Generate(_gen("late", [1, 2])).read()),
            grpc.StatusCode.UNAVAILABLE,
            Reason.DRAINING,
            "shutting down",
        )
    finally:
        servicer.draining = False


def test_kv_transfer_reasons(tiers):
    dec, d_addr, _, _, _ = tiers
    geo = wire.PageGeometry.of_pool(dec.pool)

    async def push(clients, msgs):
        stub = kv_transfer_pb2_grpc.KVTransferStub(clients.channel(d_addr))
        return await stub.Push(iter(msgs))

    _assert(
        _error(lambda c: push(c, [wire.header("ghost", geo, 0, 1)])),
        grpc.StatusCode.NOT_FOUND,
        Reason.RESERVATION_NOT_FOUND,
        "'ghost'",
    )

    async def reserved_push(clients, rid, make_msgs):
        await clients.decode(d_addr).Reserve(
            decode_pb2.ReserveRequest(request_id=rid, prompt_token_ids=[5, 6, 7])
        )
        try:
            return await push(clients, make_msgs(rid))
        finally:
            await clients.release(d_addr, rid)

    bad_dtype = wire.PageGeometry(geo.num_layers, PAGE, geo.kv_heads, geo.head_dim, "float16")
    _assert(
        _error(lambda c: reserved_push(c, "hdr", lambda r: [wire.header(r, bad_dtype, 0, 1)])),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.KV_TRANSFER_INVALID,
        "dtype='float16'",
    )
    _assert(
        _error(lambda c: reserved_push(c, "cut", lambda r: [wire.header(r, geo, 0, 1)])),
        grpc.StatusCode.DATA_LOSS,
        Reason.KV_TRANSFER_INCOMPLETE,
        "missing",
    )


def test_prefill_worker_reasons(tiers):
    _, d_addr, p_addr, _, _ = tiers

    async def prefill(clients, req):
        return await clients.prefill(p_addr).Prefill(req)

    _assert(
        _error(
            lambda c: prefill(
                c,
                prefill_pb2.PrefillRequest(
                    request_id="x", prompt_token_ids=[999], decode_address=d_addr, page_size=PAGE
                ),
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.INVALID_REQUEST,
        "999",
    )
    # More cached pages than the prompt has (a peer's bug): named, before any push opens.
    _assert(
        _error(
            lambda c: prefill(
                c,
                prefill_pb2.PrefillRequest(
                    request_id="x",
                    prompt_token_ids=[1] * 33,
                    decode_address=d_addr,
                    page_size=PAGE,
                    cached_pages=2**32 - 1,
                ),
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.INVALID_REQUEST,
        "cached_pages=4294967295 outside [0, ",
    )
    # The push into a reservation the decode worker does not have: the hand-off failed at the
    # decode side, and the decode worker's own reason rides along.
    e = _error(
        lambda c: prefill(
            c,
            prefill_pb2.PrefillRequest(
                request_id="nores", prompt_token_ids=[1, 2], decode_address=d_addr, page_size=PAGE
            ),
        )
    )
    _assert(e, grpc.StatusCode.NOT_FOUND, Reason.KV_HANDOFF_FAILED, "'nores'")
    assert (Reason.RESERVATION_NOT_FOUND.value, "decode_reason") in [
        (v, k) for k, v in _metadata(e).items()
    ]
    # A prompt larger than the prefill pool's free pages: full, retry elsewhere.
    long = np.random.default_rng(2).integers(0, 90, 110).tolist()  # 7 pages > 6
    e = _error(lambda c: handoff(c, d_addr, p_addr, "toolong", long))
    _assert(e, grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.NO_CAPACITY, "prefill pool")


def _metadata(e: grpc.aio.AioRpcError) -> dict[str, str]:
    """The ErrorInfo metadata of e."""
    from google.rpc import error_details_pb2, status_pb2
    from grpc_status import rpc_status

    for key, value in e.trailing_metadata() or ():
        if key == rpc_status.GRPC_DETAILS_METADATA_KEY:
            info = error_details_pb2.ErrorInfo()
            status_pb2.Status.FromString(value).details[0].Unpack(info)
            return dict(info.metadata)
    return {}
