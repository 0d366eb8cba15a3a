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
        self._resync_at = 0.0  # monotonic time of the next periodic rewrite of the set
        # The next beat rewrites the set whole with a version that has no delta, so routers
        # read it whole: at start, after a failed write, after Redis lost the set.
        self._rewrite = True
        self._written: int | None = None  # the BLOCKS_VERSION of the last beat written
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
        if not self._beat_once():
            self._beat_once()  # Redis lost what this worker wrote: the whole set, now

    def _beat_once(self) -> bool:
        """One transaction: the record, its TTL and the block set's changes; False when Redis
        no longer held the version this worker wrote last (it restarted or was flushed, a
        replica without the last writes took over, the record expired), the set then being
        unknown: the next beat rewrites it whole."""
        w = self.info()
        pipe = self.client.pipeline()
        if self.blocks is not None:
            pipe.hget(worker_key(w.worker_id), BLOCKS_VERSION)  # read inside the transaction
        pipe.hset(worker_key(w.worker_id), mapping=w.to_hash())
        pipe.pexpire(worker_key(w.worker_id), int(self.ttl * 1000))
        pipe.sadd(workers_set(w.role), w.worker_id)
        rewrite = False
        if self.blocks is not None:
            events = self.blocks.block_events
            if len(events) == events.maxlen:
                self._rewrite = True  # events were dropped: the change is unknown
            rewrite = self._rewrite
            change = self._publish_blocks(pipe, worker_blocks_key(w.worker_id), rewrite)
            deltas = block_deltas_key(w.worker_id)
            if rewrite:  # routers behind it read the set whole: no delta, none older kept
                self.blocks_version += 1
                pipe.delete(deltas)
            elif change:  # routers at the previous version apply it
                self.blocks_version += 1
                pipe.hset(deltas, str(self.blocks_version), change)
                pipe.hdel(deltas, str(self.blocks_version - DELTAS_KEPT))
                pipe.pexpire(deltas, int(self.ttl * 1000))
            pipe.hset(worker_key(w.worker_id), BLOCKS_VERSION, self.blocks_version)
        try:
            res = pipe.execute()
        except redis.RedisError:
            self._rewrite = True  # deltas drained into a failed write: rewrite next time
            raise
        self.beats += 1
        if self.blocks is None:
            return True
        held, written, self._written = res[0], self._written, self.blocks_version
        self._rewrite = False
        # (This beat's own version: redis-py resent a transaction Redis had applied.)
        if rewrite or _as_int(held) in (written, self.blocks_version):
            return True
        # (Every beat, if another process beats under this worker's id.)
        log.warning("redis lost this worker's block set; rewriting it", held=held, wrote=written)
        self._rewrite = True
        return False

    def _publish_blocks(self, pipe, key: str, rewrite: bool) -> str | None:
        """Adds this worker's block changes since the last beat to pipe, or the whole set (a
        rewrite, or every RESYNC_S to heal whatever else changed it); returns the change as
        block_deltas_key holds it ("added,...|removed,..."), None for none."""
        events, now = self.blocks.block_events, time.monotonic()
        full = rewrite or now >= self._resync_at
        last: dict[int, int] = {}
        while True:  # drain first, then snapshot: later events are applied next beat
            try:
                op, h = events.popleft()
            except IndexError:
                break
            last[h] = op
        added = [block_hex(h) for h, op in last.items() if op > 0]
        removed = [block_hex(h) for h, op in last.items() if op < 0]
        if full:
            pipe.delete(key)
            hashes = self.blocks.cached_hashes()
            if hashes:
                pipe.sadd(key, *map(block_hex, hashes))
            self._resync_at = now + self.RESYNC_S
        else:
            if removed:
                pipe.srem(key, *removed)
            if added:
                pipe.sadd(key, *added)
        pipe.pexpire(key, int(self.ttl * 1000))
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
                self._rewrite = True  # the withdrawn block set is rewritten whole
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


def _as_int(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):  # missing, or not written by a heartbeat
        return None
