"""The decode worker over real gRPC: concurrent streams, status codes, cancellation."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_service.engine import DecodeEngine, EngineConfig, wait_idle
from decode_service.scheduler import SchedulerConfig
from decode_service.server import create_server
from megaserve.offline import OfflineGenerator
from megaserve.rpc import decode_pb2, decode_pb2_grpc
from megaserve.sampling_params import SamplingParams
from megaserve.server_thread import ServerThread


@pytest.fixture(scope="module")
def worker(tiny_model):
    """A real server on port 0 in its own event loop thread."""
    engine = DecodeEngine(
        tiny_model,
        EngineConfig(
            max_context=128,
            scheduler=SchedulerConfig(max_running=32, max_waiting=64, prefill_chunk=32),
        ),
    )
    engine.start()
    servers = ServerThread(lambda: create_server(engine))
    yield engine, servers.addresses[0]
    servers.stop()
    engine.stop()


def _req(rid, prompt, max_tokens, sp=None, **stop):
    sp = sp or SamplingParams()
    return decode_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=decode_pb2.SamplingParams(
            temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=sp.seed
        ),
        stopping=decode_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True, **stop),
    )


def _assert_pool_clean(engine):
    wait_idle(engine, timeout=120)
    engine.alloc.check_invariants()
    assert engine.alloc.all_free_or_cached()


def expire_lease(engine, request_id: str) -> None:
    """Ends a reservation's lease now, on the engine thread (the allocator's owner): its next
    iteration drops it exactly as when the lease runs out, so tests need no short leases."""

    def end():
        engine.reservations[request_id].expires = float("-inf")

    engine._call(end)


async def until(pred, what: str, timeout: float = 60.0) -> None:
    """Polls (async) pred until true; a generous deadline, not a timing claim."""
    end = time.monotonic() + timeout
    while not await pred():
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.01)


def test_64_concurrent_streams_equal_solo(worker, tiny_model):
    engine, addr = worker
    rng = np.random.default_rng(3)
    reqs = []
    for i in range(64):
        prompt = rng.integers(0, tiny_model.cfg.vocab_size, int(rng.integers(2, 50))).tolist()
        sp = SamplingParams() if i % 2 else SamplingParams(temperature=0.9, top_k=30, seed=i)
        reqs.append((f"c{i}", prompt, sp, int(rng.integers(1, 30))))

    async def one(stub, rid, prompt, sp, n):
        toks = []
        async for r in stub.Generate(_req(rid, prompt, n, sp)):
            toks += list(r.token_ids)
        return toks

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            return await asyncio.gather(*(one(stub, *r) for r in reqs))

    got = asyncio.run(main())
    solo = OfflineGenerator(tiny_model, max_context=128)
    for (rid, prompt, sp, n), toks in zip(reqs, got):
        assert toks == solo.generate(prompt, n, sp, ignore_eos=True).token_ids, rid
    _assert_pool_clean(engine)


def _bad(rid="b", prompt=(1,), max_tokens=3, **sampling):
    return decode_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling=decode_pb2.SamplingParams(**sampling),
        stopping=decode_pb2.StoppingParams(max_tokens=max_tokens),
    )


_INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _scoring(**kw):
    return decode_pb2.GenerateRequest(
        request_id="b",
        prompt_token_ids=[1, 2],
        stopping=decode_pb2.StoppingParams(max_tokens=1),
        **kw,
    )


@pytest.mark.parametrize(
    "req,code,match",
    [
        (_bad(temperature=-1), _INVALID, "temperature=-1"),
        (_bad(temperature=float("nan")), _INVALID, "temperature=nan"),
        (_bad(top_p=1.5), _INVALID, "top_p=1.5"),
        (_bad(top_p=-0.5), _INVALID, "top_p=-0.5"),
        (_bad(top_k=-1), _INVALID, "top_k=-1"),
        (_bad(repetition_penalty=-2), _INVALID, "repetition_penalty=-2"),
        (_bad(max_tokens=0), _INVALID, "max_tokens=0"),
        (_bad(max_tokens=500), _INVALID, "context limit 128"),
        (_bad(prompt=(1, 96000)), _INVALID, "96000"),
        (_bad(prompt=()), _INVALID, "prompt_token_ids is empty"),
        (_bad(rid=""), _INVALID, "request_id is empty"),
        (_scoring(prompt_logprobs=True, prompt_top_n=-1), _INVALID, "prompt_top_n=-1"),
        (_scoring(prompt_logprobs=True, prompt_top_n=21), _INVALID, "prompt_top_n=21 must be"),
        (_scoring(prompt_top_n=2), _INVALID, "prompt_top_n=2 without prompt_logprobs"),
        (_scoring(prompt_logprobs=True, resumed_tokens=1), _INVALID, "resumed_tokens=1"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_input_status_codes(worker, req, code, match):
    engine, addr = worker

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async for _ in stub.Generate(req):
                    pass
            assert ei.value.code() == code and match in ei.value.details(), ei.value.details()
            # The server keeps serving.
            toks = [t async for r in stub.Generate(_req("ok", [1, 2, 3], 2)) for t in r.token_ids]
            assert len(toks) == 2

    asyncio.run(main())
    _assert_pool_clean(engine)


def test_unknown_release_is_not_found(worker):
    _, addr = worker

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Release(decode_pb2.ReleaseRequest(request_id="nope"))
            assert ei.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in ei.value.details()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["cancel", "deadline", "release", "disconnect"])
def test_cancellation_frees_pages(worker, how):
    engine, addr = worker

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            timeout = 0.3 if how == "deadline" else None
            call = stub.Generate(_req(f"x-{how}", [1, 2, 3, 4], 120), timeout=timeout)
            got = 0
            # A local cancel surfaces as asyncio.CancelledError, server-side ends as status.
            with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)) as ei:
                async for _ in call:
                    got += 1
                    if got == 3 and how == "cancel":
                        call.cancel()
                    if got == 1 and how == "release":  # early: the tiny model is fast
                        await stub.Release(decode_pb2.ReleaseRequest(request_id=f"x-{how}"))
                    if got == 3 and how == "disconnect":
                        await ch.close()  # the client goes away mid-stream
                    await asyncio.sleep(0.02)
            if how in ("release", "deadline"):
                want = {
                    "release": grpc.StatusCode.CANCELLED,
                    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
                }[how]
                assert ei.value.code() == want
            assert got < 120

    asyncio.run(main())
    _assert_pool_clean(engine)


def test_health_and_stats(worker):
    engine, addr = worker

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert h.status == health_pb2.HealthCheckResponse.SERVING
            s = await decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.StatsRequest())
            assert s.total_pages == engine.alloc.num_pages - 1 and s.page_size == 16

    asyncio.run(main())


def test_reservation_without_kv_expires_and_frees(worker):
    engine, addr = worker
    expired = engine.expired_reservations

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            # A lease every RPC below fits in, however slow the machine; then it is ended.
            r = await stub.Reserve(
                decode_pb2.ReserveRequest(
                    request_id="res1", prompt_token_ids=list(range(40)), lease_ms=600_000
                )
            )
            assert r.total_pages == 3 and r.page_size == 16
            s = await stub.Stats(decode_pb2.StatsRequest())
            assert s.reserved == 1
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Reserve(
                    decode_pb2.ReserveRequest(request_id="res1", prompt_token_ids=[1])
                )
            assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert engine.expired_reservations == expired  # nothing expired yet
            expire_lease(engine, "res1")

            async def gone():
                return (await stub.Stats(decode_pb2.StatsRequest())).reserved == 0

            await until(gone, "the expired reservation dropped")
            assert engine.expired_reservations == expired + 1
            # An explicit release frees at once.
            await stub.Reserve(
                decode_pb2.ReserveRequest(request_id="res2", prompt_token_ids=[1, 2, 3])
            )
            await stub.Release(decode_pb2.ReleaseRequest(request_id="res2"))
            assert (await stub.Stats(decode_pb2.StatsRequest())).reserved == 0

    asyncio.run(main())
    assert engine.expired_reservations == expired + 1  # res2 was released, not expired
    _assert_pool_clean(engine)


def test_prompt_larger_than_pool_is_rejected(tiny_model):
    from megaserve.errors import RequestError

    cfg = tiny_model.cfg
    per_page = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    small = DecodeEngine(tiny_model, EngineConfig(kv_budget_bytes=9 * per_page, max_context=512))
    with pytest.raises(RequestError, match="needs 13 pages, the whole pool has 8"):
        small.validate([1] * 200, 1)


def test_logprobs_and_penalties_over_grpc(worker, tiny_model):
    engine, addr = worker
    prompt = [5, 6, 7, 8]

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            req = _req("lp", prompt, 5)
            req.logprobs = 3
            req.prompt_logprobs, req.prompt_top_n = True, 2
            return [r async for r in stub.Generate(req)]

    resps = asyncio.run(main())
    lps = [lp for r in resps for lp in r.logprobs]
    toks = [t for r in resps for t in r.token_ids]
    assert len(lps) == len(toks) == 5
    for lp, t in zip(lps, toks):
        assert lp.token_id == t and lp.top_token_ids[0] == t and len(lp.top_token_ids) == 3
        assert lp.logprob <= 0 and list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
    # The first token's logprob equals log-softmax of the prompt's last logits.
    _, logits = OfflineGenerator(tiny_model, max_context=128).prefill(prompt, SamplingParams())
    ref = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    assert abs(lps[0].logprob - ref[toks[0]]) < 1e-4
    # Prompt tokens 1.. on the first message only; the last scores token 3 given tokens 0..2.
    assert [p.token_id for p in resps[0].prompt_logprobs] == prompt[1:]
    assert all(not r.prompt_logprobs for r in resps[1:])
    _, logits = OfflineGenerator(tiny_model, max_context=128).prefill(prompt[:3], SamplingParams())
    ref = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    last = resps[0].prompt_logprobs[-1]
    assert abs(last.logprob - ref[prompt[3]]) < 1e-4 and len(last.top_token_ids) == 2
    assert list(last.top_token_ids) == np.argsort(-ref, kind="stable")[:2].tolist()
    _assert_pool_clean(engine)


def test_server_reflection_lists_services(worker):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    _, addr = worker

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            async for resp in stub.ServerReflectionInfo(iter([req])):
                return {s.name for s in resp.list_services_response.service}

    names = asyncio.run(main())
    assert {"megaserve.internal.v1.Decode", "grpc.health.v1.Health"} <= names
