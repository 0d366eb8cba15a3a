"""Workers that left the router's view: one whose heartbeat expired (a frozen process, a
partitioned or powered-off host: nothing closes its connections) is gone after a grace, and
the requests waiting on it fail over as a dead worker's would, instead of waiting forever."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

import structlog

from router.absence import Absences

log = structlog.get_logger("megaserve.router")


class WorkerWatch:
    """Follows the worker addresses in the view (`update` after every refresh). One absent
    for `grace_s` is gone: `on_gone(address, why)` runs once, and every future from `gone()`
    that names it completes with the address.

    The grace covers a Redis that restarted empty or failed over: its workers register again
    at their next heartbeat (0.5 s), before their requests are moved for nothing."""

    def __init__(
        self,
        grace_s: float,
        on_gone: Callable[[str, str], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.grace_s, self._on_gone, self._clock = grace_s, on_gone, clock
        self._known: set[str] = set()
        self._absent = Absences()  # known addresses missing from the view
        self._waiters: dict[str, set[asyncio.Future]] = {}

    def update(self, addresses: Iterable[str]) -> list[str]:
        """Takes the view's addresses now; returns the addresses found gone by this call."""
        present = set(addresses)
        self._known |= present
        gone = self._absent.follow(self._known, present, self._clock(), self.grace_s)
        for a in gone:
            self._known.discard(a)
            why = f"worker {a} left the view: its heartbeat expired over {self.grace_s:g} s ago"
            log.warning("worker gone; its requests move", address=a, grace_s=self.grace_s)
            self._on_gone(a, why)
            for f in self._waiters.pop(a, set()):
                if not f.done():
                    f.set_result(a)
        return gone

    def gone(self, *addresses: str) -> asyncio.Future:
        """A future completed with the first of `addresses` found gone; cancel it once it is
        no longer wanted (that unregisters it)."""
        f = asyncio.get_running_loop().create_future()
        for a in addresses:
            self._waiters.setdefault(a, set()).add(f)

        def forget(_):
            for a in addresses:
                ws = self._waiters.get(a)
                if ws is not None:
                    ws.discard(f)
                    if not ws:
                        del self._waiters[a]

        f.add_done_callback(forget)
        return f

    @property
    def waiting(self) -> int:
        """Futures registered (a leak check for tests)."""
        return sum(len(ws) for ws in self._waiters.values())
