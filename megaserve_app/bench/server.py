"""Decode-worker service benchmark: real gRPC streams at fixed concurrency."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np

from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.scheduler import SchedulerConfig
from decode_service.server import create_server
from megaserve.model import LoadedModel
from megaserve.rpc import decode_pb2, decode_pb2_grpc
from megaserve.server_thread import ServerThread
from megaserve_app.bench import summary


def start_worker(model: LoadedModel, cfg: EngineConfig):
    """Engine thread + gRPC server on an event loop thread; returns (engine, addr, stop)."""
    engine = DecodeEngine(model, cfg)
    engine.start()
    servers = ServerThread(lambda: create_server(engine))

    def stop():
        servers.stop()
        engine.stop()

    return engine, servers.addresses[0], stop


async def _client(stub, rid, prompt, n, stamps):
    req = decode_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        stopping=decode_pb2.StoppingParams(max_tokens=n, ignore_eos=True),
    )
    t0 = time.perf_counter()
    times = []
    async for r in stub.Generate(req):
        times.extend([time.perf_counter()] * len(r.token_ids))
    stamps.append((t0, times))


def bench_server(
    model: LoadedModel, concurrency: int, prompt_len: int, new_tokens: int, rounds: int = 2
) -> dict:
    """`rounds` waves of `concurrency` simultaneous streams; steady-state decode figures."""
    cfg = EngineConfig(
        max_context=prompt_len + new_tokens + 16,
        kv_budget_bytes=1 << 30,
        scheduler=SchedulerConfig(max_running=max(concurrency, 1), prefill_chunk=256),
    )
    engine, addr, stop = start_worker(model, cfg)
    rng = np.random.default_rng(0)
    try:

        async def wave(k):
            stamps: list = []
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = decode_pb2_grpc.DecodeStub(ch)
                prompts = [
                    rng.integers(0, model.cfg.vocab_size, prompt_len).tolist()
                    for _ in range(concurrency)
                ]
                t = time.perf_counter()
                await asyncio.gather(
                    *(
                        _client(stub, f"w{k}-{i}", p, new_tokens, stamps)
                        for i, p in enumerate(prompts)
                    )
                )
                return stamps, time.perf_counter() - t

        asyncio.run(wave(-1))  # compile every bucket first
        results = [asyncio.run(wave(k)) for k in range(rounds)]
    finally:
        stop()
    # Decode throughput over the window where every stream is past its first token.
    return summary.server_row(results, concurrency, prompt_len, new_tokens)


def admission_cost(
    model: LoadedModel, running: int = 8, prompt_len: int = 256, chunk: int = 256
) -> dict:
    """How much one admission (a `prompt_len`-token prefill chunk) stalls running streams.

    `running` streams decode; once they are steady, one new request arrives. Reported: the
    median inter-token gap of the running streams and their largest gap while it prefilled.
    """
    cfg = EngineConfig(
        max_context=1024,
        kv_budget_bytes=1 << 30,
        scheduler=SchedulerConfig(max_running=running + 1, prefill_chunk=chunk),
    )
    engine, addr, stop = start_worker(model, cfg)
    rng = np.random.default_rng(1)
    try:

        async def main():
            stamps: list = []
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = decode_pb2_grpc.DecodeStub(ch)
                await _client(stub, "warm", rng.integers(0, 100, prompt_len).tolist(), 2, [])
                tasks = [
                    asyncio.create_task(_client(stub, f"run{i}", [1, 2, 3, i], 60, stamps))
                    for i in range(running)
                ]
                await asyncio.sleep(0.5)
                while engine.steps < 25:
                    await asyncio.sleep(0.01)
                t_admit = time.perf_counter()
                late: list = []
                await _client(stub, "newcomer", rng.integers(0, 100, prompt_len).tolist(), 1, late)
                await asyncio.gather(*tasks)
                return stamps, t_admit, late[0][1][0]

        stamps, t_admit, t_first = asyncio.run(main())
    finally:
        stop()
    # Gaps overlapping the newcomer's prefill (arrival to its first token).
    gaps, during = summary.admission_gaps(stamps, t_admit, t_first)
    return {
        "running": running,
        "prompt_len": prompt_len,
        "chunk": chunk,
        "itl_median_ms": 1000 * float(np.median(gaps)),
        "itl_max_during_admission_ms": 1000 * float(max(during) if during else 0.0),
    }
