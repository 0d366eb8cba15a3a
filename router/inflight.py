"""The router's hot-path Redis commands (the in-flight ids' SET NX PX; their DEL and the
placements it shares, fire-and-forget) on a connection of their own:
written as they come and answered in order, so concurrent requests share round trips and a
command costs one write and one read, not a pass through redis-py's pool and retry layers
(measured: 12 vs 59 us of CPU a command). Plain redis:// and unix:// URLs only; TLS and
Sentinel URLs keep redis-py (ClusterState falls back to it)."""

from __future__ import annotations

import asyncio
from collections import deque

import redis
import redis.connection

from megaserve.futures import retrieve

_SUPPORTED = {"host", "port", "db", "username", "password", "path", "connection_class"}


def _encode(*args) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


class _Replies(asyncio.Protocol):
    """Matches replies to the commands' futures in order. Replies are RESP2 lines: +OK,
    -error, :n, $-1 (nil), or a bulk string (its text is the value)."""

    def __init__(self):
        # In command order; None: a fire-and-forget command's reply (read and dropped).
        self.waiters: deque[asyncio.Future | None] = deque()
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n")) >= 0:
            line = bytes(self.buf[:end])
            if line[:1] == b"$" and line != b"$-1":  # a bulk string: its data line follows
                n = int(line[1:])
                if len(self.buf) < end + 2 + n + 2:
                    return
                line = b"+" + bytes(self.buf[end + 2 : end + 2 + n])
                end += 2 + n
            del self.buf[: end + 2]
            if not self.waiters:  # a reply nobody asked for: the stream is out of step
                self.transport.close()
                return
            w = self.waiters.popleft()
            if w is not None and not w.done():  # (a caller that timed out or was cancelled
                w.set_result(line)  # still takes its turn)

    def connection_lost(self, exc) -> None:
        err = redis.ConnectionError(f"connection to Redis lost: {exc or 'closed'}")
        while self.waiters:
            w = self.waiters.popleft()
            if w is not None and not w.done():
                w.set_exception(err)


class InflightConnection:
    """One lazily (re)connected Redis connection; every failure is a redis.RedisError (or an
    OSError while connecting), which callers treat as Redis being unreachable."""

    def __init__(self, url: str, timeout: float):
        kw = redis.connection.parse_url(url)
        if set(kw) - _SUPPORTED or kw.get("connection_class") not in (
            None,
            redis.connection.UnixDomainSocketConnection,
        ):
            raise ValueError(f"not a plain redis:// or unix:// URL: {sorted(kw)}")
        self.kw, self.timeout = kw, timeout
        self._replies: _Replies | None = None
        self._connecting: asyncio.Task | None = None

    @classmethod
    def for_url(cls, url: str, timeout: float) -> InflightConnection | None:
        """One for a plain URL; None for a TLS or Sentinel one (redis-py serves those)."""
        if not url.startswith(("redis://", "unix://")):
            return None
        try:
            return cls(url, timeout)
        except ValueError:
            return None

    async def _connect(self) -> _Replies:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.timeout):
            if "path" in self.kw:
                _, replies = await loop.create_unix_connection(_Replies, self.kw["path"])
            else:
                _, replies = await loop.create_connection(
                    _Replies, self.kw.get("host", "localhost"), self.kw.get("port", 6379)
                )
            try:
                if self.kw.get("password") is not None:
                    user = self.kw.get("username")
                    auth = (
                        ("AUTH", user, self.kw["password"])
                        if user
                        else ("AUTH", self.kw["password"])
                    )
                    await self._send(replies, *auth)
                if self.kw.get("db"):
                    await self._send(replies, "SELECT", self.kw["db"])
            except BaseException:
                replies.transport.close()
                raise
        return replies

    async def _ready(self) -> _Replies:
        r = self._replies
        if r is not None and not r.transport.is_closing():
            return r
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            self._replies = await asyncio.shield(self._connecting)
        except TimeoutError as e:
            raise redis.TimeoutError(f"connecting to Redis took over {self.timeout} s") from e
        return self._replies

    async def _send(self, replies: _Replies, *args) -> bytes:
        fut = asyncio.get_running_loop().create_future()
        replies.waiters.append(fut)
        replies.transport.write(_encode(*args))  # in the same order as the futures
        try:
            async with asyncio.timeout(self.timeout):
                line = await fut
        except TimeoutError as e:
            raise redis.TimeoutError(f"Redis did not answer {args[0]} in {self.timeout} s") from e
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:].decode(errors="replace"))
        return line

    async def call(self, *args) -> bytes:
        """Any command; its reply line (an error reply raises redis.ResponseError)."""
        return await self._send(await self._ready(), *args)

    async def set_nx(self, key: str, value: str, px: int) -> bool:
        """SET key value NX PX px: True if the key was free (and is now set)."""
        return await self._send(await self._ready(), "SET", key, value, "NX", "PX", px) == b"+OK"

    def fire(self, *commands: tuple) -> bool:
        """Writes `commands` (each a tuple of arguments) with no one waiting for their replies
        (an error reply is dropped too); False, and nothing sent, while the connection is
        down (a connect starts in the background, for later calls)."""
        r = self._replies
        if r is None or r.transport.is_closing():
            if self._connecting is None or self._connecting.done():
                # A failed connect is retrieved: the next call tries again.
                asyncio.ensure_future(self._ready()).add_done_callback(retrieve)
            return False
        r.waiters.extend([None] * len(commands))
        r.transport.write(b"".join(_encode(*c) for c in commands))
        return True

    def close(self) -> None:
        if self._replies is not None:
            self._replies.transport.close()
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
