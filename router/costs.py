"""CPU time of the router's request path by component, aggregated in-process (p50/p99)."""

from __future__ import annotations

import time
from collections import deque
from contextvars import ContextVar

from megaserve.logs import writer_cpu_seconds

# What a request's CPU time is charged to, in the order the request meets them.
COMPONENTS = (
    "validate",  # model, tokenize or id checks, sampling and stopping checks
    "claim",  # the in-flight request id (Redis SET NX)
    "session",  # a session's worker (Redis), when the request names a session
    "pick",  # candidate workers, policy choice
    "dispatch",  # the worker request built; after the last message, the attempt closed
    "worker_call",  # the gRPC call to the worker: started, sent, its messages received
    "respond",  # detokenize, stop strings, the public response built
    "send",  # gRPC serializing and writing the public responses
    "log",  # the request's log lines, as paid on the request path
    "release",  # the in-flight id freed (Redis DEL)
)
# Samples kept per component between two summaries (older ones are dropped).
KEEP = 100_000

_current: ContextVar[RequestCost | None] = ContextVar("router_request_cost", default=None)
# Event-loop CPU seconds spent on background work (the view refresh), ever: a lap that spans
# some is not charged it.
_background = [0.0]


def charge_background(seconds: float) -> None:
    _background[0] += seconds


class RequestCost:
    """One request's CPU seconds per component, taken as laps of this thread's CPU clock:
    each lap charges the CPU used since the previous lap, less the background work that ran
    meanwhile. CPU the event loop spends on other requests while this one awaits is charged
    too (none when requests come one at a time)."""

    __slots__ = ("cpu", "_t", "_bg")

    def __init__(self):
        self.cpu = dict.fromkeys(COMPONENTS, 0.0)
        self._t, self._bg = time.thread_time(), _background[0]

    def lap(self, component: str) -> None:
        now, bg = time.thread_time(), _background[0]
        self.cpu[component] += max(now - self._t - (bg - self._bg), 0.0)
        self._t, self._bg = now, bg

    def add(self, component: str, seconds: float) -> None:
        """CPU used on another thread on this request's behalf (it is not in the laps)."""
        self.cpu[component] += seconds

    @property
    def total(self) -> float:
        return sum(self.cpu.values())


def begin() -> RequestCost:
    """A new cost, current for this task (the request's code charges it with lap())."""
    c = RequestCost()
    _current.set(c)
    return c


def lap(component: str) -> None:
    """Charges the current request's CPU since its last lap to component (if one is timed)."""
    c = _current.get()
    if c is not None:
        c.lap(component)


def percentile(xs: list[float], q: float) -> float:
    """Linearly interpolated q-th percentile (numpy's default); NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class CostStats:
    """Every finished request's cost since the last summary, and the process's CPU time."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self.reset()

    def reset(self) -> None:
        self.samples = {c: deque(maxlen=self.keep) for c in (*COMPONENTS, "total")}
        self.requests = 0
        self.since, self.cpu_since = time.monotonic(), time.process_time()
        self.loop_since, self.bg_since = time.thread_time(), _background[0]
        self.writer_since = writer_cpu_seconds()

    def record(self, cost: RequestCost) -> None:
        self.requests += 1
        for c, s in cost.cpu.items():
            self.samples[c].append(s)
        self.samples["total"].append(cost.total)

    def summary(self, reset: bool = True) -> dict:
        """p50/p99/mean CPU microseconds per component over the requests since the last
        reset; over that window, the CPU of the whole process (every thread: gRPC's too),
        of the event loop (call this on it), of its background work and of the log writer."""
        ms = lambda s: round(1000 * s, 3)  # noqa: E731
        out = {
            "requests": self.requests,
            "window_s": round(time.monotonic() - self.since, 3),
            "process_cpu_ms": ms(time.process_time() - self.cpu_since),
            "loop_cpu_ms": ms(time.thread_time() - self.loop_since),
            "background_cpu_ms": ms(_background[0] - self.bg_since),
            "log_writer_cpu_ms": ms(writer_cpu_seconds() - self.writer_since),
            "cpu_us": {
                c: {
                    "p50": round(1e6 * percentile(list(xs), 50), 1),
                    "p99": round(1e6 * percentile(list(xs), 99), 1),
                    "mean": round(1e6 * sum(xs) / len(xs), 1) if xs else float("nan"),
                }
                for c, xs in self.samples.items()
            },
        }
        if reset:
            self.reset()
        return out
