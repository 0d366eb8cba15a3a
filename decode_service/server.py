"""The decode worker's gRPC server (grpc.aio): Generate (per call or many on one stream),
Reserve, Release, Stats."""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from decode_service import kv_service
from decode_service.engine import DecodeEngine
from decode_service.events import TokenEvent
from decode_service.generate_stream import StreamHub
from decode_service.metrics import WorkerMetrics
from decode_service.sequence import Sequence
from megaserve.errors import NoCapacity, RequestError
from megaserve.finish import FinishReason
from megaserve.futures import retrieve
from megaserve.grpc_server import start_serving
from megaserve.rpc import decode_pb2, decode_pb2_grpc, kv_transfer_pb2
from megaserve.sampling_params import MAX_LOGPROBS, SamplingParams
from megaserve.security import TLSConfig, add_port
from megaserve.status import Reason, abort, abort_for

SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
KV_SERVICE = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
RELEASE_WAIT_S = 1.0  # how long Release waits for its cancel to be decided
log = structlog.get_logger("megaserve.decode")


def sequence_from_request(request: decode_pb2.GenerateRequest, eos_ids) -> Sequence:
    """The validated Sequence of a Generate call; RequestError naming the bad field."""
    if not request.request_id:
        raise RequestError("request_id is empty")
    sampling = SamplingParams.from_proto(request.sampling)
    stop = set(request.stopping.stop_token_ids)
    if not request.stopping.ignore_eos:
        stop |= set(eos_ids)
    if not 0 <= request.logprobs <= MAX_LOGPROBS:
        raise RequestError(f"logprobs={request.logprobs} must be in [0, {MAX_LOGPROBS}]")
    prompt = list(request.prompt_token_ids)
    if not 0 <= request.resumed_tokens < max(len(prompt), 1):
        raise RequestError(f"resumed_tokens={request.resumed_tokens} must be in [0, prompt length)")
    return Sequence(
        request.request_id,
        prompt,
        sampling,
        request.stopping.max_tokens,
        frozenset(stop),
        logprobs=request.logprobs,
        resumed=request.resumed_tokens,
    )


def prompt_logprobs_of(request: decode_pb2.GenerateRequest) -> int | None:
    """The top-n of the prompt log-probabilities a Generate call asks (None: not asked);
    RequestError naming the bad field."""
    n = request.prompt_top_n
    if not 0 <= n <= MAX_LOGPROBS:
        raise RequestError(f"prompt_top_n={n} must be in [0, {MAX_LOGPROBS}]")
    if not request.prompt_logprobs:
        if n:
            raise RequestError(f"prompt_top_n={n} without prompt_logprobs")
        return None
    if request.resumed_tokens:
        raise RequestError(
            f"prompt_logprobs with resumed_tokens={request.resumed_tokens}: a resumed request's "
            "prompt was scored before"
        )
    return n


def _entries(lps) -> list[decode_pb2.TokenLogprobs]:
    return [
        decode_pb2.TokenLogprobs(token_id=t, logprob=lp, top_token_ids=ids, top_logprobs=vals)
        for t, lp, ids, vals in (lps or ())
    ]


