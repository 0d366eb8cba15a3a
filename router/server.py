"""The router's gRPC server: megaserve.v1.Generation (Generate, Tokenize, ListModels),
health and reflection. Text in, validation, placement, tokens and text out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import grpc
import jinja2
import structlog
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from megaserve.checkpoint import TokenizerInfo
from megaserve.finish import FinishReason
from megaserve.status import Reason, abort
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pb_grpc
from router import costs
from router.config import RouterConfig
from router.detokenize import IncrementalDetokenizer
from router.dispatch import Dispatcher
from router.frontend import (
    RouterError,
    chat_messages,
    check_input_size,
    input_chars,
    invalid,
    parse_generate,
    resolve_model,
)
from router.logprobs import public_logprobs, public_prompt_logprobs
from router.overload import Overloaded
from router.readiness import Readiness
from router.state import ClusterState
from router.stop_strings import StopStringMatcher

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
log = structlog.get_logger("megaserve.router")
# An in-flight id is held in Redis at most this long (a crashed router's ids expire).
INFLIGHT_TTL_S = 3600.0


class BadMessage:
    """A request whose bytes did not parse (e.g. invalid UTF-8 in a string field)."""

    def __init__(self, message: str):
        self.message = message


def _lenient(cls):
    """Deserializer that turns a parse error into BadMessage (answered INVALID_ARGUMENT)
    instead of gRPC's generic UNKNOWN."""

    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return BadMessage(f"malformed {cls.DESCRIPTOR.full_name}: {e}")

    return parse


