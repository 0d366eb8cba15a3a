"""A hand-off cancelled at its edges: the prefill call cancelled while its first token is
being sent stops its KV push (no commit for nobody, no jax offers taken back while they are
being written and pulled), and a push cancelled after its trailer but before its commit frees
the reservation at once. Real engines and a real decode server; the prefill side is the
servicer, called as the router's PrefillStream would."""

from __future__ import annotations

import asyncio
import threading

import pytest

from decode_service import kv_service
from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.scheduler import SchedulerConfig
from decode_service.server import create_server as create_decode
from megaserve.rpc import prefill_pb2
from megaserve.server_thread import ServerThread
from prefill_service.engine import PrefillConfig, PrefillEngine
from prefill_service.server import PrefillServicer
from tests.polling import until, until_async

PROMPT = [(i * 5) % 90 + 3 for i in range(200)]  # 13 pages of 16


class _Context:
    def time_remaining(self):
        return None


class _SlowCall:
    """A push call whose writes take 0.2 s each (a slow link): the push is still going when
    the first token is sent."""

    def __init__(self, call):
        self._c = call

    def __getattr__(self, name):
        return getattr(self._c, name)

    async def write(self, m):
        await asyncio.sleep(0.2)
        return await self._c.write(m)

    def __await__(self):
        return self._c.__await__()


@pytest.fixture(scope="module")
def workers(tiny_model):
    chunked = SchedulerConfig(prefill_chunk=32)
    decode = DecodeEngine(tiny_model, EngineConfig(max_context=256, scheduler=chunked))
    decode.start()
    prefill = PrefillEngine(tiny_model, PrefillConfig(chunk=32, max_context=256))
    servers = ServerThread(lambda: create_decode(decode))
    yield decode, prefill, servers.addresses[0]
    servers.stop()
    decode.stop()
    prefill.stop()


def _request(rid: str, address: str, transport) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=rid,
        prompt_token_ids=PROMPT,
        decode_address=address,
        page_size=16,
        transport=transport,
    )


@pytest.mark.parametrize(
    "transport",
    [prefill_pb2.TRANSPORT_GRPC, prefill_pb2.TRANSPORT_JAX_TRANSFER],
    ids=["grpc", "jax"],
)
def test_a_prefill_cancelled_while_its_first_token_is_sent_stops_its_push(
    workers, transport, monkeypatch
):
    decode, prefill, address = workers
    rid = f"first-{transport}"
    decode.reserve(rid, PROMPT, 60.0)
    real_push = PrefillServicer._push
    monkeypatch.setattr(
        PrefillServicer, "_push", lambda self, a: lambda: _SlowCall(real_push(self, a)())
    )
    stuck = kv_service.pulls_stuck()

    async def main():
        servicer = PrefillServicer(prefill)
        sending = asyncio.Event()

        async def on_first(token: int, compute_s: float) -> None:  # the client is slow
            sending.set()
            await asyncio.sleep(3600)

        t = asyncio.ensure_future(
            servicer._counted(_request(rid, address, transport), _Context(), on_first)
        )
        await sending.wait()
        t.cancel()  # the router's client left
        with pytest.raises(asyncio.CancelledError):
            await t
        assert servicer.inflight == 0
        # The loop runs on (a server's does): a push left going would commit meanwhile.
        await until_async(lambda: decode.reservation(rid) is None, "the reservation freed", 10)
        await asyncio.sleep(1.0)

    asyncio.run(main())
    assert decode.reservation(rid) is None and decode.idle
    assert kv_service.pulls_stuck() == stuck  # no pull of an offer taken back


def test_a_push_cancelled_between_its_trailer_and_its_commit_frees_the_reservation(workers):
    decode, prefill, address = workers
    rid = "trailer-then-cancel"
    decode.reserve(rid, PROMPT, 60.0)
    gate, held = threading.Event(), threading.Event()

    def block():
        held.set()
        gate.wait(30)

    decode._submit(block)  # the decode engine is busy: the push's page writes wait
    assert held.wait(10)
    try:

        async def main():
            servicer = PrefillServicer(prefill)
            t = asyncio.ensure_future(
                servicer._counted(_request(rid, address, prefill_pb2.TRANSPORT_GRPC), _Context())
            )
            # Every chunk and the trailer are in: the push awaits its page writes.
            sizes = []
            while len(sizes) < 10 or len(set(sizes[-10:])) > 1 or sizes[-1] == 0:
                await asyncio.sleep(0.05)
                sizes.append(decode._commands.qsize())
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t

        asyncio.run(main())
    finally:
        gate.set()
    until(lambda: decode.reservation(rid) is None, "the reservation freed (not its lease)", 10)
