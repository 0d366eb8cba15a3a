"""Bounded admission at every tier: a full router, decode queue or prefill queue refuses at
once with RESOURCE_EXHAUSTED and a `retry-after-ms` trailing metadata entry; queued requests
whose deadline passes are dropped (DEADLINE_EXCEEDED); a burst far over the limits against a
real stack either completes exactly or is refused within seconds, and leaves every pool clean.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import redis

from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.scheduler import SchedulerConfig
from decode_service.sequence import Sequence
from decode_service.server import create_server as create_decode
from megaserve.errors import NoCapacity
from megaserve.finish import FinishReason
from megaserve.model import LoadedModel
from megaserve.offline import OfflineGenerator
from megaserve.rpc import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from megaserve.sampling_params import SamplingParams
from megaserve.server_thread import ServerThread
from megaserve.state_keys import WorkerInfo, worker_key
from megaserve.status import RETRY_AFTER_KEY, Reason, reason_of, retry_after_ms_of
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from megaserve_app.launch import worker_stats
from prefill_service.engine import DeadlineExpired, PrefillConfig, PrefillEngine, PrefillResult
from prefill_service.server import create_server as create_prefill
from tests.conftest import FakeClock
from tests.polling import until
from tests.redis_server import RedisServer
from tests.stack import Stack, make_chat_checkpoint, tokens_equal_report, wait_router_view

SP = SamplingParams()


def _noop(*_):
    pass


# --- the prefill queue ------------------------------------------------------------------


def _held_prefill(tiny_model, max_queued: int):
    """A prefill engine (one batch row) whose first prompt holds the engine thread after its
    first chunk until `gate` is set: what is submitted meanwhile stays queued."""
    pre = PrefillEngine(
        tiny_model, PrefillConfig(max_context=128, chunk=32, max_batch=1, max_queued=max_queued)
    )
    gate, inside = threading.Event(), threading.Event()

    def hold(first, k, v):  # the engine thread
        inside.set()
        assert gate.wait(120)

    held = pre.submit(list(range(1, 40)), SP, 0, hold)  # 39 tokens: two chunks
    assert inside.wait(120), "the first prompt never reached its first chunk"
    return pre, gate, held


def test_prefill_queue_bound_cancel_and_deadline(tiny_model):
    pre, gate, held = _held_prefill(tiny_model, max_queued=3)
    clock = pre.clock = FakeClock()
    try:
        expiring = pre.submit([1, 2, 3], SP, 0, _noop, deadline=clock() + 1.0)
        cancelled = pre.submit([4, 5, 6], SP, 0, _noop)
        kept = pre.submit([7, 8, 9], SP, 0, _noop)
        with pytest.raises(NoCapacity, match="prefill queue full"):
            pre.submit([10, 11, 12], SP, 0, _noop)  # 3 queued: refused at once, not queued
        assert pre.stats()["queued"] == 3
        assert cancelled.cancel()  # its caller left: never computed
        assert pre.stats()["queued"] == 2  # its place is free at once
        clock.advance(2.0)  # the deadline passes while the prompt is queued
    finally:
        gate.set()
    assert isinstance(held.result(120), PrefillResult)
    with pytest.raises(DeadlineExpired):
        expiring.result(120)
    assert kept.result(120).prefix_hit_pages == 0
    assert pre.expired == 1
    assert pre.rows_computed == 3  # the held prompt's two chunks and `kept`; nothing else
    until(lambda: pre.stats()["active"] == 0 and pre.stats()["queued"] == 0, "engine idle")
    pre.alloc.check_invariants()
    assert pre.alloc.all_free_or_cached()


def test_cancelled_prompts_free_their_queue_places_at_once(tiny_model):
    """Callers that left free their places in the bound while the engine is still inside a
    call (they counted until the engine thread reached them); the queue itself stays bounded
    when callers keep submitting and leaving."""
    pre, gate, held = _held_prefill(tiny_model, max_queued=2)
    try:
        left = [pre.submit([1, 2, 3], SP, 0, _noop) for _ in range(2)]
        with pytest.raises(NoCapacity, match="prefill queue full"):
            pre.submit([4, 5, 6], SP, 0, _noop)
        for f in left:
            assert f.cancel()
        assert pre.stats()["queued"] == 0
        for _ in range(50):  # submit and leave, again and again, the engine still held
            assert pre.submit([7, 8, 9], SP, 0, _noop).cancel()
        assert pre._queue.qsize() <= 2 * 2 + 1
        kept = [pre.submit([10 + i, 11, 12], SP, 0, _noop) for i in range(2)]
        with pytest.raises(NoCapacity, match="prefill queue full"):
            pre.submit([4, 5, 6], SP, 0, _noop)
    finally:
        gate.set()
    held.result(120)
    assert all(isinstance(f.result(120), PrefillResult) for f in kept)
    assert pre.rows_computed == 4  # the held prompt's two chunks and the two kept
    until(lambda: pre.stats()["queued"] == 0 and pre._queue.qsize() == 0, "queue drained")
    pre.alloc.check_invariants()
    assert pre.alloc.all_free_or_cached()


def test_full_prefill_queue_is_resource_exhausted_with_retry_after(tiny_model):
    pre, gate, held = _held_prefill(tiny_model, max_queued=1)
    servers = ServerThread(lambda: create_prefill(pre))
    try:
        queued = pre.submit([1, 2, 3], SP, 0, _noop)
        req = prefill_pb2.PrefillRequest(
            request_id="over", prompt_token_ids=[5, 6, 7], decode_address="127.0.0.1:9",
            page_size=16,
        )  # fmt: skip
        with grpc.insecure_channel(servers.addresses[0]) as ch:
            with pytest.raises(grpc.RpcError) as ei:
                prefill_pb2_grpc.PrefillStub(ch).Prefill(req, timeout=30)
        e = ei.value
        assert (e.code(), reason_of(e)) == (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.NO_CAPACITY)
        assert retry_after_ms_of(e) > 0, e.trailing_metadata()
    finally:
        gate.set()
        servers.stop()
    held.result(120)
    queued.result(120)


# --- the decode queue -------------------------------------------------------------------


def _small_decode(tiny_model, max_waiting: int) -> DecodeEngine:
    """One running slot; not started: the test is the engine thread (run_once)."""
    sched = SchedulerConfig(max_running=1, max_waiting=max_waiting, prefill_chunk=32)
    eng = DecodeEngine(tiny_model, EngineConfig(max_context=128, scheduler=sched))
    eng.clock = FakeClock()
    return eng


def _run_until_idle(eng: DecodeEngine) -> None:
    end = time.monotonic() + 120
    while eng.live_count:
        eng.run_once()
        assert time.monotonic() < end, "engine did not finish"
    eng.alloc.check_invariants()
    assert eng.alloc.all_free_or_cached()


def test_decode_queue_deadline_drops_the_request(tiny_model):
    eng = _small_decode(tiny_model, max_waiting=4)
    got: dict[str, list] = {"a": [], "b": []}
    eng.submit(Sequence("a", [1, 2, 3], SP, 8, frozenset()), got["a"].append)
    eng.submit(Sequence("b", [4, 5, 6], SP, 8, frozenset()), got["b"].append, eng.clock() + 1)
    eng.run_once()  # a takes the one slot; b waits
    assert eng.stats()["waiting"] == 1 and not got["b"]
    eng.clock.advance(2.0)
    eng.run_once()
    assert [e.finish_reason for e in got["b"]] == [FinishReason.ABORT]
    assert eng.expired_in_queue == 1 and eng.stats()["waiting"] == 0
    _run_until_idle(eng)
    assert sum(len(e.token_ids) for e in got["a"]) == 8
    assert got["a"][-1].finish_reason is FinishReason.LENGTH


def _gen(rid: str, prompt: list[int], n: int = 8) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        stopping=decode_pb2.StoppingParams(max_tokens=n, ignore_eos=True),
    )


def test_decode_worker_full_queue_retry_after_and_queued_deadline(tiny_model):
    eng = _small_decode(tiny_model, max_waiting=1)
    servers = ServerThread(lambda: create_decode(eng))
    addr = servers.addresses[0]
    eng.submit(Sequence("a", [1, 2, 3], SP, 8, frozenset()), _noop)
    eng.run_once()  # a runs: the next one waits in the queue

    def call(rid):
        with grpc.insecure_channel(addr) as ch:
            try:
                return list(decode_pb2_grpc.DecodeStub(ch).Generate(_gen(rid, [4, 5]), timeout=60))
            except grpc.RpcError as e:
                return e

    try:
        with ThreadPoolExecutor(1) as ex:
            queued = ex.submit(call, "b")
            until(lambda: eng.stats()["waiting"] == 1, "b queued")
            full = call("c")  # the queue holds one: refused at once
            assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, full
            assert reason_of(full) == Reason.NO_CAPACITY
            assert retry_after_ms_of(full) > 0, full.trailing_metadata()
            eng.clock.advance(3600.0)  # b's deadline (60 s from its arrival) passes in the queue
            eng.run_once()
            late = queued.result(60)
        assert isinstance(late, grpc.RpcError), late
        assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "while queued" in late.details()  # the worker's answer, not the client's timer
        assert eng.expired_in_queue == 1
        _run_until_idle(eng)
    finally:
        servers.stop()


# --- a burst against a real stack --------------------------------------------------------

LIMITS = {"router": 12, "decode_running": 3, "decode_waiting": 3, "prefill_queued": 1}
STREAMS, MAX_TOKENS = 60, 24
MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    ck = make_chat_checkpoint(tmp / "ck")
    rs = RedisServer(tmp).start()
    (tmp / "lb.yaml").write_text(
        f"max_inflight_requests: {LIMITS['router']}\nretry_after_ms: 700\n"
        "disagg_min_uncached_tokens: 32\nprefill_busy_threshold_running: 1000\n"
        "no_worker_wait_s: 5\n"
    )
    st = Stack(rs.url, ck)
    try:
        d = st.worker(
            "decode", "d1", "--max-running", str(LIMITS["decode_running"]),
            "--max-waiting", str(LIMITS["decode_waiting"]),
        )  # fmt: skip
        p = st.worker("prefill", "p1", "--max-queued", str(LIMITS["prefill_queued"]))
        router = st.router("r1", "--config", str(tmp / "lb.yaml"))
        for proc in (d, p, router):
            proc.wait_ready()
        st.wait_registered(["d1", "p1"])
        wait_router_view(router.address, 1, 1)
        yield st, router.address, ck, rs
    finally:
        st.stop()
        rs.kill()


def _prompts(n: int, vocab: int) -> list[list[int]]:
    """Distinct prompts: short ones prefill on the decode worker, long ones (>= 32 uncached
    tokens) take the prefill tier."""
    rng = np.random.default_rng(7)
    return [rng.integers(3, vocab, 12 if i % 2 else 70).tolist() for i in range(n)]


async def _one(stub, prompt: list[int]) -> dict:
    t0 = time.monotonic()
    req = pb.GenerateRequest(
        model=MODEL,
        prompt_token_ids=pb.TokenIds(ids=prompt),
        stopping=pb.StoppingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    call = stub.Generate(req, timeout=120)
    try:
        ids = [t async for r in call for t in r.token_ids]
        return {"code": grpc.StatusCode.OK, "ids": ids, "s": time.monotonic() - t0}
    except grpc.aio.AioRpcError as e:
        hint = dict(e.trailing_metadata() or ()).get(RETRY_AFTER_KEY)
        return {"code": e.code(), "hint": hint, "msg": e.details(), "s": time.monotonic() - t0}


async def _burst(addr: str, prompts: list[list[int]]) -> list[dict]:
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pbg.GenerationStub(ch)
        return await asyncio.gather(*(_one(stub, p) for p in prompts))


def _pools_clean(st) -> bool:
    s = worker_stats(st.procs["d1"].address)
    decode_ok = (s.running, s.waiting, s.reserved) == (0, 0, 0)
    decode_ok = decode_ok and s.free_pages + s.cached_pages == s.total_pages
    h = redis.Redis.from_url(st.redis_url).hgetall(worker_key("p1"))
    p = WorkerInfo.from_hash(h)  # the prefill worker's heartbeat: free = free or cached
    prefill_ok = (p.running, p.waiting, p.free_pages) == (0, 0, p.total_pages)
    return decode_ok and prefill_ok


def test_burst_over_every_limit_completes_exactly_or_is_refused_fast(small_stack):
    st, addr, ck, _ = small_stack
    model = LoadedModel.load(str(ck), progress=False)
    gen = OfflineGenerator(model, page_size=16, max_context=512)
    prompts = _prompts(STREAMS, model.cfg.vocab_size)
    want = [gen.generate(p, MAX_TOKENS, SP, ignore_eos=True).token_ids for p in prompts]
    warm = asyncio.run(_burst(addr, _prompts(2, model.cfg.vocab_size)[::-1]))  # one of each kind
    assert [r["code"] for r in warm] == [grpc.StatusCode.OK] * 2, warm
    results = asyncio.run(_burst(addr, prompts))
    codes = [r["code"] for r in results]
    allowed = {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
    assert set(codes) <= allowed, [(r["code"], r.get("msg")) for r in results]
    for r, w in zip(results, want):
        if r["code"] == grpc.StatusCode.OK:
            assert r["ids"] == w, tokens_equal_report(r["ids"], w)
        else:
            assert r["s"] <= 5.0, r  # refused within 5 s of arrival, never held
        if r["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert r["hint"] is not None and int(r["hint"]) > 0, r
    refused = sorted(r["s"] for r in results if r["code"] != grpc.StatusCode.OK)
    assert codes.count(grpc.StatusCode.OK) >= 1 and refused, codes
    slowest = max((r for r in results if r["code"] != grpc.StatusCode.OK), key=lambda r: r["s"])
    at_router = sum("router at its limit" in (r.get("msg") or "") for r in results)
    print(
        f"\nburst of {STREAMS}: {codes.count(grpc.StatusCode.OK)} completed, "
        f"{codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)} RESOURCE_EXHAUSTED "
        f"({at_router} at the router cap), {codes.count(grpc.StatusCode.UNAVAILABLE)} "
        f"UNAVAILABLE; refusal latency p50 {1000 * statistics.median(refused):.1f} ms, "
        f"max {1000 * refused[-1]:.1f} ms ({slowest['msg'][-60:]})"
    )
    # Afterwards: every pool free or cached, and the stack answers exactly.
    until(lambda: _pools_clean(st), "decode and prefill pools free or cached")
    again = asyncio.run(_burst(addr, prompts[:2]))
    assert [r["code"] for r in again] == [grpc.StatusCode.OK] * 2, again
    assert [r["ids"] for r in again] == want[:2]
