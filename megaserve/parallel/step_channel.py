"""The leader's broadcast of each group call to the other processes of its group: a fixed-size
header (kind, payload length, and the payload itself when it fits), then a larger payload in a
power-of-two bucket or 1 MiB chunks, each one `broadcast_one_to_all` (a psum over every device
of the group)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

HEADER_BYTES = 4096  # one compiled broadcast for every call whose payload fits in it
_PREFIX = 16  # int64 kind, int64 payload length
INLINE_BYTES = HEADER_BYTES - _PREFIX
CHUNK_BYTES = 1 << 20  # larger payloads (KV page writes) go in pieces of this size


def body_sizes(n: int) -> list[int]:
    """The broadcasts after the header that carry an n-byte payload: none when it fits in
    the header, else one power-of-two bucket up to CHUNK_BYTES, else whole chunks, so every
    payload size compiles one of 9 programs and pads less than a chunk."""
    if n <= INLINE_BYTES:
        return []
    if n <= CHUNK_BYTES:
        return [max(2 * HEADER_BYTES, 1 << (n - 1).bit_length())]
    return [CHUNK_BYTES] * -(-n // CHUNK_BYTES)


def _broadcast(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(x)


class StepChannel:
    """Process 0 sends (kind, payload bytes); every other process receives them, in order.

    Every process must make the same sequence of calls (send on process 0, receive on the
    others): each is a collective. `broadcast` is injectable for tests (one process)."""

    def __init__(self, broadcast: Callable[[np.ndarray], np.ndarray] = _broadcast):
        self._broadcast = broadcast
        self.messages = 0
        self.bytes = 0  # payload bytes sent or received, headers not counted

    def send(self, kind: int, payload: bytes) -> None:
        n = len(payload)
        header = np.zeros(HEADER_BYTES, np.uint8)  # u8[HEADER_BYTES]
        header[:_PREFIX] = np.array([kind, n], np.int64).view(np.uint8)
        data = np.frombuffer(payload, np.uint8)
        if n <= INLINE_BYTES:
            header[_PREFIX : _PREFIX + n] = data
        self._broadcast(header)
        start = 0
        for size in body_sizes(n):
            piece = np.zeros(size, np.uint8)  # u8[size], zero past the payload's end
            piece[: min(size, n - start)] = data[start : start + size]
            self._broadcast(piece)
            start += size
        self.messages += 1
        self.bytes += n

    def receive(self) -> tuple[int, bytes]:
        header = self._broadcast(np.zeros(HEADER_BYTES, np.uint8))
        kind, n = (int(x) for x in np.asarray(header[:_PREFIX]).view(np.int64))
        if n <= INLINE_BYTES:
            payload = header[_PREFIX : _PREFIX + n].tobytes()
        else:
            pieces = [self._broadcast(np.zeros(size, np.uint8)) for size in body_sizes(n)]
            payload = np.concatenate(pieces)[:n].tobytes()
        self.messages += 1
        self.bytes += n
        return kind, payload
