"""Redis clients from a `--redis-url`: a plain Redis URL, or the Sentinels in front of one.

Plain URLs (`redis://`, `rediss://`, `unix://`) go to redis-py's `from_url` unchanged. A
Sentinel URL names the Sentinels, the service they monitor and the db:

    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]
                     [?sentinel_password=...]

(port 26379 when omitted, db 0; IPv6 hosts in brackets). `user`/`password` authenticate to the
Redis primary, `sentinel_password` to the Sentinels. The client is Sentinel's `master_for`:
every new connection asks the Sentinels for the current primary, so once a failover promotes
the replica, the next connection (the next heartbeat or view refresh after the error) goes
to it; a connection still open to a demoted primary gets READONLY, which redis-py turns into
a reconnect. While the old primary is down but not yet replaced, the Sentinels report no
healthy primary and the client raises `MasterNotFoundError` (a `redis.ConnectionError`), so
callers' usual "Redis unreachable" handling covers the failover.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel

SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
SENTINEL_FORM = "redis+sentinel://[:password@]host[:port][,host[:port]...]/service[/db]"
FORMS = f"redis://host:port/db, rediss://..., unix:///path or {SENTINEL_FORM}"
_QUERY_KEYS = {"sentinel_password"}
_PLAIN = ("redis://", "rediss://", "unix://")


class RedisURLError(ValueError):
    """A --redis-url that is neither a Redis URL nor a Sentinel URL (the message names it)."""


@dataclass(frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def redact(url: str) -> str:
    """url with any password replaced by *** (for messages and logs)."""
    url = re.sub(r"(?<=://)([^/@]*?):[^/@]*@", r"\1:***@", url)
    return re.sub(r"(sentinel_password=)[^&#]*", r"\1***", url)


def is_sentinel(url: str) -> bool:
    return url.partition("://")[0].lower() == SENTINEL_SCHEME


def _bad(url: str, why: str) -> RedisURLError:
    return RedisURLError(f"bad Redis URL {redact(url)!r}: {why} (expected {FORMS})")


def _host_port(url: str, entry: str) -> tuple[str, int]:
    if entry.startswith("["):  # [v6]:port
        host, _, rest = entry[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise _bad(url, f"sentinel {entry!r} is not [host]:port")
        port = rest[1:]
    else:
        host, _, port = entry.partition(":")
        if ":" in port:
            raise _bad(url, f"sentinel {entry!r}: put IPv6 addresses in brackets")
    if not host:
        raise _bad(url, f"sentinel {entry!r} has no host")
    if not port:
        return host, SENTINEL_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise _bad(url, f"sentinel {entry!r} has no valid port")
    return host, int(port)


def parse_sentinel_url(url: str) -> SentinelURL:
    """The parts of a redis+sentinel:// URL; RedisURLError naming it if malformed."""
    if not is_sentinel(url):
        raise _bad(url, f"not a {SENTINEL_SCHEME}:// URL")
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise _bad(url, str(e)) from e
    if parts.fragment:
        raise _bad(url, "a #fragment means nothing here")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")  # as redis:// does: "name@" is a user
        username, password = unquote(user) or None, (unquote(pw) if colon else None)
    if not hosts:
        raise _bad(url, "no sentinel host")
    sentinels = tuple(_host_port(url, e) for e in hosts.split(","))
    path = [unquote(p) for p in parts.path.split("/")[1:]]
    if path and path[-1] == "":
        path.pop()  # a trailing slash
    if not path or not path[0] or len(path) > 2:
        raise _bad(url, "the path must be /service or /service/db")
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise _bad(url, f"db {path[1]!r} is not a number")
        db = int(path[1])
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = set(query) - _QUERY_KEYS
    if unknown:
        raise _bad(url, f"unknown parameters {sorted(unknown)} (only {sorted(_QUERY_KEYS)})")
    sentinel_password = query["sentinel_password"][-1] if "sentinel_password" in query else None
    return SentinelURL(sentinels, path[0], db, username, password, sentinel_password or None)


def validate(url: str) -> None:
    """RedisURLError naming url unless it is a Redis or Sentinel URL the clients accept."""
    if is_sentinel(url):
        parse_sentinel_url(url)
        return
    if not url.startswith(_PLAIN):  # redis-py's own test (case-sensitive)
        raise _bad(url, "unknown scheme")
    try:
        redis.connection.parse_url(url)
    except ValueError as e:
        raise _bad(url, str(e)) from e


def url_argument(value: str) -> str:
    """argparse `type` of --redis-url: the URL as given, or a usage error naming it."""
    try:
        validate(value)
    except RedisURLError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return value


def _sentinel_args(s: SentinelURL, timeout: float) -> tuple[dict, dict]:
    """(kwargs for the Sentinel connections, kwargs for the primary's connections)."""
    sockets = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    sentinel = {**sockets, "password": s.sentinel_password}
    primary = {**sockets, "db": s.db, "username": s.username, "password": s.password}
    return sentinel, primary


class _SentinelMaster(redis.Redis):
    """master_for's client; closing it also closes its connections to the Sentinels."""

    def close(self) -> None:
        super().close()
        self.connection_pool.sentinel_manager.close()


class _AsyncSentinelMaster(aredis.Redis):
    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        await self.connection_pool.sentinel_manager.aclose()


def sync_client(url: str, timeout: float) -> redis.Redis:
    """A blocking client (socket and connect timeouts `timeout` s) for a Redis or Sentinel URL."""
    validate(url)
    if not is_sentinel(url):
        return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    s = parse_sentinel_url(url)
    sentinel_kw, primary_kw = _sentinel_args(s, timeout)
    manager = Sentinel(list(s.sentinels), sentinel_kwargs=sentinel_kw, **primary_kw)
    return manager.master_for(s.service, redis_class=_SentinelMaster)


def async_client(url: str, timeout: float) -> aredis.Redis:
    """An asyncio client (socket and connect timeouts `timeout` s) for a Redis or Sentinel URL."""
    validate(url)
    if not is_sentinel(url):
        return aredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    s = parse_sentinel_url(url)
    sentinel_kw, primary_kw = _sentinel_args(s, timeout)
    manager = AsyncSentinel(list(s.sentinels), sentinel_kwargs=sentinel_kw, **primary_kw)
    return manager.master_for(s.service, redis_class=_AsyncSentinelMaster)
