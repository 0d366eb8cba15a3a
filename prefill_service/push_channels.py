"""The prefill worker's channels to decode workers: one per address, the least recently
used closed once more addresses than a bound were asked for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

# Distinct decode workers a prefill worker keeps a channel to. Every Prefill call names its
# decode_address: without a bound, callers naming ever new addresses (workers replaced by a
# rolling deploy, a misbehaving client) would grow the table and its sockets for good. Well
# above a deployment's decode workers: past it, a rotation over them reconnects every push.
MAX_CHANNELS = 512
# An evicted channel's pushes in flight get this long to end before they are cancelled (a
# push is bounded by its reservation's lease, 60 s by default).
CLOSE_GRACE_S = 120.0


class PushChannels:
    """address -> grpc.aio channel, most recently used kept (used on the event loop)."""

    def __init__(self, make: Callable[[str], grpc.aio.Channel], limit: int = MAX_CHANNELS):
        if limit < 1:
            raise ValueError(f"limit={limit} must be >= 1")
        self._make, self.limit = make, limit
        self._open: dict[str, grpc.aio.Channel] = {}  # insertion order = least recent first
        self._closing: set[asyncio.Task] = set()  # (referenced until done)

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, address: str) -> bool:
        return address in self._open

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self._open.pop(address, None)
        if ch is None:
            ch = self._make(address)
            while len(self._open) >= self.limit:
                self._close(self._open.pop(next(iter(self._open))), CLOSE_GRACE_S)
        self._open[address] = ch  # now the most recently used
        return ch

    async def close(self) -> None:
        """Closes every channel now (pushes in flight are cancelled) and waits for them."""
        for ch in self._open.values():
            self._close(ch, None)
        self._open.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)

    def _close(self, ch: grpc.aio.Channel, grace: float | None) -> None:
        task = asyncio.ensure_future(ch.close(grace))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
