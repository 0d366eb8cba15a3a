"""The engine thread's command queue: calls from other threads (Reserve, KV writes and
commits, attaches, drops) run on the engine thread, between iterations or while a decode
step computes on the device."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

import structlog

log = structlog.get_logger("megaserve.decode")
# How often a wait for the step in flight looks at its results (a queue wait's timeout): a
# command is served at once; the step's end is noticed within this.
STEP_POLL_S = 0.001


class Commands:
    """Mixed into DecodeEngine, which owns `_commands` (a Queue), `_wake` and `_thread`."""

    _commands: queue.Queue
    _wake: threading.Event
    _thread: threading.Thread | None

    def _call(self, fn, *args):
        """Runs fn on the engine thread (the allocator is single-threaded) and waits."""
        return self._submit(fn, *args).result(timeout=30)

    def _submit(self, fn, *args) -> Future:
        """Queues fn for the engine thread (commands run in order); returns its Future."""
        fut: Future = Future()
        self._commands.put((fut, fn, args))
        self._wake.set()
        if self._thread is None:  # not started (unit tests drive run_once themselves)
            self._run_commands()
        return fut

    def _run_commands(self) -> None:
        """Runs every queued command (engine thread)."""
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            _run(item)

    def _serve_until(self, done: Callable[[], bool]) -> None:
        """Runs commands as they arrive until done() (the decode step on the device has its
        results), then returns. Engine thread; the runner calls it right after dispatching
        the step. Why: a command waiting for the step's end waits 0-1 step (~70 ms at batch
        4 on CPU), and a disaggregated request's Reserve and attach each waited that."""
        while not done():
            try:
                item = self._commands.get(timeout=STEP_POLL_S)
            except queue.Empty:
                continue
            _run(item)


def _run(item: tuple[Future, Callable, tuple]) -> None:
    """Runs a command even if its caller cancelled the Future meanwhile (a KV push whose
    sender left: what it asked for still happens, in order); the answer then goes nowhere,
    and never out of the step that serves it (it would fail the step's whole batch)."""
    fut, fn, args = item
    try:
        out = fn(*args)
    except Exception as e:  # surfaced to the caller's thread
        if fut.cancelled():  # no caller left to see it
            log.exception("engine command failed", command=getattr(fn, "__name__", repr(fn)))
        with contextlib.suppress(InvalidStateError):
            fut.set_exception(e)
        return
    with contextlib.suppress(InvalidStateError):
        fut.set_result(out)
