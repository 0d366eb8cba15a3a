"""Decode.GenerateStream on the worker: many Generate calls over one long-lived stream.

Each request runs the servicer's own Generate (same validation, queueing, metrics and
cancellation) with a per-request context; what that call would have ended with (its code,
message and trailing metadata) goes back in-band as a StreamStatus. Why a stream: a Python
gRPC call costs its client 0.36-0.40 ms of CPU, a request on an open stream 0.17 ms
(docs/benchmarks.md, "One stream per decode worker").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from megaserve.rpc import decode_pb2
from megaserve.status import Reason, rich_status

log = structlog.get_logger("megaserve.decode")

_END = object()  # the stream is over (the router closed it, or the worker drains)
DUPLICATE = Reason.DUPLICATE_REQUEST_ID


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailing):
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, tuple(trailing or ())


class RequestContext:
    """What Generate asks of its gRPC context, for one request on a stream."""

    __slots__ = ("_deadline",)

    def __init__(self, timeout_ms: int):
        self._deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms else None

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        raise _Aborted(code, details, trailing_metadata)


def status_response(rid: str, code: grpc.StatusCode, details: str, trailing=()):
    """The StreamResponse that ends request `rid` with this status."""
    md = [
        decode_pb2.StreamMetadata(key=k, value=v if isinstance(v, bytes) else str(v).encode())
        for k, v in trailing
    ]
    status = decode_pb2.StreamStatus(code=code.value[0], message=details, trailing=md)
    return decode_pb2.StreamResponse(request_id=rid, status=status)


class StreamHub:
    """The worker's open GenerateStreams; `close_idle` ends those with no request left."""

    def __init__(self):
        self._streams: dict[asyncio.Queue, dict[str, asyncio.Task]] = {}

    def close_idle(self) -> int:
        """Ends every stream without a running request (a draining worker: the routers then
        go elsewhere without waiting out the server's grace period); returns how many."""
        idle = [out for out, tasks in self._streams.items() if not tasks]
        for out in idle:
            out.put_nowait(_END)
        return len(idle)

    async def serve(
        self, generate: Callable, requests: AsyncIterator[decode_pb2.StreamRequest], context
    ) -> AsyncIterator[decode_pb2.StreamResponse]:
        """The stream's responses; `generate(request, context)` is the servicer's Generate."""
        # At once: the router writes no request before it knows this worker has the method.
        await context.send_initial_metadata(())
        out: asyncio.Queue = asyncio.Queue()
        tasks: dict[str, asyncio.Task] = {}
        self._streams[out] = tasks

        async def run(req: decode_pb2.GenerateRequest, timeout_ms: int) -> None:
            rid = req.request_id
            deadline = asyncio.timeout(timeout_ms / 1000 if timeout_ms else None)
            try:
                async with deadline:
                    async for r in generate(req, RequestContext(timeout_ms)):
                        out.put_nowait(decode_pb2.StreamResponse(request_id=rid, response=r))
            except _Aborted as a:
                out.put_nowait(status_response(rid, a.code, a.details, a.trailing))
            except TimeoutError as e:
                if not deadline.expired():  # another wait's (an engine that did not answer)
                    log.exception("stream request failed", request_id=rid)
                    msg = f"{rid!r}: {e!r}"
                    out.put_nowait(status_response(rid, grpc.StatusCode.UNKNOWN, msg))
                    return
                msg = f"request {rid!r}: deadline of {timeout_ms} ms exceeded"
                out.put_nowait(status_response(rid, grpc.StatusCode.DEADLINE_EXCEEDED, msg))
            except Exception as e:  # what gRPC would answer for a handler's crash
                log.exception("stream request failed", request_id=rid)
                out.put_nowait(status_response(rid, grpc.StatusCode.UNKNOWN, f"{rid!r}: {e}"))
            finally:
                if tasks.get(rid) is asyncio.current_task():
                    del tasks[rid]

        async def read() -> None:
            try:
                await read_all()
                # Half-closed: nothing more will come; the requests running finish first,
                # as their own Generate calls would.
                while tasks:
                    await asyncio.wait(list(tasks.values()))
            finally:
                out.put_nowait(_END)

        async def read_all() -> None:
            async for m in requests:
                if m.HasField("generate"):
                    rid = m.generate.request_id
                    if rid in tasks:
                        # Responses carry only the id: two live requests under one id cannot
                        # be told apart, so both end, with one status and nothing after it.
                        tasks.pop(rid).cancel()
                        msg = f"request_id {rid!r} was already running on this stream; both ended"
                        s = rich_status(code := grpc.StatusCode.ALREADY_EXISTS, DUPLICATE, msg)
                        out.put_nowait(status_response(rid, code, msg, s.trailing_metadata))
                        continue
                    tasks[rid] = asyncio.ensure_future(run(m.generate, m.timeout_ms))
                elif m.HasField("cancel") and (t := tasks.pop(m.cancel, None)) is not None:
                    t.cancel()  # Generate's finally frees its pages, as a cancelled call's

        reader = asyncio.ensure_future(read())
        try:
            while (m := await out.get()) is not _END:
                yield m
        finally:
            del self._streams[out]
            reader.cancel()
            for t in tasks.values():
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(reader, *tasks.values(), return_exceptions=True)
