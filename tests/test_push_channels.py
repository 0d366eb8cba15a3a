"""The prefill worker's channels to decode workers: bounded, least recently used closed,
pushes in flight on an evicted channel left to end."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from prefill_service.push_channels import PushChannels


def _addresses(n: int) -> list[str]:
    return [f"127.0.0.1:{20000 + i}" for i in range(n)]  # (channels connect lazily)


def test_more_addresses_than_the_bound_keep_the_most_recent_and_close_the_rest():
    async def main():
        made: dict[str, grpc.aio.Channel] = {}

        def make(address: str) -> grpc.aio.Channel:
            made[address] = grpc.aio.insecure_channel(address)
            return made[address]

        pool = PushChannels(make, limit=4)
        first, *rest = _addresses(10)
        for a in [first, *rest[:3]]:
            pool.get(a)
        assert pool.get(first) is made[first]  # reused; now the most recently used
        for a in rest[3:]:
            pool.get(a)
        assert len(pool) == 4
        assert first not in pool and rest[0] not in pool  # the least recent went first
        assert rest[-3:] == [a for a in rest[-3:] if a in pool]
        await asyncio.sleep(0.1)  # the evicted channels' close tasks run
        old = made[first]
        with pytest.raises(grpc.aio.UsageError):  # closed: no new call starts on it
            await old.unary_unary("/x.Y/Z")(b"", timeout=1)
        assert pool.get(first) is not old  # asked again: a new channel
        await pool.close()
        assert len(pool) == 0
        with pytest.raises(grpc.aio.UsageError):
            await made[rest[-1]].unary_unary("/x.Y/Z")(b"", timeout=1)

    asyncio.run(main())


def test_a_call_in_flight_on_an_evicted_channel_ends_normally():
    """Eviction closes with a grace period: a push already sent on it is not cut off."""

    async def slow(request: bytes, context) -> bytes:
        await asyncio.sleep(0.5)
        return b"done:" + request

    async def main():
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(slow)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("x.Y", {"Z": handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            pool = PushChannels(grpc.aio.insecure_channel, limit=1)
            address = f"127.0.0.1:{port}"
            call = pool.get(address).unary_unary("/x.Y/Z")(b"kv", timeout=10)
            await asyncio.sleep(0.1)  # sent
            pool.get(_addresses(1)[0])  # evicts the channel the call is on
            assert address not in pool
            assert await call == b"done:kv"
            await pool.close()
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="limit=0"):
        PushChannels(grpc.aio.insecure_channel, limit=0)
