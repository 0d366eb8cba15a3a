"""Registers a worker in Redis and refreshes it on a TTL heartbeat; survives Redis outages."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import redis
import structlog

from megaserve.redis_conn import sync_client
from megaserve.state_keys import (
    BLOCKS_VERSION,
    DELTAS_KEPT,
    WorkerInfo,
    block_deltas_key,
    block_hex,
    worker_blocks_key,
    worker_key,
    workers_set,
)

log = structlog.get_logger("megaserve.registration")


class BlockSource(Protocol):
    """What a page allocator exposes for publishing its cached blocks."""

    block_events: object  # deque[(+1 | -1, hash)], appended by the engine thread

    def cached_hashes(self) -> list[int]: ...


class Heartbeat:
    """Writes `info()` to worker:{id} every `interval` s with a `ttl` s expiry.

    Each beat rewrites the whole record, so a worker re-registers by itself when Redis comes
    back (or was restarted empty); serving never waits on Redis.
    """

    # Full rewrite of the block set this often even when deltas flowed, to heal any drift.
    RESYNC_S = 30.0

    def __init__(
        self,
        url: str,
        info: Callable[[], WorkerInfo],
        interval: float = 1.0,
        ttl: float = 5.0,
        blocks: BlockSource | None = None,
        alive: Callable[[], bool] | None = None,
    ):
        # redis:// or redis+sentinel:// (megaserve/redis_conn.py): through Sentinel every new
        # connection asks for the current primary, so after a failed beat the next one goes
        # to the promoted replica.
        self.client = sync_client(url, timeout=1.0)
        self.info, self.interval, self.ttl = info, interval, ttl
        self.blocks = blocks
        # Beats only while alive() (None: always): a multi-host leader whose group stopped
        # making progress withdraws its record (routers stop placing there) until it moves.
        self.alive = alive
        self.paused = False
        self._resync_at = 0.0  # monotonic time of the next full block-set rewrite
        # BLOCKS_VERSION: starts at the time, so a restarted heartbeat never repeats one.
        self.blocks_version = time.time_ns()
        self.healthy = False
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def beat(self) -> None:
        w = self.info()
        pipe = self.client.pipeline()
        pipe.hset(worker_key(w.worker_id), mapping=w.to_hash())
        pipe.pexpire(worker_key(w.worker_id), int(self.ttl * 1000))
        pipe.sadd(workers_set(w.role), w.worker_id)
        if self.blocks is not None:
            change = self._publish_blocks(pipe, worker_blocks_key(w.worker_id))
            if change is not None:
                self.blocks_version += 1
                deltas, v = block_deltas_key(w.worker_id), self.blocks_version
                if change:  # routers at the previous version apply it ("": rewritten whole)
                    pipe.hset(deltas, str(v), change)
                pipe.hdel(deltas, str(v - DELTAS_KEPT))
                pipe.pexpire(deltas, int(self.ttl * 1000))
            pipe.hset(worker_key(w.worker_id), BLOCKS_VERSION, self.blocks_version)
        try:
            pipe.execute()
        except redis.RedisError:
            self._resync_at = 0.0  # deltas drained into a failed write: rewrite next time
            raise
        self.beats += 1

    def _publish_blocks(self, pipe, key: str) -> str | None:
        """Adds this worker's block changes since the last beat (or the whole set) to pipe;
        returns the change as block_deltas_key holds it, "" for the whole set, None for no
        change."""
        events = self.blocks.block_events
        now = time.monotonic()
        full = now >= self._resync_at or len(events) == events.maxlen
        last: dict[int, int] = {}
        while True:  # drain first, then snapshot: later events are applied next beat
            try:
                op, h = events.popleft()
            except IndexError:
                break
            last[h] = op
        if full:
            pipe.delete(key)
            hashes = self.blocks.cached_hashes()
            if hashes:
                pipe.sadd(key, *map(block_hex, hashes))
            self._resync_at = now + self.RESYNC_S
        else:
            added = [block_hex(h) for h, op in last.items() if op > 0]
            removed = [block_hex(h) for h, op in last.items() if op < 0]
            if removed:
                pipe.srem(key, *removed)
            if added:
                pipe.sadd(key, *added)
        pipe.pexpire(key, int(self.ttl * 1000))
        if full:
            return ""
        return f"{','.join(added)}|{','.join(removed)}" if last else None

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.alive is not None and not self.alive():
                if not self.paused:
                    log.warning("no progress; registration withdrawn")
                    self.withdraw()
                self.paused = True
                self._stop.wait(self.interval)
                continue
            if self.paused:
                self._resync_at = 0.0  # the withdrawn block set is rewritten whole
            self.paused = False
            try:
                self.beat()
                if not self.healthy:
                    log.info("registered", redis="up")
                self.healthy = True
            except redis.RedisError as e:
                if self.healthy:
                    log.warning("redis unreachable; serving on", error=str(e))
                self.healthy = False
            self._stop.wait(self.interval)

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if deregister:
            self.withdraw()

    def withdraw(self) -> None:
        """Deletes this worker's record and block set (best effort: they expire anyway)."""
        try:
            w = self.info()
            self.client.delete(
                worker_key(w.worker_id),
                worker_blocks_key(w.worker_id),
                block_deltas_key(w.worker_id),
            )
            self.client.srem(workers_set(w.role), w.worker_id)
        except redis.RedisError:
            pass
