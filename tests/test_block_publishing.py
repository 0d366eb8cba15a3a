"""Workers publish their cached prefix blocks to Redis as pages are stored and evicted; routers
read a worker's set again only when its version moved."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from megaserve.kv.allocator import PageAllocator
from megaserve.kv.block_hash import block_hashes
from megaserve.registration import Heartbeat
from megaserve.state_keys import (
    BLOCKS_VERSION,
    DELTAS_KEPT,
    WorkerInfo,
    block_deltas_key,
    block_hex,
    worker_blocks_key,
    worker_key,
)
from router.state import ClusterState


def _info():
    return WorkerInfo("w1", "decode", "127.0.0.1:1", "m", 4, 4, 0, 0, 4)


def _members(r) -> set[str]:
    return {m.decode() for m in r.smembers(worker_blocks_key("w1"))}


def test_blocks_follow_register_and_evict(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    alloc = PageAllocator(5, 4)  # 4 usable pages of 4 tokens
    hb = Heartbeat(redis_server.url, _info, ttl=30, blocks=alloc)
    hashes = block_hashes(list(range(16)), 4)  # 4 blocks
    pages = alloc.allocate(4)
    for p, h in zip(pages, hashes):
        alloc.register(p, h)
    hb.beat()
    assert _members(r) == {block_hex(h) for h in hashes}
    alloc.release(pages)  # cached (still published)
    hb.beat()
    assert len(_members(r)) == 4
    fresh = alloc.allocate(2)  # evicts the two least recently used blocks
    hb.beat()
    assert _members(r) == {block_hex(h) for h in hashes[2:]}
    # Redis loses everything and the worker's connection sees no error (flushed, or restarted
    # between beats: redis-py reconnects): the next beat finds the version it wrote gone and
    # rewrites the whole set at once.
    r.flushall()
    hb.beat()
    assert _members(r) == {block_hex(h) for h in hashes[2:]}
    assert 0 < r.pttl(worker_blocks_key("w1")) <= 30_000
    alloc.release(fresh)
    hb.stop(deregister=True)
    assert not r.exists(worker_blocks_key("w1"))


def test_redis_down_then_back_resyncs(redis_server):
    alloc = PageAllocator(9, 4)
    hb = Heartbeat(redis_server.url, _info, ttl=30, blocks=alloc)
    hb.beat()
    redis_server.kill()
    p = alloc.allocate(1)
    alloc.register(p[0], 12345)
    try:
        hb.beat()
        raise AssertionError("beat should fail while Redis is down")
    except redis.RedisError:
        pass
    redis_server.start()
    hb.beat()  # the failed beat's deltas are gone: this one rewrites the set
    r = redis.Redis.from_url(redis_server.url)
    assert _members(r) == {block_hex(12345)}
    redis_server.kill()  # down and back between two beats: no beat fails
    redis_server.start()
    p = alloc.allocate(1)
    alloc.register(p[0], 678)
    hb.beat()
    assert _members(r) == {block_hex(12345), block_hex(678)}


def test_beats_failing_while_redis_keeps_its_data_leave_no_deltas_behind(redis_server):
    """Beats that time out while Redis keeps its data (here: Redis pauses its writers past
    the heartbeat's 1 s timeout) end in a rewrite, which drops every older delta: the
    deltas hash stays within DELTAS_KEPT however many outages a busy worker sees."""
    r = redis.Redis.from_url(redis_server.url)
    alloc = PageAllocator(DELTAS_KEPT + 2, 4)
    hb = Heartbeat(redis_server.url, _info, ttl=30, blocks=alloc)
    n = 0

    def change_and_beat() -> None:
        nonlocal n
        n += 1
        p = alloc.allocate(1)  # evicts the least recently used block
        alloc.register(p[0], n)
        alloc.release(p)
        hb.beat()

    for _ in range(DELTAS_KEPT + 4):
        change_and_beat()
    for _ in range(2):  # two outages
        r.client_pause(1500, all=False)  # WRITE: reads (this client's) go on
        with pytest.raises(redis.RedisError):
            change_and_beat()
        time.sleep(0.6)  # the pause is over
        for _ in range(DELTAS_KEPT + 1):  # the window moves past any delta left
            change_and_beat()
        assert 0 < r.hlen(block_deltas_key("w1")) <= DELTAS_KEPT
    assert _members(r) == {block_hex(h) for h in alloc.cached_hashes()}
    hb.stop(deregister=True)


def test_a_router_reads_a_block_set_again_only_when_it_moved(redis_server):
    """The worker hash's blocks_version goes up with each change of the set, in the same
    transaction as the change and its delta. A router's refresh reads nothing for a set that
    did not move, the kept deltas (HMGET) for one that did, and the whole set (SMEMBERS) when
    it is new, was rewritten, is too far behind, or its worker writes no version (Redis's own
    command counts)."""
    r = redis.Redis.from_url(redis_server.url)
    alloc = PageAllocator(5, 4)
    hb = Heartbeat(redis_server.url, _info, ttl=30, blocks=alloc)
    hashes = block_hashes(list(range(16)), 4)
    pages = alloc.allocate(4)
    for p, h in zip(pages, hashes):
        alloc.register(p, h)
    hb.beat()
    alloc.release(pages)

    async def reads(state, refreshes: int = 1) -> tuple[int, int]:
        """(SMEMBERS of block sets, HMGET of deltas) over `refreshes` refreshes."""
        r.config_resetstat()
        for _ in range(refreshes):
            await state.refresh()
        stats = r.info("commandstats")
        calls = lambda c: stats.get(f"cmdstat_{c}", {}).get("calls", 0)  # noqa: E731
        return calls("smembers") - 2 * refreshes, calls("hmget")  # (2: the worker sets)

    def published() -> set[str]:
        return _members(r)

    async def main():
        state = ClusterState(redis_server.url)
        assert await reads(state) == (1, 0)  # a new worker: read whole
        assert state.workers["w1"].blocks == published() and len(published()) == 4
        assert await reads(state, 5) == (0, 0)
        hb.beat()  # nothing changed: the version stays
        assert await reads(state, 3) == (0, 0)
        fresh = alloc.allocate(2)  # evicts two blocks
        hb.beat()
        assert await reads(state, 3) == (0, 1)  # one change applied, then nothing
        assert state.workers["w1"].blocks == published() and len(published()) == 2
        alloc.register(fresh[0], 777)
        hb.beat()
        alloc.register(fresh[1], 778)
        hb.beat()
        alloc.release(fresh)
        assert await reads(state) == (0, 1)  # two changes in one HMGET
        assert state.workers["w1"].blocks == published() and len(published()) == 4

        def replace_one(h: int) -> None:  # the least recently used block evicted for h
            p = alloc.allocate(1)
            alloc.register(p[0], h)
            alloc.release(p)
            hb.beat()

        hb._resync_at = 0.0  # the periodic rewrite: the set whole, its change still a delta
        replace_one(779)
        assert await reads(state, 2) == (0, 1)
        assert state.workers["w1"].blocks == published()
        hb._rewrite = True  # a rewrite after a failed write: its version has no delta
        replace_one(780)
        assert await reads(state, 2) == (1, 1)  # the missing delta, then the whole set
        assert state.workers["w1"].blocks == published()
        for i in range(DELTAS_KEPT + 1):  # further behind than the deltas kept
            replace_one(1000 + i)
        assert await reads(state) == (1, 0)
        assert state.workers["w1"].blocks == published() and 1000 + DELTAS_KEPT in {
            int(h, 16) for h in published()
        }
        assert r.hlen(block_deltas_key("w1")) <= DELTAS_KEPT
        r.hdel(worker_key("w1"), BLOCKS_VERSION)  # a worker that writes no version
        assert await reads(state, 3) == (3, 0)
        await state.stop()

    asyncio.run(main())
    hb.stop(deregister=True)
    assert not r.exists(block_deltas_key("w1"))
