"""Registers a worker in Redis and refreshes it on a TTL heartbeat; survives Redis outages."""

from __future__ import annotations

import threading
from collections.abc import Callable

import redis
import structlog

from megaserve.state_keys import WorkerInfo, worker_key, workers_set

log = structlog.get_logger("megaserve.registration")


class Heartbeat:
    """Writes `info()` to worker:{id} every `interval` s with a `ttl` s expiry.

    Each beat rewrites the whole record, so a worker re-registers by itself when Redis comes
    back (or was restarted empty); serving never waits on Redis.
    """

    def __init__(
        self, url: str, info: Callable[[], WorkerInfo], interval: float = 1.0, ttl: float = 5.0
    ):
        self.client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.info, self.interval, self.ttl = info, interval, ttl
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
        pipe.execute()
        self.beats += 1

    def _run(self) -> None:
        while not self._stop.is_set():
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
        self._thread.join(timeout=5)
        if deregister:
            try:
                w = self.info()
                self.client.delete(worker_key(w.worker_id))
                self.client.srem(workers_set(w.role), w.worker_id)
            except redis.RedisError:
                pass
