"""KV pages pushed over the gRPC transport into a decode worker's reservation."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest

from kernels.kv_cache import KVPool
from megaserve.kv.pages import pages_for_tokens
from megaserve.kv.wire import extract_pages, push_messages, trailer
from megaserve.offline import OfflineGenerator
from megaserve.rpc import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from megaserve.runner.batch import TokenBatch
from megaserve.runner.buckets import StepConfig
from megaserve.runner.xla import XlaRunner
from megaserve.sampling_params import SamplingArrays
from tests.test_decode_server import _assert_pool_clean, _req, expire_lease, worker  # noqa: F401


def _prefill_elsewhere(model, prompt, page_size=16):
    """A stand-in prefill worker: its own pool; returns (first token, K, V of all pages)."""
    cfg = model.cfg
    n = pages_for_tokens(len(prompt), page_size)
    pool = KVPool.create(cfg.num_layers, n + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
    r = XlaRunner(model.family, cfg, model.params, pool, StepConfig(max_pages_per_seq=n))
    pages = list(range(1, n + 1))
    nxt, _ = r.prefill(
        TokenBatch.from_padded(
            np.array([prompt], np.int32),
            np.arange(len(prompt))[None].astype(np.int32),
            np.array([pages], np.int32),
        ),
        SamplingArrays.greedy(1),
    )
    k, v = extract_pages(pool, pages)
    return int(nxt[0]), k, v


async def _reserve_push_generate(addr, rid, prompt, first, k, v, n_new, mutate=None):
    async with grpc.aio.insecure_channel(addr) as ch:
        dec = decode_pb2_grpc.DecodeStub(ch)
        res = await dec.Reserve(decode_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt))
        c = res.cached_pages
        msgs = list(push_messages(rid, first, c, k[:, c:], v[:, c:], max_chunk_bytes=4096))
        if mutate:
            msgs = mutate(msgs)
        # Explicit writes, as the prefill worker sends: a receiver that refuses mid-stream
        # then reports its own status (a request iterator can end with a generic INTERNAL).
        call = kv_transfer_pb2_grpc.KVTransferStub(ch).Push()
        try:
            for msg in msgs:
                await call.write(msg)
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the status comes from awaiting the call
        push = await call
        toks = [t async for r in dec.Generate(_req(rid, prompt, n_new)) for t in r.token_ids]
        return res, push, toks


def test_imported_kv_decodes_like_local_prefill(worker, tiny_model):  # noqa: F811
    engine, addr = worker
    solo = OfflineGenerator(tiny_model, max_context=128)
    rng = np.random.default_rng(11)
    base = rng.integers(0, tiny_model.cfg.vocab_size, 40).tolist()
    # Second prompt shares the first two full pages: only the rest may travel.
    for i, prompt in enumerate([base, base[:32] + rng.integers(0, 90, 20).tolist()]):
        first, k, v = _prefill_elsewhere(tiny_model, prompt)
        res, push, toks = asyncio.run(
            _reserve_push_generate(addr, f"imp{i}", prompt, first, k, v, 12)
        )
        assert toks == solo.generate(prompt, 12, ignore_eos=True).token_ids
        per_page = 2 * k[:, 0].nbytes
        assert res.cached_pages == (0 if i == 0 else 2)
        assert push.bytes == (res.total_pages - res.cached_pages) * per_page
    _assert_pool_clean(engine)


def _corrupt(msgs):
    c = msgs[2].chunk
    c.data = bytes([c.data[0] ^ 1]) + c.data[1:]
    return msgs


def _reshape(msgs):
    msgs[1].chunk.shape[4] = 99
    return msgs


def _retype(msgs):
    msgs[0].header.dtype = "bfloat16"
    return msgs


@pytest.mark.parametrize(
    "mutate,code,match",
    [
        (_corrupt, grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch"),
        (_reshape, grpc.StatusCode.INVALID_ARGUMENT, "shape"),
        (_retype, grpc.StatusCode.INVALID_ARGUMENT, "dtype='bfloat16'"),
        (lambda m: m[:-2] + m[-1:], grpc.StatusCode.DATA_LOSS, "cells missing"),
        (lambda m: m[:-1], grpc.StatusCode.DATA_LOSS, "no trailer"),
        (lambda m: m[:-1] + [m[1], m[-1]], grpc.StatusCode.INVALID_ARGUMENT, "duplicate chunk"),
        (lambda m: m[:-1] + [trailer(-1)], grpc.StatusCode.INVALID_ARGUMENT, "first_token=-1"),
        (lambda m: m[:-1] + [trailer(1 << 30)], grpc.StatusCode.INVALID_ARGUMENT, "outside [0,"),
    ],
    ids=["checksum", "shape", "dtype", "truncated", "no-trailer", "duplicate", "token", "token2"],
)
def test_bad_transfers_are_refused_and_free_pages(worker, tiny_model, mutate, code, match):  # noqa: F811
    engine, addr = worker
    prompt = list(range(3, 40))
    first, k, v = _prefill_elsewhere(tiny_model, prompt)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        asyncio.run(
            _reserve_push_generate(addr, f"bad-{match[:5]}", prompt, first, k, v, 3, mutate)
        )
    assert ei.value.code() == code and match in ei.value.details(), ei.value.details()
    assert not engine.reservations
    _assert_pool_clean(engine)


def test_push_to_unknown_reservation_is_not_found(worker, tiny_model):  # noqa: F811
    _, addr = worker
    first, k, v = _prefill_elsewhere(tiny_model, [1, 2, 3])

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            await kv_transfer_pb2_grpc.KVTransferStub(ch).Push(
                iter(list(push_messages("ghost", first, 0, k, v)))
            )

    with pytest.raises(grpc.aio.AioRpcError) as ei:
        asyncio.run(main())
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND and "ghost" in ei.value.details()


def test_push_after_lease_expired_is_not_found(worker, tiny_model):  # noqa: F811
    engine, addr = worker
    prompt = [4, 5, 6, 7]
    first, k, v = _prefill_elsewhere(tiny_model, prompt)

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            await decode_pb2_grpc.DecodeStub(ch).Reserve(
                decode_pb2.ReserveRequest(
                    request_id="late", prompt_token_ids=prompt, lease_ms=600_000
                )
            )
            expire_lease(engine, "late")  # the lease runs out before the KV arrives
            end = time.monotonic() + 60
            while "late" in engine.reservations:  # the engine's next iteration drops it
                assert time.monotonic() < end, "the expired reservation was not dropped"
                await asyncio.sleep(0.01)
            await kv_transfer_pb2_grpc.KVTransferStub(ch).Push(
                iter(list(push_messages("late", first, 0, k, v)))
            )

    with pytest.raises(grpc.aio.AioRpcError) as ei:
        asyncio.run(main())
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND and "expired" in ei.value.details()
    _assert_pool_clean(engine)


_SENDER = """
import sys, time, grpc, numpy as np
from megaserve.rpc import kv_transfer_pb2_grpc
from megaserve.kv.wire import push_messages
addr, n_layers, n_pages, ps, h, d = sys.argv[1], *map(int, sys.argv[2:7])
k = np.ones((n_layers, n_pages, ps, h, d), np.float32)
msgs = list(push_messages("killme", 3, 0, k, k, max_chunk_bytes=4096))
def slow():
    for m in msgs[:-2]:
        yield m
    print("SENT", flush=True)
    time.sleep(60)
