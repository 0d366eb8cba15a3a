"""The router's request-path plumbing against real processes: in-flight ids on their own
pipelined Redis connection (claims, reconnects, AUTH/SELECT, timeouts), log lines rendered by
a background writer, and a router process's per-request CPU summary on SIGUSR1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import redis

from megaserve.rpc import decode_pb2, decode_pb2_grpc
from megaserve.server_thread import ServerThread
from megaserve.state_keys import WorkerInfo, inflight_key, worker_key, workers_set
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from megaserve_app.launch import Proc, free_port, megaserve_cmd, redis_binary
from router import costs
from router.inflight import InflightConnection
from router.state import ClusterState
from tests.stack import make_chat_checkpoint, wait_router_view


def test_set_nx_and_a_fired_del(redis_server):
    r = redis.Redis.from_url(redis_server.url)

    async def main():
        ids = InflightConnection.for_url(redis_server.url, 0.5)
        assert await ids.set_nx("k", "r1", 60_000)
        assert not await ids.set_nx("k", "r2", 60_000)  # taken
        assert r.get("k") == b"r1" and 0 < r.pttl("k") <= 60_000
        assert ids.fire(("DEL", "k"))  # not waited for: the next command on it comes after
        assert await ids.set_nx("k", "r2", 60_000)
        ids.close()

    asyncio.run(main())


def test_concurrent_commands_share_one_connection_in_order(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    r.set("taken-7", "other")

    async def main():
        ids = InflightConnection.for_url(redis_server.url, 0.5)
        keys = [f"taken-{i % 10}" for i in range(10)] + [f"k{i}" for i in range(190)]
        got = await asyncio.gather(*(ids.set_nx(k, "me", 60_000) for k in keys))
        clients = r.client_list()
        ids.close()
        return keys, got, clients

    keys, got, clients = asyncio.run(main())
    assert got == [k != "taken-7" for k in keys]  # every answer went to its own command
    assert len(clients) == 2  # this test's client and the one pipelined connection


def test_reconnects_after_redis_restarts(redis_server):
    async def main():
        ids = InflightConnection.for_url(redis_server.url, 0.5)
        assert await ids.set_nx("a", "r", 60_000)
        redis_server.kill()
        with pytest.raises((redis.RedisError, OSError)):
            await ids.set_nx("b", "r", 60_000)
        redis_server.start()  # empty, same port
        assert await ids.set_nx("a", "r", 60_000)
        ids.close()

    asyncio.run(main())


def test_auth_and_select(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [redis_binary(), "--port", str(port), "--save", "", "--requirepass", "pw"],
        stdout=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    try:
        r = redis.Redis(port=port, password="pw", db=3)
        end = time.monotonic() + 10
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < end, "redis-server did not start"
                time.sleep(0.05)

        async def main():
            ids = InflightConnection.for_url(f"redis://:pw@127.0.0.1:{port}/3", 0.5)
            assert await ids.set_nx("k", "r", 60_000)
            ids.close()
            wrong = InflightConnection.for_url(f"redis://:nope@127.0.0.1:{port}/3", 0.5)
            with pytest.raises(redis.ResponseError):
                await wrong.set_nx("k2", "r", 60_000)
            wrong.close()

        asyncio.run(main())
        assert r.get("k") == b"r"  # in db 3
    finally:
        proc.kill()
        proc.wait()


def test_a_redis_that_never_answers_times_out():
    async def main():
        async def mute(reader, writer):
            await reader.read(1 << 16)
            await asyncio.sleep(10)

        server = await asyncio.start_server(mute, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        ids = InflightConnection.for_url(f"redis://127.0.0.1:{port}/0", 0.2)
        t0 = time.monotonic()
        with pytest.raises(redis.TimeoutError, match="did not answer SET"):
            await ids.set_nx("k", "r", 60_000)
        took = time.monotonic() - t0
        ids.close()
        server.close()
        return took

    assert asyncio.run(main()) < 5  # the 0.2 s timeout, with a generous margin


def test_only_plain_urls_get_the_pipelined_connection():
    assert InflightConnection.for_url("redis://127.0.0.1:6379/0", 0.5) is not None
    assert InflightConnection.for_url("unix:///tmp/redis.sock?db=2", 0.5) is not None
    for url in (
        "rediss://127.0.0.1:6379/0",  # TLS: redis-py
        "redis+sentinel://127.0.0.1:26379/megaserve",  # failover: redis-py
        "redis://127.0.0.1:6379/0?socket_timeout=3",  # an option this connection ignores
    ):
        assert InflightConnection.for_url(url, 0.5) is None, url


def test_only_client_ids_are_claimed_in_redis(redis_server):
    r = redis.Redis.from_url(redis_server.url)

    async def main():
        state = ClusterState(redis_server.url)
        assert await state.claim("client-id", "r1", 30)
        assert r.get(inflight_key("client-id")).startswith(b"r1#")
        assert await state.claim("req-made-here", "r1", 30, shared=False)
        assert r.get(inflight_key("req-made-here")) is None
        assert not await state.claim("req-made-here", "r1", 30, shared=False)  # in flight here
        await state.release("client-id")  # its DEL is not waited for; a claim comes after it
        await state.release("req-made-here", shared=False)
        assert await state.claim("client-id", "r2", 30)
        assert r.get(inflight_key("client-id")).startswith(b"r2#")
        assert await state.claim("req-made-here", "r1", 30, shared=False)
        await state.stop()

    asyncio.run(main())


def test_an_id_is_freed_while_the_pipelined_connection_is_down(redis_server):
    """A fired DEL needs the connection: while it is down, the id is deleted through redis-py
    instead of being left to refuse the client's retry for INFLIGHT_TTL_S."""
    r = redis.Redis.from_url(redis_server.url)

    async def main():
        state = ClusterState(redis_server.url)
        assert await state.claim("cid", "r1", 3600)
        state._ids._replies.transport.close()  # Redis (or a proxy) closed the connection
        await asyncio.sleep(0.05)
        await state.release("cid")
        gone = r.get(inflight_key("cid")) is None
        again = await state.claim("cid", "r2", 3600)  # the retry, on a new connection
        await state.stop()
        return gone, again

    assert asyncio.run(main()) == (True, True)


