"""Reservations: pages held for a request whose KV a prefill worker pushes, from Reserve
through the KV commit to the Generate call that attaches, or to the end of a lease.

Engine thread only (the engine runs every call here through its command queue).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from decode_service.sequence import Sequence
from kernels.kv_cache import KVPool
from megaserve.errors import DuplicateRequest, RequestError, ReservationGone
from megaserve.kv.allocator import PageAllocator
from megaserve.kv.pages import claim_pages


@dataclass
class Reservation:
    """Pages held for one request; freed at `expires` unless a Generate call takes them."""

    request_id: str
    prompt: list[int]
    pages: list[int]
    cached_pages: int
    expires: float
    first_token: int | None = None  # set when the imported KV is committed
    waiter: Sequence | None = None  # the Generate call attached to this reservation


class Reservations:
    """The open reservations of one decode worker.

    on_ready(res) runs when a reservation has both its KV and an attached Generate call (the
    engine turns it into a running sequence); on_abort(seq) when a waiting call loses its
    reservation (dropped or expired).
    """

    def __init__(
        self,
        alloc: PageAllocator,
        pool: KVPool,
        attach_lease_s: float,
        on_ready: Callable[[Reservation], None],
        on_abort: Callable[[Sequence], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.alloc, self.pool, self.attach_lease_s = alloc, pool, attach_lease_s
        self.on_ready, self.on_abort, self.clock = on_ready, on_abort, clock
        self.open: dict[str, Reservation] = {}
        self.expired = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.open

    def __len__(self) -> int:
        return len(self.open)

    def __getitem__(self, request_id: str) -> Reservation:
        return self.open[request_id]

    def get(self, request_id: str) -> Reservation | None:
        return self.open.get(request_id)

    def reserve(self, request_id: str, prompt: list[int], lease_s: float) -> Reservation:
        """Holds the prompt's pages (prefix hits included); NoCapacity when the pool is full."""
        if request_id in self.open:
            raise DuplicateRequest(f"request_id {request_id!r} is already reserved or running")
        pages, hit = claim_pages(self.alloc, prompt)
        res = Reservation(request_id, list(prompt), pages, hit, self.clock() + lease_s)
        self.open[request_id] = res
        return res

    def drop(self, request_id: str) -> bool:
        """Frees a reservation (and aborts a call waiting on it); False if unknown."""
        res = self.open.pop(request_id, None)
        if res is None:
            return False
        self.alloc.release(res.pages)
        if res.waiter is not None:
            self.on_abort(res.waiter)
        return True

    def commit(self, request_id: str, first_token: int, k: np.ndarray, v: np.ndarray) -> None:
        """Writes the complete imported pages into the pool; the request may then start."""
        res = self.open.get(request_id)
        if res is None:
            raise ReservationGone(f"reservation {request_id!r} expired before its KV committed")
        self.pool.write_pages(np.asarray(res.pages[res.cached_pages :], np.int32), k, v)
        res.first_token = int(first_token)
        # The KV is in; a Generate call must now attach within the attach lease, or the pages
        # go back (a router that vanished between hand-off and Generate leaks nothing).
        res.expires = self.clock() + self.attach_lease_s
        if res.waiter is not None:
            self._start(res)

    def attach(self, seq: Sequence) -> None:
        """seq (a Generate call) takes over its reservation, now or once the KV commits."""
        res = self.open[seq.request_id]
        if res.prompt != seq.prompt:
            raise RequestError(
                f"request {seq.request_id!r}: prompt differs from the reserved prompt"
            )
        res.waiter = seq
        if res.first_token is not None:
            self._start(res)

    def expire(self) -> None:
        now = self.clock()
        for rid in [r for r, res in self.open.items() if res.expires <= now]:
            self.drop(rid)
            self.expired += 1

    def _start(self, res: Reservation) -> None:
        del self.open[res.request_id]
        self.on_ready(res)