with grpc.insecure_channel(addr) as ch:
    kv_transfer_pb2_grpc.KVTransferStub(ch).Push(slow())
"""


def test_sender_killed_mid_transfer_frees_reservation(worker, tiny_model):  # noqa: F811
    import subprocess
    import sys

    from tests.conftest import REPO

    engine, addr = worker
    prompt = list(range(1, 40))
    expired = engine.expired_reservations

    async def reserve():
        async with grpc.aio.insecure_channel(addr) as ch:
            return await decode_pb2_grpc.DecodeStub(ch).Reserve(
                decode_pb2.ReserveRequest(
                    request_id="killme", prompt_token_ids=prompt, lease_ms=3_600_000
                )
            )

    res = asyncio.run(reserve())
    cfg = tiny_model.cfg
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _SENDER,
            addr,
            str(cfg.num_layers),
            str(res.total_pages),
            "16",
            str(cfg.num_kv_heads),
            str(cfg.head_dim),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout.readline().strip() == "SENT"
    proc.kill()
    proc.wait()
    end = time.monotonic() + 300  # generous, and still far inside the hour's lease
    while engine.reservations:
        assert time.monotonic() < end, "the broken transfer did not free its reservation"
        time.sleep(0.05)
    assert engine.expired_reservations == expired  # freed by the broken stream, not the lease
    _assert_pool_clean(engine)


def test_a_second_push_at_once_is_refused_and_the_first_commits(worker, tiny_model):  # noqa: F811
    """Two pushes into one reservation at the same time: the second is refused (the
    reservation stays the first's), the first commits and decodes."""
    engine, addr = worker
    prompt = list(range(5, 45))
    first, k, v = _prefill_elsewhere(tiny_model, prompt)

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            dec = decode_pb2_grpc.DecodeStub(ch)
            await dec.Reserve(
                decode_pb2.ReserveRequest(request_id="twice", prompt_token_ids=prompt)
            )
            msgs = list(push_messages("twice", first, 0, k, v, max_chunk_bytes=4096))
            one = kv_transfer_pb2_grpc.KVTransferStub(ch).Push()
            await one.write(msgs[0])  # the first push has begun
            await one.write(msgs[1])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await kv_transfer_pb2_grpc.KVTransferStub(ch).Push(iter(msgs))
            for m in msgs[2:]:
                await one.write(m)
            await one.done_writing()
            await one
            toks = [t async for r in dec.Generate(_req("twice", prompt, 6)) for t in r.token_ids]
            return e.value, toks

    err, toks = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reservation 'twice' has a push in progress" in err.details()
    assert (
        toks
        == OfflineGenerator(tiny_model, max_context=128)
        .generate(prompt, 6, ignore_eos=True)
        .token_ids
    )
    _assert_pool_clean(engine)


def test_corrupt_bytes_are_the_senders_fault(worker):  # noqa: F811
    """A push message that does not parse: INVALID_ARGUMENT (the sender's bytes), not the
    decode worker's INTERNAL."""
    _, addr = worker
    service = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
    with grpc.insecure_channel(addr) as ch:
        raw = ch.stream_unary(f"/{service}/Push", request_serializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            raw(iter([b"\x12\x05\x08\x01"]), timeout=30)  # a chunk of 5 bytes, 2 there
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


def test_pulls_that_never_answer_are_refused_and_starve_nothing(worker, tiny_model, monkeypatch):  # noqa: F811
    """Pull chunks whose transfer server never answers (a blocked stage stands in for the
    pull: a peer that hangs cannot be made to here): each push is refused with the address
    named once its pull has waited PULL_TIMEOUT_S, more pushes than pull threads included,
    its reservation freed; Reserve and Release answer meanwhile."""
    from decode_service import kv_service
    from megaserve.kv.wire import PageGeometry, TransferError, header

    engine, addr = worker
    hang = threading.Event()
    stage = kv_service.KVTransferServicer._stage

    def stuck(self, imp, res, chunk, data, writes):
        if chunk.HasField("pull"):  # as a pull from a server that never answers; released at
            hang.wait()  # the end, it must not pull for real (a thread stuck in the jax
            raise TransferError("released")  # runtime aborts this process's exit)
        return stage(self, imp, res, chunk, data, writes)

    monkeypatch.setattr(kv_service.KVTransferServicer, "_stage", stuck)
    monkeypatch.setattr(kv_service, "PULL_TIMEOUT_S", 1.0)
    geo = PageGeometry.of_pool(engine.pool)
    n = kv_service.PULL_THREADS + 2

    async def push(ch, rid):
        dec = decode_pb2_grpc.DecodeStub(ch)
        r = await dec.Reserve(decode_pb2.ReserveRequest(request_id=rid, prompt_token_ids=[9] * 20))
        pages = list(range(r.cached_pages, r.total_pages))
        chunk = kv_transfer_pb2.KVChunk(
            layer_end=geo.num_layers,
            page_index=pages,
            shape=[2, geo.num_layers, len(pages), geo.page_size, geo.kv_heads, geo.head_dim],
            pull=kv_transfer_pb2.PullRef(address="127.0.0.1:1", uuid=1),
        )
        msgs = [header(rid, geo, r.cached_pages, len(pages)), kv_transfer_pb2.KVPush(chunk=chunk)]
        try:
            await kv_transfer_pb2_grpc.KVTransferStub(ch).Push(iter([*msgs, trailer(1)]))
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            pushes = [asyncio.ensure_future(push(ch, f"pull-{i}")) for i in range(n)]
            await asyncio.sleep(0.3)
            dec = decode_pb2_grpc.DecodeStub(ch)  # answers while every pull thread is stuck
            await dec.Reserve(decode_pb2.ReserveRequest(request_id="ok", prompt_token_ids=[1]))
            await dec.Release(decode_pb2.ReleaseRequest(request_id="ok"), timeout=5)
            return await asyncio.gather(*pushes)

    try:
        out = asyncio.run(main())
    finally:
        hang.set()  # the stuck threads end (their reservations are gone: nothing written)
    for code, details in out:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "from '127.0.0.1:1' did not finish in 1 s; reservation freed" in details
    end = time.monotonic() + 30
    while engine.reservations:
        assert time.monotonic() < end, "reservations left behind"
        time.sleep(0.02)
    _assert_pool_clean(engine)
