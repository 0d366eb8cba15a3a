"""The prefill worker's gRPC server: Prefill computes KV and pushes it to a decode worker."""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Future

import grpc
import numpy as np
import structlog

from megaserve.errors import NoCapacity, RequestError
from megaserve.futures import retrieve
from megaserve.grpc_server import start_serving
from megaserve.kv import frames, wire
from megaserve.kv.pages import pages_for_tokens
from megaserve.rpc import prefill_pb2, prefill_pb2_grpc
from megaserve.sampling_params import SamplingParams
from megaserve.security import TLSConfig, add_port, aio_channel
from megaserve.status import Reason, abort, abort_for, error_metadata, reason_of
from prefill_service.engine import DeadlineExpired, PrefillEngine
from prefill_service.metrics import PrefillMetrics
from prefill_service.offers import PushOffers
from prefill_service.push_channels import PushChannels

SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
log = structlog.get_logger("megaserve.prefill")
_DONE = object()


async def _unless_refused(job: Future, refused: asyncio.Event):
    """The prefill job's result, or None once the decode worker has refused the push: the
    job is then cancelled, so the engine drops the prompt instead of computing KV that no
    one takes (a refusal at the header can come before the first chunk), and no first
    token goes out for a hand-off that has failed."""
    result = asyncio.wrap_future(job)
    result.add_done_callback(retrieve)  # a failure after this call was cancelled: unread
    notice = asyncio.ensure_future(refused.wait())
    try:
        await asyncio.wait((result, notice), return_when=asyncio.FIRST_COMPLETED)
        return None if refused.is_set() else result.result()
    finally:
        notice.cancel()
        if not result.done():  # refused, or this call was cancelled (the client left)
            result.cancel()  # cancels the job with it


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: PrefillEngine, tls: TLSConfig | None = None):
        self.engine = engine
        self.tls = tls  # KV pushes to decode workers go over mTLS with this cert when set
        self.metrics = PrefillMetrics(engine.model.name)
        self.channels = PushChannels(
            lambda address: aio_channel(
                address, self.tls, [("grpc.max_send_message_length", 64 << 20)]
            )
        )
        self.bytes_sent = 0
        self.transfer_failures = 0
        self.inflight = 0  # Prefill calls being computed, queued or still pushing their KV

    def _push(self, address: str):
        """KVTransfer.Push on the decode worker at `address` (pre-encoded chunks)."""
        return frames.push_call(self.channels.get(address))

    def _validated(self, request) -> tuple[SamplingParams, list[int]]:
        """(sampling, prompt) of a Prefill call; RequestError naming the bad field."""
        if not request.request_id:
            raise RequestError("request_id is empty")
        if not request.decode_address:
            raise RequestError("decode_address is empty")
        if request.page_size != self.engine.cfg.page_size:
            raise RequestError(
                f"page_size={request.page_size}, this worker uses {self.engine.cfg.page_size}"
            )
        prompt = list(request.prompt_token_ids)
        self.engine.validate(prompt)
        return SamplingParams.from_proto(request.sampling), prompt

    async def Prefill(self, request, context):  # noqa: N802
        return await self._counted(request, context)

    async def PrefillStream(self, request, context):  # noqa: N802
        """Prefill, with the first token sent as soon as it is sampled (before the KV's
        tail is pushed and committed), then the PrefillResponse."""

        async def first(token: int, compute_s: float) -> None:
            ev = prefill_pb2.FirstToken(token=token, compute_ms=1000 * compute_s)
            await context.write(prefill_pb2.PrefillEvent(first_token=ev))

        done = await self._counted(request, context, first)
        await context.write(prefill_pb2.PrefillEvent(done=done))

    async def _counted(self, request, context, on_first=None):
        """At most max_batch + max_queued calls at once, pushes included (each holds its
        prompt's KV on the host until sent): beyond it RESOURCE_EXHAUSTED + retry-after-ms."""
        limit = self.engine.cfg.max_batch + self.engine.cfg.max_queued
        if self.inflight >= limit:
            await abort_for(context, NoCapacity(f"prefill worker full ({limit} in flight); retry"))
        self.inflight += 1
        offers = PushOffers(request.request_id)  # (jax transfer only)
        done = False
        try:
            out = await self._prefill(request, context, offers, on_first)
            done = True
            return out
        finally:
            self.inflight -= 1
            offers.end(committed=done)

    async def _prefill(self, request, context, offers: PushOffers, on_first=None):
        """Validates, prefills and pushes the pages as chunks complete; `on_first(token,
        compute_s)` is awaited once the first token is sampled, while the KV's tail is still
        being pushed. Why this is long: the encode/send overlap and every failure's status
        share one flow."""
        t_start = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            sampling, prompt = self._validated(request)
        except RequestError as e:
            await abort_for(context, e)
        n_pages = pages_for_tokens(len(prompt), self.engine.cfg.page_size)
        cached = request.cached_pages
        if cached > n_pages:  # before the header's page count (n_pages - cached) is made
            await abort_for(context, RequestError(f"cached_pages={cached} outside [0, {n_pages}]"))
        outbox: asyncio.Queue = asyncio.Queue()
        geo = wire.PageGeometry.of_pool(self.engine.pool)
        header = wire.header(request.request_id, geo, cached, n_pages - cached)
        stamps: dict[str, float] = {}
        sent = {"pages": 0, "bytes": 0}

        use_jax = request.transport == prefill_pb2.TRANSPORT_JAX_TRANSFER

        def on_pages(first: int, k, v) -> None:  # prefill thread: hand chunks to the loop
            stamps.setdefault("first_chunk", time.perf_counter())
            if use_jax:
                item = wire.pull_message(first, k, v)
                offers.made_one(item)
            else:
                k.copy_to_host_async()  # device -> host now; the writer encodes later
                v.copy_to_host_async()
                item = (first, k, v)
            loop.call_soon_threadsafe(outbox.put_nowait, item)
            sent["bytes"] += 2 * k.nbytes
            sent["pages"] += k.shape[1]

        try:  # a full queue is refused before a push opens (submit checks again, bound)
            self.engine.check_room()
        except NoCapacity as e:
            await abort_for(context, e)  # RESOURCE_EXHAUSTED + retry-after-ms
        call = self._push(request.decode_address)()
        # The decode worker's early refusal: stop writing, half-close, then read its status
        # (one of our writes in flight when the status lands would replace it).
        refused = frames.watch_refusal(call, lambda: outbox.put_nowait(_DONE))

        async def writer():
            # Explicit writes (not a request iterator), stopped at the refusal notice: a
            # write in flight when the decode worker's status lands would replace it.
            try:
                while (item := await outbox.get()) is not _DONE:
                    if refused.is_set():  # what is queued is dropped on the way to _DONE
                        continue
                    if not isinstance(item, tuple):  # a pull chunk, or the trailer
                        offers.writing(item)
                        await call.write(item)
                        continue
                    # Each chunk is encoded (one copy of its pages into the message) on the
                    # loop while the one before is being written: measured faster than an
                    # encoder thread (which contends for the GIL), two chunk buffers live.
                    first, k, v = item
                    await frames.write_ahead(
                        call, wire.chunk_frames(first, np.asarray(k), np.asarray(v)), refused
                    )
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the status comes from awaiting the call
            except Exception:
                call.cancel()  # an encoding failure: `_prefill` reports it
                raise

        # The header goes out before the compute starts: a decode worker that refuses it (no
        # reservation) can answer before chunks follow, so its status is the one we report.
        try:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await call.write(header)  # on failure the status comes from awaiting the call
        except BaseException:  # cancelled: the push (a call of ours) does not end by itself
            call.cancel()
            raise
        writing = asyncio.ensure_future(writer())
        left = context.time_remaining()
        deadline = None if left is None else self.engine.clock() + left
        try:
            # Never blocks: a full queue is NoCapacity at once. A cancelled call (the client
            # left, its deadline passed) cancels the future and the engine drops the prompt.
            job = self.engine.submit(
                prompt, sampling, cached, on_pages, request.resumed_tokens, deadline
            )
            result = await _unless_refused(job, refused)  # None: refused, the job dropped
        except (RequestError, NoCapacity, DeadlineExpired) as e:
            call.cancel()  # the decode side frees the reservation when the stream breaks
            writing.cancel()
            if isinstance(e, DeadlineExpired):
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
            await abort_for(context, e)  # queue or pool full: RESOURCE_EXHAUSTED + retry hint
        except BaseException:  # cancelled: stop the push too
            call.cancel()
            writing.cancel()
            raise
        if result is not None:
            outbox.put_nowait(wire.trailer(result.first_token))
            outbox.put_nowait(_DONE)
            if on_first is not None:
                try:
                    await on_first(result.first_token, result.compute_s)
                except BaseException:  # cancelled: stop the push before its offers are ended
                    call.cancel()
                    writing.cancel()
                    raise
        try:
            await call
        except asyncio.CancelledError:
            if writing.done() and not writing.cancelled() and writing.exception():
                raise writing.exception() from None  # the writer broke the call
            raise
        except grpc.aio.AioRpcError as e:
            started = error_metadata(e).get("kv_pulls_started")
            offers.pulls_started = int(started) if started and started.isdigit() else None
            self.transfer_failures += 1
            self.metrics.failures.inc()
            writing.cancel()
            await abort(
                context,
                e.code(),
                Reason.KV_HANDOFF_FAILED,
                f"decode worker refused the KV: {e.details()}",
                decode_reason=str(reason_of(e) or ""),
            )
        await writing
        if result is None:  # a refusal notice, then no error status: not a megaserve peer
            await context.abort(grpc.StatusCode.INTERNAL, "decode worker refused, then said OK")
        return self._response(request.request_id, result, sent, stamps, t_start)

    def _response(self, rid: str, result, sent: dict, stamps: dict, t_start: float):
        """Metrics, the log line and the answer of a prefill whose KV was delivered."""
        t_end = time.perf_counter()
        self.bytes_sent += sent["bytes"]
        first = stamps.get("first_chunk", t_end)
        self.metrics.bytes.inc(sent["bytes"])
        self.metrics.compute.observe(result.compute_s)
        self.metrics.transfer.observe(t_end - first)
        log.info(
            "prefilled",
            request_id=rid,
            pages_sent=sent["pages"],
            bytes=sent["bytes"],
            prefix_hit_pages=result.prefix_hit_pages,
        )
        return prefill_pb2.PrefillResponse(
            first_token=result.first_token,
            pages_sent=sent["pages"],
            bytes_sent=sent["bytes"],
            prefix_hit_pages=result.prefix_hit_pages,
            compute_ms=1000 * result.compute_s,
            transfer_ms=1000 * (t_end - first),
            first_chunk_sent_ms=1000 * (first - t_start),
        )


async def create_server(
    engine: PrefillEngine, address: str = "127.0.0.1:0", tls: TLSConfig | None = None
):
    """Builds and starts the server; returns (server, port, health servicer, servicer).

    With `tls`: the port serves TLS (mTLS when tls.ca is set) and KV pushes present tls.cert.
    """
    server = grpc.aio.server()
    servicer = PrefillServicer(engine, tls)
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    port = add_port(server, address, tls)
    health_servicer = await start_serving(server, (SERVICE,))
    return server, port, health_servicer, servicer
