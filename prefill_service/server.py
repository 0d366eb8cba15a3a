"""The prefill worker's gRPC server: Prefill computes KV and pushes it to a decode worker."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from decode_service.server import sampling_from_proto
from megaserve.errors import RequestError
from megaserve.rpc import kv_transfer_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from megaserve.security import TLSConfig, add_port, aio_channel
from prefill_service import kv_sender
from prefill_service.engine import PoolFull, PrefillEngine

SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
log = structlog.get_logger("megaserve.prefill")
_DONE = object()


class PrefillMetrics:
    """Prometheus metrics of a prefill worker (one registry per worker)."""

    def __init__(self, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry()
        lab = {"model_name": model_name}
        self.bytes = Counter(
            "megaserve:kv_transfer_sent_bytes",
            "KV payload bytes sent.",
            labelnames=list(lab),
            registry=r,
        ).labels(**lab)
        self.failures = Counter(
            "megaserve:kv_transfer_failures",
            "Pushes the decode worker refused or that broke off.",
            labelnames=list(lab),
            registry=r,
        ).labels(**lab)
        self.compute = Histogram(
            "megaserve:prefill_compute_seconds",
            "Prefill compute.",
            labelnames=list(lab),
            registry=r,
        ).labels(**lab)
        self.transfer = Histogram(
            "megaserve:kv_transfer_seconds",
            "First chunk sent to commit.",
            labelnames=list(lab),
            registry=r,
        ).labels(**lab)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        from prometheus_client import start_http_server

        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_address[1]


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: PrefillEngine, tls: TLSConfig | None = None):
        self.engine = engine
        self.tls = tls  # KV pushes to decode workers go over mTLS with this cert when set
        self.metrics = PrefillMetrics(engine.model.name)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.bytes_sent = 0
        self.transfer_failures = 0

    def _stub(self, address: str):
        if address not in self._channels:
            self._channels[address] = aio_channel(
                address, self.tls, [("grpc.max_send_message_length", 64 << 20)]
            )
        return kv_transfer_pb2_grpc.KVTransferStub(self._channels[address])

    async def Prefill(self, request, context):  # noqa: N802
        t_start = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            if not request.request_id:
                raise RequestError("request_id is empty")
            if not request.decode_address:
                raise RequestError("decode_address is empty")
            if request.page_size != self.engine.cfg.page_size:
                raise RequestError(
                    f"page_size={request.page_size}, this worker uses {self.engine.cfg.page_size}"
                )
            sampling = sampling_from_proto(request.sampling)
            prompt = list(request.prompt_token_ids)
            self.engine.validate(prompt)
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        n_pages = -(-len(prompt) // self.engine.cfg.page_size)
        cached = request.cached_pages
        outbox: asyncio.Queue = asyncio.Queue()
        mc = self.engine.model.cfg
        outbox.put_nowait(
            kv_sender.header(
                request.request_id,
                mc.num_layers,
                cached,
                n_pages - cached,
                str(self.engine.pool.k.dtype),
            )
        )
        stamps: dict[str, float] = {}
        sent = {"pages": 0, "bytes": 0}

        use_jax = request.transport == prefill_pb2.TRANSPORT_JAX_TRANSFER

        def on_pages(first: int, k, v) -> None:  # prefill thread: hand chunks to the loop
            stamps.setdefault("first_chunk", time.perf_counter())
            if use_jax:
                msgs = [kv_sender.pull_message(first, k, v)]
                sent["bytes"] += 2 * k.nbytes
            else:
                msgs = list(kv_sender.chunk_messages(first, np.asarray(k), np.asarray(v)))
                sent["bytes"] += sum(len(m.chunk.data) for m in msgs)
            for msg in msgs:
                loop.call_soon_threadsafe(outbox.put_nowait, msg)
            sent["pages"] += k.shape[1]

        call = self._stub(request.decode_address).Push()

        async def writer():
            # Explicit writes (not a request iterator): when the decode worker refuses early,
            # the call then reports its real status instead of a generic INTERNAL.
            try:
                while (msg := await outbox.get()) is not _DONE:
                    await call.write(msg)
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the status comes from awaiting the call

        writing = asyncio.ensure_future(writer())
        try:
            result = await asyncio.to_thread(
                self.engine.prefill, prompt, sampling, cached, on_pages, request.resumed_tokens
            )
        except (RequestError, PoolFull) as e:
            call.cancel()  # the decode side frees the reservation when the stream breaks
            writing.cancel()
            code = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if isinstance(e, PoolFull)
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, str(e))
        outbox.put_nowait(kv_sender.trailer(result.first_token))
        outbox.put_nowait(_DONE)
        try:
            await call
        except grpc.aio.AioRpcError as e:
            self.transfer_failures += 1
            self.metrics.failures.inc()
            writing.cancel()
            await context.abort(e.code(), f"decode worker refused the KV: {e.details()}")
        await writing
        t_end = time.perf_counter()
        self.bytes_sent += sent["bytes"]
        first = stamps.get("first_chunk", t_end)
        self.metrics.bytes.inc(sent["bytes"])
        self.metrics.compute.observe(result.compute_s)
        self.metrics.transfer.observe(t_end - first)
        log.info(
            "prefilled",
            request_id=request.request_id,
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
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = add_port(server, address, tls)
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer, servicer
