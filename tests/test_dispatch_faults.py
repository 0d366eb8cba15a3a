"""Dispatcher retries against scripted in-process gRPC workers: faults at exact points of a
request (a decode stream breaking after some tokens, a prefill failing on a migration) that
real processes only hit by chance. Each try must be a fresh request id on the workers."""

from __future__ import annotations

import asyncio

import grpc

from decode_service.generate_stream import StreamHub
from megaserve.rpc import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.frontend import Job
from router.state import ClusterState
from router.worker_view import WorkerView
from tests.conftest import FakeClock
from tests.dispatch_helpers import job, worker_view
from tests.polling import until_async

PROMPT = list(range(3, 83))  # 80 tokens: over disagg_min_uncached_tokens, so prefill is used
N = 12


class ScriptedDecode(decode_pb2_grpc.DecodeServicer):
    """Like a decode worker: Release frees a reservation or stops a running request by id.
    The first Generate breaks after 3 tokens (the worker's stream fails); with `hold_first`,
    the first Generate instead waits on that event after its first token."""

    def __init__(self, break_first: bool = True, hold_first: asyncio.Event | None = None):
        self.break_first, self.hold_first = break_first, hold_first
        self.reserved, self.generated, self.released = [], [], []
        self.live: dict[str, asyncio.Event] = {}
        self.streams = StreamHub()

    async def Reserve(self, req, ctx):
        self.reserved.append(req.request_id)
        return decode_pb2.ReserveResponse(cached_pages=0, total_pages=8, page_size=16)

    async def Release(self, req, ctx):
        self.released.append(req.request_id)
        if req.request_id in self.live:
            self.live[req.request_id].set()
        return decode_pb2.ReleaseResponse()

    async def Generate(self, req, ctx):
        self.generated.append(req.request_id)
        released = self.live[req.request_id] = asyncio.Event()
        first_call = len(self.generated) == 1
        try:
            for i in range(req.stopping.max_tokens):
                await asyncio.sleep(0.02)
                if first_call and self.hold_first is not None and i == 1:
                    await self.hold_first.wait()
                if released.is_set():
                    rid = req.request_id
                    await ctx.abort(grpc.StatusCode.CANCELLED, f"request {rid!r} released")
                if first_call and self.break_first and i == 3:
                    await ctx.abort(grpc.StatusCode.UNAVAILABLE, "stream broke")
                pos = req.resumed_tokens + i
                last = i == req.stopping.max_tokens - 1
                yield decode_pb2.GenerateResponse(
                    token_ids=[100 + pos],
                    finish_reason=decode_pb2.FINISH_REASON_LENGTH if last else 0,
                )
        finally:
            self.live.pop(req.request_id, None)

    async def GenerateStream(self, requests, ctx):  # the router's path: its stream
        async for m in self.streams.serve(self.Generate, requests, ctx):
            yield m


class ScriptedPrefill(prefill_pb2_grpc.PrefillServicer):
    """Prefills fine except the second call (the one after the migration), which fails."""

    def __init__(self):
        self.calls = []

    async def PrefillStream(self, req, ctx):
        self.calls.append(req.request_id)
        if len(self.calls) == 2:
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker went away")
        first = 100 + req.resumed_tokens  # what ScriptedDecode then streams first
        yield prefill_pb2.PrefillEvent(first_token=prefill_pb2.FirstToken(token=first))
        yield prefill_pb2.PrefillEvent(done=prefill_pb2.PrefillResponse(first_token=first))


def _view(worker_id: str, role: str, port: int) -> WorkerView:
    return worker_view(worker_id, role, f"127.0.0.1:{port}")


def _job(rid: str) -> Job:
    return job(rid, PROMPT, N)


async def _collect(disp: Dispatcher, job: Job) -> list[int]:
    return [t async for c in disp.run(job, deadline=None) for t in c.token_ids]


