"""The decode engine's KV import side: Reserve, page writes and commits from other threads,
run on the engine thread; the imported request's start, or its waiting call's end."""

from __future__ import annotations

from concurrent.futures import Future

from decode_service.reservations import Reservation, Reservations
from decode_service.sequence import Sequence
from megaserve.errors import DuplicateRequest
from megaserve.finish import FinishReason


class ImportedKV:
    """Mixed into DecodeEngine, which owns `reservations`, `_live`, the scheduler and the
    command queue (`_call`, `_submit`)."""

    reservations: Reservations

    def reserve(self, request_id: str, prompt: list[int], lease_s: float) -> Reservation:
        """Holds pages for prompt (prefix hits included) until KV arrives or the lease ends.

        A reservation is a request that will queue here: a full queue refuses it now
        (NoCapacity), before a prefill worker computes KV that could not be used."""
        self.validate(prompt, 1)
        if request_id in self._live:
            raise DuplicateRequest(f"request_id {request_id!r} is already reserved or running")
        self._check_queue(len(self.reservations))
        return self._call(self.reservations.reserve, request_id, prompt, lease_s)

    def reservation(self, request_id: str) -> Reservation | None:
        return self.reservations.get(request_id)

    def drop_reservation(self, request_id: str) -> bool:
        """Frees a reservation (e.g. after a failed transfer); False if unknown."""
        return self._call(self.reservations.drop, request_id)

    def write_import(self, res: Reservation, blocks: list) -> Future:
        """Writes blocks of imported pages (KVImport.take_ready) into `res`'s pages ahead of
        its commit, on the engine thread; returns at once (a Future of whether it wrote)."""
        return self._submit(self.reservations.write, res, blocks)

    def commit_import(self, res: Reservation, first_token: int, blocks: list) -> None:
        """Writes the last imported pages (KVImport.take_ready) and readies the request;
        ReservationGone when `res` is no longer open."""
        self._call(self.reservations.commit, res, first_token, blocks)

    @property
    def expired_reservations(self) -> int:
        return self.reservations.expired

    def _start_imported(self, res: Reservation) -> None:
        """The reservation's pages become the sequence's; it decodes from the first token."""
        seq = res.waiter
        seq.pages = res.pages
        seq.num_computed = len(seq.prompt)
        seq.num_cached_tokens = res.cached_pages * self.cfg.page_size
        seq.num_registered = res.cached_pages
        self.sched.register_full_pages(seq)
        seq.arrival_step = self.steps
        self.imported_requests += 1
        self._emit(seq, [res.first_token], first=True)
        if seq.finish_reason is None:
            self.sched.add_ready(seq)

    def _abort_waiter(self, seq: Sequence) -> None:
        """A Generate call waiting on a reservation that was dropped or expired."""
        self._send(seq, [], FinishReason.ABORT, True)
        self._forget(seq.request_id)
