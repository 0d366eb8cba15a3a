"""A decode worker whose step raises, over real gRPC: that step's requests end INTERNAL
(reason STEP_FAILED, the error in the message), the engine thread lives on, health stays
SERVING, and the next requests are exact. A step that lost the donated pool ends every live
request and restarts on a fresh pool. The failures are injected (a fault no input causes)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_service.engine import DecodeEngine, EngineConfig, wait_idle
from decode_service.scheduler import SchedulerConfig
from decode_service.server import create_server
from megaserve.offline import OfflineGenerator
from megaserve.rpc import decode_pb2, decode_pb2_grpc
from megaserve.server_thread import ServerThread
from megaserve.status import Reason, reason_of

PROMPTS = [[(i * 7 + j) % 300 + 3 for j in range(5 + 3 * i)] for i in range(6)]
MAX_TOKENS = 6


@pytest.fixture()
def worker(tiny_model):
    engine = DecodeEngine(
        tiny_model,
        EngineConfig(max_context=128, scheduler=SchedulerConfig(max_running=8, prefill_chunk=32)),
    )
    engine.start()
    servers = ServerThread(lambda: create_server(engine))
    yield engine, servers.addresses[0]
    servers.stop()
    engine.stop()


class FailOnce:
    """Wraps a runner method: the `nth` call raises (after deleting the pool if `lose_pool`)."""

    def __init__(self, engine: DecodeEngine, method: str, nth: int, lose_pool: bool = False):
        self.engine, self.real = engine, getattr(engine.runner, method)
        self.nth, self.calls, self.lose_pool = nth, 0, lose_pool
        setattr(engine.runner, method, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.nth:
            if self.lose_pool:  # as if the donated buffers were consumed by a failed run
                self.engine.pool.k.delete()
            raise RuntimeError(f"injected failure in call {self.nth}")
        return self.real(*args, **kwargs)


def _run(addr: str, prompts: list[list[int]], prefix: str) -> list[list[int] | grpc.RpcError]:
    async def one(stub, i, prompt):
        req = decode_pb2.GenerateRequest(
            request_id=f"{prefix}{i}",
            prompt_token_ids=prompt,
            stopping=decode_pb2.StoppingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        try:
            return [t async for r in stub.Generate(req, timeout=60) for t in r.token_ids]
        except grpc.aio.AioRpcError as e:
            return e

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            out = await asyncio.gather(*(one(stub, i, p) for i, p in enumerate(prompts)))
            h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert h.status == health_pb2.HealthCheckResponse.SERVING
            return out

    return asyncio.run(main())


def _want(tiny_model) -> list[list[int]]:
    gen = OfflineGenerator(tiny_model, max_context=128)
    return [gen.generate(p, MAX_TOKENS, ignore_eos=True).token_ids for p in PROMPTS]


def _check_failed(results, want) -> int:
    """Each result exact or INTERNAL/STEP_FAILED naming the injected error; the count failed."""
    failed = 0
    for got, w in zip(results, want):
        if isinstance(got, grpc.RpcError):
            assert got.code() == grpc.StatusCode.INTERNAL, got
            assert reason_of(got) == Reason.STEP_FAILED, got
            assert "RuntimeError: injected failure" in got.details(), got.details()
            failed += 1
        else:
            assert got == w
    return failed


@pytest.mark.parametrize("method", ["decode", "prefill"])
def test_a_failed_step_ends_its_requests_and_the_worker_serves_on(worker, tiny_model, method):
    engine, addr = worker
    want = _want(tiny_model)
    FailOnce(engine, method, nth=3)
    failed = _check_failed(_run(addr, PROMPTS, "a"), want)
    assert 1 <= failed < len(PROMPTS)  # the step's requests only
    assert engine.step_failures == 1 and engine._thread.is_alive()
    assert _run(addr, PROMPTS, "b") == want  # the prefix cache it kept is sound
    wait_idle(engine)
    engine.alloc.check_invariants()
    assert engine.alloc.all_free_or_cached()
    stats = engine.stats()
    assert stats["step_failures"] == 1 and stats["running"] == stats["waiting"] == 0


def test_a_step_that_loses_the_pool_restarts_on_a_fresh_one(worker, tiny_model):
    engine, addr = worker
    want = _want(tiny_model)
    assert _run(addr, PROMPTS[-2:], "warm") == want[-2:]  # full pages: cached blocks
    cached = set(engine.alloc.by_hash)
    assert cached
    FailOnce(engine, "decode", nth=4, lose_pool=True)
    failed = _check_failed(_run(addr, PROMPTS, "c"), want)
    assert failed >= 1
    assert _run(addr, PROMPTS, "d") == want  # recomputed on the fresh pool
    wait_idle(engine)
    assert not engine.pool.k.is_deleted() and engine.step_failures == 1
    dropped = {h for sign, h in engine.alloc.block_events if sign < 0}
    assert cached <= dropped  # the lost pool's blocks left the prefix cache (and Redis)
    engine.alloc.check_invariants()
