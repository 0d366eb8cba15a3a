"""Disaggregated hand-off benchmark: TTFT split and KV transfer GB/s per transport."""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc
import numpy as np

from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.scheduler import SchedulerConfig
from decode_service.server import create_server as create_decode
from megaserve.model import LoadedModel
from megaserve.rpc import decode_pb2, decode_pb2_grpc
from megaserve.server_thread import ServerThread
from megaserve_app.bench import grpc_ceiling, summary
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


# Pages per jax transfer pull in the raw push: what one 512-token prefill chunk completes.
PAGES_PER_PULL = 32


def _start(model: LoadedModel, max_context: int, sink: bool = False):
    """Decode and prefill workers (and with `sink` a bare bytes server) on one server thread:
    (decode address, prefill address, stop, sink address or None)."""
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
    extra = [grpc_ceiling.create_server] if sink else []
    servers = ServerThread(lambda: create_decode(dec), lambda: create_prefill(pre), *extra)

    def stop():
        servers.stop()
        dec.stop()

    addrs = servers.addresses
    return addrs[0], addrs[1], stop, (addrs[2] if sink else None)


async def _one(d_addr, p_addr, rid, prompt, transport, raw_ms: float) -> dict:
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
            t0, t1, t2, stamps, raw_ms,
        )  # fmt: skip

    finally:
        await clients.close()


def bench_disagg(model: LoadedModel, lengths=(128, 1024, 4096)) -> list[dict]:
    d_addr, p_addr, stop, _ = _start(model, max(lengths))
    rows = []
    rng = np.random.default_rng(0)
    try:
        for name, transport in (("grpc", 0), ("jax-transfer", 1)):
            for n in lengths:
                warm = rng.integers(0, model.cfg.vocab_size, n).tolist()
                asyncio.run(_one(d_addr, p_addr, f"w-{name}-{n}", warm, transport, 0.0))
                # What pushing the same bytes costs alone: the exposed tail is measured on it.
                raw = raw_push_ms(model, d_addr, n, pulls=transport == 1)
                prompt = rng.integers(0, model.cfg.vocab_size, n).tolist()
                r = asyncio.run(_one(d_addr, p_addr, f"{name}-{n}", prompt, transport, raw))
                r["transport"] = name
                r["memcpy_GBps"] = memcpy_gbps(max(r["bytes"], 1 << 20))
                rows.append(r)
    finally:
        stop()
    return rows


def _pages(model: LoadedModel, n_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Pre-made K/V pages [L, n_pages, 16, Hkv, D] on the host."""
    cfg = model.cfg
    shape = (cfg.num_layers, n_pages, 16, cfg.num_kv_heads, cfg.head_dim)
    k = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    return k, k + 1


def _pulls(k, v, pages_per_pull: int) -> list[tuple[int, object, object]]:
    """(first page, K, V) device arrays of `pages_per_pull` pages each, as a prefill worker
    holds them after reading a chunk's pages from its pool."""
    import jax

    return [
        (p0, *jax.device_put((k[:, p0 : p0 + pages_per_pull], v[:, p0 : p0 + pages_per_pull])))
        for p0 in range(0, k.shape[1], pages_per_pull)
    ]


async def _raw_push(d_addr, rid, prompt, k, v, pulls=None) -> float:
    """Seconds for one Push of pre-made pages into a fresh reservation (transport only):
    gRPC chunks each encoded just before it is written (as the prefill worker sends), or,
    with `pulls`, jax transfer pulls of device arrays."""
    from megaserve import jax_transfer
    from megaserve.kv import frames, wire

    async with grpc.aio.insecure_channel(d_addr, options=grpc_ceiling.CHANNEL_OPTIONS) as ch:
        dec = decode_pb2_grpc.DecodeStub(ch)
        await dec.Reserve(
            decode_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt, lease_ms=600_000)
        )
        t = time.perf_counter()
        header = wire.header(rid, wire.PageGeometry.of_pages(k), 0, k.shape[1])
        if pulls is not None:
            body = [wire.pull_message(p0, pk, pv) for p0, pk, pv in pulls]
        else:
            body = wire.chunk_frames(0, k, v)  # lazily, one chunk at a time
        call = frames.push_call(ch)()
        await frames.write_ahead(call, itertools.chain([header], body, [wire.trailer(0)]))
        await call.done_writing()
        await call
        dt = time.perf_counter() - t
        if pulls is not None:  # all pulled: the offers' records go
            jax_transfer.settle(m.chunk.pull.uuid for m in body)
        await dec.Release(decode_pb2.ReleaseRequest(request_id=rid))
        return dt


def raw_push_ms(model: LoadedModel, d_addr: str, tokens: int, pulls: bool, repeats=2) -> float:
    """Best time (ms) of a raw push of a `tokens`-token prompt's pages into `d_addr`."""
    k, v = _pages(model, -(-tokens // 16))
    chunks = _pulls(k, v, PAGES_PER_PULL) if pulls else None
    prompt = list(range(1, tokens + 1))
    return 1000 * min(
        asyncio.run(_raw_push(d_addr, f"raw-{tokens}-{pulls}-{i}", prompt, k, v, chunks))
        for i in range(repeats)
    )


def bench_raw_transfer(model: LoadedModel, tokens: int = 4096, rounds: int = 5) -> list[dict]:
    """KV transfer GB/s of each transport for `tokens` tokens of pages, against a bare gRPC
    bytes stream of the same messages' sizes (same run, same limits) and a plain memcpy.

    Rounds interleave the three, so a busy machine slows each about alike; each row is the
    median [min-max] of the rounds after a warm-up round."""
    from megaserve.kv import wire

    d_addr, _, stop, sink_addr = _start(model, tokens, sink=True)
    k, v = _pages(model, tokens // 16)
    pulls = _pulls(k, v, PAGES_PER_PULL)
    page_layer = 2 * k[0, 0].nbytes
    sizes = [
        2 * k[l0:l1, p0:p1].nbytes
        for l0, l1, p0, p1 in wire.chunk_spans(
            k.shape[0], k.shape[1], page_layer, wire.MAX_CHUNK_BYTES
        )
    ]
    bare = grpc_ceiling.payloads(sizes)
    prompt = list(range(1, tokens + 1))
    runs = {"grpc-bare-stream": [], "grpc": [], "jax-transfer": []}
    try:
        for i in range(rounds + 1):  # round 0 warms every path up
            runs["grpc-bare-stream"].append(
                asyncio.run(grpc_ceiling.stream_seconds(sink_addr, bare))
            )
            runs["grpc"].append(asyncio.run(_raw_push(d_addr, f"raw-g-{i}", prompt, k, v)))
            runs["jax-transfer"].append(
                asyncio.run(_raw_push(d_addr, f"raw-j-{i}", prompt, k, v, pulls))
            )
    finally:
        stop()
    nbytes = 2 * k.nbytes
    memcpy = memcpy_gbps(nbytes)
    ceiling = summary.raw_transfer_row("", nbytes, runs["grpc-bare-stream"][1:], memcpy)["GBps"]
    return [
        summary.raw_transfer_row(name, nbytes, ts[1:], memcpy, ceiling) for name, ts in runs.items()
    ]
