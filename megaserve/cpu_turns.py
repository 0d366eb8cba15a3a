"""Workers sharing one CPU host take turns computing (`--cpu-turns PATH`): one step each."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


class CpuTurns:
    """A lock every worker given the same path holds while it computes one step (a decode
    iteration, a prefill call), handed over in turn when more than one is waiting.

    Why: a decode worker and a prefill worker on the same cores otherwise compute at once,
    each at about half speed (each one's XLA thread pool, sized to the whole machine,
    oversubscribed). Taking turns gives each step the whole machine and a decode step
    between any two prefill calls, as a colocated worker's iterations do. Measured on two
    cores (docs/benchmarks.md, bench serve --cpu-turns): shorter first tokens and longer
    gaps between tokens, a trade-off like a lower nice for decode, so it is opt-in.
    Uncontended, a turn is four flock(2) calls.

    Fairness is a turnstile of two flock(2) locks (the gate, then the turn itself; the gate
    is let go once the turn is held): a worker that ends its turn and wants another queues
    at the gate behind the one already waiting for the turn, so two workers alternate. The
    kernel drops the locks of a worker that dies holding them. flock(2) releases the GIL
    while it waits."""

    def __init__(self, path: str | os.PathLike):
        p = Path(path)  # its directory is checked with the flag (worker_args.turns_path)
        # Separate open files: flock(2) locks belong to an open file description.
        self._turn = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
        self._gate = os.open(p.with_name(p.name + ".gate"), os.O_RDWR | os.O_CREAT, 0o600)
        self.turns = 0
        self.waited_s = 0.0  # time spent waiting for turns (another worker was computing)

    def __enter__(self) -> CpuTurns:
        t = time.monotonic()
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._turn, fcntl.LOCK_EX)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        self.turns += 1
        self.waited_s += time.monotonic() - t
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._turn, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in (self._turn, self._gate):
            os.close(fd)


class NoTurns:
    """No other worker shares the cores: steps compute whenever they are ready."""

    turns = 0
    waited_s = 0.0

    def __enter__(self) -> NoTurns:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def close(self) -> None:
        return None


def cpu_turns(path: str | None) -> CpuTurns | NoTurns:
    """Turns on `path` (shared by the workers on this host), or none when path is empty."""
    return CpuTurns(path) if path else NoTurns()
