"""Prefill on P, decode on D over the gRPC KV transport: tokens equal one-worker decoding."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time

import grpc
import numpy as np
import pytest

from decode_service.engine import DecodeEngine, EngineConfig, wait_idle
from decode_service.kv_service import KVTransferServicer
from decode_service.scheduler import SchedulerConfig
from decode_service.server import create_server as create_decode
from megaserve.kv import frames, wire
from megaserve.offline import OfflineGenerator
from megaserve.rpc import prefill_pb2, prefill_pb2_grpc
from megaserve.sampling_params import SamplingParams
from megaserve.server_thread import ServerThread
from megaserve.status import Reason, error_metadata, reason_of
from prefill_service.engine import PrefillConfig, PrefillEngine
from prefill_service.server import create_server as create_prefill
from tests.stack import disagg_generate as _disagg


@pytest.fixture(scope="module")
def stack(tiny_model):
    """A decode worker and a prefill worker, real servers on port 0, one event loop thread."""
    dec = DecodeEngine(
        tiny_model,
        EngineConfig(max_context=256, scheduler=SchedulerConfig(max_running=32, prefill_chunk=32)),
    )
    dec.start()
    pre = PrefillEngine(tiny_model, PrefillConfig(chunk=32, max_context=256))
    servers = ServerThread(lambda: create_decode(dec), lambda: create_prefill(pre))
    d_addr, p_addr = servers.addresses
    yield dec, pre, d_addr, p_addr, servers.results[1][3]
    servers.stop()
    dec.stop()


TRANSPORTS = [prefill_pb2.TRANSPORT_GRPC, prefill_pb2.TRANSPORT_JAX_TRANSFER]


@pytest.mark.parametrize("transport", TRANSPORTS, ids=["grpc", "jax-transfer"])
def test_100_prompts_disaggregated_equal_one_worker(stack, tiny_model, transport):
    dec, pre, d_addr, p_addr, _ = stack
    rng = np.random.default_rng(21)
    shared = [rng.integers(0, 90, 48).tolist() for _ in range(4)]  # long shared prefixes
    cases = []
    for i in range(100):
        tail = rng.integers(0, 90, int(rng.integers(1, 60))).tolist()
        prompt = (shared[i % 4] + tail) if i % 3 else tail
        sp = SamplingParams() if i % 2 else SamplingParams(temperature=0.8, top_k=20, seed=i)
        cases.append((f"dg{i}", prompt, sp, int(rng.integers(1, 12))))

    async def main():
        sem = asyncio.Semaphore(8)

        async def one(c):
            async with sem:
                rid, prompt, sp, n = c
                return await _disagg(d_addr, p_addr, f"{rid}-{transport}", prompt, n, sp, transport)

        return await asyncio.gather(*(one(c) for c in cases))

    results = asyncio.run(main())
    solo = OfflineGenerator(tiny_model, max_context=256)
    for (rid, prompt, sp, n), (_, _, toks) in zip(cases, results):
        assert toks == solo.generate(prompt, n, sp, ignore_eos=True).token_ids, rid
    assert sum(pr.prefix_hit_pages for _, pr, _ in results) > 0  # P's own cache worked
    assert pre.rows_computed > pre.batched_calls  # concurrent prompts shared programs
    wait_idle(dec)
    dec.alloc.check_invariants()
    pre.alloc.check_invariants()
    assert dec.alloc.all_free_or_cached() and pre.alloc.all_free_or_cached()


@pytest.mark.parametrize("transport", TRANSPORTS, ids=["grpc", "jax-transfer"])
def test_partial_prefix_hit_sends_only_missing_pages(stack, tiny_model, transport):
    dec, _, d_addr, p_addr, _ = stack
    base = [transport + 1] + list(range(1, 64))  # 4 full pages, distinct per transport
    sp = SamplingParams()
    asyncio.run(_disagg(d_addr, p_addr, f"pp0-{transport}", base + [7, 8], 2, sp, transport))
    res, pr, _ = asyncio.run(
        _disagg(d_addr, p_addr, f"pp1-{transport}", base + [9, 9, 9], 2, sp, transport)
    )
    cfg = tiny_model.cfg
    per_page = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    assert res.cached_pages == 4 and res.total_pages == 5
    assert pr.pages_sent == 1 and pr.bytes_sent == per_page
    wait_idle(dec)


def test_transfer_overlaps_prefill_compute(stack, tiny_model):
    """On a long prompt the first pages leave before the last chunk is computed."""
    dec, _, d_addr, p_addr, _ = stack
    prompt = np.random.default_rng(5).integers(0, 90, 200).tolist()  # 7 chunks of 32
    _, pr, _ = asyncio.run(_disagg(d_addr, p_addr, "ov", prompt, 1, SamplingParams()))
    assert pr.first_chunk_sent_ms < pr.compute_ms, (pr.first_chunk_sent_ms, pr.compute_ms)
    wait_idle(dec)


def test_prefill_bad_input(stack):
    _, _, d_addr, p_addr, _ = stack

    async def main(req, streamed_too=True):
        async with grpc.aio.insecure_channel(p_addr) as ch:
            stub = prefill_pb2_grpc.PrefillStub(ch)
            if streamed_too:  # the router's call refuses it alike
                with pytest.raises(grpc.aio.AioRpcError) as streamed:
                    async for _ in stub.PrefillStream(req):
                        pass
            try:
                await stub.Prefill(req)
            except grpc.aio.AioRpcError as e:
                if streamed_too:
                    assert (e.code(), e.details()) == (
                        streamed.value.code(),
                        streamed.value.details(),
                    )
                raise

    for req, match in [
        (
            prefill_pb2.PrefillRequest(
                request_id="x", prompt_token_ids=[1], decode_address=d_addr, page_size=8
            ),
            "page_size=8",
        ),
        (
            prefill_pb2.PrefillRequest(
                request_id="x", prompt_token_ids=[999], decode_address=d_addr, page_size=16
            ),
            "999",
        ),
        (
            prefill_pb2.PrefillRequest(request_id="", prompt_token_ids=[1], page_size=16),
            "request_id is empty",
        ),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            asyncio.run(main(req))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in ei.value.details()
    # Prefilling into a reservation that does not exist: the decode worker's NOT_FOUND.
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        asyncio.run(
            main(
                prefill_pb2.PrefillRequest(
                    request_id="nores", prompt_token_ids=[1, 2], decode_address=d_addr, page_size=16
                ),
                streamed_too=False,
            )
        )
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_refused_push_reports_the_decode_workers_status_to_a_sender_still_writing(stack):
    """A push refused at its header (no such reservation) while the sender writes on: the
    decode worker's NOT_FOUND and reason reach the sender every time. grpcio turns a status
    that lands while a write is in flight into that write's INTERNAL ("Internal error from
    Core"); the decode worker therefore announces the refusal in its initial metadata and
    sends the status once the sender has stopped writing."""
    _, _, d_addr, _, _ = stack
    k = np.zeros((2, 64, 16, 2, 32), np.float32)  # a 1 MiB chunk; the drain does not check it
    chunk = frames.encode_chunk(0, list(range(1, 65)), k, k)
    geo = wire.PageGeometry.of_pages(k)

    async def push(rid: str, heed_notice: bool):
        async with grpc.aio.insecure_channel(d_addr) as ch:
            call = frames.push_call(ch)()
            refused = frames.watch_refusal(call)
            await call.write(wire.header(rid, geo, 0, 64))
            if heed_notice:  # a megaserve sender: the notice comes before any status
                await asyncio.wait_for(refused.wait(), 30)
            else:  # a sender that writes on regardless (another peer)
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await frames.write_ahead(call, iter([chunk] * 20))  # as prefill's writer
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call
            return ei.value.code(), reason_of(ei.value), refused.is_set()

    async def main():
        got = [await push(f"gone-{i}", heed_notice=i == 0) for i in range(30)]
        return collections.Counter(got)

    want = (grpc.StatusCode.NOT_FOUND, Reason.RESERVATION_NOT_FOUND, True)
    assert asyncio.run(main()) == {want: 30}


def test_a_push_the_decode_worker_fails_reports_internal_and_frees_its_reservation(
    stack, monkeypatch
):
    """A fault of the decode worker's own during a push (its staging raises here: a bug, a
    pool write that fails), the sender writing on: INTERNAL with KV_HANDOFF_FAILED, naming
    the fault, reaches the sender every time (not grpcio's INTERNAL from Core, without a
    reason), and the reservation is freed at once. The fault is injected: nothing a sender
    does can cause it."""
    dec, _, d_addr, _, _ = stack

    def broken(self, *args):
        raise RuntimeError("staging broke")

    monkeypatch.setattr(KVTransferServicer, "_stage", broken)
    geo = wire.PageGeometry.of_pool(dec.pool)
    k = np.zeros((geo.num_layers, 13, geo.page_size, geo.kv_heads, geo.head_dim), np.float32)
    chunk = frames.encode_chunk(0, list(range(13)), k, k)
    prompt = [i % 90 for i in range(200)]  # 13 pages

    async def push(rid: str):
        dec.reserve(rid, prompt, lease_s=60)
        async with grpc.aio.insecure_channel(d_addr) as ch:
            call = frames.push_call(ch)()
            await call.write(wire.header(rid, geo, 0, 13))
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await frames.write_ahead(call, iter([chunk] * 20))
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call
        freed = dec.reservation(rid) is None
        return ei.value.code(), reason_of(ei.value), "staging broke" in ei.value.details(), freed

    async def main():
        return collections.Counter([await push(f"broken-{i}") for i in range(10)])

    want = (grpc.StatusCode.INTERNAL, Reason.KV_HANDOFF_FAILED, True, True)
    assert asyncio.run(main()) == {want: 10}
    wait_idle(dec)
    dec.alloc.check_invariants()
    assert dec.alloc.all_free_or_cached()


def test_a_refusal_at_the_header_drops_the_prompt_before_its_compute(stack):
    """The decode worker refuses the push at its header (no reservation): the prefill worker
    answers its NOT_FOUND at once and drops the prompt, while the engine's chunks are held
    (before the change it waited for the whole prompt's compute)."""
    _, pre, d_addr, p_addr, _ = stack
    gate, step = threading.Event(), pre._step
    pre._step = lambda: (gate.wait(60), step())  # the engine thread waits before each chunk
    prompt = [i % 90 for i in range(200)]
    req = prefill_pb2.PrefillRequest(
        request_id="refused-early", prompt_token_ids=prompt, decode_address=d_addr, page_size=16
    )

    async def main():
        async with grpc.aio.insecure_channel(p_addr) as ch:
            return await prefill_pb2_grpc.PrefillStub(ch).Prefill(req, timeout=30)

    calls = pre.batched_calls
    try:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            asyncio.run(main())
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND, ei.value.details()
        assert error_metadata(ei.value)["decode_reason"] == Reason.RESERVATION_NOT_FOUND
    finally:
        pre._step = step
        gate.set()
    deadline = time.monotonic() + 30
    while pre._active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not pre._active and pre.batched_calls <= calls + 1  # at most the held chunk ran
