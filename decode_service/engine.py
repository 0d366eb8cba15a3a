"""The decode loop: one thread runs scheduler plans on the XLA runner and emits tokens."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from decode_service.page_allocator import OutOfPages, PageAllocator
from decode_service.scheduler import Scheduler, SchedulerConfig
from decode_service.sequence import Sequence
from kernels.kv_cache import KVPool
from kernels.xla_step import SamplingArrays, StepConfig, make_runner
from megaserve.block_hash import block_hashes
from megaserve.errors import RequestError, check_prompt_ids
from megaserve.model import LoadedModel


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    kv_budget_bytes: int = 256 * 2**20  # the pool is sized from this
    max_context: int = 2048  # prompt + output tokens per sequence
    scheduler: SchedulerConfig = SchedulerConfig()
    attach_lease_s: float = 30.0  # committed imported KV waits this long for its Generate call
    # Decode step backend: "xla" or "pallas" (the megakernel); None = pallas on TPU, else xla.
    backend: str | None = None


@dataclass(frozen=True)
class TokenEvent:
    """Tokens a request produced in one step; `finish_reason` set on its last event."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    step: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Per token: (token, logprob, top ids, top logprobs) when the request asked for them.
    logprobs: list[tuple[int, float, list[int], list[float]]] | None = None


def top_logprobs(logits: np.ndarray, token: int, n: int):
    """(token, logprob, top-n ids, top-n logprobs) of raw f32[V] logits, natural log."""
    x = logits.astype(np.float64)
    lse = x.max() + np.log(np.exp(x - x.max()).sum())
    lp = x - lse
    top = np.argsort(-lp, kind="stable")[:n]
    return int(token), float(lp[token]), top.tolist(), lp[top].tolist()


class Full(Exception):
    """The waiting queue is full (RESOURCE_EXHAUSTED)."""


@dataclass
class Reservation:
    """Pages held for a request whose KV a prefill worker will send; freed at `expires`."""

    request_id: str
    prompt: list[int]
    pages: list[int]
    cached_pages: int
    expires: float
    first_token: int | None = None  # set when the imported KV is committed
    waiter: Sequence | None = None  # the Generate call attached to this reservation