def add_generation_servicer(servicer, server) -> None:
    """Like the generated add_GenerationServicer_to_server, with lenient request parsing."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            servicer.Tokenize,
            request_deserializer=_lenient(pb.TokenizeRequest),
            response_serializer=pb.TokenizeResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels,
            request_deserializer=_lenient(pb.ListModelsRequest),
            response_serializer=pb.ListModelsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


# Text (or chat) longer than this is tokenized on a thread (about 0.2 us a character).
INLINE_CHARS = 2048


def _long_input(req) -> bool:
    return input_chars(req) > INLINE_CHARS


def _tokenize(request, model: TokenizerInfo) -> tuple[list[int], list[str]]:
    """A Tokenize request's ids and each one's text."""
    tok = model.tokenizer
    if request.WhichOneof("input") == "prompt":
        ids = tok.encode(request.prompt)
    else:
        ids = tok.encode_chat(chat_messages(request.chat))
    return ids, [tok.decode([i]) for i in ids]


def _new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def _timed_parse(*args):
    """parse_generate on a thread, with the thread's CPU time (the request's cost)."""
    t = time.thread_time()
    return parse_generate(*args), time.thread_time() - t


class TextStream:
    """Token ids -> text for one request: incremental detokenization, then stop strings."""

    def __init__(self, model: TokenizerInfo, prompt: list[int], stops: tuple[str, ...]):
        self.detok = IncrementalDetokenizer(
            model.tokenizer, prompt, skip_special_tokens=True, vocab_size=model.vocab_size
        )
        self.stops = StopStringMatcher(list(stops))

    def push(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """(text to send now, a stop string matched)."""
        text, stopped = self.stops.push(self.detok.push(ids))
        if final and not stopped:
            more, stopped = self.stops.push(self.detok.flush())
            text += more
            if not stopped:
                text += self.stops.flush()
        return text, stopped


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(
        self,
        models: dict[str, TokenizerInfo],
        state: ClusterState,
        cfg: RouterConfig,
        router_id: str | None = None,
        channel_factory=None,
    ):
        self.models, self.state, self.cfg = models, state, cfg
        self.router_id = router_id or f"router-{uuid.uuid4().hex[:8]}"
        self.dispatcher = Dispatcher(state, cfg, channel_factory)
        self.requests = 0
        self.inflight = 0  # Generate calls admitted and not yet ended
        self.readiness: Readiness | None = None  # set by create_server
        self.refused = 0  # refused at once: max_inflight_requests were in flight
        self.costs = costs.CostStats()  # CPU per request by component (logged on SIGUSR1)

    def max_context(self, model: str) -> int | None:
        ctx = [w.info.max_context for w in self.state.pool("decode", model) if w.info.max_context]
        return min(ctx) if ctx else None

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        """Bounded admission: past max_inflight_requests a call is refused at once
        (RESOURCE_EXHAUSTED, NO_CAPACITY, `retry-after-ms`), never queued."""
        if self.inflight >= self.cfg.max_inflight_requests:
            self.refused += 1
            await abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                Reason.NO_CAPACITY,
                f"router at its limit of {self.cfg.max_inflight_requests} requests in flight; "
                "retry later",
                retry_after_ms=self.cfg.retry_after_ms,
            )
        self.inflight += 1
        cost = costs.begin()
        try:
            async with contextlib.aclosing(self._generate(request, context, cost)) as out:
                async for response in out:
                    yield response
                    cost.lap("send")
        finally:
            self.inflight -= 1
            self.costs.record(cost)

    async def _generate(self, request, context, cost: costs.RequestCost):
        if isinstance(request, BadMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        arrived = time.monotonic()
        left = context.time_remaining()
        deadline = None if left is None else arrived + left
        try:
            if deadline is not None and left <= 0:
                raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline already expired")
            model = resolve_model(request.model, self.models)
            args = (request, self.models, self.max_context(model.name), _new_request_id)
            if _long_input(request):
                # Tokenizing long text takes a while: off the event loop, other streams flow on.
                job, thread_cpu = await asyncio.to_thread(_timed_parse, *args)
                cost.add("validate", thread_cpu)
            else:  # a thread hop would cost more than the work
                job = parse_generate(*args)
            cost.lap("validate")
        except RouterError as e:
            await context.abort(e.code, e.message)
        # A client's id may be reused by any router: it is claimed in Redis. An id made here is
        # 122 random bits: unique without asking anyone.
        shared = bool(request.request_id)
        if not await self.state.claim(job.request_id, self.router_id, INFLIGHT_TTL_S, shared):
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {job.request_id!r} is already in flight",
            )
        cost.lap("claim")
        self.requests += 1
        text = TextStream(job.model, job.prompt, job.stop)
        usage = pb.Usage(prompt_tokens=len(job.prompt))
        cost.lap("respond")
        # No line on arrival: "placed" (each try) names the request and its prompt tokens,
        # "failed"/"refused" one that never got a worker.
        try:
            async with contextlib.aclosing(self.dispatcher.run(job, deadline)) as chunks:
                async for c in chunks:
                    cost.lap("worker_call")
                    if usage.completion_tokens == 0:
                        usage.cached_tokens = c.cached_tokens
                    usage.completion_tokens += len(c.token_ids)
                    new, stopped = text.push(c.token_ids, c.finish_reason is not None)
                    reason = FinishReason.STOP_STRING if stopped else c.finish_reason
                    response = pb.GenerateResponse(
                        token_ids=c.token_ids,
                        text=new,
                        finish_reason=(
                            reason.to_public_proto() if reason else pb.FINISH_REASON_UNSPECIFIED
                        ),
                        usage=usage,
                        request_id=job.request_id,
                        logprobs=public_logprobs(job, c.logprobs),
                    )
                    if c.prompt_logprobs:  # first message only; a long prompt's texts: off the loop
                        response.prompt_logprobs.extend(
                            await asyncio.to_thread(public_prompt_logprobs, job, c.prompt_logprobs)
                        )
                    cost.lap("respond")
                    yield response
                    if reason:
                        log.info(
                            "finished",
                            request_id=job.request_id,
                            reason=reason,
                            decode=c.worker_id,  # the worker whose stream ended it
                            tokens=usage.completion_tokens,
                            ms=round(1000 * (time.monotonic() - arrived), 1),
                        )
                        cost.lap("log")
                        return
        except Overloaded as e:  # every worker was full
            log.warning("refused", request_id=job.request_id, error=e.message)
            await abort(
                context, e.code, Reason.NO_CAPACITY, e.message, retry_after_ms=e.retry_after_ms
            )
        except RouterError as e:
            log.warning("failed", request_id=job.request_id, code=e.code.name, error=e.message)
            if not (context.done() or context.cancelled()):  # not a call its deadline ended
                await context.abort(e.code, e.message)
        finally:
            cost.lap("dispatch")
            await self.state.release(job.request_id, shared)
            cost.lap("release")

    async def Tokenize(self, request, context):  # noqa: N802
        if isinstance(request, BadMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            model = resolve_model(request.model, self.models)
            if request.WhichOneof("input") is None:
                raise invalid("no input: set prompt or chat")
            check_input_size(request, self.max_context(model.name))  # as Generate's
            if _long_input(request):  # off the event loop, as Generate's
                ids, tokens = await asyncio.to_thread(_tokenize, request, model)
            else:
                ids, tokens = _tokenize(request, model)
        except RouterError as e:
            await context.abort(e.code, e.message)
        except (ValueError, jinja2.TemplateError) as e:  # e.g. roles out of order, no template
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def ListModels(self, request, context):  # noqa: N802
        if isinstance(request, BadMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        out = []
        for name, m in sorted(self.models.items()):
            out.append(
                pb.Model(
                    name=name,
                    vocab_size=m.vocab_size,
                    max_context=self.max_context(name) or 0,
                    decode_workers=len(self.state.pool("decode", name)),
                    prefill_workers=len(self.state.pool("prefill", name)),
                )
            )
        return pb.ListModelsResponse(models=out)


async def create_server(
    models: dict[str, TokenizerInfo],
    state: ClusterState,
    cfg: RouterConfig,
    address: str = "127.0.0.1:0",
    server_credentials: grpc.ServerCredentials | None = None,
    interceptors=(),
    channel_factory=None,
):
    """Starts the router's server; returns (server, port, health servicer, servicer).

    Health starts NOT_SERVING and follows the view (`router/readiness.py`): SERVING once
    every model has a decode worker. channel_factory(address) makes the channels to workers
    (mTLS between tiers)."""
    server = grpc.aio.server(interceptors=list(interceptors))
    servicer = GenerationServicer(models, state, cfg, channel_factory=channel_factory)
    add_generation_servicer(servicer, server)
    port = (
        server.add_secure_port(address, server_credentials)
        if server_credentials
        else server.add_insecure_port(address)
    )
    if port == 0:
        raise OSError(f"cannot bind {address}")
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    servicer.readiness = Readiness(state, models, health_servicer, (SERVICE,))
    await servicer.readiness.start()  # NOT_SERVING before the port answers
    await server.start()
    await state.start()  # the first view (if Redis answers) turns it SERVING
    return server, port, health_servicer, servicer
