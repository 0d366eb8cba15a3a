"""structlog configured for JSON lines on stderr (request ids travel as bound fields); with
`background`, lines are rendered and written by a writer thread instead of the caller."""

from __future__ import annotations

import atexit
import collections
import datetime
import logging
import sys
import threading
import time

import structlog

_UTC = datetime.UTC
_writer: _Writer | None = None  # configure(background=True)'s


def _iso(t: float) -> str:
    """structlog's TimeStamper(fmt="iso") text for the UNIX time t."""
    return datetime.datetime.fromtimestamp(t, tz=_UTC).isoformat().replace("+00:00", "Z")


class _Writer:
    """Renders queued event dicts to JSON lines on a daemon thread that wakes every
    `INTERVAL_S`: a logging caller appends to a deque and wakes no one (a put to a waiting
    queue was a futex wake-up per line, CPU charged to the event loop's request path). The
    writer renders one line at a time with the GIL let go between lines, so the event loop
    never waits behind a whole batch, then writes the batch in one call."""

    INTERVAL_S = 0.02

    def __init__(self, stream):
        self.stream, self.q = stream, collections.deque()
        self.render = structlog.processors.JSONRenderer()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="log-writer")
        self.thread.start()
        atexit.register(self.close)

    def enqueue(self, _logger, _method, event_dict) -> str:
        """The last processor: the caller pays for a dict and an append, not JSON, a write or
        a wake-up. The timestamp is taken now and formatted later."""
        event_dict["timestamp"] = time.time()
        self.q.append(event_dict)
        return ""  # to a ReturnLogger: no output of its own

    def _line(self, ev: dict) -> str:
        ev["timestamp"] = _iso(ev["timestamp"])
        return self.render(None, "", ev)

    def _drain(self) -> None:
        lines = []
        while self.q:
            lines.append(self._line(self.q.popleft()) + "\n")
            time.sleep(0)  # lets go of the GIL: the event loop runs between lines
        if not lines:
            return
        try:
            self.stream.write("".join(lines))
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed or gone: nothing to tell
            pass

    def _run(self) -> None:
        while not self.stopping.wait(self.INTERVAL_S):
            self._drain()
        self._drain()

    def cpu_seconds(self) -> float:
        """The writer thread's CPU time so far (what the callers no longer pay)."""
        ident = self.thread.ident
        if ident is None or not self.thread.is_alive():
            return 0.0
        return time.clock_gettime(time.pthread_getcpuclockid(ident))

    def close(self, timeout: float = 2.0) -> None:
        """Writes what is queued (at exit: no line logged before it is lost)."""
        if self.thread.is_alive():
            self.stopping.set()
            self.thread.join(timeout)


def writer_cpu_seconds() -> float:
    """CPU time of the background log writer so far (0 without one)."""
    return _writer.cpu_seconds() if _writer is not None else 0.0


def configure(level: str = "info", background: bool = False) -> None:
    global _writer
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    head = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level]
    if background:
        if _writer is None:
            _writer = _Writer(sys.stderr)
        tail = [_writer.enqueue]
    else:
        tail = [structlog.processors.TimeStamper(fmt="iso"), structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=head + tail,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=(
            structlog.ReturnLoggerFactory()
            if background
            # One write per line: PrintLogger writes the text and its newline apart, and a
            # line another thread writes to the same pipe between them is glued behind it (a
            # launcher then missed a worker's READY line and waited for ever).
            else structlog.WriteLoggerFactory(sys.stderr)
        ),
        # A module's `log` proxy binds a new logger on every call unless it caches one; once
        # configured for the process, the background mode caches it.
        cache_logger_on_first_use=background,
    )


def announce(line: str, stream=None) -> None:
    """Prints a line another process parses (READY ..., serve's addresses) in one write:
    `print` writes the text and its newline separately, and under PYTHONUNBUFFERED a line
    another thread writes to the same pipe could land between them, gluing itself on."""
    stream = stream or sys.stdout
    stream.write(line + "\n")
    stream.flush()
