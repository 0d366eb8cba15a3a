"""Routers share the prefix blocks they send to a worker through Redis: a second router
counts them (in flight, not yet in the worker's published set) before any heartbeat does,
they expire, and a router with sharing off or Redis down keeps only its own view."""

from __future__ import annotations

import asyncio

import redis

from megaserve.state_keys import WorkerInfo, placed_blocks_key, worker_key, workers_set
from router import state as state_mod
from router import worker_view as view_mod
from router.inflight import InflightConnection
from router.state import ClusterState

PS = 16
PROMPT = list(range(1000, 1000 + 5 * PS + 3))  # 5 full blocks of prompt[:-1]


def _register(r: redis.Redis, wid: str) -> None:
    info = WorkerInfo(wid, "decode", f"127.0.0.1:{7000 + len(wid)}", "m", 100, 100, 0, 0, PS)
    r.hset(worker_key(wid), mapping=info.to_hash())
    r.sadd(workers_set("decode"), wid)


async def _settle(*states: ClusterState) -> None:
    await asyncio.sleep(0.05)  # fire-and-forget writes reach Redis
    for s in states:
        await s.refresh()


def test_a_placement_on_one_router_is_seen_by_another(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    _register(r, "w1")
    _register(r, "w2")

    async def main():
        a, b = ClusterState(redis_server.url), ClusterState(redis_server.url)
        await _settle(a, b)
        assert b.workers["w1"].cached_prefix_blocks(PROMPT) == 0
        # a's connection is up only after its first command: the first fire connects.
        a._ids.fire(("PING",))
        await asyncio.sleep(0.05)
        a.expect(a.workers["w1"], PROMPT)
        await _settle(a, b)
        got = (
            b.workers["w1"].cached_prefix_blocks(PROMPT),
            b.workers["w2"].cached_prefix_blocks(PROMPT),
        )
        entries = r.xrange(placed_blocks_key("w1"))
        ttl = r.pttl(placed_blocks_key("w1"))
        seen = b.workers["w1"].placed_seen
        a.expect(a.workers["w1"], PROMPT + list(range(5000, 5000 + 2 * PS)))  # 2 blocks more
        await _settle(a, b)
        more = b.workers["w1"].cached_prefix_blocks(PROMPT + list(range(5000, 5000 + 2 * PS)))
        later = b.workers["w1"].placed_seen
        for s in (a, b):
            await s.stop()
        return got, entries, ttl, seen, more, later

    got, entries, ttl, seen, more, later = asyncio.run(main())
    assert got == (5, 0)  # on w1 only
    assert len(entries) == 1 and len(entries[0][1][b"b"].split(b",")) == 5  # one placement
    assert seen == entries[0][0].decode()  # b read up to it, and next time reads after it
    assert more == 7 and later > seen
    redis_ms = 1000 * redis.Redis.from_url(redis_server.url).time()[0]
    assert redis_ms - 5000 < int(seen.split("-")[0]) <= redis_ms + 1000  # ids: Redis's clock
    assert 0 < ttl <= 2 * view_mod.OPTIMISTIC_S * 1000


def test_shared_placements_expire_and_are_trimmed(redis_server, monkeypatch):
    """A placement counts for OPTIMISTIC_S from its entry's id (Redis's clock), also for a
    router that starts later and reads the stream from its start; writers keep the last
    PLACEMENTS_KEPT entries."""
    monkeypatch.setattr(view_mod, "OPTIMISTIC_S", 0.3)
    monkeypatch.setattr(state_mod, "PLACEMENTS_KEPT", 3)
    r = redis.Redis.from_url(redis_server.url)
    _register(r, "w1")

    async def main():
        a, b = ClusterState(redis_server.url), ClusterState(redis_server.url)
        await _settle(a, b)
        a._ids.fire(("PING",))
        await asyncio.sleep(0.05)
        a.expect(a.workers["w1"], PROMPT)
        await _settle(a, b)
        seen = b.workers["w1"].cached_prefix_blocks(PROMPT)
        await asyncio.sleep(0.4)
        c = ClusterState(redis_server.url)  # starts after the placement expired
        await _settle(a, b, c)
        after = [s.workers["w1"].cached_prefix_blocks(PROMPT) for s in (b, c)]
        for i in range(4):  # four more placements of one new block each
            a.expect(a.workers["w1"], [7000 + 100 * i + j for j in range(PS + 1)])
        await asyncio.sleep(0.05)
        left = r.xlen(placed_blocks_key("w1"))
        for s in (a, b, c):
            await s.stop()
        return seen, after, left

    assert asyncio.run(main()) == (5, [0, 0], 3)


def test_blocks_the_worker_publishes_are_not_written_again(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    _register(r, "w1")

    async def main():
        a = ClusterState(redis_server.url)
        await _settle(a)
        a._ids.fire(("PING",))
        await asyncio.sleep(0.05)
        w = a.workers["w1"]
        w.blocks = frozenset(w.expect_blocks(PROMPT))  # as if the worker had published them
        w.optimistic.clear()
        a.expect(w, PROMPT)
        await asyncio.sleep(0.05)
        await a.stop()

    asyncio.run(main())
    assert not r.exists(placed_blocks_key("w1"))


def test_sharing_off_keeps_placements_local(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    _register(r, "w1")

    async def main():
        a = ClusterState(redis_server.url, share_placements=False)
        await _settle(a)
        a.expect(a.workers["w1"], PROMPT)
        await asyncio.sleep(0.05)
        local = a.workers["w1"].cached_prefix_blocks(PROMPT)
        await a.stop()
        return local

    assert asyncio.run(main()) == 5  # its own view counts them
    assert not r.exists(placed_blocks_key("w1"))


def test_fire_while_redis_is_down_sends_nothing_and_reconnects(redis_server):
    async def main():
        conn = InflightConnection.for_url(redis_server.url, 0.5)
        first = conn.fire(("SET", "k", "1"))  # not connected yet: dropped, connect started
        await asyncio.sleep(0.1)
        second = conn.fire(("SET", "k", "2"))
        await asyncio.sleep(0.05)
        # A reply-awaiting command after fire-and-forget ones still gets its own reply.
        ok = await conn.set_nx("other", "x", 10_000)
        conn.close()
        return first, second, ok

    first, second, ok = asyncio.run(main())
    assert (first, second, ok) == (False, True, True)
    assert redis.Redis.from_url(redis_server.url).get("k") == b"2"


def test_blocks_shared_moments_ago_are_not_written_again(redis_server, monkeypatch):
    """A request's finish re-expects its prompt's blocks: no second write while the first
    placement has more than half its life left; a write again once it has not."""
    _register(redis.Redis.from_url(redis_server.url), "w1")

    async def main():
        a = ClusterState(redis_server.url)
        await _settle(a)
        writes = []
        monkeypatch.setattr(a._ids, "fire", lambda *cmds: writes.append(cmds) or True)
        w = a.workers["w1"]
        a.expect(w, PROMPT)
        a.expect(w, PROMPT + [1])  # the finish: the same full blocks
        first = len(writes)
        for h in w.optimistic:  # as if half the placement's life had passed
            w.optimistic[h] -= view_mod.OPTIMISTIC_S / 2 + 0.01
        a.expect(w, PROMPT)
        await a.stop()
        return first, len(writes)

    assert asyncio.run(main()) == (1, 2)
