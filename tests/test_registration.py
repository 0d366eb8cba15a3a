"""Workers register in a real Redis with a TTL heartbeat and re-register after an outage."""

from __future__ import annotations

import time

import redis

from megaserve.registration import Heartbeat
from megaserve.state_keys import WorkerInfo, worker_key, workers_set


def _info():
    return WorkerInfo("d0", "decode", "127.0.0.1:5000", "tiny", 100, 90, 1, 0, 16)


def _wait(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_register_refresh_and_expire(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    hb = Heartbeat(redis_server.url, _info, interval=0.1, ttl=0.5).start()
    assert _wait(lambda: r.exists(worker_key("d0")))
    assert WorkerInfo.from_hash(r.hgetall(worker_key("d0"))) == _info()
    assert r.sismember(workers_set("decode"), "d0")
    assert 0 < r.pttl(worker_key("d0")) <= 500
    hb.stop(deregister=False)
    assert _wait(lambda: not r.exists(worker_key("d0")), timeout=2)  # TTL, not a delete


def test_reregisters_after_redis_restart(redis_server):
    hb = Heartbeat(redis_server.url, _info, interval=0.1, ttl=2).start()
    assert _wait(lambda: hb.healthy)
    redis_server.kill()
    assert _wait(lambda: not hb.healthy)
    redis_server.start()  # same port, empty data
    r = redis.Redis.from_url(redis_server.url)
    assert _wait(lambda: r.exists(worker_key("d0")))
    hb.stop()
    assert not r.exists(worker_key("d0"))
