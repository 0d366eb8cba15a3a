"""The jax-transfer offers of one KV push and their end: settled once the decode worker has
pulled them, taken back (`jax_transfer.withdraw`) where it never will."""

from __future__ import annotations

import threading

import structlog

from megaserve import jax_transfer
from megaserve.rpc import kv_transfer_pb2

log = structlog.get_logger("megaserve.prefill")


class PushOffers:
    """Which offers were made (prefill thread), which went to the decode worker in what order
    (event loop), and how many of those it started to pull (its refusal says: the
    `kv_pulls_started` entry of its status, `decode_service/kv_service.py`)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._lock = threading.Lock()
        self.made: list[int] = []
        self.written: list[int] = []
        self.pulls_started: int | None = None  # None: not reported (the receiver broke)
        self.ended = False

    def made_one(self, msg: kv_transfer_pb2.KVPush) -> None:
        """An offered chunk (from `wire.pull_message`); one made after the push ended (a
        chunk that finished computing as it was dropped) is taken back at once."""
        uuid = msg.chunk.pull.uuid
        with self._lock:
            if not self.ended:
                self.made.append(uuid)
                return
        jax_transfer.withdraw([uuid])

    def writing(self, msg: kv_transfer_pb2.KVPush) -> None:
        """`msg` is about to be written to the decode worker (the trailer is skipped)."""
        if msg.HasField("chunk"):
            self.written.append(msg.chunk.pull.uuid)

    def end(self, committed: bool) -> None:
        """The push is over: a committed push was pulled whole; otherwise the chunks the
        decode worker started to pull are left to the server and the rest taken back (in a
        thread: a pull each). Unreported (the decode worker died, or this call was cut),
        every written chunk may have been pulled: those are left, and logged."""
        with self._lock:
            self.ended = True
            made = list(self.made)
        if committed or not made:
            jax_transfer.settle(made)
            return
        n = self.pulls_started
        pulled = set(self.written if n is None else self.written[:n])
        jax_transfer.settle(pulled)
        rest = [u for u in made if u not in pulled]
        jax_transfer.withdraw(rest, wait=False)
        if n is None and pulled:
            log.warning(
                "jax-transfer offers left held: the decode worker did not say which it pulled",
                request_id=self.request_id,
                offers=len(pulled),
                taken_back=len(rest),
            )
