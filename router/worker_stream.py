"""The router's decode calls: one long-lived Decode.GenerateStream per worker, shared by every
request sent there, or (with `worker_streams: false`, or a worker without that method) one
Generate call per request.

Either way a request gets a call with the same surface: `read()` (a GenerateResponse, or
grpc.aio.EOF after the last), `cancel()`, `done()`; and fails with the grpc.aio.AioRpcError
its own Generate call would have raised, so retries, migration and the circuit breakers
read it as they read a call's status.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections import deque
from collections.abc import Callable

import grpc
import structlog

from megaserve.rpc import decode_pb2, decode_pb2_grpc

log = structlog.get_logger("megaserve.router")
_EMPTY = grpc.aio.Metadata()
RETRY_UNIMPLEMENTED_S = 60.0  # how long a worker without GenerateStream gets calls instead


def rpc_error(code: grpc.StatusCode, details: str, trailing=_EMPTY) -> grpc.aio.AioRpcError:
    """The error a call that ended with this status raises (for failures found here)."""
    return grpc.aio.AioRpcError(code, _EMPTY, trailing, details)


def _deadline_exceeded() -> grpc.aio.AioRpcError:
    return rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")  # as gRPC words it


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _status_error(s: decode_pb2.StreamStatus) -> grpc.aio.AioRpcError:
    """The error a Generate call would have raised with this status."""
    trailing = grpc.aio.Metadata(
        *(
            (m.key, m.value if m.key.endswith("-bin") else m.value.decode(errors="replace"))
            for m in s.trailing
        )
    )
    code = _CODES.get(s.code, grpc.StatusCode.UNKNOWN)
    if code == grpc.StatusCode.OK:  # a status ends a request that did not finish: a failure
        code = grpc.StatusCode.UNKNOWN
    return rpc_error(code, s.message, trailing)


class StreamCall:
    """One request on a worker's stream, as a Generate call's surface."""

    __slots__ = ("_stream", "_items", "_waiter", "_timer", "_done", "request")

    def __init__(self, stream: WorkerStream, request, timeout: float | None):
        self._stream, self.request = stream, request
        self._items: deque = deque()  # GenerateResponses, or the AioRpcError that ends it
        self._waiter: asyncio.Future | None = None
        self._done = False
        self._timer = None
        if timeout is not None:  # one timer for the call, as gRPC keeps a call's deadline
            self._timer = asyncio.get_running_loop().call_later(timeout, self._expire)

    def _put(self, item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _expire(self) -> None:
        self._stream.cancel(self)
        self._put(_deadline_exceeded())

    def _end(self) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()

    async def read(self):
        if self._done:
            return grpc.aio.EOF
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item = self._items.popleft()
        if isinstance(item, grpc.aio.AioRpcError):
            self._end()
            raise item
        if item.finish_reason:
            self._end()
        return item

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        if self._done:
            return False
        self._end()
        self._stream.cancel(self)
        return True


class WorkerStream:
    """One open GenerateStream to a worker and the requests waiting on it. Messages go out in
    the order they are sent, by one writer task while there are any."""

    def __init__(self, rpc: Callable, address: str):
        self.address = address
        self.closed = False
        self.unimplemented = False  # the worker has no GenerateStream: per-request calls
        # Set once the worker has answered the stream (its initial metadata) or ended it: no
        # request is written before, so a worker without the method fails none of them.
        self.opened = asyncio.Event()
        self._since = time.monotonic()
        self.error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"{address} closed its stream")
        self._aborted: grpc.aio.AioRpcError | None = None  # why the router ended it (abort)
        self._waiting: dict[str, StreamCall] = {}
        self._backlog: deque = deque()  # messages not yet written, in order
        self._writing = False
        self._writer: asyncio.Task | None = None  # held: the loop keeps only weak references
        self._call = rpc()
        self._reader = asyncio.ensure_future(self._read())

    def stale(self) -> bool:
        """A worker that had no GenerateStream is asked again after a while (an upgrade)."""
        return self.unimplemented and time.monotonic() - self._since > RETRY_UNIMPLEMENTED_S

    def start(self, request: decode_pb2.GenerateRequest, timeout: float | None) -> StreamCall:
        """Sends request on the (opened) stream; its call fails at once if the stream is over."""
        call = StreamCall(self, request, timeout)
        if self.closed:
            call._put(self.error)
            return call
        self._waiting[request.request_id] = call
        timeout_ms = 0 if timeout is None else max(int(timeout * 1000), 1)
        self._send(decode_pb2.StreamRequest(generate=request, timeout_ms=timeout_ms))
        return call

    def cancel(self, call: StreamCall) -> None:
        """Cancels call if it is still the one waiting under its id (never another call that
        took the id since)."""
        rid = call.request.request_id
        if self._waiting.get(rid) is call:
            del self._waiting[rid]
            if not self.closed:
                self._send(decode_pb2.StreamRequest(cancel=rid))

    def _send(self, m: decode_pb2.StreamRequest) -> None:
        self._backlog.append(m)
        if not self._writing:
            self._writing = True
            self._writer = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Writes the backlog in order. A task of its own, never a request's: a request
        cancelled in the middle of a write would leave gRPC's send in flight, and the next
        write on the stream would then fail it (and every request on it)."""
        try:
            while self._backlog:
                await self._call.write(self._backlog.popleft())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            self._backlog.clear()  # the stream broke: its reader fails every waiting request
        finally:
            self._writing = False

    async def _read(self) -> None:
        try:
            await self._call.initial_metadata()  # the worker sends it at once
            self.opened.set()
            while (m := await self._call.read()) is not grpc.aio.EOF:
                call = self._waiting.get(m.request_id)
                if call is None:
                    continue  # cancelled here: what was already on its way
                if m.HasField("status"):
                    del self._waiting[m.request_id]
                    call._put(_status_error(m.status))
                else:
                    if m.response.finish_reason:
                        del self._waiting[m.request_id]
                    call._put(m.response)
        except grpc.aio.AioRpcError as e:
            self.unimplemented = e.code() == grpc.StatusCode.UNIMPLEMENTED
            if self.unimplemented:
                log.info(
                    "worker has no GenerateStream: a Generate call per request",
                    address=self.address,
                )
            self.error = e
        except asyncio.CancelledError:
            self.error = self._aborted or rpc_error(
                grpc.StatusCode.CANCELLED, "the router closed the stream"
            )
            raise
        finally:
            self.closed = True
            self.opened.set()
            # Every request still here fails as its own call would when the worker dies.
            for call in self._waiting.values():
                call._put(self.error)
            self._waiting.clear()

    def abort(self, error: grpc.aio.AioRpcError) -> None:
        """Ends the stream now; every request on it fails with `error` (the worker is gone
        but nothing closed its connection, so the stream would never end by itself)."""
        self._aborted = error
        self._call.cancel()

    async def close(self) -> None:
        self._call.cancel()
        with contextlib.suppress(BaseException):
            await self._reader


