"""Places one job on workers and streams its tokens: disaggregated or co-located prefill,
retries before the first token, and migration when a worker fails mid-stream. A migrated
request is re-prefilled as prompt + tokens generated so far on a healthy worker; seeded
sampling keys on (seed, position), so the continuation equals an uninterrupted run."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from megaserve.errors import NoCapacity
from megaserve.finish import FinishReason
from megaserve.futures import spawn
from megaserve.kv.pages import pages_for_tokens
from megaserve.rpc import decode_pb2, prefill_pb2
from router import costs
from router.chunk import Chunk
from router.circuit import CircuitBreakers
from router.config import RouterConfig
from router.frontend import Job, RouterError, with_budget
from router.overload import Overloaded, retry_after_of
from router.policies import RouteRequest, make_policy
from router.policies.round_robin import RoundRobin
from router.state import ClusterState, Session
from router.worker_stream import WorkerCalls
from router.worker_view import WorkerView
from router.worker_watch import WorkerWatch
from router.workers import HandoffFailed, WorkerClients, WorkerFailed, classify, handoff

log = structlog.get_logger("megaserve.router")


class Dispatcher:
    """Stateless per request; holds channels, policies and breakers shared by all requests."""

    def __init__(self, state: ClusterState, cfg: RouterConfig, channel_factory=None):
        self.state, self.cfg = state, cfg
        self.decode_policy = make_policy(cfg.decode_policy, cfg)
        self.prefill_policy = make_policy(cfg.prefill_policy, cfg)
        self.fallback = RoundRobin()  # while Redis is down: the last view, no load data
        self.breakers = CircuitBreakers(cfg.circuit_breaker_failures, cfg.circuit_breaker_reset_s)
        self.clients = WorkerClients(channel_factory)
        self.calls = WorkerCalls(self.clients.channel, cfg.worker_streams)
        self.watch = WorkerWatch(cfg.worker_gone_s, self.calls.fail)
        state.add_listener(self._view_changed)
        self._background: set[asyncio.Task] = set()
        self.stats = {"migrations": 0, "retries": 0, "disaggregated": 0, "colocated": 0}

    async def drain(self) -> None:
        """Waits for the background Releases of finished attempts (shutdown, tests)."""
        while self._background:
            pending = set(self._background)
            await asyncio.wait(pending)
            self._background -= pending  # all done (their own discards may not have run yet)

    async def close(self) -> None:
        await self.drain()
        await self.calls.close()
        await self.clients.close()

    async def _view_changed(self) -> None:
        self.breakers.follow_view(self.state.workers, self.cfg.worker_gone_s)
        for address in self.watch.update(w.info.address for w in self.state.workers.values()):
            await self.clients.forget(address)  # its requests have moved (calls.fail)

    # -- placement ---------------------------------------------------------------------
    def _candidates(self, role: str, job: Job, exclude: set[str]) -> list[WorkerView]:
        pool = self.state.pool(role, job.model.name)
        live = [w for w in pool if self.breakers.allows(w.id)]
        fresh = [w for w in live if w.id not in exclude]
        # Everything failed this request already: the workers may have restarted; try again.
        return fresh or live

    def _choose(self, role: str, workers: list[WorkerView], req: RouteRequest) -> WorkerView:
        if not self.state.redis_ok and self.state.redis is not None:
            w = self.fallback.choose(workers, req)
        else:
            w = (self.decode_policy if role == "decode" else self.prefill_policy).choose(
                workers, req
            )
        self.breakers.chosen(w.id)
        return w

    # -- the request -------------------------------------------------------------------
    async def _wait_for_decoders(self, job: Job, failed, deadline: float | None):
        """The decode candidates, waiting for the view to show one for up to
        `no_worker_wait_s` (never past the deadline); UNAVAILABLE after that."""
        decoders = self._candidates("decode", job, failed)
        if decoders:
            return decoders
        log.info("no decode worker; waiting for one", request_id=job.request_id)
        end = time.monotonic() + self.cfg.no_worker_wait_s
        if deadline is not None:
            end = min(end, deadline)
        while (left := end - time.monotonic()) > 0:
            # Each refresh may bring a worker; a breaker half-opens with time alone.
            await self.state.wait_refresh(min(left, max(self.state.refresh_s, 0.05)))
            decoders = self._candidates("decode", job, failed)
            if decoders:
                return decoders
        raise RouterError(
            grpc.StatusCode.UNAVAILABLE,
            f"no healthy decode worker for model {job.model.name!r} "
            f"(waited {self.cfg.no_worker_wait_s:g} s)",
        )

    def _untried(self, worker: WorkerView, job: Job, failed) -> bool:
        """Whether another worker of `worker`'s role has not failed this request yet."""
        if worker.info.role == "prefill":
            return True  # a full prefill tier is skipped: the decode worker prefills
        return any(w.id not in failed for w in self._candidates("decode", job, failed))

    async def run(self, job: Job, deadline: float | None) -> AsyncIterator[Chunk]:
        """Streams the job's tokens; raises RouterError when it cannot be completed."""
        generated: list[int] = []
        failed: dict[str, bool] = {}  # worker id -> it was full (not failed) for this request
        attempts = migrations = tries = 0
        tag = f"{random.getrandbits(32):08x}"  # this job's, in its worker request ids
        session = await self.state.get_session(job.session_id) if job.session_id else None
        costs.lap("session")
        first = True  # (only the first chunk keeps its cached_tokens)
        while True:
            n_before = len(generated)
            prompt = job.prompt + generated
            decoders = await self._wait_for_decoders(job, failed, deadline)
            job = with_budget(job, [w.info.max_context for w in decoders])
            d = self._choose("decode", decoders, RouteRequest(prompt, session, job.max_tokens))
            costs.lap("pick")
            tries += 1
            attempt = self._attempt(job, d, prompt, generated, failed, deadline, f"{tag}.{tries}")
            try:
                # Closed here, not by the garbage collector's finalizer task, when we return.
                async with contextlib.aclosing(attempt) as chunks:
                    async for c in chunks:
                        generated += c.token_ids
                        if self.breakers.is_open(d.id):
                            self.breakers.success(d.id)  # it answers: a probe need not wait
                        c.cached_tokens, first = (c.cached_tokens if first else 0), False
                        if c.finish_reason:  # before the yield: the consumer stops at the last
                            self.breakers.success(d.id)
                            # The worker now caches the output's full blocks too (a session's
                            # next turn starts with them), before its heartbeat says so.
                            self.state.expect(d, job.prompt + generated)
                            if job.session_id:
                                await self.state.put_session(
                                    job.session_id, Session(d.id, len(job.prompt) + len(generated))
                                )
                        yield c
                        if c.finish_reason:
                            return
                raise WorkerFailed(d, "stream ended without a finish reason")
            except (WorkerFailed, NoCapacity) as e:
                busy = isinstance(e, NoCapacity)
                worker = e.source if busy else e.worker
                if not busy:
                    self.breakers.failure(worker.id)
                failed[worker.id] = busy
                if len(generated) > n_before:
                    # A stream that had delivered tokens broke: move it on at once (the client
                    # is mid-stream). Failures placing the rest (a dead worker's Reserve, a
                    # prefill) are retries below, with backoff, not further migrations.
                    attempts = 0
                    migrations += 1
                    self.stats["migrations"] += 1
                    log.warning(
                        "migrating", request_id=job.request_id, error=str(e), done=len(generated)
                    )
                    if migrations > self.cfg.max_migrations:
                        raise RouterError(
                            grpc.StatusCode.UNAVAILABLE,
                            f"request {job.request_id!r}: gave up after {migrations - 1} "
                            f"migrations; last failure: {e}",
                        ) from e
                    continue
                self.stats["retries"] += 1
                if busy and self._untried(worker, job, failed):
                    continue  # full: another worker (or co-located prefill) at once
                attempts += 1
                if attempts >= self.cfg.retry_max_attempts:
                    why = f"request {job.request_id!r}: {attempts} attempts failed; last: {e}"
                    if busy:  # every worker is full: the client retries after the hint
                        raise Overloaded(why, retry_after_of(e, self.cfg.retry_after_ms)) from e
                    raise RouterError(grpc.StatusCode.UNAVAILABLE, why) from e
                log.info("retrying", request_id=job.request_id, error=str(e), attempt=attempts)
                await self._backoff(attempts, deadline)

    async def _backoff(self, attempt: int, deadline: float | None) -> None:
        cap = min(self.cfg.retry_max_delay_ms, self.cfg.retry_base_delay_ms * 2 ** (attempt - 1))
        delay = random.uniform(0, cap) / 1000  # full jitter: retries of many requests spread
        if deadline is not None and time.monotonic() + delay >= deadline:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while retrying")
        await asyncio.sleep(delay)

    def _timeout(self, deadline: float | None) -> float | None:
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        return left

    def _use_prefill_tier(self, d: WorkerView, prompt: list[int], job: Job, failed) -> list:
        """Prefill workers to use for this prompt, or [] to prefill on the decode worker."""
        if len(prompt) < self.cfg.disagg_min_uncached_tokens:
            return []  # short of the threshold even uncached: no need to hash the prompt
        uncached = len(prompt) - d.cached_prefix_blocks(prompt) * d.info.page_size
        lps = job.logprobs is not None or job.prompt_logprobs is not None
        if uncached < self.cfg.disagg_min_uncached_tokens or lps:
            return []  # (the hand-off carries the first token, not its log-probabilities)
        pool = [
            w
            for w in self._candidates("prefill", job, failed)
            if w.info.page_size == d.info.page_size
        ]
        # One that failed this request or said it is full is not asked again (d can prefill).
        free = [
            w
            for w in pool
            if w.load < self.cfg.prefill_busy_threshold_running and w.id not in failed
        ]
        return free  # all busy or failed (or none): co-locate rather than wait on them

    async def _attempt(
        self, job: Job, d: WorkerView, prompt: list[int], generated, failed, deadline, try_id
    ) -> AsyncIterator[Chunk]:
        # Unique per try (a migration need not add tokens) and per job (a client reuses its id
        # once a request ended, maybe while the worker still has its messages or cancel in
        # flight): a late Release, or a worker's leftovers, never touch another request.
        rid = f"{job.request_id}#{try_id}.{len(generated)}"
        remaining = job.max_tokens - len(generated)
        stopping = decode_pb2.StoppingParams(
            max_tokens=remaining, stop_token_ids=job.stop_token_ids, ignore_eos=job.ignore_eos
        )
        score = job.prompt_logprobs is not None and not generated
        req = decode_pb2.GenerateRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=job.sampling,
            stopping=stopping,
            resumed_tokens=len(generated),
            # The decode tier's 0 means none: ask for one alternative when only the token's own
            # log-probability is wanted (the router drops it).
            logprobs=0 if job.logprobs is None else max(job.logprobs, 1),
            # Asked until a try answers: a resumed prompt was scored before.
            prompt_logprobs=score,
            prompt_top_n=job.prompt_logprobs if score else 0,
        )
        prefillers = self._use_prefill_tier(d, prompt, job, failed)
        # Pages this request adds: its prefix hits are shared with whoever cached them.
        cached = d.cached_prefix_blocks(prompt)
        pages = pages_for_tokens(len(prompt) + remaining, d.info.page_size) - cached
        # Later requests with this prefix count it as there from now on (before any heartbeat).
        self.state.expect(d, prompt)
        costs.lap("dispatch")
        log.info(
            "placed",
            request_id=rid,
            decode=d.id,
            cached_blocks=cached,
            prompt_tokens=len(prompt),
            disaggregated=bool(prefillers),
        )
        costs.lap("log")
        d.inflight += 1
        d.inflight_pages += pages
        call = None
        reserved = answered = ended = False
        ahead = 0  # 1 once the prefill worker's first token went out before the decode stream
        try:
            if prefillers:
                reserved = True  # from here a reservation may exist on d until Generate attaches
                p = self._choose("prefill", prefillers, RouteRequest(prompt, None, remaining))
                handing = self._prefill_into(d, p, rid, prompt, job, len(generated), deadline)
                # Closed here when the client leaves at its first token: the hand-off stops now.
                async with contextlib.aclosing(handing) as firsts:
                    async for c in firsts:
                        ahead = 1
                        # Generate now, while the KV's tail is on its way: the call waits on
                        # the reservation and its sequence starts at the commit, without the
                        # PrefillResponse -> router -> Generate hops in the first token gap.
                        call = await self.calls.start(d.address, req, self._timeout(deadline))
                        yield c
                self.stats["disaggregated"] += 1
            else:
                self.stats["colocated"] += 1
            if call is None:
                call = await self.calls.start(d.address, req, self._timeout(deadline))
            try:
                # read(), not `async for`: no response iterator left for the finalizer to close.
                while (r := await call.read()) is not grpc.aio.EOF:
                    answered = True
                    reason = FinishReason.from_decode_proto(r.finish_reason)
                    ended = reason is not None
                    ids, lps = list(r.token_ids), list(r.logprobs)
                    if ahead and ids:  # the stream repeats the token the client already has
                        ids, lps, ahead = ids[1:], lps[1:], 0
                        if not ids and reason is None:
                            continue
                    yield Chunk(ids, reason, r.cached_tokens, d.id, lps, list(r.prompt_logprobs))
            except grpc.aio.AioRpcError as e:
                raise classify(d, e, "decode stream") from e
        finally:
            # A probe of d that ends here without a verdict must not block d; a failure of d
            # recorded after this still reopens its breaker (its failure count stays).
            self.breakers.abandon(d.id)
            d.inflight -= 1
            d.inflight_pages -= pages
            if call is not None and not call.done() and not ended:
                # The client left or a stop string matched: free the pages now. (A stream that
                # sent its finish reason is over; only its status is still on the way.)
                call.cancel()
            if reserved and not answered:
                # Cancelled (or failed) between Reserve and the first token: the decode worker
                # may hold the reservation, KV included. Free it now, even while cancelled.
                self._spawn(self.clients.release(d.address, rid))

    def _spawn(self, coro) -> None:
        spawn(coro, self._background)

    async def _prefill_into(
        self, d: WorkerView, p: WorkerView, rid: str, prompt, job: Job, resumed: int, deadline
    ) -> AsyncIterator[Chunk]:
        """Reserve on the decode worker, prefill on p into that reservation. Yields the
        first token as soon as p samples it, while its KV is still on the way (a disaggregated
        first token does not wait for the KV's tail, its commit or the Generate call), and
        returns once the KV is committed."""
        transport = (
            prefill_pb2.TRANSPORT_JAX_TRANSFER
            if self.cfg.transport == "jax_transfer"
            else prefill_pb2.TRANSPORT_GRPC
        )
        firsts: asyncio.Queue[Chunk] = asyncio.Queue()

        def first(token: int, res: decode_pb2.ReserveResponse) -> None:
            firsts.put_nowait(Chunk([token], None, res.cached_pages * res.page_size, d.id))

        p.inflight += 1
        task = asyncio.ensure_future(
            handoff(
                self.clients,
                d.address,
                p.address,
                rid,
                prompt,
                job.sampling,
                lease_ms=self.cfg.reservation_lease_ms,
                transport=transport,
                resumed=resumed,
                timeout=lambda: self._timeout(deadline),
                on_first_token=first,
            )
        )
        got = asyncio.ensure_future(firsts.get())
        gone = self.watch.gone(d.address, p.address)  # a worker that froze mid-hand-off
        try:
            await asyncio.wait((task, got, gone), return_when=asyncio.FIRST_COMPLETED)
            if got.done():
                yield got.result()
            if not task.done():
                await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                raise WorkerFailed(d if gone.result() == d.address else p, "gone mid-hand-off")
            h = task.result()
            costs.lap("worker_call")  # the Reserve and Prefill calls
            # Where a disaggregated request's time went (docs/benchmarks.md, bench serve).
            log.info(
                "handed off",
                request_id=rid,
                prefill=p.id,
                reserve_ms=round(1000 * h.reserve_s, 1),
                prefill_ms=round(1000 * h.prefill_s, 1),
                compute_ms=round(h.prefill.compute_ms, 1),
                kv_transfer_ms=round(h.prefill.transfer_ms, 1),
            )
            costs.lap("log")
            self.state.expect(p, prompt)
            self.breakers.success(p.id)
        except HandoffFailed as e:
            raise classify(d if e.at_decode else p, e.error, e.stage) from e
        finally:
            got.cancel()
            gone.cancel()
            if not task.done():  # the client left after the first token: stop the hand-off
                task.cancel()
                self._spawn(_quietly(task))  # (it releases the reservation; drain waits)
            self.breakers.abandon(p.id)  # no-op after a verdict; else the next may probe
            p.inflight -= 1


async def _quietly(task: asyncio.Future) -> None:
    with contextlib.suppress(BaseException):
        await task
