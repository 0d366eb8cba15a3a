"""`megaserve serve`'s supervision of its children: a process that dies is restarted with
exponential backoff (same name, same flags) and reported once it is back; a crash loop is given
up on, loudly. Non-blocking (`Supervisor.tick`), with an injectable clock, so its policy is
tested without processes or sleeps."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Child(Protocol):
    """What the supervisor needs of a process (launch.Proc and launch.RedisProcess have it)."""

    lines: list[str]  # its last output lines
    # Optional: `label`, what its address is (default "grpc"; the private Redis: "redis").

    @property
    def alive(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def ready(self) -> bool: ...

    @property
    def address(self) -> str: ...

    def kill9(self) -> None: ...


@dataclass(frozen=True)
class RestartPolicy:
    """Restart after base_s, then doubling up to cap_s; more than max_exits exits in a row
    without stable_s of uptime in between (so also more than max_exits within stable_s) is a
    crash loop."""

    base_s: float = 1.0
    factor: float = 2.0
    cap_s: float = 30.0
    max_exits: int = 5
    stable_s: float = 60.0
    start_timeout_s: float = 300.0  # a restart not back by then is killed (an exit)

    def delay(self, streak: int) -> float:
        """The wait before restarting after the streak-th exit in a row (1 = the first)."""
        return min(self.cap_s, self.base_s * self.factor ** (streak - 1))


class GiveUp(Exception):
    """The stack cannot go on: `name` crash-loops or cannot be restarted."""

    def __init__(self, name: str, why: str, tail: list[str]):
        super().__init__(f"{name}: {why}")
        self.name, self.why, self.tail = name, why, tail


@dataclass
class _Supervised:
    proc: Child
    state: str = "up"  # up | waiting (backoff) | starting (restarted, not yet back)
    since: float = 0.0  # up: when it was back; waiting: when due; starting: when spawned
    streak: int = 0  # exits in a row without stable_s of uptime in between
    died_at: float = 0.0  # the first exit of this outage (restart time counts from it)
    exit_code: int | None = None


class Supervisor:
    """Watches `procs` (name -> Child); `spawn(name)` starts a replacement (raising OSError or
    RuntimeError when it cannot); `registered(name, address)` says a restarted child is back
    (a worker: its Redis record carries its new address)."""

    def __init__(
        self,
        procs: dict[str, Child],
        spawn: Callable[[str], Child],
        registered: Callable[[str, str], bool] = lambda name, address: True,
        policy: RestartPolicy = RestartPolicy(),
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = print,
    ):
        self.spawn, self.registered, self.policy = spawn, registered, policy
        self.clock, self.log = clock, log
        now = clock()
        self.children = {n: _Supervised(p, since=now) for n, p in procs.items()}
        self.restarts: list[tuple[str, int | None, float]] = []  # (name, exit code, seconds)

    def tick(self) -> None:
        """One pass over every child: notice exits, start those due, report those back.
        Raises GiveUp."""
        for name, c in self.children.items():
            now = self.clock()
            if c.state != "waiting" and not c.proc.alive:
                self._exited(name, c, now)
            elif c.state == "waiting" and now >= c.since:
                try:
                    c.proc = self.spawn(name)
                except (OSError, RuntimeError) as e:
                    raise GiveUp(name, f"could not be restarted: {e}", c.proc.lines[-20:]) from e
                c.state, c.since = "starting", now
            elif c.state == "starting":
                self._starting(name, c, now)

    def _exited(self, name: str, c: _Supervised, now: float) -> None:
        p = self.policy
        if c.state == "up":
            c.died_at = now
            c.streak = 1 if now - c.since >= p.stable_s else c.streak + 1
        else:  # died again before it was back
            c.streak += 1
        c.exit_code = c.proc.returncode
        if c.streak > p.max_exits:
            why = (
                f"crash loop: {c.streak} exits in a row without {p.stable_s:g} s up "
                f"(last exit {c.exit_code})"
            )
            raise GiveUp(name, why, c.proc.lines[-20:])
        delay = p.delay(c.streak)
        c.state, c.since = "waiting", now + delay
        self.log(f"{name} exited (exit {c.exit_code}); restarting in {delay:g} s")
        if c.exit_code is not None and c.exit_code > 0:  # an error, not a signal: its last words
            self.log("".join(f"  [{name}] {line}" for line in c.proc.lines[-10:]).rstrip())

    def _starting(self, name: str, c: _Supervised, now: float) -> None:
        if c.proc.ready and self.registered(name, c.proc.address):
            c.state, c.since = "up", now
            took = now - c.died_at
            self.restarts.append((name, c.exit_code, took))
            self.log(
                f"restarted {name} (exit {c.exit_code}) in {took:.1f} s: "
                f"{getattr(c.proc, 'label', 'grpc')}={c.proc.address}"
            )
        elif now - c.since > self.policy.start_timeout_s:
            self.log(f"{name} not back within {self.policy.start_timeout_s:g} s; killing it")
            c.proc.kill9()