class UnaryCall:
    """A Generate call of its own (no stream), which `WorkerCalls.fail` can end with an error:
    gRPC's cancel alone would raise CancelledError, which reads as the request cancelled."""

    __slots__ = ("_call", "error", "__weakref__")

    def __init__(self, call):
        self._call, self.error = call, None

    async def read(self):
        try:
            return await self._call.read()
        except asyncio.CancelledError:
            if self.error is None or asyncio.current_task().cancelling():
                raise  # the request's own task was cancelled
            raise self.error from None

    def done(self) -> bool:
        return self._call.done()

    def cancel(self) -> bool:
        return self._call.cancel()

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        self.error = error
        self._call.cancel()


class WorkerCalls:
    """Decode calls to every worker: streams when `streams`, else a Generate call each."""

    def __init__(self, channel: Callable[[str], grpc.aio.Channel], streams: bool = True):
        self._channel, self._streams_on = channel, streams
        self._streams: dict[str, WorkerStream] = {}
        self._unary: dict[str, Callable] = {}  # address -> Generate callable
        # address -> its Generate calls in flight (for fail(); a call ended is dropped)
        self._live: dict[str, weakref.WeakSet[UnaryCall]] = {}

    def _generate(self, address: str) -> Callable:
        rpc = self._unary.get(address)
        if rpc is None:
            rpc = self._unary[address] = decode_pb2_grpc.DecodeStub(self._channel(address)).Generate
        return rpc

    async def start(self, address: str, request: decode_pb2.GenerateRequest, timeout: float | None):
        """A call for `request` on the worker at `address`."""
        s = self._streams.get(address) if self._streams_on else None
        if self._streams_on and (s is None or (s.closed and not s.unimplemented) or s.stale()):
            stub = decode_pb2_grpc.DecodeStub(self._channel(address))
            s = self._streams[address] = WorkerStream(stub.GenerateStream, address)
        if s is not None and not s.opened.is_set():
            try:
                async with asyncio.timeout(timeout):  # a worker that never answers the stream
                    await s.opened.wait()
            except TimeoutError:
                call = StreamCall(s, request, None)
                call._put(_deadline_exceeded())
                return call
        if s is None or s.unimplemented:  # a worker from before GenerateStream
            call = UnaryCall(self._generate(address)(request, timeout=timeout))
            self._live.setdefault(address, weakref.WeakSet()).add(call)
            return call
        return s.start(request, timeout)

    def fail(self, address: str, why: str) -> None:
        """The worker at `address` is gone: its requests (on its stream, or Generate calls)
        fail with UNAVAILABLE and move elsewhere; the next request there opens a new stream."""
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, why)
        self._unary.pop(address, None)  # its stub's channel is closed next (WorkerClients)
        s = self._streams.pop(address, None)
        if s is not None:
            s.abort(error)
        for call in list(self._live.pop(address, ())):
            call.fail(error)

    async def close(self) -> None:
        for s in list(self._streams.values()):
            await s.close()
        self._streams.clear()
