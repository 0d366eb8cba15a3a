"""A multi-host decode group's step protocol: on process 0 (the leader) each runner call and KV
page write is broadcast, then run; the other processes (followers) receive each one and run
the same call on the same inputs, so every process reaches the same programs in order."""

from __future__ import annotations

import enum
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import structlog

from megaserve.parallel.step_channel import StepChannel
from megaserve.runner.batch import SequenceCache, TokenBatch
from megaserve.sampling_params import SamplingArrays
from megaserve.watchdog import StallConfig, StallWatch, exit_process

log = structlog.get_logger("megaserve.group")


class Call(enum.IntEnum):
    STOP = 0  # the followers return
    TICK = 1  # nothing to run: an idle group's collectives (and its stall check) keep moving
    DECODE = 2  # Runner.decode(batch, sampling, n_steps, want_logits)
    PREFILL = 3  # Runner.prefill(batch, sampling)
    PREFILL_LOGPROBS = 4  # Runner.prefill_with_logprobs(batch, sampling, targets)
    WRITE_PAGES = 5  # KVPool.write_pages(pages, k, v): imported KV


class PoolLost(RuntimeError):
    """A group call failed after its programs took the pool: this process's KV no longer
    matches the others', and the group cannot go on."""


# -- wire forms: pickled call arguments, with the bulky types made compact ---------------------
@dataclass(frozen=True)
class _Batch:
    """A TokenBatch with its rows' pages in one array (not one pickled array per row)."""

    tokens: np.ndarray  # i32[N]
    num_new: np.ndarray  # i32[S]
    num_cached: np.ndarray  # i32[S]
    lengths: np.ndarray  # i32[S] pages per row
    pages: np.ndarray  # i32[sum(lengths)]


@dataclass(frozen=True)
class _Penalized:
    """SamplingArrays with penalty state: its [B, V] counts and seen as their nonzero entries
    (a row's history is at most its context long; V is up to ~150k)."""

    columns: dict
    shape: tuple[int, int]
    count_at: np.ndarray  # i64[k] flat indices of nonzero counts
    counts: np.ndarray  # i32[k]
    seen_at: np.ndarray  # i64[j] flat indices of seen tokens


def _wire(x: Any) -> Any:
    if isinstance(x, TokenBatch):
        lengths = np.asarray([len(c.pages) for c in x.caches], np.int32)
        pages = np.concatenate([np.asarray(c.pages, np.int32) for c in x.caches])
        return _Batch(x.tokens, x.num_new, x.num_cached, lengths, pages)
    if isinstance(x, SamplingArrays) and x.counts is not None:
        at, seen_at = np.flatnonzero(x.counts), np.flatnonzero(x.seen)
        return _Penalized(x.columns, x.counts.shape, at, x.counts.ravel()[at], seen_at)
    return x


def _unwire(x: Any) -> Any:
    if isinstance(x, _Batch):
        rows = np.split(x.pages, np.cumsum(x.lengths)[:-1])
        caches = tuple(SequenceCache(r) for r in rows)
        return TokenBatch(x.tokens, x.num_new, x.num_cached, caches)
    if isinstance(x, _Penalized):
        counts, seen = np.zeros(x.shape, np.int32), np.zeros(x.shape, bool)
        counts.ravel()[x.count_at] = x.counts
        seen.ravel()[x.seen_at] = True
        return SamplingArrays(x.columns, counts, seen)
    return x


def encode(args: tuple) -> bytes:
    # Pickle: both ends are one program's processes, and the channel is JAX's own collective
    # between them (nothing outside the group writes to it).
    return pickle.dumps(tuple(_wire(a) for a in args), protocol=5)


def decode(payload: bytes) -> tuple:
    return tuple(_unwire(a) for a in pickle.loads(payload))


def pool_lost(pool: Any) -> bool:
    return pool.k.is_deleted() or pool.v.is_deleted()


