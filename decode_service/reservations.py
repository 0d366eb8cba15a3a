"""Reservations: pages held for a request whose KV a prefill worker pushes, from Reserve
through the KV commit to the Generate call that attaches, or to the end of a lease.

Engine thread only (the engine runs every call here through its command queue).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
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
    pushing: bool = False  # a KV push into it began (a second one at once is refused)
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

    def write(self, res: Reservation, blocks: list[tuple[int, Any, Any]]) -> bool:
        """Writes imported pages into `res`'s pages before its commit (nothing reads them
        until then). False, writing nothing, when res is no longer open (expired, dropped,
        replaced under the same id: its pages may be someone else's now) or committed."""
        if self.open.get(res.request_id) is not res or res.first_token is not None:
            return False
        pages = np.asarray(res.pages[res.cached_pages :], np.int32)
        for off, k, v in blocks:
            self.pool.write_pages(pages[off : off + k.shape[1]], k, v)
        return True

    def commit(self, res: Reservation, first_token: int, blocks: list) -> None:
        """Writes the last imported pages into the pool; the request may then start.

        `blocks`: (offset, K, V) with K/V [L, n, page_size, Hkv, D] for the reservation's
        pages cached_pages + offset, ...; the others were written by `write` before."""
        if self.open.get(res.request_id) is not res:
            raise ReservationGone(f"reservation {res.request_id!r} expired before its KV committed")
        self.write(res, blocks)
        # Committed means in the pool: a failed write fails this push, not the next step.
        jax.block_until_ready((self.pool.k, self.pool.v))
        res.first_token = int(first_token)
        # The KV is in; a Generate call must now attach within the attach lease, or the pages
        # go back (a router that vanished between hand-off and Generate leaks nothing).
        res.expires = self.clock() + self.attach_lease_s
        if res.waiter is not None:
            self._start(res)

    def attach(self, seq: Sequence) -> bool:
        """seq (a Generate call) takes over its reservation, now or once the KV commits;
        False when it is gone (dropped or expired after the caller saw it)."""
        res = self.open.get(seq.request_id)
        if res is None:
            return False
        if res.prompt != seq.prompt:
            raise RequestError(
                f"request {seq.request_id!r}: prompt differs from the reserved prompt"
            )
        res.waiter = seq
        if res.first_token is not None:
            self._start(res)
        return True

    def expire(self) -> None:
        now = self.clock()
        for rid in [r for r, res in self.open.items() if res.expires <= now]:
            self.drop(rid)
            self.expired += 1

    def _start(self, res: Reservation) -> None:
        del self.open[res.request_id]
        self.on_ready(res)