def test_a_claim_cancelled_before_its_reply_leaves_no_id_behind(redis_server):
    """The client leaves while its id's SET NX waits in Redis (here Redis pauses writers):
    the SET still lands, so the router deletes the key after it, if the claim was its own
    (another router's claim of the same id stays)."""
    r = redis.Redis.from_url(redis_server.url)
    r.set(inflight_key("theirs"), "r-other")

    async def cancelled_claim(state: ClusterState, rid: str) -> None:
        await state.claim("warm", "r1", 3600)  # the pipelined connection is up
        r.client_pause(300, all=False)
        t = asyncio.ensure_future(state.claim(rid, "r1", 3600))
        await asyncio.sleep(0.05)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    async def main():
        state = ClusterState(redis_server.url)
        await cancelled_claim(state, "mine")
        await cancelled_claim(state, "theirs")
        await asyncio.sleep(0.5)  # the pause is over: the SETs, then the deletes, ran
        assert r.get(inflight_key("mine")) is None
        assert r.get(inflight_key("theirs")) == b"r-other"
        assert await state.claim("mine", "r2", 3600)  # the client's retry
        await state.stop()

    asyncio.run(main())


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "redis-py"])
def test_a_cancelled_claim_redis_will_not_free_is_logged(redis_server, pipelined):
    """A Redis that refuses EVAL (an ACL) cannot free a cancelled claim: the id then refuses
    retries until it expires, and the router says so (it was dropped silently)."""
    from structlog.testing import capture_logs

    r = redis.Redis.from_url(redis_server.url)

    async def main():
        state = ClusterState(redis_server.url)
        if not pipelined:  # as for a TLS or Sentinel URL
            state._ids.close()
            state._ids = None
        await state.claim("warm", "r1", 3600)
        r.execute_command("ACL", "SETUSER", "default", "-eval")
        try:
            r.client_pause(300, all=False)
            t = asyncio.ensure_future(state.claim("kept", "r1", 3600))
            await asyncio.sleep(0.05)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            with capture_logs() as logs:
                await asyncio.sleep(0.6)  # the pause is over: the SET, then the EVAL, ran
        finally:
            r.execute_command("ACL", "SETUSER", "default", "+eval")
        await state.stop()
        return logs

    logs = asyncio.run(main())
    if pipelined:  # (redis-py drops its connection at the cancel: a paused SET goes with it)
        assert r.get(inflight_key("kept")) is not None  # nothing could free it
    said = [x for x in logs if "could not be freed" in x["event"]]
    assert len(said) == 1 and "eval" in said[0]["error"].lower(), logs
    assert said[0]["key"] == inflight_key("kept") and said[0]["expires_in_s"] == 3600


