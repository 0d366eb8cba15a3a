"""The decode worker's KVTransfer endpoint: stage validated chunks, commit a whole request."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time

import grpc
import structlog
from google.protobuf.message import DecodeError

from decode_service.engine import DecodeEngine
from megaserve.errors import RequestError, ReservationGone
from megaserve.futures import retrieve
from megaserve.kv import frames
from megaserve.kv.staging import KVImport
from megaserve.kv.wire import PageGeometry, TransferError
from megaserve.rpc import kv_transfer_pb2
from megaserve.status import Reason, abort

log = structlog.get_logger("megaserve.kv")
# How long a refused push's remaining messages are read and dropped before its status goes
# out: a megaserve sender half-closes at the refusal notice; another peer may send on.
REFUSE_DRAIN_S = 10.0
# A pull (jax transfer) blocks its thread in the runtime until the peer's server answers, and
# one that never answers (an address nothing serves) never returns. So pulls run on daemon
# threads of their own, at most PULL_THREADS at once: Reserve, Release and the drain (the
# default executor's) never wait behind them, and an exit does not join them. A push waits
# PULL_TIMEOUT_S for a chunk's pull (its thread included) before it is refused.
PULL_THREADS = 4
PULL_TIMEOUT_S = 30.0


def pulls_stuck() -> int:
    """Pull threads still running: a peer's transfer server that never answered."""
    return sum(t.name == "kv-pull" and t.is_alive() for t in threading.enumerate())


