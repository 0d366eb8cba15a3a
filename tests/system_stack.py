"""The system tests' stack (two decode, two prefill workers, a router, a real Redis) and the
helpers both system test modules use: one Generate call, and waiting for idle pools."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from megaserve.rpc import decode_pb2
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from megaserve_app.launch import worker_stats
from tests.redis_server import RedisServer
from tests.stack import Stack, make_chat_checkpoint

MODEL = "tiny-chat"
DECODE, PREFILL = ("d1", "d2"), ("p1", "p2")
DISAGG_MIN = 40  # the router's disagg_min_uncached_tokens (lb.yaml below)
IDS = [5, 6, 7, 8]


@contextlib.contextmanager
def system_stack(tmp: Path) -> Iterator[tuple[Stack, str, RedisServer]]:
    """(stack, router address, redis) up for the block's duration, torn down after it."""
    ck = make_chat_checkpoint(tmp / "ck")
    rs = RedisServer(tmp).start()
    # Patient retries: while a killed worker restarts, requests wait for the other one. The
    # chaos kills a worker every few seconds, far above any real failure rate, so one long
    # request can lose several decode workers: a migration budget to match.
    (tmp / "lb.yaml").write_text(
        f"disagg_min_uncached_tokens: {DISAGG_MIN}\ncircuit_breaker_reset_s: 2.0\n"
        "retry_max_attempts: 10\nretry_max_delay_ms: 2000\nmax_migrations: 16\n"
    )
    (tmp / "logs").mkdir()
    st = Stack(rs.url, ck, log_dir=tmp / "logs")
    st.lb = str(tmp / "lb.yaml")
    try:
        router = st.up(DECODE, PREFILL, st.lb)
        yield st, router.address, rs
    finally:
        st.stop()
        rs.kill()


def wait_pools_idle(st, timeout=120.0) -> list[decode_pb2.StatsResponse]:
    """Every decode worker's pool fully free or cached, no request or reservation left."""
    end = time.monotonic() + timeout
    while True:
        stats = [worker_stats(st.procs[w].address) for w in DECODE]
        ok = all(
            s.running == 0
            and s.waiting == 0
            and s.reserved == 0
            and s.free_pages + s.cached_pages == s.total_pages
            for s in stats
        )
        if ok or time.monotonic() > end:
            assert ok, stats
            return stats
        time.sleep(0.2)


def generate(addr, prompt, max_tokens, seed=None, rid="", timeout=120):
    sampling = pb.SamplingParams(temperature=0.8, top_k=40, seed=seed) if seed is not None else None
    req = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=pb.TokenIds(ids=prompt),
        sampling=sampling,
        stopping=pb.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    with grpc.insecure_channel(addr) as ch:
        return [
            t for r in pbg.GenerationStub(ch).Generate(req, timeout=timeout) for t in r.token_ids
        ]