async def _scenario():
    decode, prefill = ScriptedDecode(), ScriptedPrefill()
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServicer_to_server(decode, server)
    prefill_pb2_grpc.add_PrefillServicer_to_server(prefill, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    state = ClusterState(None)
    state.workers = {"d": _view("d", "decode", port), "p": _view("p", "prefill", port)}
    cfg = RouterConfig(disagg_min_uncached_tokens=16, retry_base_delay_ms=1.0)
    disp = Dispatcher(state, cfg)
    try:
        tokens = await _collect(disp, _job("req"))
        # The background Releases of failed tries have all landed.
        await disp.drain()  # the dispatcher's background Releases
        return tokens, decode, prefill, disp
    finally:
        await disp.close()
        await server.stop(None)


def test_every_try_is_a_fresh_request_and_releases_only_touch_failed_tries():
    tokens, decode, prefill, disp = asyncio.run(_scenario())
    # Try 1 (disaggregated) streams 3 tokens and breaks: a migration; try 2's prefill fails:
    # a retry (no tokens flowed); try 3 (co-located: the prompt is cached there now)
    # completes. The client sees every position once; try 2's late Release cannot stop try 3.
    assert tokens == [100 + i for i in range(N)], tokens
    assert disp.stats["migrations"] == 1 and disp.stats["retries"] == 1, disp.stats
    assert len(prefill.calls) == 2 and decode.reserved == prefill.calls, decode.reserved
    assert len(decode.generated) == 2, decode.generated  # try 2 never reached Generate
    tries = [decode.reserved[0], decode.reserved[1], decode.generated[1]]
    assert decode.generated[0] == tries[0] and len(set(tries)) == 3, tries
    assert tries[1] in decode.released  # the failed prefill's reservation is freed
    assert tries[2] not in decode.released, decode.released


async def _held_decode_worker():
    """(held, the ScriptedDecode, its started server, a view of it as worker "d"): its first
    Generate stays open after its first token until `held` is set."""
    held = asyncio.Event()
    decode = ScriptedDecode(break_first=False, hold_first=held)
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServicer_to_server(decode, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    state = ClusterState(None)
    state.workers = {"d": _view("d", "decode", port)}
    return held, decode, server, state


async def _probe_scenario():
    held, decode, server, state = await _held_decode_worker()  # the probe's stream held
    cfg = RouterConfig(disagg_min_uncached_tokens=10_000, retry_max_attempts=3,
                       retry_base_delay_ms=1.0, circuit_breaker_reset_s=5.0)  # fmt: skip
    disp = Dispatcher(state, cfg)
    clock = disp.breakers.clock = FakeClock()  # the breaker's time moves only when told
    for _ in range(cfg.circuit_breaker_failures):  # the worker had failed (it restarted)
        disp.breakers.failure("d")
    assert not disp.breakers.allows("d")
    clock.advance(cfg.circuit_breaker_reset_s)  # half-open: the next request is the probe
    probe = None
    try:
        probe = asyncio.create_task(_collect(disp, _job("probe")))
        # The probe's first token reached the router and closed the breaker; the probe itself
        # cannot finish until `held` is set. No clock moves: the silent-probe timeout is out.
        await until_async(lambda: not disp.breakers.is_open("d"), "the probe closing the breaker")
        assert not probe.done()
        other = await _collect(disp, _job("other"))
        assert not probe.done() and len(decode.generated) == 2, decode.generated
        held.set()
        return await probe, other
    finally:
        held.set()
        if probe is not None and not probe.done():
            probe.cancel()
        await disp.close()
        await server.stop(None)


def test_a_probe_that_answers_closes_the_breaker_before_it_finishes():
    """Only worker half-open: once the probe streams, other requests go there too, instead of
    failing 'no healthy decode worker' while a long generation runs."""
    probe, other = asyncio.run(_probe_scenario())
    assert probe == other == [100 + i for i in range(N)]


def test_a_client_id_used_again_gets_other_worker_ids():
    """A client reuses its request id once a request ended (here: cancelled mid-stream) while
    the worker may still have the old request's messages or cancel in flight: the new job's
    worker request ids are its own, so nothing of the old one reaches it or stops it."""

    async def main():
        held, decode, server, state = await _held_decode_worker()  # the first request held
        disp = Dispatcher(state, RouterConfig(disagg_min_uncached_tokens=10_000))
        try:
            first = asyncio.create_task(_collect(disp, _job("same")))
            await until_async(lambda: decode.generated, "the first request on the worker")
            first.cancel()  # the client left
            async with asyncio.timeout(30):  # (with the old worker ids it hung here)
                again = await _collect(disp, _job("same"))
            return again, decode.generated
        finally:
            held.set()
            await disp.close()
            await server.stop(None)

    tokens, generated = asyncio.run(main())
    assert tokens == [100 + i for i in range(N)]
    assert len(generated) == 2 and generated[0] != generated[1], generated
    assert {g.split("#")[0] for g in generated} == {"same"}
