"""The decode worker's gRPC server (grpc.aio): Generate streams, Release, Stats, health."""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from decode_service.engine import DecodeEngine, Full, TokenEvent
from decode_service.metrics import WorkerMetrics
from decode_service.sequence import Sequence
from megaserve.errors import RequestError
from megaserve.rpc import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from megaserve.sampling_params import SamplingParams
from megaserve.security import TLSConfig, add_port

_FINISH = {
    None: decode_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": decode_pb2.FINISH_REASON_STOP,
    "length": decode_pb2.FINISH_REASON_LENGTH,
}
SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
KV_SERVICE = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
log = structlog.get_logger("megaserve.decode")


def sampling_from_proto(p: decode_pb2.SamplingParams) -> SamplingParams:
    """Proto -> validated params; top_p 0 (unset) means disabled."""
    top_p = 1.0 if p.top_p == 0 else p.top_p
    if not math.isfinite(p.temperature):
        raise RequestError(f"temperature={p.temperature} must be finite")
    rep = 1.0 if p.repetition_penalty == 0 else p.repetition_penalty
    return SamplingParams(
        p.temperature, p.top_k, top_p, p.min_p, p.seed, p.presence_penalty, p.frequency_penalty, rep
    )


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: DecodeEngine, metrics: WorkerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics or WorkerMetrics(engine, engine.model.name)
        self.draining = False

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        rid = request.request_id
        arrived = time.monotonic()
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is shutting down; retry")
        try:
            if not rid:
                raise RequestError("request_id is empty")
            sampling = sampling_from_proto(request.sampling)
            stop = set(request.stopping.stop_token_ids)
            if not request.stopping.ignore_eos:
                stop |= set(self.engine.model.eos_token_ids)
            if not 0 <= request.logprobs <= 20:
                raise RequestError(f"logprobs={request.logprobs} must be in [0, 20]")
            seq = Sequence(
                rid,
                list(request.prompt_token_ids),
                sampling,
                request.stopping.max_tokens,
                frozenset(stop),
                logprobs=request.logprobs,
                resumed=request.resumed_tokens,
            )
            if not 0 <= request.resumed_tokens < max(len(seq.prompt), 1):
                raise RequestError(
                    f"resumed_tokens={request.resumed_tokens} must be in [0, prompt length)"
                )
            self.engine.submit(seq, lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        except RequestError as e:
            code = (
                grpc.StatusCode.ALREADY_EXISTS
                if "already" in str(e)
                else (grpc.StatusCode.INVALID_ARGUMENT)
            )
            await context.abort(code, str(e))
        except Full as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
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
                if e.finish_reason == "abort":
                    await context.abort(grpc.StatusCode.CANCELLED, f"request {rid!r} released")
                yield decode_pb2.GenerateResponse(
                    token_ids=e.token_ids,
                    finish_reason=_FINISH[e.finish_reason],
                    prompt_tokens=e.prompt_tokens,
                    cached_tokens=e.cached_tokens,
                    step=e.step,
                    logprobs=[
                        decode_pb2.TokenLogprobs(
                            token_id=t, logprob=lp, top_token_ids=ids, top_logprobs=vals
                        )
                        for t, lp, ids, vals in (e.logprobs or ())
                    ],
                )
        finally:
            # Client cancel, disconnect or deadline: the engine frees the pages next step.
            if not done:
                self.engine.cancel(rid)

    async def Release(self, request, context):  # noqa: N802
        if not await asyncio.to_thread(self.engine.cancel, request.request_id):
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unknown request_id {request.request_id!r}"
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
        except RequestError as e:
            code = (
                grpc.StatusCode.ALREADY_EXISTS
                if "already" in str(e)
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, str(e))
        except Full as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
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
    # KV chunks can be several MB; senders split by layer and page group below this.
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    servicer = DecodeServicer(engine)
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    from decode_service.kv_service import KVTransferServicer

    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(
        KVTransferServicer(engine, servicer.metrics), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE, KV_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = add_port(server, address, tls)
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer, servicer