class KVTransferServicer:
    """KVTransfer.Push; requests arrive as frames.Frame (see `add_to_server`)."""

    def __init__(self, engine: DecodeEngine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self.geo = PageGeometry.of_pool(engine.pool)
        self.bytes_committed = 0
        self.failures = 0
        self._pull_slots = asyncio.Semaphore(PULL_THREADS)  # a slot: one pull thread

    async def Push(self, request_iterator, context):  # noqa: N802
        """Why this is long: staging overlapped with receiving, and every failure's status
        (each names what broke and frees the reservation) share one flow."""
        rid = None
        imp: KVImport | None = None
        trailer = None
        t0 = time.perf_counter()
        staging = None  # the previous chunk's validation and copy, run off the loop
        writes: list = []  # Futures of blocks written into the reservation ahead of commit
        committing = False  # the commit is on its way to the engine (it lands, cancel or not)

        async def pulls_started() -> str:
            """How many of the push's pull chunks, in order, a pull was started for (the
            staging now running done first): a megaserve sender takes back its other offers
            (`megaserve/jax_transfer.py`)."""
            if staging is not None:
                await asyncio.wait([staging])  # (its failure is reported where it is awaited)
            return str(len(imp.pull_attempts) if imp is not None else 0)

        refuse = functools.partial(self._refuse, request_iterator, context, pulls_started)
        try:
            async for frame in request_iterator:
                msg = frame.msg
                kind = msg.WhichOneof("kind")
                if imp is None:
                    if kind != "header":
                        raise TransferError("the first message of a push must be its header")
                    rid = msg.header.request_id
                    res = self.engine.reservation(rid)
                    if res is None:
                        await refuse(
                            grpc.StatusCode.NOT_FOUND,
                            Reason.RESERVATION_NOT_FOUND,
                            f"no open reservation {rid!r} (unknown or expired)",
                        )
                    # Refused without freeing the reservation: it is another push's.
                    busy = "already has its KV" if res.first_token is not None else None
                    busy = busy or ("has a push in progress" if res.pushing else None)
                    if busy:
                        await refuse(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            Reason.KV_TRANSFER_INVALID,
                            f"reservation {rid!r} {busy}",
                        )
                    imp = KVImport(self.geo, len(res.pages), res.cached_pages, msg.header)
                    res.pushing = True  # (on the event loop: no other push sees it half-set)
                    continue
                if trailer is not None:
                    raise TransferError("a message after the trailer")
                if kind == "trailer":
                    trailer = msg.trailer
                elif kind == "chunk":
                    # One chunk stages (checksum, copy; or a blocking device pull) in a
                    # thread while the loop receives the next; one at a time, in order.
                    if staging is not None:
                        await staging
                    staging = asyncio.ensure_future(
                        self._pull(imp, res, msg.chunk, writes)
                        if msg.chunk.HasField("pull")
                        else asyncio.to_thread(self._stage, imp, res, msg.chunk, frame.data, writes)
                    )
                    # A failure is retrieved here; the push reports the first one it awaits.
                    staging.add_done_callback(retrieve)
                else:
                    raise TransferError("a second header in one push")
            if staging is not None:
                await staging
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
                    kv_pulls_started=await pulls_started(),
                )
            vocab = self.engine.model.cfg.vocab_size
            if not 0 <= trailer.first_token < vocab:
                raise TransferError(
                    f"trailer.first_token={trailer.first_token} outside [0, {vocab})"
                )
            for w in writes:  # in order; each True unless the reservation went meanwhile
                await asyncio.wrap_future(w)
            committing = True
            await asyncio.to_thread(
                self.engine.commit_import, res, trailer.first_token, imp.take_ready()
            )
        except asyncio.CancelledError:
            # The sender vanished mid-transfer (killed, disconnected): nothing partial is
            # kept; free the reservation now rather than at the end of its lease.
            self.failures += 1
            if imp is not None and not committing:  # (imp: this push holds the reservation)
                self.engine.cancel_soon(rid)
            raise
        except ReservationGone as e:  # its lease ran out during the push
            self.failures += 1
            if self.metrics:
                self.metrics.kv_failures.inc()
            log.warning("kv push too late", request_id=rid, error=str(e))
            await refuse(grpc.StatusCode.NOT_FOUND, Reason.RESERVATION_NOT_FOUND, str(e))
        except (TransferError, RequestError, DecodeError) as e:  # (DecodeError: bad bytes)
            log.warning("kv push refused", request_id=rid, error=str(e))
            await self._fail(
                rid, refuse, grpc.StatusCode.INVALID_ARGUMENT, Reason.KV_TRANSFER_INVALID, f"{e}"
            )
        except grpc.aio.AbortError:
            raise  # a status decided above (DATA_LOSS for an incomplete push, a refusal)
        except Exception as e:  # a fault of this worker's (staging, a pool write, the commit)
            log.exception("kv push failed", request_id=rid)
            # Refused like a bad push, so a sender still writing gets this status, not
            # grpcio's INTERNAL "Internal error from Core" (see _refuse).
            await self._fail(
                rid,
                refuse,
                grpc.StatusCode.INTERNAL,
                Reason.KV_HANDOFF_FAILED,
                f"the decode worker failed the push: {e!r}",
            )
        self.bytes_committed += imp.bytes
        if self.metrics:
            self.metrics.kv_bytes.inc(imp.bytes)
            self.metrics.kv_seconds.observe(time.perf_counter() - t0)
        return kv_transfer_pb2.KVPushResponse(bytes=imp.bytes, chunks=imp.chunks)

    async def _fail(self, rid, refuse, code, reason, message: str) -> None:
        """A push that cannot be committed: its reservation freed, then refused."""
        self.failures += 1
        if self.metrics:
            self.metrics.kv_failures.inc()
        if rid is not None:
            await asyncio.to_thread(self.engine.drop_reservation, rid)
        await refuse(code, reason, f"{message}; reservation freed")

    async def _refuse(
        self, request_iterator, context, pulls_started, code, reason, message: str
    ) -> None:
        """Ends a push with an error status once its sender has stopped writing. grpcio
        replaces a status that reaches the client while one of its writes is in flight
        with that write's INTERNAL "Internal error from Core" (without this, 14-17 of 30
        refused pushes of a sender writing on, as in tests/test_disaggregated.py, lost
        their NOT_FOUND and reason). So the refusal goes ahead as initial metadata
        (frames.REFUSED_KEY: a megaserve sender stops and half-closes), what is still on
        its way is read and dropped (unchecked), and then the status goes out, saying how
        many pull chunks were pulled (or started to be)."""
        with contextlib.suppress(Exception):  # (metadata already sent: the status still follows)
            await context.send_initial_metadata(((frames.REFUSED_KEY, code.name),))
        with contextlib.suppress(Exception):  # a broken stream: its status is ours to send
            async with asyncio.timeout(REFUSE_DRAIN_S):
                async for _ in request_iterator:
                    pass
        await abort(context, code, reason, message, kv_pulls_started=await pulls_started())

    async def _pull(self, imp: KVImport, res, chunk, writes: list) -> None:
        """Stages a pulled chunk on a pull thread; refused if it takes PULL_TIMEOUT_S."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(error: BaseException | None) -> None:  # (the loop's thread)
            self._pull_slots.release()
            if not done.done():
                done.set_exception(error) if error else done.set_result(None)

        def run() -> None:
            error = None
            try:
                self._stage(imp, res, chunk, None, writes)
            except BaseException as e:
                error = e
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (exit)
                loop.call_soon_threadsafe(settle, error)

        try:
            async with asyncio.timeout(PULL_TIMEOUT_S):
                await self._pull_slots.acquire()
                threading.Thread(target=run, name="kv-pull", daemon=True).start()
                await done
        except TimeoutError:
            raise TransferError(
                f"pull of chunk uuid {chunk.pull.uuid} from {chunk.pull.address!r} did not "
                f"finish in {PULL_TIMEOUT_S:g} s"
            ) from None

    def _stage(self, imp: KVImport, res, chunk, data, writes: list) -> None:
        """Stages one chunk (a worker thread) and queues the blocks it completed for the
        engine thread to write: the pool fills while later chunks are still on the way."""
        imp.add(chunk, data)
        ready = imp.take_ready()
        if ready:
            writes.append(self.engine.write_import(res, ready))


def add_to_server(servicer: KVTransferServicer, server) -> None:
    """Serves KVTransfer.Push with chunk payloads read in place from the received bytes."""
    frames.add_push_handler(servicer.Push, server)
