"""Prefill compute: prompts batched into shared chunked prefill programs over this worker's
own paged pool, which doubles as its prefix cache (shared with prompts still in flight)."""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass, field

from kernels.kv_cache import KVPool
from kernels.programs import Program
from megaserve.cpu_turns import cpu_turns
from megaserve.errors import NoCapacity, RequestError, check_prompt_ids
from megaserve.kv.allocator import PageAllocator
from megaserve.kv.block_hash import block_hashes
from megaserve.kv.pages import claim_pages, pages_for_tokens
from megaserve.memory_plan import planned_pool
from megaserve.model import LoadedModel
from megaserve.parallel.mesh import ParallelConfig
from megaserve.runner.base import Runner
from megaserve.runner.batch import TokenBatch
from megaserve.runner.buckets import StepConfig
from megaserve.runner.factory import make_runner
from megaserve.runner.warm import warm_up
from megaserve.sampling_params import SamplingArrays, SamplingParams
from megaserve.watchdog import StallWatch


@dataclass(frozen=True)
class PrefillConfig:
    page_size: int = 16
    kv_budget_bytes: int | None = 256 * 2**20  # None: what the device has left
    max_context: int = 4096
    # Prompt tokens one prefill call computes, padding included (the token budget, split
    # over its rows by `StepConfig.prefill_pieces`); pages are sent after each call. 512:
    # SmolLM2 on 2 CPU cores prefills 4096 tokens in 5.35 s at 512 against 5.63 s at 256
    # (the matmuls' weight packing is per call), 1024 tokens in 0.95 s against 1.02 s
    # (`megaserve bench prefill --chunk N --peers none`, docs/benchmarks.md).
    chunk: int = 512
    max_batch: int = 8  # prompts in flight (holding pages); one call takes up to this many
    max_queued: int = 64  # prompts waiting for a batch row; beyond it NoCapacity
    # --tp x --ep: the model and pool over this many devices (the XLA programs under shard_map).
    parallel: ParallelConfig = ParallelConfig()
    # --cpu-turns: a lock file shared with the workers on the same cores (megaserve.cpu_turns);
    # each prefill call is one turn. "" = none.
    cpu_turns: str = ""

    def __post_init__(self):
        for name in ("max_batch", "max_queued", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


class DeadlineExpired(Exception):
    """A prompt's deadline passed before it was computed (DEADLINE_EXCEEDED on the wire)."""


@dataclass
class PrefillResult:
    first_token: int
    prefix_hit_pages: int
    compute_s: float


@dataclass
class _Job:
    prompt: list[int]
    sampling: SamplingParams
    skip_pages: int
    on_pages: Callable
    resumed: int = 0  # trailing prompt tokens that were generated (penalties count them)
    deadline: float | None = None  # on the engine's clock
    future: Future = field(default_factory=Future)
    pages: list[int] = field(default_factory=list)
    hit: int = 0  # leading pages taken from the cache (at admission or from a prompt in flight)
    hashes: list[int] = field(default_factory=list)  # block hashes of the prompt's full blocks
    registered: int = 0  # leading pages published to the prefix cache
    done: int = 0  # tokens computed
    sent: int = 0  # pages handed to on_pages (indices < sent are done or skipped)
    started: float = 0.0
    queued: bool = False  # counted against max_queued (submitted; not admitted, not cancelled)


def step_config(cfg: PrefillConfig, max_pages: int) -> StepConfig:
    """The prefill tier's buckets: up to max_batch prompts per call, chunk tokens each."""
    return StepConfig.for_limits(cfg.max_batch, cfg.chunk, max_pages)


def engine_programs(runner: Runner, pool: KVPool, max_pages: int) -> list[Program]:
    """Every program a prefill engine can run: prefill chunks, penalized picks, page reads."""
    ours = [p for p in runner.programs() if p.name in ("prefill", "pick")]
    return ours + pool.page_programs(max_pages, read=True, write=False)


class PrefillEngine:
    """A thread that batches queued prompts: each iteration runs one prefill call holding
    pieces of several active prompts under the token budget (`chunk` padded tokens; the
    oldest prompt always has a piece, and a later one joins when it finishes in that call,
    so short prompts do not wait behind long ones: `StepConfig.prefill_pieces`), then hands
    each prompt the pages its piece completed."""

    def programs(self) -> list[Program]:
        return engine_programs(self.runner, self.pool, self.max_pages)

    def warm_up(self) -> tuple[int, float]:
        """Compiles, or loads from the persistent compilation cache, every program."""
        self.memory, n, secs = warm_up(self.runner, self.pool, self.programs(), self.memory)
        return n, secs

    def __init__(self, model: LoadedModel, cfg: PrefillConfig = PrefillConfig()):
        self.model, self.cfg = model, cfg
        mc = model.cfg
        # Checked before the pool is allocated (exit 2 naming the terms when it cannot fit),
        # and again after warm-up with every weight copy and the largest program temp.
        self.memory, self.pool = planned_pool(
            model, cfg.page_size, cfg.kv_budget_bytes, cfg.parallel
        )
        self.alloc = PageAllocator(self.pool.num_pages, cfg.page_size)
        self.max_pages = math.ceil(cfg.max_context / cfg.page_size)
        self.runner = make_runner(  # (prefill programs are XLA on every backend today)
            model.family, mc, model.params, self.pool, step_config(cfg, self.max_pages),
            backend="xla", parallel=cfg.parallel,
        )  # fmt: skip
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._submit_lock = threading.Lock()  # the queue bound's check and put, together
        # Prompts queued whose caller still waits: the bound counts these, not the queue, which
        # also holds cancelled ones until the engine thread reaches them (after a long call).
        self._waiting = 0
        self._active: list[_Job] = []
        self.batched_calls = 0
        self.rows_computed = 0
        self.shared_inflight_pages = 0  # pages taken from prompts computed alongside
        self.expired = 0  # prompts dropped at their deadline (queued or between chunks)
        self.clock = time.monotonic  # deadlines are on this clock; tests inject a fake one
        self.turns = cpu_turns(cfg.cpu_turns)  # shared with the other workers on these cores
        self.watch = StallWatch()  # times each call; the worker configures it and watches
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="prefill-engine", daemon=True)
        self._thread.start()

    def validate(self, prompt: list[int]) -> None:
        check_prompt_ids(prompt, self.model.cfg.vocab_size, "prompt_token_ids")
        if len(prompt) > self.cfg.max_context:
            raise RequestError(f"prompt ({len(prompt)} tokens) exceeds {self.cfg.max_context}")

    def submit(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        skip_pages: int,
        on_pages: Callable[[int, object, object], None],
        resumed: int = 0,
        deadline: float | None = None,
    ) -> Future:
        """Queues the prompt (batched with others in flight); after each chunk the engine
        calls on_pages(first_index, K, V) for the pages it completed, skipping `skip_pages`.

        K/V are device arrays [L, n, page_size, Hkv, D]; indices count this prompt's pages.
        Returns a Future of the PrefillResult (DeadlineExpired once `deadline`, on
        `self.clock`, passes before the prompt is done; cancelling it drops the prompt).
        Raises RequestError, or NoCapacity when `max_queued` prompts already wait. Safe from
        any thread; never blocks.
        """
        self.validate(prompt)
        n_pages = pages_for_tokens(len(prompt), self.cfg.page_size)
        if not 0 <= skip_pages <= n_pages:
            raise RequestError(f"cached_pages={skip_pages} outside [0, {n_pages}]")
        if not 0 <= resumed < len(prompt):
            raise RequestError(f"resumed_tokens={resumed} must be in [0, {len(prompt)})")
        job = _Job(list(prompt), sampling, skip_pages, on_pages, resumed, deadline)
        with self._submit_lock:
            self.check_room()
            if self._queue.qsize() >= 2 * self.cfg.max_queued:
                self._drop_cancelled()
            job.queued = True
            self._waiting += 1
            self._queue.put(job)
        job.future.add_done_callback(lambda _, job=job: self._dequeued(job))  # (a cancel too)
        return job.future

    def check_room(self) -> None:
        """NoCapacity when `max_queued` prompts already wait for a batch row."""
        if self._waiting >= self.cfg.max_queued:
            raise NoCapacity(f"prefill queue full ({self.cfg.max_queued} queued); retry")

    def _dequeued(self, job: _Job) -> None:
        """job no longer waits for a row (admitted, failed, or its caller left)."""
        with self._submit_lock:
            if job.queued:
                job.queued = False
                self._waiting -= 1

    def _drop_cancelled(self) -> None:
        """Takes cancelled prompts out of the queue (they hold no pages yet): while the engine
        is inside a long call, callers that submit and leave would otherwise grow it."""
        with self._queue.mutex:
            q = self._queue.queue
            kept = [j for j in q if j is None or not j.future.cancelled()]
            q.clear()
            q.extend(kept)

    def prefill(self, prompt, sampling, skip_pages, on_pages, resumed=0) -> PrefillResult:
        """submit(), then blocks until the result."""
        return self.submit(prompt, sampling, skip_pages, on_pages, resumed).result()

    def stop(self, timeout: float = 60.0) -> bool:
        """Ends the engine thread after the call it is in; the prompts it still holds fail
        with NoCapacity. A process must not exit while a program runs on that thread (a
        test process that did crashed, rc 134/139). True if it ended within timeout."""
        self._stopping = True
        self._queue.put(None)  # wakes the thread if it waits for work
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            if not self._active:
                self._admit(self._queue.get())
            while len(self._active) < self.cfg.max_batch:
                try:
                    self._admit(self._queue.get_nowait())
                except queue.Empty:
                    break
            if self._active:
                try:
                    # One prefill call and its page reads, timed from the wait for the turn:
                    # a worker whose turn never comes is as stuck as one whose call hangs.
                    with self.watch.span(), self.turns:
                        self._step()
                except Exception as e:  # a failed program fails its batch, not the worker
                    for job in self._active:
                        self._fail(job, e)
                    self._active = []
        held, self._active = self._active, []
        with contextlib.suppress(queue.Empty):
            while True:
                held.append(self._queue.get_nowait())
        for job in filter(None, held):  # (None: stop()'s wake-up)
            self._fail(job, NoCapacity("the prefill worker is stopping; retry"))

    def _gone(self, job: _Job) -> bool:
        """The caller left (cancelled) or the deadline passed: fails job, True if so."""
        if job.future.cancelled():
            self._fail(job, CancelledError())  # frees its pages; the future stays cancelled
            return True
        if job.deadline is not None and self.clock() >= job.deadline:
            self.expired += 1
            self._fail(job, DeadlineExpired("deadline passed before the prefill was done"))
            return True
        return False

    def _admit(self, job: _Job | None) -> None:
        if job is None:  # stop() woke the thread
            return
        self._dequeued(job)
        if self._gone(job):
            return
        try:
            job.pages, hit = claim_pages(self.alloc, job.prompt)
        except NoCapacity as e:
            self._fail(job, NoCapacity(f"prefill pool: {e}; retry"))
            return
        job.hit, job.done, job.sent = hit, hit * self.cfg.page_size, job.skip_pages
        job.hashes, job.registered = block_hashes(job.prompt, self.cfg.page_size), hit
        job.started = time.perf_counter()
        self._active.append(job)

    def stats(self) -> dict:
        """Load and pool counters (safe from any thread; read by the heartbeat)."""
        a = self.alloc
        return {
            "total_pages": a.num_pages - 1,
            "available_pages": a.num_available,
            "active": len(self._active),
            "queued": self._waiting,
            "page_size": a.page_size,
            "batched_calls": self.batched_calls,
            "rows_computed": self.rows_computed,
            "shared_inflight_pages": self.shared_inflight_pages,
            "cpu_turn_wait_s": round(self.turns.waited_s, 3),
        }

    def _step(self) -> None:
        ps = self.cfg.page_size
        self._active = [j for j in self._active if not self._gone(j)]
        runnable = self._runnable(self._active)
        # Always recompute at least the last token (its logits give the first token).
        starts = [min(j.done, len(j.prompt) - 1) for j in runnable]
        sizes = self.runner.step_cfg.prefill_pieces(
            [len(j.prompt) - s for j, s in zip(runnable, starts)]
        )
        jobs = [j for j, n in zip(runnable, sizes) if n]
        rows = [(s, j.prompt[s : s + n]) for j, s, n in zip(runnable, starts, sizes) if n]
        if not jobs:
            return
        batch = TokenBatch.from_rows(
            [(toks, start, j.pages) for j, (start, toks) in zip(jobs, rows)]
        )
        sampling = SamplingArrays.build(
            [j.sampling for j in jobs],
            [
                (j.prompt[: len(j.prompt) - j.resumed], j.prompt[len(j.prompt) - j.resumed :])
                for j in jobs
            ],
            self.model.cfg.vocab_size,
        )
        nxt, _ = self.runner.prefill(batch, sampling)
        self.batched_calls += 1
        self.rows_computed += len(jobs)
        ended: set[int] = set()  # ids of jobs finished or failed this step
        for job, (start, toks), tok in zip(jobs, rows, nxt.tolist()):
            job.done = start + len(toks)
            self._register(job, job.done // ps)
            finished = job.done >= len(job.prompt)
            complete = len(job.pages) if finished else job.done // ps
            try:
                if complete > job.sent:
                    for off, k, v in self.pool.read_pages(job.pages[job.sent : complete]):
                        # Heads split on the read piece, never on the pool (wire layout).
                        shape = self.pool.heads_shape(k.shape[1])
                        job.on_pages(job.sent + off, k.reshape(shape), v.reshape(shape))
                    job.sent = complete
            except Exception as e:
                self._fail(job, e)
                ended.add(id(job))
                continue
            if finished:
                self._finish(job, int(tok))
                ended.add(id(job))
        # Admission order is kept: the earliest of prompts sharing a prefix computes it.
        self._active = [j for j in self._active if id(j) not in ended]

    def _runnable(self, jobs: list[_Job]) -> list[_Job]:
        """The jobs that may compute this step (`prefill_pieces` picks the call's rows among
        them): a prompt whose next block an earlier prompt in this batch is still to compute
        waits for it (it takes that prompt's pages once they are registered) instead of
        computing the same KV twice. The first never waits."""
        ps, pending, run = self.cfg.page_size, set(), []
        for job in jobs:
            self._share_computed(job)
            shareable = (len(job.prompt) - 1) // ps  # the last token's KV is always computed
            nxt = job.done // ps
            if job.done % ps == 0 and nxt < shareable and job.hashes[nxt] in pending:
                continue
            pending.update(job.hashes[nxt:shareable])
            run.append(job)
        return run

    def _share_computed(self, job: _Job) -> None:
        """Takes the next blocks of job's prompt that the cache now holds (computed by a
        prompt in flight beside it since job was admitted)."""
        ps = self.cfg.page_size
        i, shareable = job.done // ps, (len(job.prompt) - 1) // ps
        if job.done % ps or job.registered != i:
            return
        while i < shareable:
            page = self.alloc.by_hash.get(job.hashes[i])
            if page is None or page == job.pages[i]:
                break
            self.alloc.acquire([page])
            self.alloc.release([job.pages[i]])  # fresh and never written: back to free
            job.pages[i] = page
            i += 1
        taken = i - job.registered
        if taken:
            self.shared_inflight_pages += taken
            job.hit += taken
            job.done, job.registered = i * ps, i

    def _register(self, job: _Job, full: int) -> None:
        """Publishes job's pages that now hold complete blocks, so prompts beside it can
        take them before it finishes."""
        for i in range(job.registered, min(full, len(job.hashes))):
            self.alloc.register(job.pages[i], job.hashes[i])
        job.registered = max(job.registered, min(full, len(job.hashes)))

    def _finish(self, job: _Job, first_token: int) -> None:
        self._register(job, len(job.hashes))
        self.alloc.release(job.pages)  # pages stay cached (LRU) for later prompts
        job.pages = []
        with contextlib.suppress(InvalidStateError):  # the caller cancelled meanwhile
            job.future.set_result(
                PrefillResult(first_token, job.hit, time.perf_counter() - job.started)
            )

    def _fail(self, job: _Job, e: Exception) -> None:
        self.alloc.release(job.pages)
        job.pages = []
        with contextlib.suppress(InvalidStateError):  # cancelled, or settled already
            job.future.set_exception(e)
