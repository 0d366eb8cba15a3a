"""The router's view of the cluster: workers, their load and cached blocks, sessions, ids.

Everything lives in Redis (megaserve.state_keys) so any number of stateless routers share
it. The view is refreshed in the background; when Redis is unreachable the router keeps its
last view (and a local session table) and catches up when Redis returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis
import structlog

from megaserve.futures import retrieve
from megaserve.redis_conn import async_client
from megaserve.state_keys import (
    PLACEMENTS_KEPT,
    inflight_key,
    placed_blocks_key,
    session_key,
    workers_set,
)
from router import costs, worker_view
from router.inflight import InflightConnection
from router.view_read import read_workers
from router.worker_view import WorkerView

log = structlog.get_logger("megaserve.router.state")
# A cancelled claim through redis-py is deleted twice, this far apart (see _unclaim_now).
UNCLAIM_AGAIN_S = 1.0
# Deletes KEYS[1] only while it holds ARGV[1] (the claim is this router's).
_UNCLAIM = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


class _Sometimes:
    """A warning that happens once per request, logged at most every `every_s` seconds with
    the count since the last one (`requests`)."""

    def __init__(self, every_s: float):
        self.every_s, self.at, self.count = every_s, 0.0, 0

    def warn(self, event: str, **kw) -> None:
        self.count += 1
        now = time.monotonic()
        if now >= self.at:
            log.warning(event, requests=self.count, **kw)
            self.at, self.count = now + self.every_s, 0


@dataclass
class Session:
    worker_id: str
    kv_tokens: int  # tokens whose KV the worker holds for this session (prompt + output)


class ClusterState:
    """Background-refreshed worker views plus session and in-flight-id operations."""

    def __init__(
        self,
        redis_url: str | None,
        refresh_s: float = 0.2,
        session_ttl_s: float = 600,
        share_placements: bool = True,
    ):
        # A redis:// URL or a redis+sentinel:// one (the client follows failovers); a bad URL
        # raises RedisURLError (a ValueError) naming it.
        self.redis = async_client(redis_url, timeout=0.5) if redis_url else None
        # In-flight ids on their own pipelined connection (None: through self.redis).
        self._ids = InflightConnection.for_url(redis_url, 0.5) if redis_url else None
        self.refresh_s, self.session_ttl_s = refresh_s, session_ttl_s
        self.share_placements = share_placements
        self.workers: dict[str, WorkerView] = {}
        self.redis_ok = False
        self.refreshes = 0
        self._sessions: dict[str, tuple[Session, float]] = {}  # local fallback, with expiry
        self._inflight: set[str] = set()
        self._claims = itertools.count()  # each claim's own value (owner#n): its undo's test
        self._task: asyncio.Task | None = None
        self._fresh = asyncio.Event()
        # claim()'s fallback to this router's own ids, and a cancelled claim's failed undo:
        # each logged at most every 10 s, not once per request.
        self._claim_fallbacks, self._unclaims_failed = _Sometimes(10.0), _Sometimes(10.0)
        self._pulse = asyncio.Event()  # replaced after every refresh attempt (wait_refresh)
        self._listeners: list[Callable[[], Awaitable[None]]] = []

    # -- worker view -------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())
        try:  # a first view before serving, if Redis answers quickly
            await asyncio.wait_for(self._fresh.wait(), timeout=2.0)
        except TimeoutError:
            log.warning("no worker state yet (Redis unreachable?); serving on")

    def add_listener(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Awaits fn() after every refresh, right as the new view becomes visible."""
        self._listeners.append(fn)

    async def wait_refresh(self, timeout: float) -> None:
        """Returns after the next refresh attempt, or after timeout seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._pulse.wait(), timeout=max(timeout, 0.0))

    async def _notify(self) -> None:
        for fn in self._listeners:
            try:
                await fn()
            except Exception as e:  # a listener's bug must not stop the view from refreshing
                log.exception("state listener failed", error=repr(e))

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._ids is not None:
            self._ids.close()
        if self.redis is not None:
            await self.redis.aclose()

    async def _loop(self) -> None:
        while True:
            t = time.thread_time()
            try:
                await self.refresh()
                if not self.redis_ok:
                    log.info("redis reachable; worker view live", workers=len(self.workers))
                self.redis_ok = True
                self._fresh.set()
            except (redis.RedisError, OSError) as e:
                if self.redis_ok:
                    log.warning("redis unreachable; serving on the last known view", error=str(e))
                self.redis_ok = False
            except Exception as e:  # a bad record must not stop the view from refreshing
                log.exception("state refresh failed", error=repr(e))
            pulse, self._pulse = self._pulse, asyncio.Event()
            pulse.set()
            # Not a request's cost: requests whose CPU laps span a refresh are not charged it.
            costs.charge_background(time.thread_time() - t)
            await asyncio.sleep(self.refresh_s)

    async def refresh(self) -> None:
        """Reads every registered worker, its load and its cached blocks."""
        if self.redis is None:
            return
        r = self.redis
        seen, stale = await read_workers(r, self.workers)
        self.workers = seen
        self.refreshes += 1
        await self._notify()  # listeners (readiness) follow the view as it changes
        if stale:  # expired members: tidy the sets so later refreshes stay cheap
            pipe = r.pipeline(transaction=False)
            for wid in stale:
                pipe.srem(workers_set("decode"), wid)
                pipe.srem(workers_set("prefill"), wid)
                pipe.delete(placed_blocks_key(wid))
            await pipe.execute()

    def expect(self, view: WorkerView, prompt: list[int]) -> None:
        """Records that view's worker is about to cache prompt's full blocks: in this
        router's view at once and, sharing placements, in Redis for the other routers (a
        write nobody waits for; expired entries are trimmed by the same write)."""
        new = view.expect_blocks(prompt)
        if not (new and self.share_placements and self.redis is not None):
            return
        key = placed_blocks_key(view.id)
        cmds = (  # (trimmed by count: by time would take this router's clock, not Redis's)
            ("XADD", key, "MAXLEN", PLACEMENTS_KEPT, "*", "b", ",".join(new)),
            ("PEXPIRE", key, 2 * int(worker_view.OPTIMISTIC_S * 1000)),
        )
        if self._ids is not None:
            self._ids.fire(*cmds)  # down: this placement is not shared (the next one tries)
        else:  # a TLS or Sentinel URL: through redis-py, off the request's path; a failed
            # write only loses this one shared placement
            asyncio.ensure_future(self._publish(cmds)).add_done_callback(retrieve)

    async def _publish(self, cmds) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for c in cmds:
            pipe.execute_command(*c)
        with contextlib.suppress(redis.RedisError, OSError):
            await pipe.execute()

    def pool(self, role: str, model: str) -> list[WorkerView]:
        return [w for w in self.workers.values() if w.info.role == role and w.info.model == model]

    def models(self) -> dict[str, list[WorkerView]]:
        out: dict[str, list[WorkerView]] = {}
        for w in self.workers.values():
            out.setdefault(w.info.model, []).append(w)
        return out

    # -- sessions ----------------------------------------------------------------------
    async def get_session(self, session_id: str) -> Session | None:
        if self.redis is not None:
            try:
                h = await self.redis.hgetall(session_key(session_id))
                if h:
                    h = {k.decode(): v.decode() for k, v in h.items()}
                    await self.redis.expire(session_key(session_id), int(self.session_ttl_s))
                    return Session(h["worker_id"], int(h["kv_tokens"]))
            except (redis.RedisError, OSError, KeyError, ValueError):
                pass  # fall back to this router's own table
        s = self._sessions.get(session_id)
        if s is None or s[1] < time.monotonic():
            return None
        return s[0]

    async def put_session(self, session_id: str, s: Session) -> None:
        self._sessions[session_id] = (s, time.monotonic() + self.session_ttl_s)
        if len(self._sessions) > 100_000:  # bound the fallback table
            now = time.monotonic()
            self._sessions = {k: v for k, v in self._sessions.items() if v[1] > now}
        if self.redis is None:
            return
        try:
            pipe = self.redis.pipeline()
            key = session_key(session_id)
            pipe.hset(key, mapping={"worker_id": s.worker_id, "kv_tokens": str(s.kv_tokens)})
            pipe.expire(key, int(self.session_ttl_s))
            await pipe.execute()
        except (redis.RedisError, OSError) as e:
            log.warning("session not saved in redis", session_id=session_id, error=str(e))

    # -- in-flight request ids -----------------------------------------------------------
    async def claim(self, request_id: str, owner: str, ttl_s: float, shared: bool = True) -> bool:
        """True if no other request with this id is in flight on any router (shared=False:
        an id only this router can have made, checked here alone)."""
        if request_id in self._inflight:
            return False
        self._inflight.add(request_id)
        if shared and self.redis is not None:
            key, px = inflight_key(request_id), int(ttl_s * 1000)
            value = f"{owner}#{next(self._claims)}"  # (a retry's claim is another value)
            try:
                if self._ids is not None:
                    ok = await self._ids.set_nx(key, value, px)
                else:
                    ok = await self.redis.set(key, value, nx=True, px=px)
                if not ok:
                    self._inflight.discard(request_id)
                    return False
            except asyncio.CancelledError:  # the client left mid-claim: its SET may land
                self._inflight.discard(request_id)
                self._unclaim(key, value, ttl_s)
                raise
            except (redis.RedisError, OSError) as e:  # only this router's own ids are checked
                self._claim_fallbacks.warn(
                    "redis unreachable; duplicate request ids checked on this router only",
                    error=str(e),
                )
        return True

    def _unclaim(self, key: str, value: str, ttl_s: float) -> None:
        """Deletes key, in the background (the caller is being cancelled), if it holds this
        claim's value: a claim cancelled before its reply may still have landed, and would
        refuse the client's retry under this id until it expires; a retry's own claim has
        another value."""
        with contextlib.suppress(RuntimeError):  # no loop left (shutdown): the key expires
            task = asyncio.ensure_future(self._unclaim_now(key, value, ttl_s))
            task.add_done_callback(retrieve)

    async def _unclaim_now(self, key: str, value: str, ttl_s: float) -> None:
        try:
            if self._ids is not None:  # after the SET on the same connection: Redis runs it after
                await self._ids.call("EVAL", _UNCLAIM, 1, key, value)
                return
            await self.redis.eval(_UNCLAIM, 1, key, value)
            # redis-py sent the SET on a connection of its own, which it dropped at the
            # cancel: a SET still on its way may land after the first delete.
            await asyncio.sleep(UNCLAIM_AGAIN_S)
            await self.redis.eval(_UNCLAIM, 1, key, value)
        except (redis.RedisError, OSError) as e:  # (a Redis that refuses EVAL, too)
            self._unclaims_failed.warn(
                "a cancelled claim's id could not be freed; if its SET landed, retries under "
                "it are refused until it expires",
                key=key,
                expires_in_s=ttl_s,
                error=str(e),
            )

    async def release(self, request_id: str, shared: bool = True) -> None:
        """Frees the id. On the pipelined connection the DEL is written and not waited for:
        the client had the request's last message before this ran, so waiting for Redis
        would order nothing, and cost a round trip per request. While that connection is
        down, redis-py (which connects afresh) deletes it: a key left behind would refuse
        the client's retry under this id until it expires (INFLIGHT_TTL_S)."""
        self._inflight.discard(request_id)
        if shared and self.redis is not None:
            key = inflight_key(request_id)
            if self._ids is not None and self._ids.fire(("DEL", key)):
                return
            try:
                await self.redis.delete(key)
            except (redis.RedisError, OSError):
                pass  # the key expires by itself
