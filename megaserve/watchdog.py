"""A worker's stall watchdog: how long the engine's step in flight has run; past stall_s the
worker stops offering itself (registration, health), past exit_s the process ends."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NoReturn

import structlog

log = structlog.get_logger("megaserve.watchdog")


class StallConfigError(ValueError):
    """A --stall-s / --stall-exit-s pair that cannot work (the values named)."""


@dataclass(frozen=True)
class StallConfig:
    """stall_s: a step running this long makes the worker not alive (its heartbeat withdraws
    its registration, so routers stop placing there and move its requests; its gRPC health
    says NOT_SERVING) until the step ends. exit_s: a step running this long ends the process
    (exit status 1), for its supervisor to restart. 0 turns either off.

    Why these defaults: a step's own compute is at most one prefill budget or one decode step
    (well under a second here), and every program is compiled at warm-up; a shape compiled
    on first use (--warm-up none) can take tens of seconds on CPU, hence a minute before
    the worker is given up on and five before it is ended (SGLang's watchdog: 300 s)."""

    stall_s: float = 60.0
    exit_s: float = 300.0

    def __post_init__(self):
        if self.stall_s < 0 or self.exit_s < 0:
            raise StallConfigError(
                f"--stall-s {self.stall_s} and --stall-exit-s {self.exit_s} must be >= 0"
            )
        if self.stall_s and self.exit_s and self.exit_s < self.stall_s:
            raise StallConfigError(
                f"--stall-exit-s {self.exit_s} must be 0 (never) or at least --stall-s "
                f"{self.stall_s}: a worker is withdrawn before it is ended"
            )


class StallWatch:
    """Times the spans (`with watch.span():`) one thread runs its steps in. `alive()` is False
    while the span in flight is older than stall_s; once started, a thread logs the stall
    (once each way) and calls `on_stuck(why)` when a span passes exit_s."""

    def __init__(self, cfg: StallConfig = StallConfig(), what: str = "engine step", poll_s=0.25):
        self.cfg, self.what, self.poll_s = cfg, what, poll_s
        self._since: float | None = None  # monotonic start of the span in flight
        self.done_at = time.monotonic()  # when the last span ended
        self.stalls = 0  # spans that passed stall_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None
            self.done_at = time.monotonic()

    def stalled_for(self) -> float:
        since = self._since  # one read: the owning thread may end the span meanwhile
        return 0.0 if since is None else time.monotonic() - since

    def alive(self) -> bool:
        return not self.cfg.stall_s or self.stalled_for() < self.cfg.stall_s

    def start(self, on_stuck: Callable[[str], object]) -> StallWatch:
        """Starts the watching thread (none when both limits are off)."""
        if self.cfg.stall_s or self.cfg.exit_s:
            self._thread = threading.Thread(
                target=self._watch, args=(on_stuck,), name="stall-watch", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, on_stuck: Callable[[str], object]) -> None:
        stalled = False
        while not self._stop.wait(self.poll_s):
            stuck = self.stalled_for()
            if self.cfg.exit_s and stuck > self.cfg.exit_s:
                on_stuck(f"{self.what} running for {stuck:.1f} s (limit {self.cfg.exit_s} s)")
            if not self.alive() and not stalled:
                stalled = True
                self.stalls += 1
                log.warning("stalled; not serving", what=self.what, running_s=round(stuck, 1))
            elif self.alive() and stalled:
                stalled = False
                log.info("moving again; serving", what=self.what)


def exit_process(event: str, why: str, before: Callable[[], object]) -> NoReturn:
    """Logs `event` with `why`, runs `before` (leaving Redis), and ends the process with status
    1 at once: the thread that is stuck cannot be joined, and a clean exit would wait on it."""
    log.error(event, why=why)
    try:
        before()
    finally:
        os._exit(1)