LOG_SCRIPT = """
import structlog
from megaserve.logs import configure, writer_cpu_seconds
configure(background=True)
log = structlog.get_logger("t")
for i in range(500):
    log.info("placed", request_id=f"r{i}", decode="d1", cached_blocks=0)
log.warning("last", n=[1, 2])
assert writer_cpu_seconds() >= 0
"""


def test_background_log_lines_keep_their_content_and_are_written_by_exit():
    out = subprocess.run([sys.executable, "-c", LOG_SCRIPT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stderr.splitlines()]
    assert len(lines) == 501  # nothing queued was lost at exit
    assert lines[0] == {
        "request_id": "r0",
        "decode": "d1",
        "cached_blocks": 0,
        "event": "placed",
        "level": "info",
        "timestamp": lines[0]["timestamp"],
    }
    assert list(lines[0]) == [
        "request_id",
        "decode",
        "cached_blocks",
        "event",
        "level",
        "timestamp",
    ]
    assert lines[-1]["n"] == [1, 2] and lines[-1]["level"] == "warning"
    assert lines[0]["timestamp"].endswith("Z") and "T" in lines[0]["timestamp"]


class Instant(decode_pb2_grpc.DecodeServicer):
    """A decode worker that answers every Generate with one token at once."""

    async def Generate(self, req, ctx):  # noqa: N802
        yield decode_pb2.GenerateResponse(
            token_ids=[7], finish_reason=decode_pb2.FINISH_REASON_LENGTH
        )


async def _instant_worker():
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServicer_to_server(Instant(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def test_router_logs_cpu_per_request_by_component_on_sigusr1(redis_server, tmp_path):
    ck = make_chat_checkpoint(tmp_path / "ck")
    worker = ServerThread(_instant_worker)
    r = redis.Redis.from_url(redis_server.url)
    info = WorkerInfo("d1", "decode", worker.addresses[0], "tiny-chat", 64, 64, 0, 0, 16, 512, 384)
    r.sadd(workers_set("decode"), "d1")
    r.hset(worker_key("d1"), mapping=info.to_hash())
    cmd = megaserve_cmd("router", "--port", "0", "--redis-url", redis_server.url)
    router = Proc([*cmd, "--checkpoint", f"tiny-chat={ck}"], "router")
    try:
        router.wait_ready()
        wait_router_view(router.address, 1, 0)
        with grpc.insecure_channel(router.address) as ch:
            stub = pbg.GenerationStub(ch)
            for i in range(5):
                req = pb.GenerateRequest(
                    request_id=f"c{i}" if i % 2 else "",  # client ids and router-made ones
                    prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]),
                    stopping=pb.StoppingParams(max_tokens=1),
                )
                assert [t for m in stub.Generate(req, timeout=30) for t in m.token_ids] == [7]
        os.kill(router.pid, signal.SIGUSR1)
        end = time.monotonic() + 30
        while not (found := [x for x in list(router.lines) if '"request costs"' in x]):
            assert time.monotonic() < end, "".join(router.lines[-20:])
            time.sleep(0.05)
    finally:
        router.stop()
        worker.stop()
    s = json.loads(found[0])
    assert s["requests"] == 5
    assert list(s["cpu_us"]) == [*costs.COMPONENTS, "total"]
    assert all(s["cpu_us"][c]["p50"] > 0 for c in ("validate", "worker_call", "send", "total"))
    assert s["process_cpu_ms"] >= s["loop_cpu_ms"] > 0
