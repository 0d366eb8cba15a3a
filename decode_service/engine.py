"""The decode loop: one thread runs scheduler plans on the runner and emits tokens."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import structlog

from decode_service.commands import Commands
from decode_service.emission import Emission
from decode_service.events import TokenEvent, top_logprobs
from decode_service.imported import ImportedKV
from decode_service.prefill_step import PrefillStep, PromptScoring
from decode_service.programs import engine_programs, fit_running, step_config
from decode_service.reservations import Reservations
from decode_service.scheduler import Scheduler, SchedulerConfig
from decode_service.sequence import Sequence
from decode_service.step_failures import StepFailures
from kernels.programs import Program
from megaserve.cpu_turns import cpu_turns
from megaserve.errors import DuplicateRequest, NoCapacity, RequestError, check_prompt_ids
from megaserve.finish import FinishReason
from megaserve.kv.allocator import PageAllocator
from megaserve.kv.pages import pages_for_tokens
from megaserve.memory_plan import planned_pool
from megaserve.model import LoadedModel
from megaserve.parallel.mesh import ParallelConfig
from megaserve.runner.batch import TokenBatch
from megaserve.runner.factory import make_runner
from megaserve.runner.warm import warm_up
from megaserve.sampling_params import SamplingArrays
from megaserve.watchdog import StallWatch

log = structlog.get_logger("megaserve.decode")


STALL_S = 1.0  # an iteration's steps longer than this do not count against reservation leases


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    # The pool is sized from this; None: what the device has left (megaserve.memory_plan).
    kv_budget_bytes: int | None = 256 * 2**20
    max_context: int = 2048  # prompt + output tokens per sequence
    scheduler: SchedulerConfig = SchedulerConfig()
    attach_lease_s: float = 30.0  # committed imported KV waits this long for its Generate call
    # Decode step backend (--backend): "auto", "xla" or "pallas"; see runner.choose_backend.
    backend: str = "auto"
    vmem_budget_bytes: int | None = None  # the megakernel plan's VMEM cap (None: tpu7x's)
    # The megakernel's matmul input dtype (None: bf16); float32 is the exactness mode that
    # compares it token for token with the XLA backend.
    kernel_matmul_dtype: Any = None
    # --tp x --ep: the model and pool over this many devices (the XLA step under shard_map).
    parallel: ParallelConfig = ParallelConfig()
    # --cpu-turns: a lock file shared with the workers on the same cores (megaserve.cpu_turns);
    # each iteration's compute is one turn. "" = none.
    cpu_turns: str = ""


class DecodeEngine(Commands, Emission, StepFailures, PrefillStep, ImportedKV):
    """Owns the pool, allocator, scheduler, reservations and runner; the public methods are
    safe from any thread (the engine thread owns all state below them)."""

    def __init__(self, model: LoadedModel, cfg: EngineConfig = EngineConfig()):
        self.model, self.cfg = model, cfg
        mc = model.cfg
        # Checked before the pool is allocated (exit 2 naming the terms when it cannot fit),
        # and again after warm-up with every weight copy and the largest program temp.
        self.memory, self.pool = planned_pool(
            model, cfg.page_size, cfg.kv_budget_bytes, cfg.parallel
        )
        self.alloc = PageAllocator(self.pool.num_pages, cfg.page_size)
        self.max_pages_per_seq = math.ceil(cfg.max_context / cfg.page_size)
        self.turns = cpu_turns(cfg.cpu_turns)  # shared with the other workers on these cores
        step_cfg = step_config(cfg.scheduler, cfg.scheduler.max_running, self.max_pages_per_seq)
        self.runner = make_runner(
            model.family, mc, model.params, self.pool, step_cfg, cfg.backend,
            cfg.vmem_budget_bytes, cfg.kernel_matmul_dtype, cfg.parallel,
        )  # fmt: skip
        sched_cfg = fit_running(self.runner, cfg.scheduler)
        # Buckets only up to what the scheduler may run: no program is built for more rows.
        self.runner.step_cfg = step_config(sched_cfg, sched_cfg.max_running, self.max_pages_per_seq)
        self.sched = Scheduler(sched_cfg, self.alloc, self.runner.step_cfg)
        # Leases run on a clock that stands still during this engine's own long steps (a
        # compile of a new shape takes tens of seconds on CPU): a lease bounds the sender's
        # delay, and the KV a stalled engine could not take yet is not the sender's fault.
        self._stalled_s = 0.0
        self.reservations = Reservations(
            self.alloc,
            self.pool,
            cfg.attach_lease_s,
            self._start_imported,
            self._abort_waiter,
            clock=lambda: time.monotonic() - self._stalled_s,
        )
        self.steps = 0
        self.loop_at = time.monotonic()  # the engine thread's last iteration (progress)
        # Times each iteration; the worker configures it and watches (megaserve/watchdog.py).
        self.watch = StallWatch()
        self._inbox: queue.Queue = queue.Queue()
        self._cancel: set[str] = set()
        self._lock = threading.Lock()
        self._live: dict[str, Sequence] = {}
        self._sinks: dict[str, Callable[[TokenEvent], None]] = {}
        self._scoring: dict[str, PromptScoring] = {}  # requests asking prompt log-probabilities
        self._commands: queue.Queue = queue.Queue()
        self.prefill_tokens = 0  # prompt tokens computed by this worker's own prefill
        self.cached_prompt_tokens = 0  # prompt tokens served from the prefix cache
        self.imported_requests = 0  # requests whose KV came from a prefill worker
        self.requests = 0  # Generate calls accepted
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.clock = time.monotonic  # deadlines are on this clock; tests inject a fake one
        self._deadlines: dict[str, float] = {}  # request id -> deadline, while it may queue
        self.expired_in_queue = 0  # requests dropped from the queue at their deadline
        self.step_failures = 0  # steps that raised; their requests ended with ERROR

    def programs(self) -> list[Program]:
        return engine_programs(self.runner, self.pool, self.max_pages_per_seq)

    def warm_up(self) -> tuple[int, float]:
        """Compiles, or loads from the persistent compilation cache, every program before
        serving; returns (programs, seconds) and logs them."""
        self.memory, n, secs = warm_up(self.runner, self.pool, self.programs(), self.memory)
        return n, secs

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
        pages = pages_for_tokens(len(prompt) + max_tokens, self.cfg.page_size)
        if pages > self.alloc.num_pages - 1:
            raise RequestError(
                f"request needs {pages} pages, the whole pool has {self.alloc.num_pages - 1}"
            )

    def submit(
        self,
        seq: Sequence,
        sink: Callable[[TokenEvent], None],
        deadline: float | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        """Queues seq; sink(event) is called from the engine thread for each step's tokens.

        A request still queued at `deadline` (on `self.clock`) is dropped: its sink gets an
        ABORT event. `prompt_logprobs` (top-n, 0..MAX_LOGPROBS): its first event carries each
        prompt token's log-probability. Raises RequestError (DuplicateRequest for a live id)
        or NoCapacity (queue full)."""
        self.validate(seq.prompt, seq.max_tokens)
        attaching = seq.request_id in self.reservations  # its pages are held: not refused now
        self._check_scoring(seq.request_id, attaching, prompt_logprobs)
        with self._lock:
            if seq.request_id in self._live:
                raise DuplicateRequest(f"request_id {seq.request_id!r} is already running")
            if not attaching:
                self._check_queue(0)
            self._live[seq.request_id] = seq
            self._sinks[seq.request_id] = sink
            if deadline is not None:
                self._deadlines[seq.request_id] = deadline
            if prompt_logprobs is not None:
                self._scoring[seq.request_id] = PromptScoring(prompt_logprobs)
            self.requests += 1
        if attaching:
            try:
                if self._call(self.reservations.attach, seq):
                    return
            except RequestError:
                self._forget(seq.request_id)
                raise
            except BaseException:  # the engine did not answer: whatever the attach does
                self.cancel_soon(seq.request_id)  # when it runs, this undoes after it
                raise
            # Dropped since (its push failed, its lease ended): prefilled here, as a request
            # that came without one.
            try:
                self._check_queue(0)
            except NoCapacity:
                self._forget(seq.request_id)
                raise
        self._inbox.put(seq)
        self._wake.set()

    def _check_queue(self, reserved: int) -> None:
        """NoCapacity when `max_waiting` requests (plus `reserved` reservations) queue."""
        limit = self.cfg.scheduler.max_waiting
        if len(self.sched.waiting) + self._inbox.qsize() + reserved >= limit:
            raise NoCapacity(f"queue full ({limit} waiting); retry later")

    def cancel(self, request_id: str) -> bool:
        """Cancels a live request or drops a reservation; False if the id is unknown."""
        return self.cancel_soon(request_id).result(timeout=30)

    def cancel_soon(self, request_id: str) -> Future:
        """cancel without waiting (a Future of its answer). Decided on the engine thread in
        order with the commands before it: a KV commit queued first has started the request,
        which is then cancelled, not left decoding for nobody."""
        return self._submit(self._cancel_now, request_id)

    def _cancel_now(self, request_id: str) -> bool:
        if self.reservations.drop(request_id):  # (a Generate call waiting on it ends too)
            return True
        with self._lock:
            known = request_id in self._live
            if known:
                self._cancel.add(request_id)  # ended at the iteration's _apply_cancels
        return known

    @property
    def live_count(self) -> int:
        """Requests accepted and not yet finished."""
        return len(self._live)

    @property
    def idle(self) -> bool:
        return not self._live and not self.reservations

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=30)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._live.pop(request_id, None)
            self._sinks.pop(request_id, None)
            self._deadlines.pop(request_id, None)
            self._scoring.pop(request_id, None)

    # -- engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self.loop_at = time.monotonic()
            try:
                with self.watch.span():
                    worked = self.run_once()
            except Exception:  # outside any step (a bug): log it, keep the thread alive
                log.exception("engine iteration failed")
                worked = False
            if not worked:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def run_once(self) -> bool:
        """One iteration: admit, prefill pieces of several prompts, one decode step. True if
        worked."""
        while True:
            try:
                self.sched.add(self._inbox.get_nowait())
            except queue.Empty:
                break
        self._run_commands()
        self.reservations.expire()
        self._apply_cancels()
        self._expire_queued()
        plan = self.sched.plan()
        if not (plan.prefill or plan.decode):
            return False
        t0 = time.monotonic()
        # The compute is one --cpu-turns turn; commands and admission need none (a Reserve
        # does not wait for another worker's prefill call).
        with self.turns:
            if plan.prefill:
                self._run_prefills(plan.prefill)
            decode = [s for s in plan.decode if s.request_id in self._live]  # a failed prefill
            if decode:
                self._guarded(decode, self._run_decode, decode)
        took = time.monotonic() - t0
        if took > STALL_S:
            self._stalled_s += took
        return True

    def _apply_cancels(self) -> None:
        with self._lock:
            cancels, self._cancel = self._cancel, set()
        for rid in cancels:
            seq = self._live.get(rid)
            if seq is not None:
                self._finish(seq, FinishReason.ABORT, [])

    def _expire_queued(self) -> None:
        """Drops queued requests (never admitted, or preempted) whose deadline has passed."""
        if not self._deadlines or not self.sched.waiting:
            return
        now = self.clock()
        for seq in list(self.sched.waiting):
            deadline = self._deadlines.get(seq.request_id)
            if deadline is not None and deadline <= now:
                self.expired_in_queue += 1
                self._finish(seq, FinishReason.ABORT, [])

    def _rows(self, seqs: list[Sequence]) -> SamplingArrays:
        return SamplingArrays.build(
            [s.sampling for s in seqs], [s.penalty_split() for s in seqs], self.model.cfg.vocab_size
        )

    def _run_decode(self, seqs: list[Sequence]) -> None:
        batch = TokenBatch.from_rows([([s.tokens[-1]], len(s.tokens) - 1, s.pages) for s in seqs])
        want = any(s.logprobs for s in seqs)
        # Commands run while the step computes (Commands._serve_until), not after it.
        toks, logits = self.runner.decode(batch, self._rows(seqs), 1, want, self._serve_until)
        self.steps += 1
        for i, (s, t) in enumerate(zip(seqs, toks[0].tolist())):
            s.num_computed = len(s.tokens)
            self.sched.register_full_pages(s)
            lps = [top_logprobs(logits[0, i], int(t), s.logprobs)] if s.logprobs else None
            self._emit(s, [int(t)], logprobs=lps)

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
            "step_failures": self.step_failures,
            "cpu_turn_wait_s": round(self.turns.waited_s, 3),
        }


def wait_idle(engine: DecodeEngine, timeout: float = 30.0) -> None:
    """Blocks until no request is live (tests and graceful shutdown)."""
    end = time.monotonic() + timeout
    while not engine.idle:
        if time.monotonic() > end:
            raise TimeoutError(f"engine still has {engine.live_count} live requests")
        time.sleep(0.01)