class DecodeEngine:
    """Owns the pool, allocator, scheduler and runner; `submit` is safe from any thread."""

    def __init__(self, model: LoadedModel, cfg: EngineConfig = EngineConfig()):
        self.model, self.cfg = model, cfg
        mc = model.cfg
        probe = KVPool.create(mc.num_layers, 2, cfg.page_size, mc.num_kv_heads, mc.head_dim)
        n_pages = KVPool.pages_for_budget(cfg.kv_budget_bytes, probe.bytes_per_page)
        del probe
        self.pool = KVPool.create(
            mc.num_layers,
            n_pages,
            cfg.page_size,
            mc.num_kv_heads,
            mc.head_dim,
            model.params["embed"].dtype,
        )
        self.alloc = PageAllocator(n_pages, cfg.page_size)
        self.sched = Scheduler(cfg.scheduler, self.alloc)
        self.max_pages_per_seq = math.ceil(cfg.max_context / cfg.page_size)
        buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < cfg.scheduler.max_running)
        step_cfg = StepConfig(
            batch_buckets=buckets + (cfg.scheduler.max_running,),
            token_buckets=tuple(
                b for b in (16, 32, 64, 128, 256, 512) if b < cfg.scheduler.prefill_chunk
            )
            + (cfg.scheduler.prefill_chunk,),
            max_pages_per_seq=self.max_pages_per_seq,
        )
        self.runner = make_runner(
            model.family, mc, model.params, self.pool, step_cfg, backend=cfg.backend
        )
        self.steps = 0
        self._inbox: queue.Queue = queue.Queue()
        self._cancel: set[str] = set()
        self._lock = threading.Lock()
        self._live: dict[str, Sequence] = {}
        self._sinks: dict[str, Callable[[TokenEvent], None]] = {}
        self._commands: queue.Queue = queue.Queue()
        self.reservations: dict[str, Reservation] = {}
        self.expired_reservations = 0
        self.prefill_tokens = 0  # prompt tokens computed by this worker's own prefill
        self.cached_prompt_tokens = 0  # prompt tokens served from the prefix cache
        self.imported_requests = 0  # requests whose KV came from a prefill worker
        self.requests = 0  # Generate calls accepted
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- caller side -------------------------------------------------------------------
    def validate(self, prompt: list[int], max_tokens: int) -> None:
        check_prompt_ids(prompt, self.model.cfg.vocab_size, "prompt_token_ids")
        if max_tokens < 1:
            raise RequestError(f"max_tokens={max_tokens} must be >= 1")
        if len(prompt) + max_tokens > self.cfg.max_context:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"limit {self.cfg.max_context}"
            )
        pages = -(-(len(prompt) + max_tokens) // self.cfg.page_size)
        if pages > self.alloc.num_pages - 1:
            raise RequestError(
                f"request needs {pages} pages, the whole pool has {self.alloc.num_pages - 1}"
            )

    def submit(self, seq: Sequence, sink: Callable[[TokenEvent], None]) -> None:
        """Queues seq; sink(event) is called from the engine thread for each step's tokens."""
        self.validate(seq.prompt, seq.max_tokens)
        with self._lock:
            if seq.request_id in self._live:
                raise RequestError(f"request_id {seq.request_id!r} is already running")
            if len(self.sched.waiting) + self._inbox.qsize() >= self.cfg.scheduler.max_waiting:
                raise Full(f"queue full ({self.cfg.scheduler.max_waiting} waiting); retry later")
            self._live[seq.request_id] = seq
            self._sinks[seq.request_id] = sink
            self.requests += 1
        if seq.request_id in self.reservations:
            try:
                self._call(self._attach, seq)
            except RequestError:
                with self._lock:
                    self._live.pop(seq.request_id, None)
                    self._sinks.pop(seq.request_id, None)
                raise
            return
        self._inbox.put(seq)
        self._wake.set()

    def cancel(self, request_id: str) -> bool:
        """Cancels a live request or drops a reservation; False if the id is unknown."""
        if request_id in self.reservations:
            return self._call(self._drop_reservation, request_id)
        with self._lock:
            known = request_id in self._live
            if known:
                self._cancel.add(request_id)
        self._wake.set()
        return known

    def reserve(self, request_id: str, prompt: list[int], lease_s: float) -> Reservation:
        """Holds pages for prompt (prefix hits included) until KV arrives or the lease ends."""
        self.validate(prompt, 1)
        return self._call(self._reserve, request_id, prompt, lease_s)

    def _call(self, fn, *args):
        """Runs fn on the engine thread (the allocator is single-threaded) and waits."""
        fut: Future = Future()
        self._commands.put((fut, fn, args))
        self._wake.set()
        if self._thread is None:  # not started (unit tests drive run_once themselves)
            self._run_commands()
        return fut.result(timeout=30)

    def _run_commands(self) -> None:
        while True:
            try:
                fut, fn, args = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn(*args))
            except Exception as e:  # surfaced to the caller's thread
                fut.set_exception(e)

    def _reserve(self, request_id: str, prompt: list[int], lease_s: float) -> Reservation:
        if request_id in self.reservations or request_id in self._live:
            raise RequestError(f"request_id {request_id!r} is already reserved or running")
        hashes = block_hashes(prompt[: len(prompt) - 1], self.cfg.page_size)
        hit = self.alloc.match_prefix(hashes)
        need = -(-len(prompt) // self.cfg.page_size) - len(hit)
        self.alloc.acquire(hit)
        try:
            fresh = self.alloc.allocate(need)
        except OutOfPages as e:
            self.alloc.release(hit)
            raise Full(f"reservation needs {need} pages: {e}; retry") from e
        res = Reservation(
            request_id, list(prompt), hit + fresh, len(hit), time.monotonic() + lease_s
        )
        self.reservations[request_id] = res
        return res

    def _drop_reservation(self, request_id: str) -> bool:
        res = self.reservations.pop(request_id, None)
        if res is None:
            return False
        self.alloc.release(res.pages)
        if res.waiter is not None:  # a Generate call was waiting for this KV
            self._send(res.waiter, [], "abort", True)
            with self._lock:
                self._live.pop(request_id, None)
                self._sinks.pop(request_id, None)
        return True

    def reservation(self, request_id: str) -> Reservation | None:
        return self.reservations.get(request_id)

    def drop_reservation(self, request_id: str) -> bool:
        """Frees a reservation (e.g. after a failed transfer); False if unknown."""
        return self._call(self._drop_reservation, request_id)

    def commit_import(
        self, request_id: str, first_token: int, k: np.ndarray, v: np.ndarray
    ) -> None:
        """Writes complete imported pages into the pool and readies the request."""
        self._call(self._commit_import, request_id, first_token, k, v)

    def _commit_import(self, request_id, first_token, k, v) -> None:
        res = self.reservations.get(request_id)
        if res is None:
            raise RequestError(f"reservation {request_id!r} expired before its KV committed")
        self.pool.write_pages(np.asarray(res.pages[res.cached_pages :], np.int32), k, v)
        res.first_token = int(first_token)
        # The KV is in; a Generate call must now attach within the attach lease, or the pages
        # go back (a router that vanished between hand-off and Generate leaks nothing).
        res.expires = time.monotonic() + self.cfg.attach_lease_s
        if res.waiter is not None:
            self._start_imported(res)

    def _start_imported(self, res: Reservation) -> None:
        """The reservation's pages become the sequence's; it decodes from the first token."""
        seq = res.waiter
        del self.reservations[res.request_id]
        seq.pages = res.pages
        seq.num_computed = len(seq.prompt)
        seq.num_cached_tokens = res.cached_pages * self.cfg.page_size
        seq.num_registered = res.cached_pages
        self.sched.register_full_pages(seq)
        seq.arrival_step = self.steps
        self.imported_requests += 1
        self._emit(seq, [res.first_token], first=True)
        if seq.state.value != "finished":
            self.sched.add_ready(seq)

    def _attach(self, seq: Sequence) -> None:
        res = self.reservations[seq.request_id]
        if res.prompt != seq.prompt:
            raise RequestError(
                f"request {seq.request_id!r}: prompt differs from the reserved prompt"
            )
        res.waiter = seq
        if res.first_token is not None:
            self._start_imported(res)

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        for rid in [r for r, res in self.reservations.items() if res.expires <= now]:
            self._drop_reservation(rid)
            self.expired_reservations += 1

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=30)

    @property
    def idle(self) -> bool:
        return not self._live and not self.reservations

    # -- engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.run_once():
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def run_once(self) -> bool:
        """One iteration: admit, at most one prefill chunk, one decode step. True if worked."""
        while True:
            try:
                self.sched.add(self._inbox.get_nowait())
            except queue.Empty:
                break
        self._run_commands()
        self._expire_reservations()
        self._apply_cancels()
        plan = self.sched.plan()
        worked = False
        if plan.prefill is not None:
            self._run_prefill(plan.prefill, plan.prefill_tokens, plan.prefill_start)
            worked = True
        if plan.decode:
            self._run_decode(plan.decode)
            worked = True
        return worked

    def _apply_cancels(self) -> None:
        with self._lock:
            cancels, self._cancel = self._cancel, set()
        for rid in cancels:
            seq = self._live.get(rid)
            if seq is not None:
                self._finish(seq, "abort", [])

    def _rows(self, seqs: list[Sequence]) -> SamplingArrays:
        return SamplingArrays.build(
            [s.sampling.as_row() for s in seqs],
            [s.penalty_split() for s in seqs],
            self.model.cfg.vocab_size,
        )

    def _table(self, seqs: list[Sequence]) -> np.ndarray:
        width = max(len(s.pages) for s in seqs)
        t = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            t[i, : len(s.pages)] = s.pages
        return t

    def _run_prefill(self, seq: Sequence, chunk: list[int], start: int) -> None:
        pos = np.arange(start, start + len(chunk), dtype=np.int32)
        self.prefill_tokens += len(chunk)
        nxt, logits = self.runner.prefill(
            np.array([chunk], np.int32), pos[None], self._table([seq]), self._rows([seq])
        )
        if self.sched.prefill_done(seq, len(chunk)):
            first = not seq.output
            tok = int(nxt[0])
            lps = [top_logprobs(logits[0], tok, seq.logprobs)] if seq.logprobs else None
            self._emit(seq, [tok], first=first, logprobs=lps)

    def _run_decode(self, seqs: list[Sequence]) -> None:
        tokens = np.array([s.tokens[-1] for s in seqs], np.int32)
        pos = np.array([len(s.tokens) - 1 for s in seqs], np.int32)
        want = any(s.logprobs for s in seqs)
        toks, logits = self.runner.decode(
            tokens, pos, self._table(seqs), self._rows(seqs), n_steps=1, want_logits=want
        )
        self.steps += 1
        for i, (s, t) in enumerate(zip(seqs, toks[0].tolist())):
            s.num_computed = len(s.tokens)
            self.sched.register_full_pages(s)
            lps = [top_logprobs(logits[0, i], int(t), s.logprobs)] if s.logprobs else None
            self._emit(s, [int(t)], logprobs=lps)

    def _emit(self, seq: Sequence, new: list[int], first: bool = False, logprobs=None) -> None:
        seq.output.extend(new)
        reason = None
        if new[-1] in seq.stop_ids:
            reason = "stop"
        elif len(seq.output) >= seq.max_tokens:
            reason = "length"
        if reason:
            self._finish(seq, reason, new, first, logprobs)
        else:
            self._send(seq, new, None, first, logprobs)

    def _finish(
        self, seq: Sequence, reason: str, new: list[int], first: bool = False, logprobs=None
    ) -> None:
        self.sched.finish(seq, reason)
        self._send(seq, new, reason, first, logprobs)
        with self._lock:
            self._live.pop(seq.request_id, None)
            self._sinks.pop(seq.request_id, None)

    def _send(
        self, seq: Sequence, new: list[int], reason: str | None, first: bool, logprobs=None
    ) -> None:
        if first:
            self.cached_prompt_tokens += seq.num_cached_tokens
        sink = self._sinks.get(seq.request_id)
        if sink is None:
            return
        sink(
            TokenEvent(
                seq.request_id,
                new,
                reason,
                self.steps,
                len(seq.prompt) if first else 0,
                seq.num_cached_tokens if first else 0,
                logprobs,
            )
        )

    def stats(self) -> dict:
        a = self.alloc
        return {
            "total_pages": a.num_pages - 1,
            "free_pages": len(a.free),
            "cached_pages": len(a.lru),
            "running": len(self.sched.running) + len(self.sched.prefilling),
            "waiting": len(self.sched.waiting) + self._inbox.qsize(),
            "reserved": len(self.reservations),
            "steps": self.steps,
            "preemptions": self.sched.preemptions,
            "page_size": a.page_size,
            "prefill_tokens": self.prefill_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "imported_requests": self.imported_requests,
            "requests": self.requests,
        }


def wait_idle(engine: DecodeEngine, timeout: float = 30.0) -> None:
    """Blocks until no request is live (tests and graceful shutdown)."""
    end = time.monotonic() + timeout
    while not engine.idle:
        if time.monotonic() > end:
            raise TimeoutError(f"engine still has {len(engine._live)} live requests")
        time.sleep(0.01)
