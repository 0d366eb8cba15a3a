"""The decode worker's KVTransfer endpoint: stage validated chunks, commit a whole request."""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from decode_service.engine import DecodeEngine
from megaserve.errors import RequestError, ReservationGone
from megaserve.kv.staging import KVImport
from megaserve.kv.wire import PageGeometry, TransferError
from megaserve.rpc import kv_transfer_pb2, kv_transfer_pb2_grpc
from megaserve.status import Reason, abort

log = structlog.get_logger("megaserve.kv")


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, engine: DecodeEngine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self.geo = PageGeometry.of_pool(engine.pool)
        self.bytes_committed = 0
        self.failures = 0

    async def Push(self, request_iterator, context):  # noqa: N802
        rid = None
        imp: KVImport | None = None
        trailer = None
        t0 = time.perf_counter()
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if imp is None:
                    if kind != "header":
                        raise TransferError("the first message of a push must be its header")
                    rid = msg.header.request_id
                    res = self.engine.reservation(rid)
                    if res is None:
                        await abort(
                            context,
                            grpc.StatusCode.NOT_FOUND,
                            Reason.RESERVATION_NOT_FOUND,
                            f"no open reservation {rid!r} (unknown or expired)",
                        )
                    if res.first_token is not None:
                        raise TransferError(f"reservation {rid!r} already has its KV")
                    imp = KVImport(self.geo, len(res.pages), res.cached_pages, msg.header)
                    continue
                if trailer is not None:
                    raise TransferError("a message after the trailer")
                if kind == "trailer":
                    trailer = msg.trailer
                elif kind == "chunk":
                    if msg.chunk.HasField("pull"):  # a blocking device pull: off the loop
                        await asyncio.to_thread(imp.add, msg.chunk)
                    else:
                        imp.add(msg.chunk)
                else:
                    raise TransferError("a second header in one push")
            if imp is None:
                raise TransferError("empty push: no header")
            if not imp.complete or trailer is None:
                self.failures += 1
                await asyncio.to_thread(self.engine.drop_reservation, rid)
                await abort(
                    context,
                    grpc.StatusCode.DATA_LOSS,
                    Reason.KV_TRANSFER_INCOMPLETE,
                    f"stream ended with {imp.missing} (layer, page) cells missing"
                    f"{'' if trailer else ' and no trailer'}; reservation {rid!r} freed",
                )
            await asyncio.to_thread(
                self.engine.commit_import, rid, trailer.first_token, imp.k, imp.v
            )
        except asyncio.CancelledError:
            # The sender vanished mid-transfer (killed, disconnected): nothing partial is
            # kept; free the reservation now rather than at the end of its lease.
            self.failures += 1
            if rid is not None and imp is not None and not (imp.complete and trailer):
                self.engine.cancel(rid)
            raise
        except ReservationGone as e:  # its lease ran out during the push
            self.failures += 1
            if self.metrics:
                self.metrics.kv_failures.inc()
            log.warning("kv push too late", request_id=rid, error=str(e))
            await abort(context, grpc.StatusCode.NOT_FOUND, Reason.RESERVATION_NOT_FOUND, str(e))
        except (TransferError, RequestError) as e:
            self.failures += 1
            if self.metrics:
                self.metrics.kv_failures.inc()
            if rid is not None:
                await asyncio.to_thread(self.engine.drop_reservation, rid)
            log.warning("kv push refused", request_id=rid, error=str(e))
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                Reason.KV_TRANSFER_INVALID,
                f"{e}; reservation freed",
            )
        self.bytes_committed += imp.bytes
        if self.metrics:
            self.metrics.kv_bytes.inc(imp.bytes)
            self.metrics.kv_seconds.observe(time.perf_counter() - t0)
        return kv_transfer_pb2.KVPushResponse(bytes=imp.bytes, chunks=imp.chunks)