def response_of(e: TokenEvent) -> decode_pb2.GenerateResponse:
    return decode_pb2.GenerateResponse(
        token_ids=e.token_ids,
        finish_reason=(
            e.finish_reason.to_decode_proto()
            if e.finish_reason
            else decode_pb2.FINISH_REASON_UNSPECIFIED
        ),
        prompt_tokens=e.prompt_tokens,
        cached_tokens=e.cached_tokens,
        step=e.step,
        logprobs=_entries(e.logprobs),
        prompt_logprobs=_entries(e.prompt_logprobs),
    )


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: DecodeEngine, metrics: WorkerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics or WorkerMetrics(engine, engine.model.name)
        self.draining = False
        self.streams = StreamHub()

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        rid = request.request_id
        arrived = time.monotonic()
        if self.draining:
            await abort(
                context, grpc.StatusCode.UNAVAILABLE, Reason.DRAINING, "worker is shutting down"
            )
        left = context.time_remaining()
        deadline = None if left is None else self.engine.clock() + left
        try:
            seq = sequence_from_request(request, self.engine.model.eos_token_ids)
            args = (
                seq,
                lambda e: loop.call_soon_threadsafe(events.put_nowait, e),
                deadline,
                prompt_logprobs_of(request),
            )
            if rid in self.engine.reservations:  # attaching waits for the engine thread
                await self._attach(rid, args)
            else:
                self.engine.submit(*args)
        except (RequestError, NoCapacity) as e:
            await abort_for(context, e)  # a full queue: RESOURCE_EXHAUSTED + retry-after-ms
        done = False
        last = None
        m = self.metrics
        m.prompt_tokens.inc(len(request.prompt_token_ids))
        log.info(
            "request",
            request_id=rid,
            prompt_tokens=len(request.prompt_token_ids),
            max_tokens=request.stopping.max_tokens,
        )
        try:
            while not done:
                e = await events.get()
                done = e.finish_reason is not None
                now = time.monotonic()
                if e.token_ids:
                    (m.ttft.observe(now - arrived) if last is None else m.itl.observe(now - last))
                    last = now
                    m.generation_tokens.inc(len(e.token_ids))
                if done:
                    m.finished(e.finish_reason)
                    log.info("finished", request_id=rid, reason=e.finish_reason)
                if e.finish_reason is FinishReason.ERROR:
                    await abort(
                        context,
                        grpc.StatusCode.INTERNAL,
                        Reason.STEP_FAILED,
                        f"request {rid!r}: {e.error}",
                    )
                if e.finish_reason is FinishReason.ABORT:
                    if deadline is not None and self.engine.clock() >= deadline:
                        await context.abort(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"request {rid!r}: deadline passed while queued",
                        )
                    await abort(
                        context,
                        grpc.StatusCode.CANCELLED,
                        Reason.RELEASED,
                        f"request {rid!r} released",
                    )
                yield response_of(e)
        finally:
            # Client cancel, disconnect or deadline: the engine frees the pages next step.
            if not done:
                self.engine.cancel_soon(rid)  # not waited for: the loop serves other calls

    async def _attach(self, rid: str, args: tuple) -> None:
        """engine.submit off the event loop (its attach waits for the engine thread). A call
        cancelled meanwhile cancels the request once the submit is in: before, the attach
        could land after the cancel and run the request for nobody."""
        submit = asyncio.ensure_future(asyncio.to_thread(self.engine.submit, *args))
        try:
            await asyncio.shield(submit)
        except asyncio.CancelledError:

            def then_cancel(t: asyncio.Future) -> None:
                if not t.cancelled() and t.exception() is None:
                    self.engine.cancel_soon(rid)

            submit.add_done_callback(then_cancel)
            raise

    async def GenerateStream(self, request_iterator, context):  # noqa: N802
        async for m in self.streams.serve(self.Generate, request_iterator, context):
            yield m

    async def Release(self, request, context):  # noqa: N802
        # Decided on the engine thread, in order with its commands (a Reserve still queued
        # there is undone after it), and waited for up to RELEASE_WAIT_S, not through a whole
        # prefill call (seconds, past the caller's timeout): undecided by then, it is OK.
        decided = asyncio.wrap_future(self.engine.cancel_soon(request.request_id))
        await asyncio.wait((decided,), timeout=RELEASE_WAIT_S)
        if not decided.done():
            decided.add_done_callback(retrieve)
        elif (e := decided.exception()) is not None:
            log.error("release failed", request_id=request.request_id, error=repr(e))
        elif not decided.result():
            await abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                Reason.UNKNOWN_REQUEST,
                f"unknown request_id {request.request_id!r}",
            )
        return decode_pb2.ReleaseResponse()

    async def Reserve(self, request, context):  # noqa: N802
        lease = (request.lease_ms or 30000) / 1000
        try:
            if not request.request_id:
                raise RequestError("request_id is empty")
            res = await asyncio.to_thread(
                self.engine.reserve, request.request_id, list(request.prompt_token_ids), lease
            )
        except (RequestError, NoCapacity) as e:
            await abort_for(context, e)
        return decode_pb2.ReserveResponse(
            cached_pages=res.cached_pages,
            total_pages=len(res.pages),
            page_size=self.engine.cfg.page_size,
        )

    async def Stats(self, request, context):  # noqa: N802
        return decode_pb2.StatsResponse(**self.engine.stats())


async def create_server(
    engine: DecodeEngine, address: str = "127.0.0.1:0", tls: TLSConfig | None = None
):
    """Builds and starts the server; returns (server, bound port, health, servicer).

    With `tls` the port serves TLS, and mTLS (client certificates signed by tls.ca) when
    tls.ca is set: only the other tiers may reserve, push KV or generate."""
    # KV chunks are up to wire.MAX_CHUNK_BYTES (16 MiB); senders split pages below this.
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    servicer = DecodeServicer(engine)
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    kv_service.add_to_server(kv_service.KVTransferServicer(engine, servicer.metrics), server)
    port = add_port(server, address, tls)
    health_servicer = await start_serving(server, (SERVICE, KV_SERVICE))
    return server, port, health_servicer, servicer