# -- the leader ------------------------------------------------------------------------------
class Leader:
    """Process 0's end: broadcasts each call, then runs it, under one lock (the engine
    thread's calls and the idle ticks: a tick never lands between a call's broadcast and its
    programs). `alive` turns False once a call is stuck for stall_s; a watchdog ends the
    process once one is stuck for exit_s (a member alive but not following: JAX's heartbeats
    still arrive, so its runtime would wait for ever)."""

    def __init__(
        self,
        channel: StepChannel,
        stall_s: float,
        exit_s: float,
        on_fatal: Callable[[], None],
        lost: Callable[[], bool],
        tick_s: float = 1.0,
    ):
        self.channel, self.tick_s = channel, tick_s
        self.on_fatal, self.lost = on_fatal, lost
        self.watch = StallWatch(StallConfig(stall_s, exit_s), "group call")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="group-tick", daemon=True)

    def start(self) -> Leader:
        self._ticker.start()
        self.watch.start(self.fatal)
        return self

    def run(self, kind: Call, fn: Callable, *args):
        with self._lock:
            return self._run_locked(kind, fn, args)

    def _run_locked(self, kind: Call, fn: Callable, args: tuple):
        with self.watch.span():
            return self._call(kind, fn, args)

    def _call(self, kind: Call, fn: Callable, args: tuple):
        try:
            self._send(kind, encode(args) if args else b"")
            return fn(*args)
        except Exception as e:
            if self.lost():  # the engine would reset its pool alone: the group cannot
                self.fatal(f"{kind.name} failed and lost the KV pool: {e!r}")
            # A TICK tells the two failures apart: with a member gone (gloo saw its closed
            # connections) it fails too and the process ends; a call that failed on its own
            # failed alike on the followers, which go on and take it.
            self._send(Call.TICK, b"")
            raise

    def _send(self, kind: Call, payload: bytes) -> None:
        try:
            self.channel.send(kind, payload)
        except Exception as e:
            self.fatal(f"{kind.name} broadcast failed: {e!r}")

    def alive(self, loop_at: float) -> bool:
        """Whether the group makes progress: no call stuck past stall_s, and the engine loop
        (which iterates at `loop_at`) or a call moved within it. An idle group ticks."""
        moved = max(loop_at, self.watch.done_at)
        return self.watch.alive() and time.monotonic() - moved < self.watch.cfg.stall_s

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s / 4):
            idle = time.monotonic() - self.watch.done_at >= self.tick_s
            if idle and self._lock.acquire(blocking=False):
                try:
                    self._run_locked(Call.TICK, _nothing, ())
                finally:
                    self._lock.release()

    def fatal(self, why: str) -> None:
        """Leaves Redis (on_fatal) and exits 1: the router migrates this group's streams when
        they break, and the deployment recreates the group."""
        exit_process("group broken; exiting", why, self.on_fatal)

    def stop(self) -> None:
        """Ends the followers (STOP) once the call in flight, if any, is done."""
        self._stop.set()
        self.watch.stop()
        if self._lock.acquire(timeout=self.watch.cfg.exit_s):
            try:
                self.channel.send(Call.STOP, b"")
            finally:
                self._lock.release()
        log.info("group stopped", messages=self.channel.messages, bytes=self.channel.bytes)


def _nothing() -> None:
    return None


class LeaderRunner:
    """The engine's runner on the leader: its calls go through `Leader.run`; everything else
    (buckets, program sets, the pool) is the wrapped runner's."""

    def __init__(self, inner: Any, leader: Leader):
        self.inner, self.leader = inner, leader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decode(self, batch, sampling, n_steps=None, want_logits=False, while_running=None):
        run = self.leader.run
        # `while_running` is not passed on: the group's calls and page writes are broadcast
        # and run in one order on every process, which a write during the step would break.
        return run(Call.DECODE, self.inner.decode, batch, sampling, n_steps, want_logits)

    def prefill(self, batch, sampling):
        return self.leader.run(Call.PREFILL, self.inner.prefill, batch, sampling)

    def prefill_with_logprobs(self, batch, sampling, targets):
        fn = self.inner.prefill_with_logprobs
        return self.leader.run(Call.PREFILL_LOGPROBS, fn, batch, sampling, targets)


def lead(engine: Any, channel: StepChannel, timeout_s: float, on_fatal: Callable[[], None]):
    """Makes `engine` (a DecodeEngine, not started) the group's leader: its runner calls and
    its pool's page writes broadcast first. Returns once every follower has built its engine
    (a first TICK, unbounded: the runtime ends this process if one dies meanwhile) with the
    Leader started (stop it after the engine). `timeout_s` is the group's (GroupConfig): a
    call stuck half of it withdraws the registration, one stuck twice it ends the process."""
    t0 = time.monotonic()
    channel.send(Call.TICK, b"")  # before the watchdog: followers may still be compiling
    log.info("group complete", waited_s=round(time.monotonic() - t0, 1))
    pool = engine.pool
    leader = Leader(channel, timeout_s / 2, 2 * timeout_s, on_fatal, partial(pool_lost, pool))
    leader.start()
    engine.runner = LeaderRunner(engine.runner, leader)
    write = pool.write_pages

    def write_pages(pages, k_new, v_new):
        # Host copies: pulled pages live on one of this process's devices only.
        host = (np.asarray(pages, np.int32), np.asarray(k_new), np.asarray(v_new))
        return leader.run(Call.WRITE_PAGES, write, *host)

    # One object for every holder (the reservations write imports through the same pool).
    pool.write_pages = write_pages
    return leader


def follow(engine: Any, channel: StepChannel) -> int:
    """Runs the leader's calls on `engine`'s runner and pool (built as the leader's) until
    STOP; returns the calls run. A call that fails as it did on the leader (a bad request:
    the leader's engine fails its requests) is logged; one that lost the pool is PoolLost."""
    runner, pool = engine.runner, engine.pool
    calls = {
        Call.DECODE: runner.decode,
        Call.PREFILL: runner.prefill,
        Call.PREFILL_LOGPROBS: runner.prefill_with_logprobs,
        Call.WRITE_PAGES: pool.write_pages,
    }
    n = 0
    while True:
        raw, payload = channel.receive()
        kind = Call(raw)  # ValueError: a leader speaking another protocol
        if kind == Call.STOP:
            return n
        if kind == Call.TICK:
            continue
        n += 1
        try:
            calls[kind](*decode(payload))
        except Exception as e:
            if pool_lost(pool):
                raise PoolLost(f"{kind.name} failed and lost the KV pool: {e!r}") from e
            log.exception("group call failed (as on the leader)", call=kind.name)
