"""A worker whose engine is stuck while its process, gRPC server and heartbeat thread run on
(here: its --cpu-turns lock held by another process, as a frozen turn partner would hold it):
past --stall-s its record leaves Redis and its health says NOT_SERVING, the router moves its
requests (tokens equal to an uninterrupted run), and it serves again once the engine moves;
past --stall-exit-s the process ends. Real workers, router and Redis."""

from __future__ import annotations

import contextlib
import fcntl
import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from megaserve.sampling_params import SamplingParams
from megaserve_app.launch import worker_stats
from tests.polling import until
from tests.redis_server import RedisServer
from tests.router_stack import offline_reference
from tests.stack import Stack, make_chat_checkpoint, tokens_equal_report, wait_router_view
from tests.test_router_migration import N_TOKENS, Stream, _events

STALLED = "stalled; not serving"
SERVING, NOT_SERVING = (
    health_pb2.HealthCheckResponse.SERVING,
    health_pb2.HealthCheckResponse.NOT_SERVING,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stall")
    ck = make_chat_checkpoint(tmp / "ck")
    rs = RedisServer(tmp).start()
    (tmp / "lb.yaml").write_text("decode_policy: least_loaded\ndisagg_min_uncached_tokens: 32\n")
    st = Stack(rs.url, ck)
    turns = {w: str(tmp / f"turns-{w}") for w in ("d1", "p1")}  # each its own: uncontended
    try:
        procs = [
            st.worker("decode", "d1", "--cpu-turns", turns["d1"], "--stall-s", "1",
                      "--stall-exit-s", "0"),
            st.worker("decode", "d2"),
            st.worker("prefill", "p1", "--cpu-turns", turns["p1"], "--stall-s", "1",
                      "--stall-exit-s", "8"),
            st.router("r1", "--config", str(tmp / "lb.yaml")),
        ]  # fmt: skip
        for p in procs:
            p.wait_ready()
        st.wait_registered(["d1", "d2", "p1"])
        wait_router_view(st.procs["r1"].address, 2, 1)
        yield st, st.procs["r1"].address, ck, turns
    finally:
        st.stop()
        rs.kill()


@contextlib.contextmanager
def _turn_held(path: str):
    """Holds the worker's turn lock for the block: its engine's next step waits for ever."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # once the step in flight, if any, lets go
        yield
    finally:
        os.close(fd)  # releases the lock


def _health(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        req = health_pb2.HealthCheckRequest()
        return health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status


def test_stuck_decode_engine_requests_move_and_it_serves_again(stack):
    st, addr, ck, turns = stack
    d1 = st.procs["d1"]
    _, gen = offline_reference(ck)
    cases = [([(11 * i + j) % 300 + 3 for j in range(10 + i)], SamplingParams()) for i in range(4)]
    cases[2] = (cases[2][0], SamplingParams(temperature=0.9, top_k=50, seed=11))
    streams = [Stream(addr, p, sp, f"stall-{i}") for i, (p, sp) in enumerate(cases)]
    for s in streams:
        s.start()
    until(lambda: all(len(s.tokens) >= 4 for s in streams), "streams started", 120)
    assert worker_stats(d1.address).running > 0  # least_loaded put some on d1
    with _turn_held(turns["d1"]):
        until(
            lambda: _health(d1.address) == health_pb2.HealthCheckResponse.NOT_SERVING,
            "NOT_SERVING",
            120,
        )
        for s in streams:
            s.join(timeout=240)
        assert not [s.rid for s in streams if s.is_alive()], "requests stuck on the stalled worker"
        assert _events(d1, STALLED)  # its watch logged the stall
        assert d1.alive  # withdrawn, not ended (--stall-exit-s 0)
    for s, (prompt, sp) in zip(streams, cases):
        assert s.error is None, (s.rid, s.error)
        want = gen.generate(prompt, N_TOKENS, sp, ignore_eos=True).token_ids
        assert s.tokens == want, (s.rid, tokens_equal_report(s.tokens, want))
    gone = _events(st.procs["r1"], "worker gone; its requests move")
    assert [e["address"] for e in gone] == [d1.address], gone
    moved = _events(st.procs["r1"], "migrating")
    assert moved and all("left the view" in e["error"] for e in moved), moved
    # Lock let go: the engine moves, health and registration come back, nothing was leaked.
    until(lambda: _health(d1.address) == SERVING, "SERVING", 120)
    st.wait_registered(["d1"])
    wait_router_view(addr, 2, 1)

    def idle() -> bool:
        s = worker_stats(d1.address)
        return s.running == s.waiting == 0 and s.free_pages + s.cached_pages == s.total_pages

    until(idle, "d1's aborted requests released", 120)
    # Placed there again: the router closed its channel to d1 when d1 left, and opens another.
    after = [Stream(addr, p, sp, f"after-{i}") for i, (p, sp) in enumerate(cases)]
    for s in after:
        s.start()
    for s in after:
        s.join(timeout=240)
    for s, (prompt, sp) in zip(after, cases):
        assert s.error is None, (s.rid, s.error)
        assert s.tokens == gen.generate(prompt, N_TOKENS, sp, ignore_eos=True).token_ids
    placed = {e["request_id"].split("#")[0]: e["decode"] for e in _events(st.procs["r1"], "placed")}
    assert "d1" in {placed[s.rid] for s in after}, placed


def test_stuck_prefill_engine_hand_off_moves_and_the_process_ends(stack):
    st, addr, ck, turns = stack
    p1 = st.procs["p1"]
    _, gen = offline_reference(ck)
    prompt = [(5 * j) % 300 + 3 for j in range(90)]  # over disagg_min_uncached_tokens (32)
    s = Stream(addr, prompt, SamplingParams(), "stall-p")
    with _turn_held(turns["p1"]):
        s.start()  # placed through p1: its engine waits for the turn
        s.join(timeout=240)
        assert not s.is_alive(), "the request is stuck on the stalled prefill worker"
        # The router moved it once p1 left the view (--stall-s 1 + the router's 2 s grace),
        # before p1 ended itself (--stall-exit-s 8).
        until(lambda: p1.returncode is not None, "p1's exit", 120)
    assert s.error is None, s.error
    assert s.tokens == gen.generate(prompt, N_TOKENS, SamplingParams(), ignore_eos=True).token_ids
    assert p1.returncode == 1
    assert _events(p1, STALLED) and _events(p1, "engine stuck; exiting")
    retried = _events(st.procs["r1"], "retrying")
    assert retried and "gone mid-hand-off" in retried[0]["error"], retried
    for w in ("d1", "d2"):  # the stuck hand-off's reservation was given back
        assert worker_stats(st.procs[w].address).reserved == 0
