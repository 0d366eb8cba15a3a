"""KV the decode worker refuses as invalid is a fault between the two workers, not the
request's: the router's dispatcher blames the prefill worker (never the decode worker, which
stays usable), does not send that request's retry back to it, and the client gets the tokens
one worker gives. Real workers and the real dispatcher; the fault (the sender's bytes changed
on the way, so the decode worker's checksum fails) is injected into the prefill worker's chunk
encoder: nothing a client sends can cause it."""

from __future__ import annotations

import asyncio

from decode_service.engine import DecodeEngine, EngineConfig, wait_idle
from decode_service.scheduler import SchedulerConfig
from decode_service.server import create_server as create_decode
from megaserve.kv import frames, wire
from megaserve.offline import OfflineGenerator
from megaserve.sampling_params import SamplingParams
from megaserve.server_thread import ServerThread
from prefill_service.engine import PrefillConfig, PrefillEngine
from prefill_service.server import create_server as create_prefill
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.state import ClusterState
from tests.dispatch_helpers import job, worker_view

PROMPT = [(i * 7) % 90 + 3 for i in range(80)]  # over disagg_min_uncached_tokens below
N = 10


def _corrupted(encode):
    def encode_chunk(*args, **kwargs) -> bytes:
        b = bytearray(encode(*args, **kwargs))
        b[-1] ^= 0xFF  # the last payload byte: the chunk's checksum no longer matches
        return bytes(b)

    return encode_chunk


async def _route(d_addr: str, p_addr: str, page_size: int) -> tuple[list[int], Dispatcher]:
    state = ClusterState(None)
    state.workers = {
        "d": worker_view("d", "decode", d_addr, page_size, 256),
        "p": worker_view("p", "prefill", p_addr, page_size, 256),
    }
    cfg = RouterConfig(
        disagg_min_uncached_tokens=16, retry_base_delay_ms=1.0, circuit_breaker_failures=1
    )
    disp = Dispatcher(state, cfg)
    try:
        tokens = [t async for c in disp.run(job("bad-kv", PROMPT, N), deadline=None)
                  for t in c.token_ids]  # fmt: skip
        await disp.drain()  # the failed try's background Release
        return tokens, disp
    finally:
        await disp.close()


def test_kv_the_decode_worker_refuses_is_retried_without_the_prefill_worker(
    tiny_model, monkeypatch
):
    monkeypatch.setattr(frames, "encode_chunk", _corrupted(frames.encode_chunk))
    sched = SchedulerConfig(prefill_chunk=32)
    dec = DecodeEngine(tiny_model, EngineConfig(max_context=256, scheduler=sched))
    dec.start()
    pre = PrefillEngine(tiny_model, PrefillConfig(chunk=32, max_context=256))
    servers = ServerThread(lambda: create_decode(dec), lambda: create_prefill(pre))
    d_addr, p_addr = servers.addresses
    try:
        page_size = wire.PageGeometry.of_pool(dec.pool).page_size
        tokens, disp = asyncio.run(_route(d_addr, p_addr, page_size))
        solo = OfflineGenerator(tiny_model, max_context=256)
        want = solo.generate(PROMPT, N, SamplingParams(), ignore_eos=True).token_ids
        assert tokens == want
        # One failed try (a retry, or a migration if the first token came ahead of the KV),
        # charged to the prefill worker; the next try prefilled on the decode worker.
        assert disp.stats["retries"] + disp.stats["migrations"] == 1, disp.stats
        assert disp.breakers.is_open("p") and not disp.breakers.is_open("d")
        wait_idle(dec)
        dec.alloc.check_invariants()
        assert dec.alloc.all_free_or_cached()  # the refused push's reservation was freed
    finally:
        servers.stop()
        dec.stop()
