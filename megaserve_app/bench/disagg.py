"""Disaggregated hand-off benchmark: TTFT split and KV transfer GB/s per transport."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np

from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.scheduler import SchedulerConfig
from decode_service.server import create_server as create_decode
from megaserve.model import LoadedModel
from megaserve.rpc import decode_pb2, decode_pb2_grpc
from megaserve.server_thread import ServerThread
from megaserve_app.bench import summary
from prefill_service.engine import PrefillConfig, PrefillEngine
from prefill_service.server import create_server as create_prefill
from router.workers import WorkerClients, handoff


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """A plain host copy of the same number of bytes, best of `repeats`."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def _start(model: LoadedModel, max_context: int):
    dec = DecodeEngine(
        model,
        EngineConfig(
            max_context=max_context + 16,
            kv_budget_bytes=1 << 30,
            scheduler=SchedulerConfig(max_running=4),
        ),
    )
    dec.start()
    pre = PrefillEngine(
        model, PrefillConfig(max_context=max_context, kv_budget_bytes=1 << 30, chunk=512)
    )
    servers = ServerThread(lambda: create_decode(dec), lambda: create_prefill(pre))

    def stop():
        servers.stop()
        dec.stop()

    return servers.addresses[0], servers.addresses[1], stop


async def _one(d_addr, p_addr, rid, prompt, transport) -> dict:
    clients = WorkerClients()
    try:
        t0 = time.perf_counter()
        h = await handoff(
            clients, d_addr, p_addr, rid, prompt, lease_ms=600_000, transport=transport
        )
        pr = h.prefill
        t1 = t0 + h.reserve_s
        t2 = t1 + h.prefill_s
        req = decode_pb2.GenerateRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            stopping=decode_pb2.StoppingParams(max_tokens=2, ignore_eos=True),
        )
        stamps = []
        async for _ in clients.decode(d_addr).Generate(req):
            stamps.append(time.perf_counter())
        # Tail of the transfer not hidden behind compute = time after compute ended.
        return summary.handoff_row(
            len(prompt), pr.bytes_sent, pr.compute_ms, pr.transfer_ms, pr.first_chunk_sent_ms,
            t0, t1, t2, stamps,
        )  # fmt: skip

    finally:
        await clients.close()


def bench_disagg(model: LoadedModel, lengths=(128, 1024, 4096)) -> list[dict]:
    d_addr, p_addr, stop = _start(model, max(lengths))
    rows = []
    rng = np.random.default_rng(0)
    try:
        for name, transport in (("grpc", 0), ("jax-transfer", 1)):
            for n in lengths:
                warm = rng.integers(0, model.cfg.vocab_size, n).tolist()
                asyncio.run(_one(d_addr, p_addr, f"w-{name}-{n}", warm, transport))
                prompt = rng.integers(0, model.cfg.vocab_size, n).tolist()
                r = asyncio.run(_one(d_addr, p_addr, f"{name}-{n}", prompt, transport))
                r["transport"] = name
                r["memcpy_GBps"] = memcpy_gbps(max(r["bytes"], 1 << 20))
                rows.append(r)
    finally:
        stop()
    return rows


async def _raw_push(d_addr, rid, prompt, k, v, transport) -> float:
    """Seconds for one Push of pre-made pages into a fresh reservation (transport only)."""
    import jax.numpy as jnp

    from megaserve.kv import wire
    from megaserve.rpc import kv_transfer_pb2_grpc

    async with grpc.aio.insecure_channel(
        d_addr, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as ch:
        dec = decode_pb2_grpc.DecodeStub(ch)
        await dec.Reserve(
            decode_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt, lease_ms=600_000)
        )
        t = time.perf_counter()
        if transport == 1:
            body = [wire.pull_message(0, jnp.asarray(k), jnp.asarray(v))]
        else:
            body = list(wire.chunk_messages(0, k, v))
        header = wire.header(rid, wire.PageGeometry.of_pages(k), 0, k.shape[1])
        msgs = [header, *body, wire.trailer(0)]
        await kv_transfer_pb2_grpc.KVTransferStub(ch).Push(iter(msgs))
        dt = time.perf_counter() - t
        await dec.Release(decode_pb2.ReleaseRequest(request_id=rid))
        return dt


def bench_raw_transfer(model: LoadedModel, tokens: int = 4096) -> list[dict]:
    """KV transfer GB/s of each transport for `tokens` tokens of pages vs a plain memcpy."""
    d_addr, _, stop = _start(model, tokens)
    cfg = model.cfg
    n_pages = tokens // 16
    shape = (cfg.num_layers, n_pages, 16, cfg.num_kv_heads, cfg.head_dim)
    k = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    v = k + 1
    prompt = list(range(1, tokens + 1))
    rows = []
    try:
        for name, transport in (("grpc", 0), ("jax-transfer", 1)):
            asyncio.run(_raw_push(d_addr, f"raw-w-{name}", prompt, k, v, transport))
            best = min(
                asyncio.run(_raw_push(d_addr, f"raw-{name}-{i}", prompt, k, v, transport))
                for i in range(3)
            )
            nbytes = 2 * k.nbytes
            rows.append(summary.raw_transfer_row(name, nbytes, best, memcpy_gbps(nbytes)))
    finally:
        stop()
    return rows
