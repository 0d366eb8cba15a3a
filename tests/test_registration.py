"""Workers register in a real Redis with a TTL heartbeat and re-register after an outage."""

from __future__ import annotations

import redis

from megaserve.registration import Heartbeat
from megaserve.state_keys import WorkerInfo, worker_key, workers_set
from tests.polling import until


def _info():
    return WorkerInfo("d0", "decode", "127.0.0.1:5000", "tiny", 100, 90, 1, 0, 16)


def test_register_refresh_and_expire(redis_server):
    # A TTL far longer than any stall between two of the checks below: nothing here races it.
    r = redis.Redis.from_url(redis_server.url)
    hb = Heartbeat(redis_server.url, _info, interval=0.1, ttl=60).start()
    until(lambda: r.exists(worker_key("d0")), "r.exists(worker_key('d0'))")
    assert WorkerInfo.from_hash(r.hgetall(worker_key("d0"))) == _info()
    assert r.sismember(workers_set("decode"), "d0")
    assert 0 < r.pttl(worker_key("d0")) <= 60_000
    # Each beat rewrites the expiry: it is back near the full TTL after a later beat.
    r.pexpire(worker_key("d0"), 30_000)
    beats = hb.beats
    until(lambda: hb.beats >= beats + 2, "hb.beats >= beats + 2")
    assert r.pttl(worker_key("d0")) > 30_000
    hb.stop(deregister=False)
    stopped_at = hb.beats
    # Left to expire by its TTL, not deleted: still there, with an expiry set.
    assert r.exists(worker_key("d0")) and 0 < r.pttl(worker_key("d0")) <= 60_000
    r.pexpire(worker_key("d0"), 1)  # the TTL runs out (Redis's own expiry)
    until(lambda: not r.exists(worker_key("d0")), "not r.exists(worker_key('d0'))")
    assert hb.beats == stopped_at and not r.exists(worker_key("d0"))  # no beat brings it back


def test_reregisters_after_redis_restart(redis_server):
    hb = Heartbeat(redis_server.url, _info, interval=0.1, ttl=2).start()
    until(lambda: hb.healthy, "hb.healthy")
    redis_server.kill()
    until(lambda: not hb.healthy, "not hb.healthy")
    redis_server.start()  # same port, empty data
    r = redis.Redis.from_url(redis_server.url)
    until(lambda: r.exists(worker_key("d0")), "r.exists(worker_key('d0'))")
    hb.stop()
    assert not r.exists(worker_key("d0"))


def test_withdrawn_while_not_alive(redis_server):
    """A worker whose alive() is False (a multi-host leader's stuck group) deletes its record
    at once and writes it back whole when alive again."""
    r = redis.Redis.from_url(redis_server.url)
    alive = [True]
    hb = Heartbeat(redis_server.url, _info, interval=0.05, ttl=60, alive=lambda: alive[0]).start()
    until(lambda: r.exists(worker_key("d0")), "r.exists(worker_key('d0'))")
    alive[0] = False
    until(
        lambda: not r.exists(worker_key("d0")) and hb.paused,
        "not r.exists(worker_key('d0')) and hb.paused",
    )
    assert not r.sismember(workers_set("decode"), "d0")
    alive[0] = True
    until(
        lambda: r.exists(worker_key("d0")) and not hb.paused,
        "r.exists(worker_key('d0')) and not hb.paused",
    )
    hb.stop()
